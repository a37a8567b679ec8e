"""The core ``dgpo`` policy loss against upstream's formula restated here, and the whole-group batch plumbing.

The reference is Luo-Yihong/DGPO@01ceb4b, ``scripts/train_sd3_dgpo.py`` ("L" below): the group loss
``compute_group_dgpo_loss_allreduce`` (L162-193: per-sample term A·β·(dsm − dsm_ref)/G scattered into group sums,
σ of the sum, loss mean(σ·A·dsm)), the PPO-style clip (L1133-1144: ratio exp(dsm_old − dsm), dsm detached where
A > 0 and r > 1 + c or otherwise r < 1 − c), the EMA reference (L1122-1124) and the mean over the M trained times that
gradient accumulation makes (L537, L1089-1167). Nothing below calls mmrl's DGPO code to compute an expected value.
"""

from __future__ import annotations

import pytest
import torch

from mmrl.algos import aggregate, policy_losses
from mmrl.config import ConfigError
from mmrl.trainer.geometry import BatchGeometry, check_whole_groups
from mmrl.trainer.sampler import group_minibatch_partition, minibatch_partition

GROUP = 4  # G, upstream's num_image_per_prompt


def _upstream_time_loss(dsm, ref_dsm, advantages, group_of, beta, group_size):
    """L162-193 written out for one time on one process: ``dsm`` [B] with gradients, the rest constants."""
    delta = dsm.detach() - ref_dsm.detach()
    per_sample = advantages * beta * delta / group_size
    sums = torch.zeros(int(group_of.max()) + 1, dtype=per_sample.dtype).scatter_add_(0, group_of, per_sample)
    weights = torch.sigmoid(sums)[group_of]
    return (weights.detach() * advantages * dsm).mean()


def _upstream_clipped(dsm, old_dsm, advantages, clip_range):
    """L1133-1144: the clipped dsm (value unchanged, gradient stopped where should_clip)."""
    ratio = torch.exp(-dsm + old_dsm)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(should_clip, dsm.detach(), dsm), should_clip


