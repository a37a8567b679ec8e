"""The rewards a ``mmrl serve-rewards`` server serves, each built for the reward context of the requests it scores.

In a training run, a reward with a ``resolve_args`` hook (``iou``, ``giou``, ``detection``) takes options from the
run's reward context (:meth:`mmrl.plugin.Plugin.reward_context`) when it is built: ``convention: null`` becomes the
model family's box convention, and a named convention that differs is refused. A server scores for any run that asks,
so it does the same per request, with the context the request carries (the ``context`` field of ``POST /score``,
sent by the ``remote`` reward):

- A reward without ``resolve_args`` is built once, at start-up, and scores every request; the context is none of
  its business, as in a run.
- A reward with ``resolve_args`` is resolved against each request's context (a pure function of the options and the
  context, cheap) and scored by the instance built for the options that come out: requests whose contexts resolve to
  the same options share one instance (a reward model is loaded once per distinct set of options, however the
  contexts differ otherwise). At most ``max_variants`` instances are kept per reward; the least recently used is
  dropped and rebuilt when needed again. A context the hook refuses (a named convention that differs from the
  request's, no convention anywhere) is answered 409 with the hook's one-line reason; nothing is built.

Start-up: each reward is built for the empty context, as a run whose plugin declares no context would build it, so
that a constructor failure (a missing weights file, a bad option) stops the server before it serves. A reward whose
hook refuses the empty context (``{name: iou}`` without a convention: it needs the run's) is not an error: it is
built at the first request of each context, and :attr:`ServedReward.deferred` keeps the reason, which the server
prints at start. The ``remote`` reward's start-up check (a ``POST /score`` without rows, carrying its run's context)
makes that first build happen when the training run starts, so its failures stop the run before training.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from mmrl.config.schema import ConfigError
from mmrl.reward import RewardError, RewardInput, build_reward, resolve_reward_args, reward_functions
from mmrl.rewards.server_requests import BadRequest, shown_json

MAX_VARIANTS = 8  # instances kept per reward; the box rewards need at most one per box convention (5)


class ServedReward:
    """One reward of a server and the instances built for it (see the module docstring).

    Args:
        name: The reward's registered name, which is also its name on the server.
        args: Its options from the server's config (validated against its signature).
        function: An already built reward callable, served as it is to every request whatever its context (``args``
            is then ignored); for rewards built outside a config.
        max_variants: Most instances kept for different resolved options.

    Raises:
        RewardError: The reward cannot be built for the empty context although its options resolve for it (one line).
    """

    def __init__(self, name: str, args: Mapping[str, Any] | None = None, *,
                 function: Callable[[RewardInput], Any] | None = None, max_variants: int = MAX_VARIANTS):
        if max_variants < 1:
            raise ConfigError("max_variants", max_variants, "an integer >= 1")
        self.name = name
        self.args = dict(args or {})
        self.max_variants = max_variants
        # Taken while a variant is built and while it scores: a reward scores one request at a time, and a variant
        # is built once however many requests ask for it at the same moment.
        self.lock = threading.Lock()
        self._variants: OrderedDict[str, Callable[[RewardInput], Any]] = OrderedDict()
        self.builds = 0  # instances built so far (start-up included); read by tests and logs
        self.deferred: str | None = None  # why nothing was built at start-up (needs a request's context), or None
        self._fixed = function is not None
        if function is not None:
            self.reads_context = False
            self._variants[""] = function
            return
        self.reads_context = getattr(reward_functions.get(name), "resolve_args", None) is not None
        try:
            options = resolve_reward_args(name, self.args, None)
        except RewardError as error:
            self.deferred = _without_name(str(error), name)
            return
        self._variants[_key(options)] = self._build(options, "")

    def variant(self, context: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """The key and options of the instance that scores a request with reward context ``context``.

        Args:
            context: The request's context, checked by :func:`~mmrl.rewards.server_requests.decode_context`; None
                when the request carries none.

        Raises:
            BadRequest: 409 when the reward's ``resolve_args`` hook refuses the context, with its one-line reason.
        """
        if self._fixed:
            return "", {}  # an already built function: no options to resolve
        if not self.reads_context:
            return _key(self.args), self.args
        try:
            options = resolve_reward_args(self.name, self.args, context)
        except RewardError as error:
            reason = _without_name(str(error), self.name)
            if context is None:
                what = ("needs the run's reward context, and the request carries none (its 'context' field, which the "
                        "remote reward of a training run sends)")
            else:
                what = f"refuses the request's reward context {shown_json(context)}"
            raise BadRequest(409, f"reward {self.name!r} of this server's config {what}: {reason}") from None
        return _key(options), options

    def instance(self, variant: tuple[str, dict[str, Any]]) -> Callable[[RewardInput], Any]:
        """The reward callable of ``variant`` (from :meth:`variant`), built now if it is not kept; call with
        :attr:`lock` held.

        Raises:
            BadRequest: 500 when the reward cannot be built with these options (a one-line reason).
        """
        key, options = variant
        if key in self._variants:
            self._variants.move_to_end(key)
            return self._variants[key]
        try:
            function = self._build(options, " with the options " + shown_json(options))
        except (RewardError, ConfigError) as error:
            raise BadRequest(500, str(error)) from None
        self._variants[key] = function
        while len(self._variants) > self.max_variants:
            self._variants.popitem(last=False)  # the least recently used
        return function

    def instance_for(self, context: dict[str, Any] | None = None) -> Callable[[RewardInput], Any]:
        """The reward callable that scores requests with reward context ``context`` (for tests and notebooks).

        Raises:
            BadRequest: As :meth:`variant` and :meth:`instance` do.
        """
        variant = self.variant(context)
        with self.lock:
            return self.instance(variant)

    def _build(self, options: dict[str, Any], where: str) -> Callable[[RewardInput], Any]:
        try:
            function = build_reward(self.name, options, resolve=False)
        except (RewardError, ConfigError):
            raise
        except Exception as error:  # a constructor's failure (user or third-party code): one line, cause chained
            message = " ".join(str(error).split())[:300]
            raise RewardError(f"reward {self.name!r} could not be built{where}: {type(error).__name__}: "
                              f"{message}") from error
        self.builds += 1
        return function


def _key(options: Mapping[str, Any]) -> str:
    """Canonical text of a reward's options: equal options give equal keys (values that are not JSON by repr)."""
    return json.dumps(options, sort_keys=True, separators=(",", ":"), default=repr)


def _without_name(message: str, name: str) -> str:
    """``message`` without the ``reward 'NAME': `` prefix that :func:`resolve_reward_args` adds, on one line."""
    return " ".join(message.split()).removeprefix(f"reward {name!r}: ")
