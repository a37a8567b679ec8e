"""The credit strategies' logic without a network (:mod:`mmrl.plugins.flow.credit`): hand-computed values, and the
closed-form Gaussian model (the exact velocity of Gaussian data, as in test_sde.py) standing in for the transformer.

Data x0 ~ N(m, diag(c²)), x_σ = (1−σ)·x0 + σ·ε, so per dim v(x, σ) = (σ − (1−σ)c²)/S·(x − (1−σ)m) − m with
S = (1−σ)²c² + σ²: every ODE step is affine in x, which gives independent closed forms for the tests below.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algos import advantage_estimators, aggregate, policy_losses
from mmrl.plugins.flow.credit.base import guard_reweighting, noise_aware_weights, transition_std
from mmrl.plugins.flow.credit.branch import branch_points, branch_template
from mmrl.plugins.flow.credit.chunk import (
    chunk_mean_weights,
    chunk_probabilities,
    chunks_from_dynamics,
    chunks_from_sizes,
    relative_l1,
    sample_chunk_mask,
)
from mmrl.plugins.flow.credit.config import SlidingWindowCreditConfig
from mmrl.plugins.flow.credit.guard import ratio_norm_logp
from mmrl.plugins.flow.credit.sharing import shared_rollout
from mmrl.plugins.flow.credit.sliding_window import window_bounds, window_start
from mmrl.plugins.flow.credit.solvers import ode_tail, tail_grid
from mmrl.plugins.flow.credit.tree import node_rewards, tree_template, width_pruning_keep
from mmrl.plugins.flow.sde import sde_step
from mmrl.trainer.credit import action_advantages

M = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
C = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)


def exact_velocity(x, sigma, m=M, c=C):
    var = (1 - sigma) ** 2 * c**2 + sigma**2
    return (sigma - (1 - sigma) * c**2) / var * (x - (1 - sigma) * m) - m


def gaussian_engine(sigmas, kind="flow_grpo", noise_level=0.7):
    """The shared-prefix engine's model and step functions for the Gaussian data (float64)."""

    def velocity(x, s, groups):
        return exact_velocity(x, float(sigmas[s]))

    def step(v, x, s, stochastic, generators):
        return sde_step(kind if stochastic else "ode", v, x, float(sigmas[s]), float(sigmas[s + 1]),
                        noise_level=noise_level, generator=generators)

    return velocity, step


# ---------------------------------------------------------------------------------------------- per-step weights
def test_noise_aware_weights_reproduce_tempflow_grpos_constant():
    # TempFlow-GRPO's code (SD3.5, 10 steps, a = 0.7) multiplies each step's loss by 2.25·std_t, std_t = s_t·√Δ_t.
    # Our weights are std_t / mean_{t ≤ 8} std_t: the normaliser must come out as that 2.25 (1/2.2522).
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.double()
    expected = []
    for t in range(10):  # plain floats, the formula of Flow-GRPO's SDE step
        sigma, sigma_next = float(sigmas[t]), float(sigmas[t + 1])
        denominator = float(sigmas[1]) if sigma == 1.0 else sigma
        expected.append(0.7 * math.sqrt(sigma / (1 - denominator)) * math.sqrt(sigma - sigma_next))
    weights = noise_aware_weights("flow_grpo", sigmas, 0.7)
    torch.testing.assert_close(weights, 2.2522 * torch.tensor(expected, dtype=torch.float64), rtol=2e-4, atol=0)
    assert weights[:9].mean().item() == pytest.approx(1.0)
    assert (weights[:-1].diff()[1:] < 0).all()  # more weight early, where the noise is large (after step 0)


def test_transition_std_matches_sde_step_for_every_kind():
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.1, 0.0], dtype=torch.float64)
    x = torch.zeros(1, 3, dtype=torch.float64)
    for kind, level in (("flow_grpo", 0.7), ("dance_grpo", 0.3), ("cps", 0.8)):
        stds = transition_std(kind, sigmas, level)
        for t in range(4):
            out = sde_step(kind, x, x, float(sigmas[t]), float(sigmas[t + 1]), noise_level=level, prev_sample=x)
            assert stds[t].item() == pytest.approx(out.std.item(), rel=1e-12)


