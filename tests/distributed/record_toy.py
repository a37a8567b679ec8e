"""Run a plugin (the reference one by default) for a few steps and record what the equality tests compare.

Launched by the tests in this folder, alone or under ``accelerate launch --multi_gpu --num_processes 2``. Every
process writes ``rank{r}.json`` with the advantage of each sample it generated (keyed by the sample's seed, which
depends only on its global index and sampling round; 0 for one outside the groups dynamic sampling kept) and the
per-step losses; the main process also writes the final parameters
to ``params.pt`` and the gradient of every optimizer step (as the optimizer saw it: reduced over processes, clipped)
to ``gradients.pt``.

    python tests/distributed/record_toy.py OUT_DIR [--plugin-old-logp] [--rollout-per-sample] [--bucketed]
        [--config PATH] [key=value overrides...]

``--config PATH`` starts from a shipped recipe (e.g. configs/toy.yaml) instead of the tests' small toy config.

``--plugin-old-logp`` makes the plugin return training rollouts with their own ``old_logp`` (the sampling weights'
log-probs through the forward's computation); the toy plugin leaves them out, and the learner then substitutes the
detached training log-probs (one optimizer step per rollout) or computes them (several).

``--bucketed`` runs :class:`tests.helpers.BucketToy` (rows bucketed by prompt length; a batch that mixes buckets
fails) and writes each rank's training buckets, one per rollout call, into its ``rank{r}.json``.

``--rollout-per-sample`` decodes each training batch one sample at a time (:func:`per_sample_rollout`) and joins
the rollouts: for plugins whose samples depend on the batch composition by design (the vlm plugin seeds one RNG
stream per decode call from all the batch's sample seeds, docs/vlm.md), so that a sample depends on its own seed
only and one and two processes sample the same tokens. Evaluation batches are decoded as they come.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mmrl.config import load_config  # noqa: E402
from mmrl.plugin import PromptBatch, plugin_registry  # noqa: E402
from mmrl.reward import reward_functions  # noqa: E402
from mmrl.rewards.text_match import token_accuracy  # noqa: E402
from mmrl.rollout import Rollout  # noqa: E402
from mmrl.trainer import Trainer  # noqa: E402
from tests.helpers import BucketToy, toy_config  # noqa: E402


@reward_functions.register("test_constant_on_rank_1")
def constant_on_rank_1(batch):
    """token_accuracy on process 0; a constant on process 1, so that every group there lacks spread."""
    import os

    if os.environ.get("RANK", "0") == "1":
        return [0.5] * len(batch)
    return token_accuracy(batch)


@reward_functions.register("test_completion_length")
def completion_length(batch):
    """The completion's length in characters over 100: a random tiny VLM never writes a box or the R1 format, so the
    recipe's rewards are all 0 (zero advantages, zero gradients); lengths spread within every group."""
    return [len(text) / 100 for text in batch.output("completions")]


def per_sample_rollout(rollout: Callable[..., Rollout]) -> Callable[..., Rollout]:
    """Wrap a plugin's ``rollout`` so that a training batch is decoded as one-sample batches (each row with its own
    group id and seed), joined with :meth:`Rollout.concat` in the batch's order (which averages their ``metrics``
    over the samples: the vlm plugin's are per-sample means, so they stay the batch's)."""

    def decode_one_at_a_time(policy, batch: PromptBatch) -> Rollout:
        if not batch.training:
            return rollout(policy, batch)
        parts = [rollout(policy, replace(batch, rows=[row], group_ids=batch.group_ids[i:i + 1],
                                         seeds=batch.seeds[i:i + 1]))
                 for i, row in enumerate(batch.rows)]
        return Rollout.concat(parts)

    return decode_one_at_a_time


def main() -> None:
    out = Path(sys.argv[1])
    arguments = sys.argv[2:]
    plugin_old_logp = "--plugin-old-logp" in arguments
    rollout_per_sample = "--rollout-per-sample" in arguments
    bucketed = "--bucketed" in arguments
    arguments = [arg for arg in arguments if arg not in ("--plugin-old-logp", "--rollout-per-sample", "--bucketed")]
    if bucketed:
        plugin_registry.register(BucketToy.name, BucketToy)
        arguments = ["plugin.name=bucket_toy", *arguments]
    if "--config" in arguments:
        at = arguments.index("--config")
        recipe = arguments[at + 1]
        overrides = [*arguments[:at], *arguments[at + 2:]]
        config = load_config(recipe, [f"run.output_dir={out / 'run'}", "run.progress=false", *overrides])
    else:
        config = toy_config(out / "run", *arguments)
    trainer = Trainer(config)
    advantages: dict[str, float] = {}
    current_seeds: list[torch.Tensor] = []
    original_rollout, original_credit = trainer.plugin.rollout, trainer.collector.credit_kept
    if rollout_per_sample:
        original_rollout = per_sample_rollout(original_rollout)

    def recording_rollout(policy, batch):
        current_seeds.append(batch.seeds.clone())
        rollout = original_rollout(policy, batch)
        if plugin_old_logp and batch.training:
            plugin = trainer.plugin
            with torch.no_grad():
                rollout.old_logp, _ = plugin._token_logp(plugin.runtime.unwrap(policy), rollout.replay["prompt_ids"],
                                                         rollout.replay["tokens"])
        return rollout

    def recording_credit(rounds, selection):  # a step's pooled samples, every round's, in sampling order
        result = original_credit(rounds, selection)
        seeds = torch.cat(current_seeds)
        current_seeds.clear()
        local = result[0].cpu()
        for seed, value in zip(seeds.tolist(), local.tolist(), strict=True):
            advantages[str(seed)] = value
        return result

    gradients: list[torch.Tensor] = []  # [optimizer steps] the (reduced, clipped) gradient each step applied
    original_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        gradients.append(torch.cat([p.grad.detach().flatten().cpu() for p in trainer.learner.parameters]))
        return original_step(*args, **kwargs)

    trainer.plugin.rollout = recording_rollout
    trainer.collector.credit_kept = recording_credit
    trainer.optimizer.step = recording_step
    result = trainer.train()
    rank = trainer.accelerator.process_index
    record = {"advantages": advantages, "losses": [r["loss/total"] for r in result.history],
              "rewards": [r["reward/mean"] for r in result.history],
              "padded": [r["samples/padded"] for r in result.history],
              "num_processes": trainer.accelerator.num_processes,
              "entropy_control": None if trainer.entropy_control is None else trainer.entropy_control.state_dict(),
              "buckets": [key for training, key in getattr(trainer.plugin, "calls", []) if training]}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if trainer.accelerator.is_main_process:
        model = getattr(trainer.plugin, "model", None)  # the flow plugin holds a pipeline: its trained parameters
        params = (model.state_dict().items() if model is not None
                  else ((str(i), p) for i, p in enumerate(trainer.learner.parameters)))
        torch.save({k: v.detach().cpu() for k, v in params}, out / "params.pt")
        torch.save(torch.stack(gradients), out / "gradients.pt")
    trainer.close()  # the process group is destroyed before the interpreter exits
    assert not torch.distributed.is_initialized()
    # ...and freed, its worker threads joined: a gloo thread alive at exit can abort the process (Trainer.close)
    assert not gloo_threads(), f"gloo threads alive after Trainer.close(): {gloo_threads()}"


def gloo_threads() -> list[str]:
    """Names of this process's threads that gloo started (``pt_gloo_runloop``, ``gloo_tcp_loop``; Linux, from
    /proc/self/task; empty elsewhere)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we read
            continue
    return sorted(name for name in names if "gloo" in name)


if __name__ == "__main__":
    main()
