"""The reward interface and the scorer that runs the configured rewards.

A reward is registered in :data:`reward_functions` (re-exported as ``mmrl.rewards.reward_functions``) and is
either

- a class (subclass :class:`Reward`) constructed once with the config's ``args`` and then called on batches, or
- a function ``fn(batch, **args)``.

Called on a :class:`RewardInput`, it returns one score per sample (a list of floats or a ``[N]`` tensor). A reward
with ``groupwise = True`` is called once per group with that group's samples (Pref-GRPO's win rate needs the whole
group). Rewards must score malformed model outputs (unparseable text, blank images) rather than raise.

**Reward context.** A training run hands every reward, when it is built, the plugin's
:meth:`mmrl.plugin.Plugin.reward_context`: a JSON-serialisable dict of facts about the model being trained (the VLM
plugin declares ``{"box_convention": "qwen2_vl"}``). A reward that needs such a fact carries a ``resolve_args``
attribute (a function attribute, or a static/class method of a :class:`Reward` class) ``(args, context) -> args``:
:func:`build_reward` calls it before building the reward, so it can fill a default from the context and refuse an
option that contradicts it with a :class:`RewardError`, at start-up. Rewards without ``resolve_args`` never see the
context. Outside a run (a plain :func:`build_reward` or :meth:`RewardScorer.from_config`) the context is empty.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmrl.registry import Registry

reward_functions: Registry[Any] = Registry("reward", entry_point_group="mmrl.rewards", populate="mmrl.rewards")


class RewardError(RuntimeError):
    """A reward could not be built, raised, or returned something unusable (wrong length, non-numbers, NaN under
    ``on_nonfinite: error``). ``str(error)`` is one line naming the reward and, where one is to blame, the sample."""


@dataclass
class RewardInput:
    """The samples a reward scores.

    Attributes:
        rows: The dataset row (prompt and metadata such as ``"solution"``) of each sample.
        payload: Per-sample model outputs, e.g. ``{"completions": list[str]}`` or ``{"images": Tensor[N,3,H,W]}``.
        group_ids: ``[N]`` group of each sample.
    """

    rows: list[dict[str, Any]]
    payload: dict[str, Any]
    group_ids: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def prompts(self) -> list[str]:
        return [str(row.get("prompt", "")) for row in self.rows]

    def column(self, name: str) -> list[Any]:
        """The metadata field ``name`` of every row; a clear error names the rows that lack it."""
        missing = [i for i, row in enumerate(self.rows) if name not in row]
        if missing:
            raise RewardError(f"dataset rows {missing[:5]} have no {name!r} field, which this reward reads")
        return [row[name] for row in self.rows]

    def output(self, name: str) -> Any:
        """The payload entry ``name``; a clear error lists what the plugin produced instead."""
        if name not in self.payload:
            raise RewardError(f"this reward reads payload[{name!r}] but the plugin produced {sorted(self.payload)}")
        return self.payload[name]

    def select(self, indices: Sequence[int]) -> RewardInput:
        from mmrl.rollout import _take

        index = torch.as_tensor(list(indices), dtype=torch.long)
        return RewardInput(
            rows=[self.rows[i] for i in index.tolist()],
            payload=_take(self.payload, index),
            group_ids=self.group_ids.index_select(0, index) if self.group_ids.numel() else self.group_ids,
        )


class Reward:
    """Optional base class for rewards with state (models loaded once) or group-wise scoring.

    Subclasses implement ``__call__(self, batch: RewardInput) -> Sequence[float] | Tensor``. Constructor keyword
    arguments are the reward's options, validated from the config's ``args``.
    """

    groupwise: ClassVar[bool] = False

    def __call__(self, batch: RewardInput) -> Sequence[float] | Tensor:
        raise NotImplementedError


def check_reward_context(context: Mapping[str, Any] | None) -> dict[str, Any]:
    """A private copy of a plugin's reward context (``{}`` for None), checked to be a JSON-serialisable dict with
    string keys, so that every reward reads the same facts and a remote reward can send them."""
    if context is None:
        return {}
    if not isinstance(context, Mapping) or not all(isinstance(key, str) for key in context):
        raise RewardError(f"a reward context must be a dict with string keys (Plugin.reward_context), got {context!r}")
    try:
        return json.loads(json.dumps(dict(context)))
    except (TypeError, ValueError) as error:
        raise RewardError(f"a reward context must be JSON-serialisable (Plugin.reward_context): {error}") from None


def resolve_reward_args(name: str, args: Mapping[str, Any], context: Mapping[str, Any] | None = None
                        ) -> dict[str, Any]:
    """The options the reward registered as ``name`` is built with in a run whose reward context is ``context``.

    Args:
        name: A registered reward.
        args: Its options from the config.
        context: The run's reward context (None: none, as outside a run).

    Returns:
        ``args`` as the reward's ``resolve_args`` hook returns them, or a copy of ``args`` for a reward without one.

    Raises:
        RewardError: The context is not a JSON-serialisable dict with string keys, or the hook refused; one line
            starting with ``reward 'NAME':``.
    """
    entry = reward_functions.get(name)
    context = check_reward_context(context)
    resolve = getattr(entry, "resolve_args", None)
    if resolve is None:
        return dict(args)
    try:
        return resolve(dict(args), context)
    except RewardError as error:
        raise RewardError(f"reward {name!r}: {error}") from None


def build_reward(name: str, args: dict[str, Any], context: Mapping[str, Any] | None = None, *,
                 resolve: bool = True) -> Callable[[RewardInput], Any]:
    """Instantiate (class) or bind (function) the reward registered as ``name`` with ``args``.

    Args:
        name: A registered reward.
        args: Its options (checked against its signature when the config loads).
        context: Facts about the run that rewards may read (:meth:`mmrl.plugin.Plugin.reward_context`); None outside
            a run. A reward with a ``resolve_args(args, context)`` attribute gets its arguments from it (see the
            module docstring and :func:`resolve_reward_args`); a :class:`RewardError` it raises is prefixed with the
            reward's name.
        resolve: False when ``args`` already are what :func:`resolve_reward_args` returned (the reward server
            resolves first, to build one instance per distinct set of options): they are used as they are.
    """
    entry = reward_functions.get(name)
    if resolve:
        args = resolve_reward_args(name, args, context)
    if isinstance(entry, type):
        return entry(**args)

    def bound(batch: RewardInput) -> Any:
        return entry(batch, **args)

    bound.groupwise = getattr(entry, "groupwise", False)  # type: ignore[attr-defined]
    bound.__name__ = name
    return bound


@dataclass
class ScoredBatch:
    """Scores of one batch.

    Attributes:
        scores: ``[N, K]`` float32, one column per reward (non-finite entries replaced by 0 when skipped).
        valid: ``[N]`` bool, False for samples with a non-finite score under ``on_nonfinite: skip``.
    """

    scores: Tensor
    valid: Tensor

    @staticmethod
    def concat(parts: Sequence[ScoredBatch]) -> ScoredBatch:
        """Join the scores of consecutive chunks of one batch (in order)."""
        if not parts:
            raise RewardError("ScoredBatch.concat needs at least one part")
        return ScoredBatch(scores=torch.cat([p.scores for p in parts]), valid=torch.cat([p.valid for p in parts]))


class RewardScorer:
    """Runs the configured rewards on a batch and checks what they return.

    Args:
        names: Reward names, one per column.
        functions: The built reward callables.
        weights: ``[K]`` weights.
        on_nonfinite: ``"error"`` stops with a message naming the reward and sample; ``"skip"`` marks the
            sample invalid (it is excluded from advantages and the loss).
        num_workers: Threads of the pool behind :meth:`submit` (asynchronous scoring), created on first use.

    Asynchronous scoring: ``future = scorer.submit(batch)`` scores ``batch`` in a worker thread while the caller goes
    on (e.g. samples the next chunk); ``future.result()`` returns exactly what ``score(batch)`` returns, or raises
    its error. The batch must not be modified until the future is done, and rewards must be safe to call from
    several threads when ``num_workers > 1`` (models in eval mode under ``no_grad`` are). Call :meth:`close` (or use
    the scorer as a context manager) to stop the pool.
    """

    def __init__(self, names: list[str], functions: list[Callable[[RewardInput], Any]], weights: list[float],
                 on_nonfinite: str = "error", num_workers: int = 1):
        self.names = names
        self.functions = functions
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.on_nonfinite = on_nonfinite
        if num_workers < 1:
            raise RewardError(f"RewardScorer num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False
        # NaN or infinite scores seen per reward (dropped under "skip"); read to explain steps that trained on nothing.
        self.nonfinite_counts: dict[str, int] = dict.fromkeys(names, 0)
        self._counts_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Any, context: Mapping[str, Any] | None = None) -> RewardScorer:
        """Build from a :class:`mmrl.config.RewardsConfig`; ``context`` is the plugin's reward context (see
        :func:`build_reward`), None outside a training run.

        Raises:
            RewardError: naming the reward whose constructor failed (a missing dependency or weights file, ...).
        """
        specs = config.functions
        return cls(
            [spec.name for spec in specs],
            [_build_named(spec.name, spec.args, context) for spec in specs],
            [spec.weight for spec in specs],
            config.on_nonfinite,
            num_workers=getattr(config, "num_workers", 1),
        )

    def submit(self, batch: RewardInput) -> Future[ScoredBatch]:
        """Score ``batch`` in the worker pool; the future's result equals ``score(batch)`` (same checks and errors)."""
        with self._executor_lock:
            if self._closed:
                raise RewardError("RewardScorer.submit called after close()")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="mmrl-reward")
            return self._executor.submit(self.score, batch)

    def close(self, wait: bool = True) -> None:
        """Stop the worker pool (waiting for submitted batches unless ``wait=False``). Idempotent."""
        with self._executor_lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def groupwise(self) -> bool:
        return any(getattr(fn, "groupwise", False) for fn in self.functions)

    def score(self, batch: RewardInput) -> ScoredBatch:
        """Score ``batch`` with every reward → :class:`ScoredBatch` (``[N, K]`` scores and ``[N]`` validity)."""
        n = len(batch)
        columns = []
        valid = torch.ones(n, dtype=torch.bool)
        for name, fn in zip(self.names, self.functions, strict=True):
            column = self._run(name, fn, batch)  # [N] float64
            finite = torch.isfinite(column)
            if not finite.all():
                bad = (~finite).nonzero().flatten()[:5].tolist()
                with self._counts_lock:
                    self.nonfinite_counts[name] = self.nonfinite_counts.get(name, 0) + int((~finite).sum())
                if self.on_nonfinite == "error":
                    raise RewardError(
                        f"reward {name!r} returned NaN or infinite scores for samples {bad} "
                        "(set rewards.on_nonfinite=skip to drop such samples instead)"
                    )
                valid &= finite
                column = torch.where(finite, column, torch.zeros_like(column))
            columns.append(column)
        scores = torch.stack(columns, dim=1).to(torch.float32) if columns else torch.zeros(n, 0)
        return ScoredBatch(scores=scores, valid=valid)

    def raw_scores(self, batch: RewardInput) -> Tensor:
        """``[N, K]`` float64 scores as the rewards returned them: lengths and types checked, NaN kept, no policy."""
        columns = [self._run(name, fn, batch) for name, fn in zip(self.names, self.functions, strict=True)]
        return torch.stack(columns, dim=1) if columns else torch.zeros(len(batch), 0, dtype=torch.float64)

    def _run(self, name: str, fn: Callable[[RewardInput], Any], batch: RewardInput) -> Tensor:
        if not getattr(fn, "groupwise", False):
            return _as_scores(_call(name, fn, batch), len(batch), name)
        if batch.group_ids.numel() != len(batch):
            raise RewardError(
                f"group-wise reward {name!r} needs the group id of each of the {len(batch)} samples, "
                f"got {batch.group_ids.numel()}"
            )
        column = torch.empty(len(batch), dtype=torch.float64)
        ids = batch.group_ids.tolist()
        for group in dict.fromkeys(ids):
            members = [i for i, gid in enumerate(ids) if gid == group]
            scores = _call(name, fn, batch.select(members), where=f"on group {group} (samples {members})")
            column[members] = _as_scores(scores, len(members), name)
        return column


