"""T-GRPO's temporal reward (``temporal_contrast``; Video-R1, arXiv:2503.21776, tulerfeng/Video-R1@59d65c3
``vllm_grpo_trainer_modified.py:771-786``): by hand, against Video-R1's rule written out, group by group through the
scorer, and its errors."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward
from tests.helpers import BASE


def _group(answers, shuffled, solution="B", group=0):
    rows = [{"prompt": "q", "solution": solution} for _ in answers]
    return RewardInput(rows=rows, payload={"completions": list(answers),
                                           "shuffled_completions": [list(shuffled) for _ in answers]},
                       group_ids=torch.full((len(answers),), group, dtype=torch.long))


def _score(batch, **options):
    reward = build_reward("temporal_contrast", {"reward": "exact_match", **options})
    return torch.as_tensor(reward(batch), dtype=torch.float64).tolist()


def test_the_bonus_by_hand():
    # p = 0.5 >= 0.8 · p̃ = 0.8 · 0.5: the two correct answers get + 0.3
    assert _score(_group(["B", "A", "B", "C"], ["B", "A"])) == pytest.approx([1.3, 0.0, 1.3, 0.0])
    # p = 0.25 < 0.8 · 1.0: no bonus
    assert _score(_group(["B", "A", "A", "A"], ["B", "B"])) == pytest.approx([1.0, 0.0, 0.0, 0.0])
    # at the boundary p = μ · p̃ (0.4 = 0.8 · 0.5) the bonus is given (Video-R1's >=)
    assert _score(_group(["B", "A", "A", "A", "B"], ["B", "A"])) == pytest.approx([1.3, 0, 0, 0, 1.3])
    # no contrast group (a prompt without a video, an evaluation rollout): the accuracy alone
    assert _score(_group(["B", "A"], [])) == [1.0, 0.0]
    # other α, μ and threshold: every answer wrong in both groups still satisfies 0 >= μ · 0, nothing is correct
    assert _score(_group(["A", "A"], ["A"])) == [0.0, 0.0]
    assert _score(_group(["B", "A"], ["B"]), ratio=0.4, bonus=1.0) == pytest.approx([2.0, 0.0])
    assert _score(_group(["B", "A"], ["B"]), ratio=0.6) == pytest.approx([1.0, 0.0])
    assert _score(_group(["B", "A"], ["A"]), threshold=1.0) == pytest.approx([1.0, 0.0])


def test_video_r1s_rule_written_out_agrees():
    # tulerfeng/Video-R1@59d65c3 vllm_grpo_trainer_modified.py:771-786, one prompt's groups (accuracy column 0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        ordered = (torch.rand(8, generator=generator) > 0.5).tolist()
        shuffled = (torch.rand(4, generator=generator) > 0.5).tolist()
        answers = ["B" if right else "A" for right in ordered]
        contrast = ["B" if right else "A" for right in shuffled]
        rewards = torch.tensor([float(right) for right in ordered])
        shuffled_rewards = torch.tensor([float(right) for right in shuffled])
        expected = rewards.clone()
        if rewards.mean() >= 0.8 * shuffled_rewards.mean():
            mask = expected > 0.1
            expected[mask] = expected[mask] + 0.3
        assert _score(_group(answers, contrast)) == pytest.approx(expected.tolist())


def test_each_group_is_compared_on_its_own_through_the_scorer():
    first, second = _group(["B", "B"], ["A", "A"], group=0), _group(["B", "A"], ["B", "B"], group=1)
    batch = RewardInput(rows=first.rows + second.rows,
                        payload={key: first.payload[key] + second.payload[key] for key in first.payload},
                        group_ids=torch.tensor([0, 0, 1, 1]))
    config = load_config({**BASE, "rewards": {"functions": [
        {"name": "temporal_contrast", "args": {"reward": "exact_match"}}]}})
    scorer = RewardScorer.from_config(config.rewards)
    assert scorer.groupwise
    scores = scorer.score(batch).scores[:, 0].tolist()
    assert scores == pytest.approx([1.3, 1.3, 1.0, 0.0])  # group 0: 1 >= 0; group 1: 0.5 < 0.8


def test_an_unscorable_accuracy_gives_no_bonus():
    reward = build_reward("temporal_contrast", {"reward": "exact_match"})
    reward.inner = lambda batch: [math.nan if text == "?" else float(text == "B")
                                  for text in batch.output("completions")]
    scores = torch.as_tensor(reward(_group(["B", "?"], ["A"]))).tolist()
    assert scores[0] == 1.0 and math.isnan(scores[1])  # the mean is NaN: no comparison holds, NaN stays for the core


def test_the_accuracy_reward_sees_the_runs_reward_context():
    """Wrapped, iou takes the plugin's box convention from the run's context as it does on its own."""
    reward = build_reward("temporal_contrast", {"reward": "iou"}, context={"box_convention": "qwen2_vl"})
    direct = build_reward("iou", {}, context={"box_convention": "qwen2_vl"})
    rows = [{"prompt": "q", "solution": [64, 48, 320, 240], "image_size": [640, 480]}]
    answer = "<|box_start|>(100,100),(500,500)<|box_end|>"
    batch = RewardInput(rows=rows, payload={"completions": [answer], "shuffled_completions": [[]]},
                        group_ids=torch.zeros(1, dtype=torch.long))
    assert torch.as_tensor(reward(batch)).tolist() == pytest.approx(torch.as_tensor(direct(batch)).tolist())
    assert float(torch.as_tensor(reward(batch))[0]) == pytest.approx(1.0)


def test_errors_name_what_is_wrong():
    with pytest.raises(RewardError, match="reward must name a per-sample accuracy reward, one of"):
        build_reward("temporal_contrast", {"reward": "no_such_reward"})
    with pytest.raises(RewardError, match="'pref_winrate' is group-wise"):
        build_reward("temporal_contrast", {"reward": "pref_winrate",
                                           "options": {"judge_args": {"reward": "exact_match"}}})
    with pytest.raises(RewardError, match=r"payload\['shuffled_completions'\] must hold one list of texts per sample"):
        build_reward("temporal_contrast", {"reward": "exact_match"})(
            RewardInput(rows=[{"solution": "B"}], payload={"completions": ["B"], "shuffled_completions": "B"}))
    batch = _group(["B", "A"], ["B"])
    batch.payload["shuffled_completions"][1] = ["A"]
    with pytest.raises(RewardError, match="the samples of one group carry different"):
        build_reward("temporal_contrast", {"reward": "exact_match"})(batch)
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].args.reward"):
        load_config({**BASE, "rewards": {"functions": [{"name": "temporal_contrast", "args": {"reward": "nope"}}]}})
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].args.options.max_chars"):
        load_config({**BASE, "rewards": {"functions": [
            {"name": "temporal_contrast", "args": {"reward": "exact_match", "options": {"max_chars": 0}}}]}})