def test_guard_reweighting_is_one_over_the_step_size_normalised():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])  # Δ = 0.2, 0.3, 0.5 → 1/Δ = 5, 10/3, 2; mean of the first two 25/6
    expected = torch.tensor([5.0, 10 / 3, 2.0], dtype=torch.float64) / (25 / 6)
    torch.testing.assert_close(guard_reweighting(sigmas), expected)


# ---------------------------------------------------------------------------------------------- GRPO-Guard
def test_ratio_norm_is_the_noise_correlation_and_removes_the_ratio_bias():
    # Two policies on the Gaussian data: the sampler (velocity of data mean m) and a trained one (mean m + 0.3).
    # With x' = μ_old + s·z, the normalised log-ratio must be mean(z·d) (d = μ_new − μ_old) for every sample; the
    # raw per-element log-ratio averages −mean(d²)/(2s²) < 0 over z, the normalised one 0.
    generator = torch.Generator().manual_seed(0)
    n, sigma, sigma_next = 20_000, 0.6, 0.45
    x = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    v_old, v_new = exact_velocity(x, sigma), exact_velocity(x, sigma, m=M + 0.3)
    old = sde_step("flow_grpo", v_old, x, sigma, sigma_next, noise_level=0.7, generator=generator)
    new = sde_step("flow_grpo", v_new, x, sigma, sigma_next, noise_level=0.7, prev_sample=old.prev_sample)
    s = old.std.reshape(n)
    z = (old.prev_sample - old.mean) / old.std
    d = new.mean - old.mean
    normalised = ratio_norm_logp(new.log_prob, old.log_prob, new.mean, old.mean, old.std) - old.log_prob
    torch.testing.assert_close(normalised, (z * d).mean(dim=1), rtol=1e-9, atol=1e-12)
    bias = -(d**2).mean(dim=1) / (2 * s**2)  # [n]
    raw = new.log_prob - old.log_prob
    standard_error = normalised.std().item() / math.sqrt(n)
    assert abs((raw - bias).mean().item()) < 5 * (raw - bias).std().item() / math.sqrt(n)  # E[raw] = the bias ...
    assert bias.mean().item() < -10 * standard_error  # ... which is far below 0 ...
    assert abs(normalised.mean().item()) < 5 * standard_error  # ... while the normalised log-ratio is centred


def test_ratio_norm_is_exactly_one_on_policy_with_the_scaled_gradient():
    mean = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    old_mean = mean.detach().clone()
    std = torch.full((4, 1), 0.3, dtype=torch.float64)
    action = old_mean + std * torch.randn(4, 6, dtype=torch.float64)
    logp = (-(action - mean) ** 2 / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=1)
    old_logp = logp.detach().clone()
    normalised = ratio_norm_logp(logp, old_logp, mean, old_mean, std)
    assert torch.equal(normalised.detach() - old_logp, torch.zeros(4, dtype=torch.float64))
    (grad_normalised,) = torch.autograd.grad(normalised.sum(), mean, retain_graph=True)
    (grad_plain,) = torch.autograd.grad(logp.sum(), mean)
    torch.testing.assert_close(grad_normalised, 0.3 * grad_plain)
    # a deterministic step (std 0, log-prob 0 by convention) keeps ratio 1 instead of dividing by 0
    deterministic = ratio_norm_logp(logp.detach() + 0.5, old_logp, mean.detach() + 1, old_mean, torch.zeros(4, 1))
    assert torch.equal(deterministic, old_logp)