def _case(seed=0, groups=3, times=2):
    """dsm values of B = groups·G samples at M times as a function of parameters θ (so a gradient exists), the
    reference's and an old copy's, advantages with a zero, and group ids in a shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    n = groups * GROUP
    theta = torch.randn(n, times, generator=generator, dtype=torch.float64).requires_grad_(True)
    dsm = 0.4 + theta.pow(2) * 0.1  # [B, M] > 0, with gradients
    ref_dsm = 0.4 + torch.randn(n, times, generator=generator, dtype=torch.float64).pow(2) * 0.1
    old_dsm = dsm.detach() + 0.05 * torch.randn(n, times, generator=generator, dtype=torch.float64)
    advantages = torch.randn(n, generator=generator, dtype=torch.float64)
    advantages[3] = 0.0
    ids = torch.arange(groups).repeat_interleave(GROUP)[torch.randperm(n, generator=generator)] * 7 + 11  # sparse
    return theta, dsm, ref_dsm, old_dsm, advantages, ids


def _mmrl_loss(dsm, ref_dsm, old_dsm, advantages, ids, **options):
    logp, ref, old = -dsm, -ref_dsm, -old_dsm  # the flow plugin's columns: log p = −dsm
    mask = torch.ones_like(logp)
    per_action, metrics = policy_losses["dgpo"](logp, old, advantages, mask, group_ids=ids, ref_logp=ref, **options)
    return aggregate(per_action, mask, "token_mean"), metrics


@pytest.mark.parametrize(("beta", "clip_range", "reference"), [
    (100.0, None, "ref"), (10.0, 1e-2, "ref"), (2000.0, 5e-2, "old"), (0.5, None, "old"),
])
def test_value_and_gradient_are_upstreams_mean_over_times(beta, clip_range, reference):
    theta, dsm, ref_dsm, old_dsm, advantages, ids = _case()
    _, group_of = torch.unique(ids, return_inverse=True)
    expected = 0.0
    for j in range(dsm.shape[1]):  # each time's loss / M: accelerate's gradient accumulation over the M times
        column = dsm[:, j]
        if clip_range is not None:
            column, _ = _upstream_clipped(column, old_dsm[:, j], advantages, clip_range)
        baseline = old_dsm[:, j] if reference == "old" else ref_dsm[:, j]  # use_ema_ref: ref_dgpo_v = old_v
        expected = expected + _upstream_time_loss(column, baseline, advantages, group_of, beta, GROUP) / dsm.shape[1]
    got, metrics = _mmrl_loss(dsm, ref_dsm, old_dsm, advantages, ids, beta_dpo=beta, clip_range=clip_range,
                              reference=reference)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    want_grad, = torch.autograd.grad(expected, theta, retain_graph=True)
    got_grad, = torch.autograd.grad(got, theta)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)
    assert float(want_grad.abs().max()) > 1e-3
    weights = metrics["group_weight_mean"]
    assert 0.05 < float(weights) < 0.95 and float(weights) != pytest.approx(0.5)  # σ(S_g) away from 0.5 and saturation
    if clip_range is not None:  # both sides clip in this case: a zeroed gradient on A > 0 and on A ≤ 0 rows
        clipped = [_upstream_clipped(dsm[:, j], old_dsm[:, j], advantages, clip_range)[1] for j in range(2)]
        clipped = torch.stack(clipped, dim=1)
        assert bool((clipped & (advantages > 0)[:, None]).any())
        assert bool((clipped & (advantages <= 0)[:, None]).any())
        assert float(metrics["clip_fraction"]) == pytest.approx(float(clipped.double().mean()))
        trained = ~clipped & (advantages != 0)[:, None]
        assert bool((got_grad[clipped] == 0).all()) and bool((got_grad[trained] != 0).all())


def test_group_sums_are_per_group_not_per_batch():
    """Changing the reference of one group's members moves that group's weights only."""
    theta, dsm, ref_dsm, old_dsm, advantages, ids = _case(seed=1)
    per_action, _ = policy_losses["dgpo"](-dsm, -old_dsm, advantages, torch.ones_like(dsm), group_ids=ids,
                                          ref_logp=-ref_dsm, beta_dpo=50.0)
    moved = ref_dsm.clone()
    first = ids == ids[0]
    moved[first] += 0.3
    again, _ = policy_losses["dgpo"](-dsm, -old_dsm, advantages, torch.ones_like(dsm), group_ids=ids,
                                     ref_logp=-moved, beta_dpo=50.0)
    changed = (again - per_action).abs().sum(dim=1) > 0
    assert torch.equal(changed, first & (advantages != 0))


def test_rows_in_any_order_give_the_same_loss():
    theta, dsm, ref_dsm, old_dsm, advantages, ids = _case(seed=2)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(5))
    first, _ = _mmrl_loss(dsm, ref_dsm, old_dsm, advantages, ids, beta_dpo=30.0, clip_range=0.02)
    second, _ = _mmrl_loss(dsm[order], ref_dsm[order], old_dsm[order], advantages[order], ids[order], beta_dpo=30.0,
                           clip_range=0.02)
    torch.testing.assert_close(first, second, rtol=1e-12, atol=0)


def test_a_masked_row_adds_nothing_to_its_group_sum():
    """A row with mask 0 (dropped or padding; its reference may be NaN) leaves its group's σ(S_g) as if its
    advantage were 0."""
    theta, dsm, ref_dsm, old_dsm, advantages, ids = _case(seed=4)
    mask = torch.ones_like(dsm)
    mask[0] = 0
    poisoned = ref_dsm.clone()
    poisoned[0] = float("nan")
    masked, _ = policy_losses["dgpo"](-dsm, -old_dsm, advantages, mask, group_ids=ids, ref_logp=-poisoned)
    silent = advantages.clone()
    silent[0] = 0.0
    expected, _ = policy_losses["dgpo"](-dsm, -old_dsm, silent, torch.ones_like(dsm), group_ids=ids,
                                        ref_logp=-ref_dsm)
    assert bool(torch.isfinite(masked).all())
    torch.testing.assert_close(masked[1:], expected[1:], rtol=1e-12, atol=0)


def test_first_step_ratio_is_one_and_nothing_clips():
    theta, dsm, ref_dsm, _, advantages, ids = _case(seed=3)
    _, metrics = _mmrl_loss(dsm, ref_dsm, dsm.detach(), advantages, ids, clip_range=1e-5)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"group_ids": None}, "group_ids"),
    ({"ref_logp": None}, "ref_logp"),
    ({"beta_dpo": 0.0}, "beta_dpo"),
    ({"clip_range": 1.0}, "clip_range"),
    ({"reference": "ema"}, "reference"),
])
def test_bad_inputs_are_refused_in_one_line(kwargs, message):
    logp = torch.zeros(4, 2)
    call = {"group_ids": torch.tensor([0, 0, 1, 1]), "ref_logp": logp, **kwargs}
    with pytest.raises(ValueError, match=message) as error:
        policy_losses["dgpo"](logp, logp, torch.ones(4), torch.ones(4, 2), **call)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------------- whole groups
def _geometry(prompts=4, processes=1, minibatches=1, micro=8, group_size=GROUP):
    local = prompts * group_size // processes
    size = local // minibatches
    return BatchGeometry(prompts=prompts, group_size=group_size, num_processes=processes,
                         samples=prompts * group_size, local_samples=local, minibatches=minibatches,
                         minibatch_size=size, micro_batch_size=min(micro, size), micro_steps=-(-size // micro),
                         inner_epochs=1)


@pytest.mark.parametrize(("processes", "minibatches"), [(1, 1), (1, 2), (2, 2), (4, 1), (2, 4)])
def test_group_partition_deals_whole_groups_and_is_the_same_on_any_process_count(processes, minibatches):
    samples, prompts = 8 * GROUP, 8
    seed = 1234
    assignment = {}  # global sample -> mini-batch
    for rank in range(processes):
        parts = group_minibatch_partition(samples, GROUP, minibatches, processes, rank, seed)
        assert len(parts) == minibatches
        offset = rank * samples // processes  # contiguous layout: process r holds a block of whole groups
        for m, part in enumerate(parts):
            assert len(part) == samples // processes // minibatches and part == sorted(part)
            for member in part:
                assignment[offset + member] = m
    assert sorted(assignment) == list(range(samples))
    for g in range(prompts):  # every group's members share a mini-batch
        assert len({assignment[g * GROUP + k] for k in range(GROUP)}) == 1
    single = group_minibatch_partition(samples, GROUP, minibatches, 1, 0, seed)
    alone = {s: m for m, part in enumerate(single) for s in part}
    assert alone == assignment  # the same samples meet on any process count
    if minibatches > 1:  # the sample partition splits groups: the reason for the group one
        plain = minibatch_partition(samples, minibatches, "contiguous", 1, 0, seed)
        split = {s: m for m, part in enumerate(plain) for s in part}
        assert any(len({split[g * GROUP + k] for k in range(GROUP)}) > 1 for g in range(prompts))


@pytest.mark.parametrize(("geometry", "layout", "key"), [
    (_geometry(processes=2), "spread", "rollout.layout"),
    (_geometry(prompts=4, processes=2, minibatches=4, micro=2), "contiguous", "algorithm.minibatches"),
    (_geometry(micro=6), "contiguous", "algorithm.micro_batch_size"),
    (_geometry(micro=2), "spread", "algorithm.micro_batch_size"),
])
def test_geometries_that_split_a_group_are_refused_in_one_line(geometry, layout, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        check_whole_groups(geometry, layout, "policy_loss 'dgpo'")
    assert "\n" not in str(error.value) and "dgpo" in str(error.value)


@pytest.mark.parametrize(("geometry", "layout"), [
    (_geometry(), "spread"),  # one process: every layout holds whole groups
    (_geometry(processes=2, minibatches=2, micro=4), "contiguous"),
    (_geometry(micro=100), "contiguous"),  # the micro-batch is the whole mini-batch
])
def test_geometries_of_whole_groups_are_accepted(geometry, layout):
    check_whole_groups(geometry, layout, "policy_loss 'dgpo'")


def test_dgpo_reads_old_logp_only_for_its_clip_or_the_old_baseline():
    from mmrl.algos.policy_losses import reads_old_logp

    loss = policy_losses.get("dgpo")
    assert not reads_old_logp(loss, {}) and not reads_old_logp(loss, {"beta_dpo": 10.0, "reference": "ref"})
    assert reads_old_logp(loss, {"clip_range": 0.05}) and reads_old_logp(loss, {"reference": "old"})
    # every other core loss reads them (its ratio), whatever the options
    assert all(reads_old_logp(policy_losses.get(name), {}) for name in ("grpo", "gspo", "cispo", "sapo", "gmpo"))
