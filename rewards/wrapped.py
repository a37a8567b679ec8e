"""Rewards that wrap another registered reward, named in their ``reward`` option with its options in ``options``
(``per_frame`` wraps an image reward; ``temporal_contrast`` and ``correct_length_bonus`` an accuracy reward): the
inner reward is checked when the config loads, its options are resolved with the run's reward context as if it
were configured on its own, and its scores are read back with their count checked."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor

from mmrl.reward import RewardError, RewardInput, build_reward, resolve_reward_args, reward_functions


def bind_wrapped_options(options: dict[str, Any], key: str, *, excluded: Collection[str], kind: str
                         ) -> dict[str, Any]:
    """``bind_nested_options`` of a wrapping reward: ``options["reward"]`` must be a registered reward outside
    ``excluded``, and ``options["options"]`` are bound against it (a bad option stops the run at load time).

    Args:
        options: The wrapping reward's ``args``.
        key: Their dotted key in the config (for the error).
        excluded: Rewards the wrapper cannot wrap (itself, ...).
        kind: What the inner reward must be, for the error ("an image reward").
    """
    from mmrl.config.schema import ConfigError, bind_options

    reward = options.get("reward")
    if reward in excluded or reward not in reward_functions:
        names = [name for name in reward_functions.names() if name not in excluded]
        raise ConfigError(f"{key}.reward", reward, f"{kind}, one of {', '.join(names)}")
    inner = bind_options(reward_functions.get(reward), dict(options.get("options") or {}), f"{key}.options",
                         f"reward {reward!r}")
    return options if options.get("options") is None else {**options, "options": inner}


def resolve_wrapped_args(args: dict[str, Any], context: dict[str, Any], *, excluded: Collection[str]
                         ) -> dict[str, Any]:
    """``resolve_args`` of a wrapping reward: the inner reward's options resolved with the run's reward context
    (e.g. the VLM plugin's box convention for ``iou``); an unknown inner reward is left for the constructor to
    refuse in one line."""
    reward = args.get("reward")
    if reward in excluded or reward not in reward_functions:
        return args
    return {**args, "options": resolve_reward_args(reward, dict(args.get("options") or {}), context)}


def build_accuracy_reward(wrapper: str, reward: Any, options: dict[str, Any] | None) -> Callable[[RewardInput], Any]:
    """The per-sample accuracy reward that ``wrapper`` wraps, built from options already resolved
    (:func:`resolve_wrapped_args`).

    Raises:
        RewardError: ``reward`` is not a registered reward, is ``wrapper`` itself, or is group-wise.
    """
    if reward == wrapper or reward not in reward_functions:
        names = [name for name in reward_functions.names() if name != wrapper]
        raise RewardError(f"reward {wrapper!r}: reward must name a per-sample accuracy reward, one of "
                          f"{', '.join(names)}; got {reward!r}")
    inner = build_reward(reward, dict(options or {}), resolve=False)
    if getattr(inner, "groupwise", False):
        raise RewardError(f"reward {wrapper!r}: {reward!r} is group-wise; name a per-sample accuracy reward")
    return inner


def inner_scores(wrapper: str, name: str, inner: Callable[[RewardInput], Any], batch: RewardInput, what: str
                 ) -> Tensor:
    """``[n]`` float64 scores of the inner reward on ``batch``, their count checked."""
    scores = torch.as_tensor(inner(batch), dtype=torch.float64).reshape(-1).cpu()
    if scores.shape[0] != len(batch):
        raise RewardError(f"reward {wrapper!r}: {name!r} returned {scores.shape[0]} scores for {len(batch)} {what}")
    return scores


__all__ = ["bind_wrapped_options", "build_accuracy_reward", "inner_scores", "resolve_wrapped_args"]