def _build_named(name: str, args: dict[str, Any], context: Mapping[str, Any] | None = None
                 ) -> Callable[[RewardInput], Any]:
    """:func:`build_reward`, with a constructor's failure turned into a one-line :class:`RewardError` naming it."""
    from mmrl.config.schema import ConfigError

    try:
        return build_reward(name, args, context)
    except ConfigError:
        raise
    except RewardError as error:  # already says what is wrong; it gets the reward's name if it lacks it
        message = _one_line(str(error))
        if message.startswith(f"reward {name!r}"):
            raise
        raise RewardError(f"reward {name!r}: {message}") from error
    except Exception as error:  # any other failure of user or third-party code: name the reward, keep the cause
        raise RewardError(f"reward {name!r} could not be built: {_describe(error)}") from error


def _call(name: str, fn: Callable[[RewardInput], Any], batch: RewardInput, where: str | None = None) -> Any:
    """Call one reward on ``batch``; an error it raises becomes a one-line :class:`RewardError` naming the reward and
    ``where`` (a group), or else the first sample that fails on its own.

    A :class:`RewardError` the reward raises itself (a malformed dataset row, an unreachable server) already says
    what is wrong: it only gets the reward's name. Any other exception is a bug or a crash of the reward; it is
    named with the sample that reproduces it, found by calling the reward again on one sample at a time.
    """
    try:
        return fn(batch)
    except RewardError as error:
        message = _one_line(str(error))
        if message.startswith(f"reward {name!r}"):
            raise
        raise RewardError(f"reward {name!r}: {message}" + (f" {where}" if where else "")) from error
    except Exception as error:  # user code: anything it raises is reported as this reward's error (cause chained)
        if where is None:
            where = _failing_sample(fn, batch)
        raise RewardError(f"reward {name!r} raised {_describe(error)} {where}") from error


