"""DAPO's soft overlong punishment (``overlong_penalty``; arXiv:2503.14476 eq. 13, verl's DAPO reward manager)."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.reward import RewardError, RewardInput, build_reward
from mmrl.rewards.length import overlong_penalty
from tests.helpers import toy_config


def _batch(lengths):
    return RewardInput(rows=[{}] * len(lengths), payload={"completion_tokens": torch.tensor(lengths)})


def test_penalty_by_hand():
    # L_max 10, L_cache 4: free up to 6 tokens, then −1/4 per token, −1 at the budget and beyond (DAPO eq. 13)
    assert overlong_penalty(_batch([3, 6, 7, 8, 10, 12]), max_length=10, buffer=4) == [0.0, 0.0, -0.25, -0.5, -1.0,
                                                                                       -1.0]
    assert overlong_penalty(_batch([9]), max_length=10, buffer=4, factor=0.5) == [-0.375]
    assert overlong_penalty(_batch([10]), max_length=10, buffer=10) == [-1.0]  # the buffer may span the budget


def test_verls_formula_agrees_up_to_the_budget():
    max_length, buffer, factor = 20480, 4096, 1.0  # verl's DAPO recipe
    lengths = [1, 16384, 16385, 18000, 20479, 20480]
    verl = [min(-(length - (max_length - buffer)) / buffer * factor, 0) for length in lengths]
    assert overlong_penalty(_batch(lengths), max_length=max_length, buffer=buffer) == pytest.approx(verl)


def test_bad_options_and_missing_lengths_are_one_line_errors():
    with pytest.raises(RewardError, match=r"buffer must be in \[1, max_length=4\]"):
        overlong_penalty(_batch([1]), max_length=4, buffer=5)
    with pytest.raises(RewardError, match=r"payload\['completion_tokens'\]"):
        overlong_penalty(RewardInput(rows=[{}], payload={"completions": ["x"]}), max_length=4, buffer=2)
    with pytest.raises(ConfigError, match="max_length"):
        toy_config("/tmp/unused", "rewards.functions=[{name: overlong_penalty, args: {buffer: 2}}]")


def test_the_text_plugins_write_the_lengths_it_reads(tmp_path):
    from mmrl.trainer import Trainer

    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", "rewards.functions=[{name: token_accuracy}, "
                                 "{name: overlong_penalty, args: {max_length: 5, buffer: 2}}]"))
    rollouts = []
    rollout = trainer.plugin.rollout

    def recorded(policy, batch):
        rollouts.append(rollout(policy, batch))
        return rollouts[-1]

    trainer.plugin.rollout = recorded
    metrics = trainer.train().history[0]
    tokens = rollouts[0].payload["completion_tokens"]
    assert torch.equal(tokens, rollouts[0].mask.sum(dim=1).long())  # up to and including the EOS
    expected = [min(3 - length, 0) / 2 for length in tokens.tolist()]
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(sum(expected) / len(expected))


# ------------------------------------------------------------------------------------------ correct_length_bonus
def _length_group(answers, lengths, solution="B"):
    return RewardInput(rows=[{"prompt": "q", "solution": solution} for _ in answers],
                       payload={"completions": list(answers), "completion_tokens": torch.tensor(lengths)},
                       group_ids=torch.zeros(len(answers), dtype=torch.long))


def test_correct_length_bonus_by_hand():
    reward = build_reward("correct_length_bonus", {"reward": "exact_match"})
    # two correct answers (enough): the one of 400 tokens gets 0.2, the one of 600 does not; wrong ones never
    scores = torch.as_tensor(reward(_length_group(["B", "B", "A", "A"], [400, 600, 400, 320]))).tolist()
    assert scores == pytest.approx([0.2, 0.0, 0.0, 0.0])
    # the window is inclusive at both ends
    assert torch.as_tensor(reward(_length_group(["B", "B"], [320, 512]))).tolist() == pytest.approx([0.2, 0.2])
    # one correct answer only: no bonus (Video-R1: len(selected_indices) > 1)
    assert torch.as_tensor(reward(_length_group(["B", "A"], [400, 400]))).tolist() == [0.0, 0.0]
    custom = build_reward("correct_length_bonus", {"reward": "exact_match", "bonus": 1.0, "min_tokens": 2,
                                                   "max_tokens": 3, "min_correct": 1})
    assert torch.as_tensor(custom(_length_group(["B", "A"], [3, 3]))).tolist() == pytest.approx([1.0, 0.0])


def test_correct_length_bonus_agrees_with_video_r1s_rule_written_out():
    # tulerfeng/Video-R1@59d65c3 vllm_grpo_trainer_modified.py:795-813 (one prompt's group)
    generator = torch.Generator().manual_seed(1)
    reward = build_reward("correct_length_bonus", {"reward": "exact_match"})
    for _ in range(50):
        right = (torch.rand(8, generator=generator) > 0.6).tolist()
        lengths = torch.randint(250, 600, (8,), generator=generator)
        accuracy = torch.tensor([float(r) for r in right])
        expected = torch.zeros(8)
        selected = torch.nonzero(accuracy > 0.1, as_tuple=True)[0].tolist()
        if len(selected) > 1:
            for index in selected:
                if 320 <= lengths[index] <= 512:
                    expected[index] += 0.2
        batch = _length_group(["B" if r else "A" for r in right], lengths.tolist())
        assert torch.as_tensor(reward(batch)).tolist() == pytest.approx(expected.tolist())


def test_correct_length_bonus_refuses_bad_options():
    with pytest.raises(RewardError, match="min_tokens \\(600\\) exceeds max_tokens \\(512\\)"):
        build_reward("correct_length_bonus", {"reward": "exact_match", "min_tokens": 600})
    with pytest.raises(RewardError, match="reward must name a per-sample accuracy reward"):
        build_reward("correct_length_bonus", {"reward": "correct_length_bonus"})
    with pytest.raises(RewardError, match=r"holds 1 lengths for 2 samples"):
        build_reward("correct_length_bonus", {"reward": "exact_match"})(
            RewardInput(rows=[{"solution": "B"}] * 2, payload={"completions": ["B", "B"],
                                                               "completion_tokens": [3]}))
