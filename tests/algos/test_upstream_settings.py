"""The settings docs/algorithms.md ("Coming from TRL or verl") gives for each upstream objective reproduce it.

Each upstream objective is written here as a plain per-element loop from its definition in the upstream code
(TRL ``trl/trainer/grpo_trainer.py`` at huggingface/trl@f2cd577, verl ``verl/trainer/ppo/core_algos.py`` at
volcengine/verl@b178a3c; lines in the docstrings of ``mmrl/algos``), independent of mmrl's vectorised code, and
compared with mmrl's loss under the documented settings: values and gradients.
"""

import math

import pytest
import torch

from mmrl.algos import advantage_estimators, aggregate, kl_estimators, multi_reward_advantages, policy_losses

GROUP_IDS = torch.tensor([0, 0, 0, 1, 1, 1])
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.9])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 0.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0],
                     [1.0, 1.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0]])
MAX_COMPLETION_LENGTH = 4


def _logps():
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(MASK.shape, generator=generator) * 2.0
    new = (old + 0.4 * torch.randn(MASK.shape, generator=generator)).requires_grad_(True)  # ratios well off 1
    ref = old - 0.3 * torch.rand(MASK.shape, generator=generator)
    return new, old, ref


def _group_advantages(scale: bool, eps: float) -> list[float]:
    """TRL ``scale_rewards="group"`` (Bessel std, + eps) or ``"none"``; a loop over groups."""
    out = []
    for i, reward in enumerate(REWARDS.tolist()):
        members = [r for r, g in zip(REWARDS.tolist(), GROUP_IDS.tolist(), strict=True) if g == GROUP_IDS[i]]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((r - mean) ** 2 for r in members) / (len(members) - 1))
        out.append((reward - mean) / (std + eps) if scale else reward - mean)
    return out


def _clipped(ratio: torch.Tensor, advantage: float, low: float, high: float, dual: float | None) -> torch.Tensor:
    """−min(r·A, clip(r)·A), and verl's dual clip min(that, −c·A) for A < 0, for one element."""
    loss = -torch.minimum(ratio * advantage, ratio.clamp(1 - low, 1 + high) * advantage)
    if dual is not None and advantage < 0:
        loss = torch.minimum(loss, torch.tensor(-dual * advantage))
    return loss


def _upstream(new, old, ref, advantages, *, reduce: str, low=0.2, high=0.2, dual=None, beta=0.0) -> torch.Tensor:
    rows = []
    for i in range(MASK.shape[0]):
        terms = []
        for t in range(MASK.shape[1]):
            if MASK[i, t] == 0:
                continue
            loss = _clipped(torch.exp(new[i, t] - old[i, t]), advantages[i], low, high, dual)
            if beta:
                x = ref[i, t] - new[i, t]
                loss = loss + beta * (torch.exp(x) - x - 1)  # TRL's k3
            terms.append(loss)
        rows.append(terms)
    if reduce == "token_mean":  # TRL dapo / bnpo on one micro-batch; verl token-mean
        return sum(sum(terms) for terms in rows) / sum(len(terms) for terms in rows)
    if reduce == "seq_mean_token_mean":  # TRL grpo; verl seq-mean-token-mean
        return sum(sum(terms) / len(terms) for terms in rows) / len(rows)
    if reduce == "dr_grpo":  # TRL dr_grpo: the summed loss over (batch size × max_completion_length)
        return sum(sum(terms) for terms in rows) / (len(rows) * MAX_COMPLETION_LENGTH)
    raise ValueError(reduce)


def _mmrl(new, old, ref, *, advantage, aggregation, beta=0.0, **loss_options) -> torch.Tensor:
    name, eps = advantage
    options = {} if eps is None else {"eps": eps}
    adv = advantage_estimators.get(name)(REWARDS, GROUP_IDS, **options)
    loss, _ = policy_losses.get("grpo")(new, old, adv, MASK, **loss_options)
    if beta:
        loss = loss + beta * kl_estimators.get("k3")(new, ref)
    return aggregate(loss, MASK, aggregation, max_actions=MAX_COMPLETION_LENGTH)


