"""The sampling-headroom probe of the grounding world (plugins/vlm/grounding/headroom.py; docs/vlm.md)."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
import torch

from mmrl.plugins.vlm.grounding import headroom, world

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "vlm" / "grounding.yaml"


def test_expected_best_of_is_the_mean_maximum_over_every_subset():
    scores = [0.0, 0.5, 1.0]  # k = 2: subsets {0, .5}, {0, 1}, {.5, 1} -> maxima .5, 1, 1
    assert headroom.expected_best_of(scores, 2) == pytest.approx(2.5 / 3)
    assert headroom.expected_best_of(scores, 1) == pytest.approx(0.5)  # the mean
    assert headroom.expected_best_of(scores, 3) == pytest.approx(1.0)  # the maximum
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(7, generator=generator).tolist() + [0.25, 0.25]  # ties count once per subset too
    for k in range(1, len(values) + 1):
        brute = statistics.mean(max(subset) for subset in itertools.combinations(values, k))
        assert headroom.expected_best_of(values, k) == pytest.approx(brute, rel=1e-12)
    # 0/1 scores: the pass@k estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, eq. 1), here n 5, c 2, k 2
    assert headroom.expected_best_of([1, 0, 0, 1, 0], 2) == pytest.approx(1 - 3 / 10)
    with pytest.raises(ValueError, match="between 1 and the number of scores"):
        headroom.expected_best_of(scores, 4)


def test_summarise_reports_mean_best_of_k_and_spread():
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    result = headroom.summarise(scores)
    assert result["questions"] == 2 and result["samples"] == 4
    assert result["mean_sample"] == pytest.approx((0.25 + 0.5) / 2)
    assert list(result["best_of"]) == ["1", "2", "4"]
    assert result["best_of"]["2"] == pytest.approx((0.5 + 0.5) / 2)  # question 1: 3 of the 6 pairs hold the 1
    assert result["best_of"]["4"] == pytest.approx(0.75)
    assert result["groups_with_spread"] == pytest.approx(0.5)
    assert headroom.subset_sizes(6) == [1, 2, 4, 6]


def test_probe_samples_the_bundled_checkpoint_on_held_out_questions(tmp_path, capsys):
    """The script end to end on 3 held-out questions, 4 samples each, from the bundled checkpoint: it samples (the
    answers differ within a question at the recipe's temperature 1 for at least one of them) and scores with the
    world's reward; a missing questions file is refused."""
    data = world.write_dataset(tmp_path / "data", train=3, test=3, seed=0)
    out = tmp_path / "headroom.json"
    assert headroom.main([str(RECIPE), str(data["test"]), "--samples", "4", "--prompts-per-call", "2",
                          "--out", str(out), "--output-dir", str(tmp_path / "run"), "plugin.top_k=0"]) == 0
    result = json.loads(out.read_text())
    assert result["reward"] == "grounding_world" and result["questions"] == 3 and result["samples"] == 4
    assert result["overrides"] == ["plugin.top_k=0"]
    best = [result["best_of"][k] for k in ("1", "2", "4")]
    assert best[0] == pytest.approx(result["mean_sample"])
    assert best == sorted(best) and 0.0 <= best[0] <= best[-1] <= 1.0
    assert result["groups_with_spread"] > 0  # sampled, not greedy (90% of questions have spread, docs/vlm.md)
    assert "grounding_world over 3 questions x 4 samples" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        headroom.main([str(RECIPE), str(tmp_path / "missing.jsonl")])
