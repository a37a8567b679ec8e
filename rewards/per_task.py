"""``per_task``: score each row with the reward its task names, for datasets that mix question types.

A run scores every sample with the same reward functions, and rewards do not dispatch on a row's ``task``
(docs/rewards.md). Mixed datasets need the dispatch: Video-R1's GRPO data mixes multiple-choice, numerical, OCR,
free-form and regression questions and picks the accuracy reward by the row's ``problem_type``
(tulerfeng/Video-R1@59d65c3 ``src/r1-v/src/open_r1/grpo.py``, ``accuracy_reward``), as VLM-R1's multi-task runs
pick theirs by the dataset. ``per_task`` does that with registered rewards: ``tasks`` maps each value of the row's
``field`` to a reward spec ``{name, args}``; each row is scored by its task's reward (rows of one task together),
rows of an unlisted task by ``default`` or, without one, a one-line error naming the task. It returns one column, so
it can stand where a single accuracy reward stands (also inside ``temporal_contrast``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from mmrl.reward import Reward, RewardError, RewardInput, build_reward, resolve_reward_args, reward_functions
from mmrl.rewards.wrapped import inner_scores

RewardSpec = Mapping[str, Any]
"""``{"name": registered reward, "args": its options}`` (``args`` optional)."""


def _spec_problem(spec: Any) -> str | None:
    """What is wrong with a reward spec ``{name, args}``, or None."""
    if not isinstance(spec, Mapping) or set(spec) - {"name", "args"} or not isinstance(spec.get("name"), str):
        return f"must be {{name: <reward>, args: {{...}}}}, got {spec!r}"
    if spec["name"] == "per_task" or spec["name"] not in reward_functions:
        names = [n for n in reward_functions.names() if n != "per_task"]
        return f"names {spec['name']!r}; one of {', '.join(names)}"
    if not isinstance(spec.get("args") or {}, Mapping):
        return f"args must be a mapping of options, got {spec['args']!r}"
    return None


def _spec(spec: Any, where: str) -> tuple[str, dict[str, Any]]:
    """The (name, args) of a reward spec; a one-line error for anything else."""
    problem = _spec_problem(spec)
    if problem is not None:
        raise RewardError(f"reward 'per_task': {where} {problem}")
    return spec["name"], dict(spec.get("args") or {})


class PerTaskReward(Reward):
    """Each row scored by the reward of its task (module docstring)."""

    def __init__(self, *, tasks: dict[str, Any], field: str = "task", default: dict[str, Any] | None = None):
        """Options (the config's ``args``).

        Args:
            tasks: Task value → reward spec ``{name, args}`` (e.g. ``{"multiple choice": {name: choice},
                "numerical": {name: math}}``).
            field: The row field holding the task (Video-R1: ``problem_type``).
            default: The reward spec of rows whose task ``tasks`` does not list; null: such a row is an error.
        """
        if not isinstance(tasks, Mapping) or not tasks:
            raise RewardError(f"reward 'per_task': tasks must map each task to a reward spec, got {tasks!r}")
        self.field = field
        self.rewards: dict[str, Callable[[RewardInput], Any]] = {}
        self.names: dict[str, str] = {}
        for task, spec in tasks.items():
            name, args = _spec(spec, f"tasks[{task!r}]")
            self.rewards[str(task)], self.names[str(task)] = build_reward(name, args, resolve=False), name
        self.default = None
        self.default_name = None
        if default is not None:
            name, args = _spec(default, "default")
            self.default, self.default_name = build_reward(name, args, resolve=False), name
        inner = [*self.rewards.values(), *([self.default] if self.default is not None else [])]
        # A group is one prompt, so one task: a group-wise inner reward sees whole groups when this one is group-wise.
        self.groupwise = any(getattr(fn, "groupwise", False) for fn in inner)

    @staticmethod
    def resolve_args(args: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        """Every inner reward's options resolved with the run's reward context, as if configured on its own."""
        def resolved(spec: Any) -> Any:
            if _spec_problem(spec) is not None:
                return spec  # the constructor refuses it in one line
            return {**spec, "args": resolve_reward_args(spec["name"], dict(spec.get("args") or {}), context)}

        tasks = args.get("tasks")
        out = dict(args)
        if isinstance(tasks, Mapping):
            out["tasks"] = {task: resolved(spec) for task, spec in tasks.items()}
        if args.get("default") is not None:
            out["default"] = resolved(args["default"])
        return out

    @classmethod
    def bind_nested_options(cls, options: dict[str, Any], key: str) -> dict[str, Any]:
        """Check every inner reward's name and options when the config loads (called by ``bind_options``)."""
        from mmrl.config.schema import ConfigError, bind_options

        def bound(spec: Any, where: str) -> dict[str, Any]:
            problem = _spec_problem(spec)
            if problem is not None:
                raise ConfigError(where, spec, f"a reward spec {{name, args}} (it {problem})")
            name, args = _spec(spec, where)
            return {"name": name, "args": bind_options(reward_functions.get(name), args, f"{where}.args",
                                                       f"reward {name!r}")}

        tasks = options.get("tasks")
        if not isinstance(tasks, Mapping) or not tasks:
            raise ConfigError(f"{key}.tasks", tasks, "a mapping of each task to a reward spec {name, args}")
        out = {**options, "tasks": {task: bound(spec, f"{key}.tasks.{task}") for task, spec in tasks.items()}}
        if options.get("default") is not None:
            out["default"] = bound(options["default"], f"{key}.default")
        return out

    def __call__(self, batch: RewardInput) -> Tensor:
        n = len(batch)
        scores = torch.zeros(n, dtype=torch.float64)
        tasks = [str(task) for task in batch.column(self.field)]
        for task in dict.fromkeys(tasks):
            rows = [i for i, other in enumerate(tasks) if other == task]
            reward, name = self.rewards.get(task), self.names.get(task)
            if reward is None:
                if self.default is None:
                    raise RewardError(f"reward 'per_task': rows {rows[:5]} have {self.field} {task!r}, which "
                                      f"tasks does not list ({', '.join(map(repr, self.rewards))}) and there is no "
                                      "default")
                reward, name = self.default, self.default_name
            part = batch.select(rows)
            scores[rows] = inner_scores("per_task", str(name), reward, part, f"rows of task {task!r}")
        return scores


__all__ = ["PerTaskReward"]