CASES = {
    # TRL loss_type="dapo" (default), scale_rewards="group", beta 0.04, clip-higher.
    "trl_dapo": ({"scale": True, "eps": 1e-4}, {"reduce": "token_mean", "high": 0.28, "beta": 0.04},
                 {"advantage": ("grpo", 1e-4), "aggregation": "token_mean", "clip_high": 0.28, "beta": 0.04}),
    "trl_grpo": ({"scale": True, "eps": 1e-4}, {"reduce": "seq_mean_token_mean"},
                 {"advantage": ("grpo", 1e-4), "aggregation": "seq_mean_token_mean"}),
    "trl_dr_grpo": ({"scale": False, "eps": 0.0}, {"reduce": "dr_grpo"},
                    {"advantage": ("dr_grpo", None), "aggregation": "seq_mean_token_sum_norm"}),
    # verl: adv_estimator grpo (eps 1e-6), compute_policy_loss_vanilla with its always-on dual clip c = 3.
    "verl_vanilla": ({"scale": True, "eps": 1e-6}, {"reduce": "token_mean", "dual": 3.0},
                     {"advantage": ("grpo", 1e-6), "aggregation": "token_mean", "dual_clip": 3.0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_documented_settings_reproduce_the_upstream_objective(case):
    advantage_options, upstream_options, mmrl_options = CASES[case]
    new, old, ref = _logps()
    expected = _upstream(new, old, ref, _group_advantages(**advantage_options), **upstream_options)
    (expected_grad,) = torch.autograd.grad(expected, new)
    got = _mmrl(new, old, ref, **mmrl_options)
    (got_grad,) = torch.autograd.grad(got, new)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert expected_grad.abs().sum() > 0  # the case exercises a non-trivial gradient


def test_the_dual_clip_is_active_in_the_verl_case():
    """Without ``dual_clip`` the verl case differs: some negative-advantage ratio exceeds c = 3 there."""
    new, old, ref = _logps()
    advantages = _group_advantages(scale=True, eps=1e-6)
    ratios = torch.exp(new - old).detach()
    negative = torch.tensor([a < 0 for a in advantages]).unsqueeze(1) & (MASK > 0)
    if not (ratios[negative] > 3.0).any():  # make one: a negative-advantage token far off-policy
        row = int(torch.nonzero(negative)[0, 0])
        with torch.no_grad():
            new[row, 0] = old[row, 0] + 2.0  # r = e^2 ≈ 7.4 > 3
    expected = _upstream(new, old, ref, advantages, reduce="token_mean", dual=3.0)
    without = _mmrl(new, old, ref, advantage=("grpo", 1e-6), aggregation="token_mean")
    with_dual = _mmrl(new, old, ref, advantage=("grpo", 1e-6), aggregation="token_mean", dual_clip=3.0)
    torch.testing.assert_close(with_dual, expected, rtol=1e-5, atol=1e-7)
    assert not torch.isclose(without, expected, rtol=1e-4)


def test_trl_and_gdpo_normalize_then_sum_is_reproduced():
    """TRL ``multi_objective_aggregation="normalize_then_sum"`` and GDPO's code (NVlabs/GDPO@b080e63): each reward
    group-normalised (Bessel std + 1e-4), weighted, summed, then whitened over the batch (Bessel std + 1e-4)."""
    scores = torch.stack([REWARDS, torch.tensor([0.0, 1.0, 1.0, 0.3, 0.3, 0.8]), torch.tensor([2.0, 0, 1, 5, 4, 4])],
                         dim=1)  # [6, K = 3], scales apart
    weights = [1.0, 0.5, 0.25]
    per_reward = []
    for k in range(scores.shape[1]):
        column = scores[:, k].tolist()
        normalised = []
        for i, value in enumerate(column):
            members = [v for v, g in zip(column, GROUP_IDS.tolist(), strict=True) if g == GROUP_IDS[i]]
            mean = sum(members) / len(members)
            std = math.sqrt(sum((v - mean) ** 2 for v in members) / (len(members) - 1))
            normalised.append((value - mean) / (std + 1e-4))
        per_reward.append(normalised)
    summed = [sum(w * per_reward[k][i] for k, w in enumerate(weights)) for i in range(len(REWARDS))]
    mean = sum(summed) / len(summed)
    std = math.sqrt(sum((v - mean) ** 2 for v in summed) / (len(summed) - 1))
    expected = torch.tensor([(v - mean) / (std + 1e-4) for v in summed])
    got, _ = multi_reward_advantages(scores, torch.tensor(weights), GROUP_IDS, advantage_estimators.get("grpo"),
                                     order="normalize_then_sum", eps=1e-4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
