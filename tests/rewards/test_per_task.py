"""``per_task``: each row scored by the reward its task names (Video-R1's accuracy by ``problem_type``)."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward
from tests.helpers import BASE

SPECS = {"multiple choice": {"name": "choice"}, "numerical": {"name": "math"},
         "free-form": {"name": "exact_match"}}


def _batch():
    rows = [{"problem_type": "multiple choice", "solution": "B"}, {"problem_type": "numerical", "solution": "42"},
            {"problem_type": "free-form", "solution": "a red ball"},
            {"problem_type": "multiple choice", "solution": "C"}, {"problem_type": "numerical", "solution": "3.5"}]
    answers = ["<answer>B</answer>", "<answer>42.0</answer>", "a red ball", "<answer>A</answer>", "<answer>7</answer>"]
    return RewardInput(rows=rows, payload={"completions": answers}, group_ids=torch.arange(5))


def test_each_row_is_scored_by_its_tasks_reward():
    reward = build_reward("per_task", {"tasks": SPECS, "field": "problem_type"})
    batch = _batch()
    scores = torch.as_tensor(reward(batch)).tolist()
    # the same as each reward on its own rows
    expected = []
    for i, row in enumerate(batch.rows):
        single = build_reward(SPECS[row["problem_type"]]["name"], {})
        expected.append(float(torch.as_tensor(single(batch.select([i])))[0]))
    assert scores == pytest.approx(expected) and scores == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0])


def test_unlisted_tasks_use_the_default_or_stop_with_one_line():
    batch = _batch()
    only_choice = {"multiple choice": {"name": "choice"}}
    with pytest.raises(RewardError, match=r"rows \[1, 4\] have problem_type 'numerical', which tasks does not"):
        build_reward("per_task", {"tasks": only_choice, "field": "problem_type"})(batch)
    reward = build_reward("per_task", {"tasks": only_choice, "field": "problem_type",
                                       "default": {"name": "exact_match"}})
    assert torch.as_tensor(reward(batch)).tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0, 0.0])


def test_options_are_checked_when_the_config_loads_and_the_context_reaches_the_inner_rewards():
    def config(args):
        return load_config({**BASE, "rewards": {"functions": [{"name": "per_task", "args": args}]}})

    config({"tasks": SPECS, "field": "problem_type"})
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].args.tasks.numerical.args.rel_tol"):
        config({"tasks": {"numerical": {"name": "math", "args": {"rel_tol": -1}}}})
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].args.tasks.ocr"):
        config({"tasks": {"ocr": {"name": "no_such_reward"}}})
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].args.tasks"):
        config({"tasks": {}})
    # iou inside per_task takes the run's box convention, as on its own
    reward = build_reward("per_task", {"tasks": {"grounding": {"name": "iou"}}},
                          context={"box_convention": "qwen2_vl"})
    rows = [{"task": "grounding", "solution": [64, 48, 320, 240], "image_size": [640, 480]}]
    batch = RewardInput(rows=rows, payload={"completions": ["<|box_start|>(100,100),(500,500)<|box_end|>"]})
    assert float(torch.as_tensor(reward(batch))[0]) == pytest.approx(1.0)


def test_it_can_be_the_accuracy_inside_temporal_contrast():
    options = {"tasks": {"multiple choice": {"name": "choice"}}, "field": "problem_type"}
    functions = [{"name": "temporal_contrast", "args": {"reward": "per_task", "options": options}}]
    scorer = RewardScorer.from_config(load_config({**BASE, "rewards": {"functions": functions}}).rewards)
    rows = [{"problem_type": "multiple choice", "solution": "B"}] * 2
    batch = RewardInput(rows=rows, payload={"completions": ["<answer>B</answer>", "<answer>A</answer>"],
                                            "shuffled_completions": [["<answer>A</answer>"]] * 2},
                        group_ids=torch.zeros(2, dtype=torch.long))
    assert scorer.score(batch).scores[:, 0].tolist() == pytest.approx([1.3, 0.0])


def test_edge_inputs_of_the_grouped_and_dispatching_rewards():
    """An empty batch, a one-sample group and an unscorable accuracy."""
    import math

    empty = RewardInput(rows=[], payload={"completions": [], "shuffled_completions": [], "completion_tokens": []})
    for name, args in (("per_task", {"tasks": SPECS}), ("temporal_contrast", {"reward": "exact_match"}),
                       ("correct_length_bonus", {"reward": "exact_match"})):
        assert torch.as_tensor(build_reward(name, args)(empty)).numel() == 0
    one = RewardInput(rows=[{"solution": "B"}], payload={"completions": ["B"], "shuffled_completions": [["A"]],
                                                         "completion_tokens": [400]})
    assert torch.as_tensor(build_reward("temporal_contrast", {"reward": "exact_match"})(one)).tolist() == [1.3]
    # one correct answer is below min_correct 2: no length bonus
    assert torch.as_tensor(build_reward("correct_length_bonus", {"reward": "exact_match"})(one)).tolist() == [0.0]
    bonus = build_reward("correct_length_bonus", {"reward": "exact_match", "min_correct": 1})
    bonus.inner = lambda batch: [math.nan]
    assert torch.as_tensor(bonus(one)).tolist() == [0.0]  # NaN is not correct; the accuracy column keeps the NaN