# ---------------------------------------------------------------------------------------------- branch (TempFlow)
def test_branch_template_splits_the_group_over_the_points():
    template = branch_template(4, [0, 2], num_steps=4)
    # members 0, 1 branch at step 0, members 2, 3 at step 2; before their step they share the trunk (node 0)
    assert template.node.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [2, 2, 3, 3]]
    assert template.stochastic.tolist() == [[True, False, False, False]] * 2 + [[False, False, True, False]] * 2
    assert template.step_index.tolist() == [[0, 2]] * 4
    assert template.mask.tolist() == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    # evaluations: the trunk up to step 2 (3), then every branch to the end: 2·3 (from step 0) + 2·1 (from step 2)
    assert template.evaluations() == 3 + 6 + 2
    with pytest.raises(ValueError, match="evenly"):
        branch_template(6, [0, 1, 2, 3], num_steps=6)


def test_branch_spread_comes_only_from_the_branch_step():
    # All G members branch at k. After k everything is ODE, an affine map x ↦ A·x + b per dim, so the members'
    # final values spread with variance (A·std_k)² exactly (A: product of the ODE steps' slopes). Before k the
    # members are the shared ODE trunk, identical to the bit.
    sigmas = torch.linspace(1, 0, 9, dtype=torch.float64)
    num_steps, k, group = 8, 2, 1500
    velocity, step = gaussian_engine(sigmas)
    template = branch_template(group, [k], num_steps)
    initial = torch.randn(1, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    seeds = torch.arange(group).unsqueeze(0) + 10
    result = shared_rollout(template, initial, seeds, velocity, step)
    assert result.evaluations == (k + 1) + group * (num_steps - 1 - k)
    assert (result.before[0, :, 0] == result.before[0, 0, 0]).all()  # the trunk is shared exactly
    trunk = initial.clone()
    for t in range(k):  # the trunk is the ODE
        trunk = trunk - (sigmas[t] - sigmas[t + 1]) * exact_velocity(trunk, float(sigmas[t]))
    torch.testing.assert_close(result.before[0, 0, 0], trunk[0])
    slope = torch.ones(3, dtype=torch.float64)
    for t in range(k + 1, num_steps):  # d(x_{t+1})/d(x_t) of the Euler step, from two probes
        probe = torch.stack([torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)])
        moved = probe - (sigmas[t] - sigmas[t + 1]) * exact_velocity(probe, float(sigmas[t]))
        slope = slope * (moved[1] - moved[0])
    std_k = sde_step("flow_grpo", trunk, trunk, float(sigmas[k]), float(sigmas[k + 1]), noise_level=0.7,
                     prev_sample=trunk).std.item()
    variance = result.final[0].var(dim=0)
    ratio = variance / (slope * std_k) ** 2
    assert ((ratio - 1).abs() < 5 * math.sqrt(2 / group)).all(), ratio


