"""Test helpers: small configs of the reference plugin, a call recorder, a gradient recorder and a bucketed variant
of the reference plugin."""

from __future__ import annotations

from pathlib import Path

import torch

from mmrl.config import TrainConfig, load_config
from mmrl.plugins.toy.plugin import ToyPlugin

# A fast, fixed-length variant of configs/toy.yaml: it learns clearly within a few dozen steps.
BASE = {
    "plugin": {"name": "toy", "task": "reverse", "num_digits": 6, "min_length": 4, "max_length": 4,
               "train_size": 512, "eval_size": 64},
    "run": {"max_steps": 4, "seed": 0, "progress": False, "save_every": 0},
    "rollout": {"prompts_per_step": 8, "group_size": 4},
    "algorithm": {"micro_batch_size": 32},
    "optim": {"lr": 5.0e-3},
    "rewards": {"functions": [{"name": "token_accuracy"}]},
    "eval": {"at_start": False, "num_prompts": 16},
}


def toy_config(output_dir: str | Path, *overrides: str) -> TrainConfig:
    return load_config(BASE, [f"run.output_dir={output_dir}", *overrides])


def record_calls(owner: object, name: str) -> list[bool]:
    """Wrap ``owner.name`` so that each call appends whether gradients were enabled (a training forward) or not (a
    no-grad pass); returns that list, which fills as the wrapped method is called."""
    calls: list[bool] = []
    method = getattr(owner, name)

    def recorded(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return method(*args, **kwargs)

    setattr(owner, name, recorded)
    return calls


def trainable_gradients(loss: torch.Tensor, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: d loss / d parameter}`` for ``module``'s trainable parameters that ``loss`` depends on: the
    gradient a test writes out itself, to compare with what :func:`record_gradients` recorded from a run."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: g for (name, _), g in zip(named, grads, strict=True) if g is not None}


def record_gradients(trainer, module: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Wrap ``trainer.optimizer.step`` so that every optimizer step first records a copy of ``module``'s gradients.

    Runs that should train alike are compared through these gradients rather than through their parameters after
    AdamW steps: where a gradient is (mathematically) zero, such as a key bias (it adds the same constant to every
    attention logit of a query), the computed gradient is rounding noise, and AdamW divides that noise by its own
    square root, moving the parameter by about lr in a direction set by the CPU's kernels.

    Args:
        trainer: A :class:`mmrl.trainer.Trainer`, before ``train()``.
        module: The module whose parameters' gradients are recorded (e.g. ``trainer.plugin.model``).

    Returns:
        A list that fills as the run trains: one ``{parameter name: gradient}`` per optimizer step, for the
        parameters that have a gradient (after clipping, as the optimizer sees them).
    """
    steps: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def recorded(*args, **kwargs):
        steps.append({name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recorded
    return steps


class BucketToy(ToyPlugin):
    """The toy plugin with its rows bucketed by prompt length (``Plugin.row_buckets``, as image rows are by size),
    which refuses batches that mix buckets and records the bucket of every rollout call as ``(training, bucket)``."""

    name = "bucket_toy"

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.calls: list[tuple[bool, str]] = []  # (training, bucket) per rollout call

    def row_buckets(self, split):
        return [f"len{len(row['digits'])}" for row in self.dataset(split)]

    def rollout(self, policy, batch):
        keys = {f"len{len(row['digits'])}" for row in batch.rows}
        if len(keys) != 1:
            raise AssertionError(f"a batch mixes buckets {sorted(keys)}")
        self.calls.append((batch.training, keys.pop()))
        return super().rollout(policy, batch)
