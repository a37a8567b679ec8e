"""Sampling headroom: how far a model's own samples reach on held-out questions, against its greedy answer.

GRPO moves a policy toward the answers that score best among the ones it samples; where no sample of a group
scores well there is nothing to move toward. This script samples ``--samples`` answers per held-out question at the
recipe's rollout settings (temperature, top-p/k; the same plugin call the training rollout makes, without training)
and writes, for one reward (by default the ``grounding_world`` score, else the last reward of the config):

- ``mean_sample``: the mean score of a sampled answer (what GRPO's expected reward is);
- ``best_of``: for each k in 1, 2, 4, ... up to ``--samples``, the expected best score among k of a question's
  samples, averaged over the questions — the unbiased estimate over all k-subsets of the n samples (for scores
  sorted ascending ``s_1 <= ... <= s_n``, ``E[max of k] = sum_{i >= k} C(i-1, k-1) / C(n, k) * s_i``; with 0/1
  scores it is the pass@k estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1);
- ``groups_with_spread``: the share of questions whose samples do not all score the same (groups with a
  group-relative signal).

The greedy score is what ``mmrl eval`` reports. Usage (docs/vlm.md, "Sampling headroom")::

    python -m mmrl.plugins.vlm.grounding.headroom configs/vlm/grounding.yaml QUESTIONS.jsonl --samples 8 \\
        [--out headroom.json] [key=value overrides, e.g. plugin.model=EXPORTED_MODEL]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

PREFERRED_REWARD = "grounding_world"


def expected_best_of(scores: Sequence[float], k: int) -> float:
    """The expected maximum of ``k`` scores drawn without replacement from ``scores`` (every k-subset equally likely).

    Args:
        scores: The n scores of one question's samples.
        k: Subset size, ``1 <= k <= n``.
    """
    n = len(scores)
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of scores ({n}), got {k}")
    ordered = sorted(scores)
    total = math.comb(n, k)
    # The i-th smallest (1-based) is the maximum of the C(i-1, k-1) subsets made of it and k-1 smaller ones.
    return sum(math.comb(i - 1, k - 1) * ordered[i - 1] for i in range(k, n + 1)) / total


def subset_sizes(samples: int) -> list[int]:
    """1, 2, 4, ... below ``samples``, and ``samples`` itself."""
    sizes, k = [], 1
    while k < samples:
        sizes.append(k)
        k *= 2
    return [*sizes, samples]


def summarise(scores: torch.Tensor) -> dict[str, Any]:
    """The headroom numbers of a ``[questions, samples]`` score matrix (see the module docstring)."""
    questions, samples = scores.shape
    rows = scores.tolist()
    return {
        "questions": questions,
        "samples": samples,
        "mean_sample": float(scores.mean()),
        "best_of": {str(k): sum(expected_best_of(row, k) for row in rows) / questions for k in subset_sizes(samples)},
        "groups_with_spread": float((scores.amax(dim=1) > scores.amin(dim=1)).float().mean()),
    }


def sample_scores(config: Any, samples: int, prompts_per_call: int, reward: str | None) -> tuple[torch.Tensor, str]:
    """``[questions, samples]`` scores of ``samples`` sampled answers to each training question of ``config`` (the
    held-out file given as ``plugin.data.train``), and the name of the reward they are."""
    from mmrl.plugin import PromptBatch
    from mmrl.seeding import derive_seed
    from mmrl.trainer import Trainer

    trainer = Trainer(config)
    try:
        names = list(trainer.scorer.names)
        name = reward or (PREFERRED_REWARD if PREFERRED_REWARD in names else names[-1])
        if name not in names:
            raise SystemExit(f"--reward {name!r} is not one of the config's rewards: {', '.join(names)}")
        column = names.index(name)
        rows = trainer.train_rows
        found: list[torch.Tensor] = []
        trainer.policy.eval()
        with torch.no_grad():
            for start in tqdm(range(0, len(rows), prompts_per_call), desc="headroom", unit="call"):
                chosen = rows[start:start + prompts_per_call]
                group_ids = torch.arange(len(chosen)).repeat_interleave(samples)
                seeds = torch.tensor([derive_seed(config.run.seed, start + index, sample)
                                      for index in range(len(chosen)) for sample in range(samples)])
                batch = PromptBatch(rows=[row for row in chosen for _ in range(samples)], group_ids=group_ids,
                                    group_size=samples, seeds=seeds, generator=trainer.collector.generator(0, start),
                                    training=True, step=0, max_steps=1)
                _, scored = trainer.collector.sample_and_score(trainer.policy, batch, {})
                found.append(scored.scores[:, column].reshape(len(chosen), samples).float().cpu())
        return torch.cat(found), name
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.vlm.grounding.headroom",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the recipe (e.g. configs/vlm/grounding.yaml)")
    parser.add_argument("questions", type=Path, help="the held-out questions (a JSONL file of the world)")
    parser.add_argument("--samples", type=int, default=8, help="answers sampled per question (default 8)")
    parser.add_argument("--prompts-per-call", type=int, default=8, help="questions per rollout call (default 8)")
    parser.add_argument("--reward", help=f"the reward to read (default {PREFERRED_REWARD}, else the config's last)")
    parser.add_argument("--out", type=Path, help="also write the numbers here as JSON")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/vlm/headroom"),
                        help="the run folder the trainer is built on (nothing is trained; default runs/vlm/headroom)")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. plugin.model=FOLDER")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    if args.samples < 2 or args.prompts_per_call < 1:
        parser.error("--samples must be at least 2 and --prompts-per-call at least 1")
    if not args.questions.is_file():
        parser.error(f"no questions file at {args.questions}")
    from mmrl.config import load_config

    config = load_config(str(args.config), [
        f"plugin.data.train={args.questions}", f"plugin.data.eval={args.questions}",
        f"rollout.group_size={args.samples}", f"run.output_dir={args.output_dir}", "run.progress=false",
        *args.overrides,
    ])
    scores, name = sample_scores(config, args.samples, args.prompts_per_call, args.reward)
    result = {"reward": name, "config": str(args.config), "questions_file": str(args.questions),
              "overrides": args.overrides, **summarise(scores)}
    best = ", ".join(f"{k}: {value:.3f}" for k, value in result["best_of"].items())
    print(f"{name} over {result['questions']} questions x {result['samples']} samples: mean sample "
          f"{result['mean_sample']:.3f}; expected best of k ({best}); groups with spread "
          f"{result['groups_with_spread']:.0%}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