def test_shared_rollout_can_return_the_last_steps_prediction_of_the_clean_latent():
    # decode_latent: predicted_x0 (DanceGRPO / BranchGRPO / GCPO decode x − σ·v of the last step). Members 0, 1 split
    # at the last step (SDE), members 2, 3 at step 1 and end with an ODE step: children of one node share the
    # prediction, and after an ODE last step (x − σ·v to σ = 0) the prediction is the sample itself.
    from mmrl.plugins.flow.credit.sharing import SharedTemplate

    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.0], dtype=torch.float64)
    template = SharedTemplate(
        node=torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 2], [0, 2, 3]]),
        stochastic=torch.tensor([[False, False, True], [False, False, True], [False, True, False],
                                 [False, True, False]]),
        step_index=torch.tensor([[2], [2], [1], [1]]), mask=torch.ones(4, 1))
    velocity, step = gaussian_engine(sigmas)
    initial = torch.randn(1, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    seeds = torch.arange(4).unsqueeze(0) + 11
    calls = []

    def predict(x, v, s):
        calls.append(s)
        return x - sigmas[s] * v

    sampled = shared_rollout(template, initial, seeds, velocity, step)
    predicted = shared_rollout(template, initial, seeds, velocity, step, predict=predict)
    assert calls == [2]
    for field in ("before", "after", "old_logp"):  # the trajectories do not change
        assert torch.equal(getattr(sampled, field), getattr(predicted, field))
    x_last = sampled.before[0, :2, 0]  # [2, 3] the shared input of members 0, 1's last (SDE) step
    expected = x_last - sigmas[2] * exact_velocity(x_last, float(sigmas[2]))
    torch.testing.assert_close(predicted.final[0, :2], expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(predicted.final[0, 0], predicted.final[0, 1])  # one node's children: one prediction
    assert not torch.allclose(sampled.final[0, 0], sampled.final[0, 1])  # their samples differ by the SDE noise
    torch.testing.assert_close(predicted.final[0, 2:], sampled.final[0, 2:], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- tree (BranchGRPO)
def tempflow_released_rollout(initial, sigmas, velocity, noises, noise_level=0.7):
    """TempFlow-GRPO's sampler for one trunk, following its released code (Shredded-Pork/TempFlow-GRPO e66824e,
    sd3_pipeline_with_logprob_perstep.py and sd3_sde_with_logprob_perstep.py, in float64): for every step i but the
    last, the trunk's velocity gives both the ODE step (the trunk goes on) and the SDE step's mean; the K samples
    mean + std·noises[i] leave the trunk and are completed by ODE steps over the remaining steps into images.

    Returns the trunk states [S−1, *latent], the SDE actions [S−1, K, *latent] and the images [S−1, K, *latent]."""
    num_steps = sigmas.numel() - 1
    sigma_max = float(sigmas[1])
    latents, trunk, actions, images = initial, [], [], []
    for i in range(num_steps - 1):
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        v = velocity(latents, i)
        std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
        mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        sde = mean + std_dev_t * math.sqrt(-dt) * noises[i]  # [K, *latent]
        trunk.append(latents)
        actions.append(sde)
        latents = latents + dt * v  # the ODE trunk
        inner = sde
        for j in range(i + 1, num_steps):  # the inner loop over timesteps[i+1:]
            inner = inner + float(sigmas[j + 1] - sigmas[j]) * velocity(inner, j)
        images.append(inner)
    return torch.stack(trunk), torch.stack(actions), torch.stack(images)


def test_branch_default_is_tempflow_grpos_released_branching():
    # points null: a branch at every step 0..S−2, K = G/(S−1) samples each, every sample trains its own branch step;
    # against the released code's loop structure (tempflow_released_rollout), with the noises the engine drew.
    num_steps, per_step = 4, 3
    sigmas = torch.tensor([1.0, 0.85, 0.6, 0.3, 0.0], dtype=torch.float64)
    points = branch_points(None, num_steps)
    assert points == [0, 1, 2]
    group = per_step * len(points)
    template = branch_template(group, points, num_steps)
    velocity, step = gaussian_engine(sigmas)
    initial = torch.randn(1, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    result = shared_rollout(template, initial, torch.arange(group).unsqueeze(0) + 7, velocity, step, keep_means=True)
    # the trunk's S − 1 evaluations, then K·(S − 1 − i) for the branches of step i: (9+8+...+1)·K at S = 10 (#3)
    assert result.evaluations == (num_steps - 1) + per_step * num_steps * (num_steps - 1) // 2
    members = torch.arange(group)
    own = members // per_step  # [G] the column (= the step) a member branches at
    assert template.mask.tolist() == (own.unsqueeze(1) == torch.arange(3)).float().tolist()
    stds = transition_std("flow_grpo", sigmas, 0.7)
    after = result.after[0, members, own]  # [G, 3] each member's action at its branch step
    noises = ((after - result.means[0, members, own]) / stds[own].unsqueeze(1)).reshape(3, per_step, 3)
    trunk, actions, images = tempflow_released_rollout(initial[0], sigmas, lambda x, i: exact_velocity(
        x, float(sigmas[i])), noises)
    torch.testing.assert_close(result.before[0, members, own], trunk[own], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after, actions.reshape(group, 3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.final[0], images.reshape(group, 3), rtol=1e-12, atol=1e-12)
    # the released trainer's advantages: one reward per (row, branch step), normalised per prompt and column by
    # Flow-GRPO's stat tracker (population std + 1e-4); one group is one prompt, so batch_std per column is that
    rewards = images.sum(dim=-1).T  # [K, S−1]: row e holds the e-th branch of every step, as upstream's rows
    upstream = (rewards - rewards.mean(dim=0)) / (rewards.std(dim=0, unbiased=False) + 1e-4)
    per_member = result.final[0].sum(dim=-1).float()  # [G]
    got = action_advantages(per_member.unsqueeze(1).expand(group, 3), template.mask, torch.zeros(group),
                            advantage_estimators["batch_std"], {"eps": 1e-4}, clip=None)
    torch.testing.assert_close(got[members, own], upstream.T.reshape(group).float(), rtol=1e-4, atol=1e-5)


def test_tree_template_by_hand():
    template = tree_template(4, [0, 2], branching=2, num_steps=4)
    assert template.node.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 2, 2], [1, 1, 3, 3]]
    assert template.stochastic.all()
    assert template.step_index.tolist() == [[0, 1, 2]] * 4  # first split .. S − 2
    assert template.mask.tolist() == [[1, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert template.evaluations() == 1 + 2 + 2 + 4
    splits = tree_template(4, [0, 2], branching=2, num_steps=4, sde_steps="splits")
    assert splits.step_index.tolist() == [[0, 2]] * 4
    assert splits.stochastic[0].tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match="leaves"):
        tree_template(6, [0, 2], branching=2, num_steps=4)


def test_tree_advantages_are_branchgrpos_per_depth_z_scores():
    # One tree of 4 leaves with rewards 1, 3, 2, 6 (hand-set). BranchGRPO: a node's reward is the mean of its
    # leaves; advantages are z-scores (unbiased std) among the nodes of one depth; each edge is trained once.
    template = tree_template(4, [0, 2], branching=2, num_steps=4)
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    nodes = template.node.gather(1, template.step_index)
    per_action = node_rewards(rewards, torch.zeros(4, dtype=torch.long), nodes)
    assert per_action.tolist() == [[2, 2, 1], [2, 2, 3], [4, 4, 2], [4, 4, 6]]
    got = action_advantages(per_action, template.mask, torch.zeros(4, dtype=torch.long),
                            advantage_estimators["grpo"], {"eps": 0.0}, clip=None)
    a = 1 / math.sqrt(2)  # depth 1 and 2: nodes 2 and 4 → ∓1/√2
    b = math.sqrt(14 / 3)  # leaves: mean 3, unbiased std √(14/3)
    expected = torch.tensor([[-a, -a, -2 / b], [0, 0, 0 / b], [a, a, -1 / b], [0, 0, 3 / b]])
    torch.testing.assert_close(got, expected)


def test_tree_shares_prefixes_and_trains_each_edge_once():
    sigmas = torch.linspace(1, 0, 7, dtype=torch.float64)
    velocity, step = gaussian_engine(sigmas, kind="dance_grpo", noise_level=0.3)
    template = tree_template(8, [0, 2, 4], branching=2, num_steps=6)
    initial = torch.randn(2, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    result = shared_rollout(template, initial, torch.arange(16).reshape(2, 8), velocity, step)
    for column, s in enumerate(template.step_index[0].tolist()):
        nodes = template.node[:, s]
        for node in nodes.unique().tolist():
            members = (nodes == node).nonzero().flatten()
            assert template.mask[members, column].sum() == 1  # one representative trains the edge
            for r in range(2):  # members of a node share the edge: state before, action, log-prob
                assert (result.after[r, members, column] == result.after[r, members[0], column]).all()
                assert (result.old_logp[r, members, column] == result.old_logp[r, members[0], column]).all()
    assert not torch.equal(result.final[0, 0], result.final[0, 1])  # every leaf is its own image
    assert not torch.equal(result.final[0], result.final[1])  # trees of different groups differ
    assert result.evaluations == 2 * (1 + 2 + 2 + 4 + 4 + 8)
    # ratio == 1 on policy: every stored edge, rescored with the model that sampled it, has its stored log-prob
    for column, s in enumerate(template.step_index[0].tolist()):
        before, after = result.before[:, :, column].reshape(16, 3), result.after[:, :, column].reshape(16, 3)
        rescored = sde_step("dance_grpo", exact_velocity(before, float(sigmas[s])), before, float(sigmas[s]),
                            float(sigmas[s + 1]), noise_level=0.3, prev_sample=after).log_prob
        assert torch.equal(rescored, result.old_logp[:, :, column].reshape(16))


def test_width_pruning_keeps_the_best_and_the_worst_leaves():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4])
    assert width_pruning_keep(rewards, 0.5).nonzero().flatten().tolist() == [0, 1, 5, 6]
    assert width_pruning_keep(rewards, 0.1).sum() == 2  # at least two
    assert width_pruning_keep(torch.tensor([1.0, float("nan"), 0.0, 2.0]), 0.5).tolist() == [False, True, False, True]


# ---------------------------------------------------------------------------------------------- sliding window
def test_progressive_window_moves_every_shift_and_rolls_back():
    # The default range is MixGRPO's: max_timesteps = sampling_steps − 2 and the window range(cur, min(cur + W,
    # max_timesteps)) (Tencent-Hunyuan/MixGRPO e5cdd6a, train_grpo_flux.py:919, utils/grpo_states.py:148), so no
    # window reaches step S − 2 or the nearly deterministic last step S − 1.
    options = SlidingWindowCreditConfig(size=4, shift_every=2)
    assert window_bounds(options, 10) == (0, 8)
    starts = [window_start(options, 10, step=t, max_steps=100, run_seed=0) for t in range(12)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0]  # 5 positions (0..4: steps 0..7), then back to 0
    clipped = SlidingWindowCreditConfig(size=4, shift_every=2, roll_back=False)
    assert window_start(clipped, 10, step=15, max_steps=100, run_seed=0) == 4
    randomised_default = SlidingWindowCreditConfig(size=4, schedule="random")
    assert max(window_start(randomised_default, 10, step=t, max_steps=100, run_seed=1) for t in range(200)) == 4
    spread = SlidingWindowCreditConfig(size=2, shift_every=None, window_range=[0, 5])  # 4 positions over 8 steps
    assert [window_start(spread, 6, step=t, max_steps=8, run_seed=0) for t in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    randomised = SlidingWindowCreditConfig(size=3, schedule="random", window_range=[1, 8])
    drawn = [window_start(randomised, 10, step=t, max_steps=100, run_seed=5) for t in range(50)]
    assert set(drawn) <= set(range(1, 6)) and len(set(drawn)) > 2
    assert drawn == [window_start(randomised, 10, step=t, max_steps=100, run_seed=5) for t in range(50)]


def test_tail_grid_compresses_the_steps_after_the_window():
    assert tail_grid(6, 10, 0.4) == [6, 8, 10]  # ⌈0.4·4⌉ = 2 steps
    assert tail_grid(6, 10, 1.0) == [6, 7, 8, 9, 10]
    assert tail_grid(10, 10, 0.5) == []


def _ode_moments(solver, steps, start=0.8):
    """Exact final mean and variance of the tail from the exact marginal at σ = start (the map is affine)."""
    sigmas = torch.linspace(start, 0, steps + 1, dtype=torch.float64)
    probe = torch.stack([torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)])
    out = ode_tail(lambda x, i: exact_velocity(x, float(sigmas[i])), probe, sigmas, list(range(steps + 1)), solver)
    slope, intercept = out[1] - out[0], out[0]
    mean0, var0 = (1 - start) * M, (1 - start) ** 2 * C**2 + start**2
    return slope * mean0 + intercept, slope**2 * var0


def test_dpm_solver_2m_is_second_order_and_euler_first_order():
    # The exact ODE carries N((1−σ)m, (1−σ)²c² + σ²) at σ = 0.8 to the data N(m, c²). Halving the step must divide the
    # variance error by ~2 for Euler and by ~4 for DPM-Solver++(2M) (3.1–4.6 at these sizes, still approaching 4),
    # which also beats Euler by far at equal steps (one model call per step for both).
    errors = {}
    for solver in ("euler", "dpm2m"):
        errors[solver] = []
        for steps in (32, 64, 128):
            mean, var = _ode_moments(solver, steps)
            torch.testing.assert_close(mean, M, rtol=0, atol=1e-10)  # E[v] is exact: the mean never errs
            errors[solver].append((var / C**2 - 1).abs())
    for coarse, fine in zip(errors["euler"], errors["euler"][1:], strict=False):
        assert ((coarse / fine > 1.8) & (coarse / fine < 2.2)).all(), coarse / fine
    for coarse, fine in zip(errors["dpm2m"], errors["dpm2m"][1:], strict=False):
        assert ((coarse / fine > 2.8) & (coarse / fine < 5.0)).all(), coarse / fine
    for second, first in zip(errors["dpm2m"], errors["euler"], strict=True):
        assert (second < first / 4).all()


# ---------------------------------------------------------------------------------------------- chunks
def test_chunk_ids_from_sizes_and_from_the_relative_l1_change():
    assert chunks_from_sizes([2, 3], 5).tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="add up"):
        chunks_from_sizes([2, 2], 5)
    # D = 4, 5, 6, 7, 8; midpoint shares (D − d/2)/8 = .25, .5625, .6875, .8125, .9375 → ⌊2·share⌋ = 0, 1, 1, 1, 1
    # equal changes: shares .1, .3, .5, .7, .9 → 0, 0, 1, 1, 1; no change at all: cut the same way
    dynamics = torch.tensor([[4.0, 1, 1, 1, 1], [1.0, 1, 1, 1, 1], [0.0, 0, 0, 0, 0]])
    assert chunks_from_dynamics(dynamics, 2).tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    # one huge step swallows the others' shares: ids stay consecutive (no empty chunk)
    assert chunks_from_dynamics(torch.tensor([[0.1, 10.0, 0.1]]), 3).tolist() == [[0, 1, 2]]
    assert chunks_from_dynamics(torch.tensor([[0.1, 0.1, 10.0, 0.1]]), 4).tolist() == [[0, 0, 1, 2]]
    before = torch.tensor([[[[1.0, -1.0]]]])  # [N=1, A=1, 1, 2]
    after = torch.tensor([[[[2.0, -1.0]]]])
    assert relative_l1(before, after).tolist() == [[0.5]]  # mean|Δ| = 0.5, mean|x| = 1


def test_chunk_sampling_follows_the_dynamics():
    dynamics = torch.tensor([[3.0, 1.0, 1.0, 2.0]])
    ids = torch.tensor([[0, 0, 1, 1]])
    torch.testing.assert_close(chunk_probabilities(dynamics, ids, "l1"),
                               torch.tensor([[2 / 3.5, 1.5 / 3.5]], dtype=torch.float64), rtol=1e-6, atol=0)
    softmax = torch.tensor([math.exp(2), math.exp(1.5)], dtype=torch.float64)
    torch.testing.assert_close(chunk_probabilities(dynamics, ids, "softmax"), (softmax / softmax.sum()).unsqueeze(0))
    # 3 chunks with probabilities .7, .2, .1, one drawn per sample: frequencies over 4000 seeds within 5 std errors
    n = 4000
    chunk_ids = torch.tensor([0, 1, 1, 2]).expand(n, 4)
    probabilities = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64).expand(n, 3)
    mask = sample_chunk_mask(chunk_ids, probabilities, 0.5, torch.arange(n))
    assert (mask[:, 1] == mask[:, 2]).all()  # whole chunks
    assert (torch.stack([mask[:, 0], mask[:, 1], mask[:, 3]], dim=1).sum(dim=1) == 1).all()  # one chunk each
    frequency = torch.stack([mask[:, 0], mask[:, 1], mask[:, 3]], dim=1).mean(dim=0).double()
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    assert ((frequency - p).abs() < 5 * (p * (1 - p) / n).sqrt()).all(), frequency


def gcpo_chunk_loss(logp, old_logp, advantages, sizes, trained, clip):
    """The released Chunk-GRPO/GCPO loss (xingzhejun/GCPO ea6cc4d, fastvideo/train_grpo_flux_clip.py): per sample and
    trained chunk, the chunk log-probs are the means of the steps' (lines 475, 638), the chunk ratio is clipped PPO
    style, and each chunk's loss is divided by the number of trained chunks and the accumulation steps, one sample
    per step (line 777)."""
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    total = logp.new_zeros(())
    for i in range(logp.shape[0]):
        chunks = trained[i]
        for c in chunks:
            steps = slice(starts[c], starts[c] + sizes[c])
            ratio = torch.exp(logp[i, steps].mean() - old_logp[i, steps].mean())
            policy_loss = torch.maximum(-advantages[i] * ratio, -advantages[i] * ratio.clamp(1 - clip, 1 + clip))
            total = total + policy_loss / (logp.shape[0] * len(chunks))
    return total


def test_chunk_mean_weights_by_hand():
    ids = chunks_from_sizes([2, 3, 4, 7], 16).expand(2, 16)
    mask = torch.ones(2, 16)
    mask[1, 2:5] = 0  # the second sample trains chunks 0, 2 and 3 only
    mask[1, 9:] = 0  # ... and not 3 either: chunks 0 and 2, 6 steps
    weights = chunk_mean_weights(ids, mask)
    per_step = {0: 16 / (4 * 2), 1: 16 / (4 * 3), 2: 16 / (4 * 4), 3: 16 / (4 * 7)}
    torch.testing.assert_close(weights[0], torch.tensor([per_step[int(c)] for c in ids[0]]))
    # under token_mean over the 16 steps: 0.125, 0.083, 0.0625, 0.036 per step against a flat 0.0625 (issue 20)
    torch.testing.assert_close(weights[0, [0, 2, 5, 9]] / 16, torch.tensor([0.125, 1 / 12, 0.0625, 1 / 28]))
    expected = torch.tensor([6 / (2 * 2)] * 2 + [1.0] * 3 + [6 / (2 * 4)] * 4 + [1.0] * 7)
    torch.testing.assert_close(weights[1], expected)


@pytest.mark.parametrize("sampled", [False, True])
def test_chunk_mean_weighting_gives_the_released_chunk_loss(sampled):
    # Off policy, chunk ratios clipped by the core: the core's loss with the chunk_mean action weights equals the
    # released code's loss and gradient (token_mean when every sample trains all its chunks; seq_mean_token_mean
    # when samples train different chunks), while the default step weighting differs.
    generator = torch.Generator().manual_seed(4)
    sizes, n = [2, 3, 4, 7], 3
    ids = chunks_from_sizes(sizes, 16).expand(n, 16).clone()
    old_logp = torch.randn(n, 16, generator=generator, dtype=torch.float64)
    logp = (old_logp + 0.05 * torch.randn(n, 16, generator=generator, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    trained = [[0, 2], [1, 2, 3], [3]] if sampled else [[0, 1, 2, 3]] * n
    mask = torch.stack([torch.isin(ids[i], torch.tensor(trained[i])) for i in range(n)]).double()
    mode = "seq_mean_token_mean" if sampled else "token_mean"
    loss_fn = policy_losses["grpo"]
    per_action, _ = loss_fn(logp, old_logp, advantages, mask, clip_low=0.02, clip_high=0.02, ratio_level="chunk",
                            chunk_ids=ids)
    weights = chunk_mean_weights(ids, mask).double()
    got = aggregate(per_action * weights, mask, mode)
    reference = gcpo_chunk_loss(logp, old_logp, advantages, sizes, trained, clip=0.02)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-9)  # the weights are float32
    (grad,) = torch.autograd.grad(got, logp, retain_graph=True)
    (grad_reference,) = torch.autograd.grad(reference, logp, retain_graph=True)
    torch.testing.assert_close(grad, grad_reference, rtol=1e-6, atol=1e-9)
    (grad_step,) = torch.autograd.grad(aggregate(per_action, mask, mode), logp)
    assert (grad_step - grad_reference).abs().max() > 1e-3
