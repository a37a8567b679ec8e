"""Mask plans drawn for a whole batch from per-sample random streams (masking.SampleStreams) are, sample by sample,
the plans each sample draws alone from its own generator: the dLLM plugin draws its plans batched (issue 26) and
keeps the plans of a seed independent of the batch it was sampled in."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import load_config
from mmrl.plugin import Runtime, plugin_registry
from mmrl.plugins.dllm.estimators import draw_plan
from mmrl.plugins.dllm.masking import SampleStreams, uniform
from mmrl.plugins.dllm.plugin import PLAN_SEED_TAG
from mmrl.seeding import derive_seed

ESTIMATORS = [  # (name, options, num_samples)
    ("one_step", {}, 5),
    ("one_step", {"p_mask_prompt": 0.3}, 5),
    ("elbo_t", {}, 5),
    ("elbo_l", {"stratified": True}, 5),
    ("elbo_l", {"stratified": False}, 5),
    ("coupled", {"stratified": True}, 4),
    ("coupled", {"stratified": False}, 4),
    ("coupled_cv", {}, 5),  # two pairs of D rows
    ("coupled_cv", {"stratified": False}, 6),  # two pairs and an odd D row
    ("spg_lower", {"masking": "block", "block_length": 2, "p_mask_prompt": 0.15}, 5),
    ("spg_upper", {}, 5),
    ("espo", {}, 4),
    ("espo", {"coupled": False, "stratified": True}, 5),
]


def _generators(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def test_streams_read_each_generator_in_order_along_the_batch_axis():
    streams = SampleStreams(_generators([3, 4]))
    first = streams.take((2, 2), batch_axis=1)  # [2 draws, B=2]
    second = streams.take((2, 5), batch_axis=0)  # [B=2, 5]
    for b, seed in enumerate([3, 4]):
        alone = torch.rand(7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert torch.equal(first[:, b], alone[:2]) and torch.equal(second[b], alone[2:])
    with pytest.raises(ValueError, match=r"a draw of shape \(3, 4\) has 3 samples along axis 0, but there are 2"):
        streams.take((3, 4), batch_axis=0)
    big = SampleStreams(_generators([5]))  # more than one block (64 values) in one call, then a second block
    values = torch.cat([big.take((1, 100), batch_axis=0)[0], big.take((1, 300), batch_axis=0)[0]])
    assert torch.equal(values, torch.rand(400, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    assert uniform((2, 3), SampleStreams(_generators([1, 2])), torch.device("cpu"), batch_axis=0).dtype == torch.float64


@pytest.mark.parametrize(("name", "options", "num_samples"), ESTIMATORS)
def test_a_batched_plan_is_every_sample_drawn_alone(name, options, num_samples):
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    completion = torch.tensor([[1, 5, 7, 0, 0, 0], [2, 2, 9, 1, 3, 4], [6, 0, 0, 0, 0, 0]])
    real = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])  # L = 3, 6, 1
    seeds = [11, 12, 13]
    streams = SampleStreams(_generators(seeds))
    batched = [draw_plan(name, prompt, completion, real, num_samples=num_samples, generator=streams, **options)
               for _ in range(2)]  # two plans: the second continues every stream
    for b, generator in enumerate(_generators(seeds)):
        alone = [draw_plan(name, prompt[b:b + 1], completion[b:b + 1], real[b:b + 1], num_samples=num_samples,
                           generator=generator, **options) for _ in range(2)]
        for plan, own in zip(batched, alone, strict=True):
            assert torch.equal(plan.completion_masked[:, b], own.completion_masked[:, 0])
            torch.testing.assert_close(plan.weights[:, b], own.weights[:, 0], rtol=1e-6, atol=0.0)
            if own.prompt_masked is None:
                assert plan.prompt_masked is None
            else:
                assert torch.equal(plan.prompt_masked[:, b], own.prompt_masked[:, 0])


def _plugin(**plugin):
    data = {"plugin": {"name": "dllm", "train_size": 16, "eval_size": 4, **plugin},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return plugin_registry.get("dllm")(load_config(data).plugin.config, Runtime())


@pytest.mark.parametrize(("estimator", "options"), [("coupled", {}),
                                                    ("one_step", {"p_mask_prompt": 0.5}),
                                                    ("spg_lower", {"masking": "block", "block_length": 3,
                                                                   "p_mask_prompt": 0.2})])
def test_draw_plans_match_each_sample_drawn_alone_from_its_seed(estimator, options):
    """The plugin's plans against the per-sample definition: sample i draws plan after plan from a generator seeded
    with derive_seed(seed_i, PLAN_SEED_TAG), on its real prompt tokens (left padding removed); prompt lengths
    differ, so prompt masking is drawn per length group."""
    plugin = _plugin(estimator=estimator, num_mc_samples=4, estimator_options=options)
    width = 5
    lengths = torch.tensor([5, 2, 3, 2])
    prompt_ids = torch.tensor([[9, 8, 7, 6, 5], [0, 0, 0, 4, 3], [0, 0, 2, 3, 4], [0, 0, 0, 7, 7]])
    completion = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 0, 0, 0, 0], [3, 3, 3, 3, 0, 0], [4, 0, 0, 0, 0, 0]])
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]).bool()
    seeds = torch.tensor([101, 202, 303, 404])
    out = plugin.draw_plans(prompt_ids, lengths, completion, real, seeds, num_plans=2)
    for i, seed in enumerate(seeds.tolist()):
        generator = torch.Generator().manual_seed(derive_seed(seed, PLAN_SEED_TAG))
        length = int(lengths[i])
        for e in range(2):
            plan = draw_plan(plugin.estimator, prompt_ids[i:i + 1, width - length:], completion[i:i + 1],
                             real[i:i + 1], num_samples=4, generator=generator, **plugin.config.estimator_options)
            assert torch.equal(out["plan_masked"][i, e], plan.completion_masked[:, 0])
            torch.testing.assert_close(out["plan_weights"][i, e], plan.weights[:, 0], rtol=1e-6, atol=0.0)
            if plan.prompt_masked is None:
                assert "plan_prompt_masked" not in out
            else:
                padded = torch.nn.functional.pad(plan.prompt_masked[:, 0], (width - length, 0))
                assert torch.equal(out["plan_prompt_masked"][i, e], padded)
    # the same sample in another batch (alone, or after a different neighbour) gets the same plans
    part = plugin.draw_plans(prompt_ids[2:], lengths[2:], completion[2:], real[2:], seeds[2:], num_plans=2)
    for key, value in part.items():
        assert torch.equal(value, out[key][2:])