def _failing_sample(fn: Callable[[RewardInput], Any], batch: RewardInput) -> str:
    """``"on sample i of N (prompt '...')"`` for the first sample on which ``fn`` fails alone (rewards score samples
    independently unless group-wise), or a note that only the whole batch fails."""
    from mmrl.rollout import RolloutError

    def sample(index: int) -> str:
        prompt = str(batch.prompts[index])
        shown = repr(prompt) if len(prompt) <= 60 else repr(prompt[:57] + "...")
        return f"on sample {index} of {len(batch)} (prompt {shown})"

    if len(batch) == 1:
        return sample(0)
    for index in range(len(batch)):
        try:
            single = batch.select([index])
        except RolloutError:  # a payload entry that cannot be split per sample: the batch is all there is
            break
        try:
            fn(single)
        except Exception:  # this sample reproduces the failure (the batch's exception is the one reported)
            return sample(index)
    return f"on a batch of {len(batch)} samples (no sample fails on its own)"


def _describe(error: BaseException) -> str:
    """``"ValueError: message"`` on one line (whitespace collapsed, at most 300 characters of message)."""
    message = _one_line(str(error))
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _as_scores(value: Any, n: int, name: str) -> Tensor:
    if isinstance(value, Tensor):
        scores = value.detach().to("cpu", torch.float64).flatten()
    else:
        try:
            scores = torch.tensor([_as_float(v) for v in value], dtype=torch.float64)
        except (TypeError, ValueError):
            raise RewardError(f"reward {name!r} must return numbers, got {type(value).__name__}") from None
    if scores.numel() != n:
        raise RewardError(f"reward {name!r} returned {scores.numel()} scores for {n} samples")
    return scores


def _as_float(value: Any) -> float:
    # None means "no score" (TRL's convention); it is treated like NaN, i.e. by rewards.on_nonfinite.
    return math.nan if value is None else float(value)
