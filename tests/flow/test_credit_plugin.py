"""The credit strategies inside the flow plugin on the tiny SD3 (and FLUX) pipelines, without the trainer: ratio == 1
on policy, the shapes of mask / chunk_ids / action_weights / action_rewards, and where the credit lands."""

from __future__ import annotations

import pytest
import torch

from mmrl.algos import advantage_estimators
from mmrl.config import ConfigError, from_dict
from mmrl.plugins.flow.plugin import FlowPluginConfig
from mmrl.rollout import RolloutError
from mmrl.trainer.credit import action_advantages
from tests.flow.conftest import prompt_batch

STRATEGIES = {
    "step": {"strategy": "step"},
    "chunk": {"strategy": "chunk", "chunk": {"sizes": [1, 2], "sample": "weighted"}},
    "branch": {"strategy": "branch", "branch": {"points": [0, 2]}, "noise_weighting": True},
    "sliding_window": {"strategy": "sliding_window",
                      "sliding_window": {"size": 2, "shift_every": 1, "solver": "dpm2m", "solver_steps": 0.5}},
    "tree": {"strategy": "tree", "tree": {"split_points": [0, 2], "width_pruning": 0.5}},
    "guard": {"strategy": "step", "ratio_norm": True, "ratio_norm_reweight": True},
}


def _perturb_lora(plugin, scale=0.5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in plugin.policy().named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def _deviation(output, part):
    active = part.mask > 0
    return float((output.logp.detach() - part.old_logp).exp().sub(1).abs()[active].max())


def _batch(step=0):
    batch = prompt_batch(["a cat", "a dog"], 4)  # two whole groups of G = 4
    batch.step, batch.max_steps = step, 10
    return batch


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_has_ratio_one_on_policy_and_can_move_it(make_plugin, name):
    plugin = make_plugin("sd3", credit=STRATEGIES[name])
    _perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, _batch(step=1)).validate()
    assert rollout.mask.sum() > 0
    for split in ([0, 1, 2, 3, 4, 5, 6, 7], [6], [5, 0, 3]):
        part = rollout.select(torch.tensor(split))
        with torch.no_grad():
            assert _deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
    output = plugin.forward(policy, rollout, need_reference=False)
    weights = torch.ones_like(rollout.mask) if rollout.action_weights is None else rollout.action_weights
    (output.logp * rollout.mask * weights).sum().backward()  # gradients reach the adapter through active actions
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_" in n)
    _perturb_lora(plugin, seed=1)
    with torch.no_grad():
        assert _deviation(plugin.forward(policy, rollout, need_reference=False), rollout) > 1e-3


@pytest.mark.parametrize("name", ["branch", "tree", "sliding_window", "chunk"])
def test_strategies_work_with_the_flux_adapter(make_plugin, name):
    plugin = make_plugin("flux", credit=STRATEGIES[name])
    _perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), _batch()).validate()
    with torch.no_grad():
        assert _deviation(plugin.forward(plugin.policy(), rollout, need_reference=False), rollout) < 1e-5


@pytest.mark.parametrize("name", ["branch", "tree", "sliding_window", "chunk"])
def test_strategies_decode_the_last_prediction_on_the_same_trajectories(make_plugin, name):
    # decode_latent only changes the decoded latent (docs/flow.md, "What the rewards see"): every strategy's
    # trajectories, log-probs and masks stay as they are; the images are those of x − σ·v at the last step.
    rollouts = {}
    for mode in ("sample", "predicted_x0"):
        plugin = make_plugin("sd3", credit=STRATEGIES[name], decode_latent=mode)
        rollouts[mode] = plugin.rollout(plugin.policy(), _batch()).validate()
    sample, prediction = rollouts["sample"], rollouts["predicted_x0"]
    for key in ("latents", "next_latents", "step_index"):
        assert torch.equal(sample.replay[key], prediction.replay[key])
    assert torch.equal(sample.mask, prediction.mask)
    torch.testing.assert_close(sample.old_logp, prediction.old_logp)
    assert prediction.payload["images"].shape == sample.payload["images"].shape
    assert torch.isfinite(prediction.payload["images"]).all()
    stochastic_end = name in ("tree", "chunk")  # their last step is an SDE step; branch and windows end on the ODE
    assert stochastic_end != torch.allclose(sample.payload["images"], prediction.payload["images"], atol=1e-5)


def test_branch_shares_the_ode_trunk_and_trains_only_the_branch_step(make_plugin):
    plugin = make_plugin("sd3", credit=STRATEGIES["branch"])
    batch = _batch()
    rollout = plugin.rollout(plugin.policy(), batch)
    replay = rollout.replay
    assert rollout.old_logp.shape == (8, 2) and replay["step_index"].tolist() == [[0, 2]] * 8
    # members 0, 1 of each group branch at step 0, members 2, 3 at step 2; one active column per sample
    assert rollout.mask.tolist() == [[1, 0], [1, 0], [0, 1], [0, 1]] * 2
    for group in range(2):
        rows = torch.arange(4) + 4 * group
        start = plugin.sampler.group_noise(group)[0]
        assert torch.equal(replay["latents"][rows[0], 0], start) and torch.equal(replay["latents"][rows[1], 0], start)
        trunk = start.unsqueeze(0)  # the ODE trunk to step 2, recomputed
        sigmas, timesteps = plugin.adapter.schedule(4)
        conditioning = {k: v[rows[:1]] for k, v in replay["conditioning"].items()}
        with torch.no_grad():
            for s in range(2):
                v = plugin.sampler.velocity(plugin.policy(), trunk, timesteps[s].expand(1), conditioning,
                                            plugin.guidance_scale, phase="rollout")
                trunk = trunk - (sigmas[s] - sigmas[s + 1]) * v
        torch.testing.assert_close(replay["latents"][rows[2], 1], trunk[0], rtol=0, atol=1e-5)
        assert torch.equal(replay["latents"][rows[2], 1], replay["latents"][rows[3], 1])  # same x_k, one trunk
        assert not torch.equal(replay["next_latents"][rows[2], 1], replay["next_latents"][rows[3], 1])  # own noise
    images = rollout.payload["images"]
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[2], images[3])
    # noise-aware weights: std_k / mean std over steps 0..S−2, the same for every sample at that step
    from mmrl.plugins.flow.credit.base import noise_aware_weights

    expected = noise_aware_weights("flow_grpo", plugin.sampler.sigma_grid(), 0.7)[[0, 2]].float()
    torch.testing.assert_close(rollout.action_weights, expected.expand(8, 2))
    # per-action credit: the core normalises the rewards of the samples that branched at the same step
    rewards = torch.tensor([1.0, 3.0, 10.0, 30.0, 0.0, 4.0, 5.0, 5.0])
    per_action = plugin.action_rewards(rollout, rewards)
    advantages = action_advantages(per_action, rollout.mask, rollout.group_ids, advantage_estimators["grpo"],
                                   {"eps": 0.0}, clip=None)
    a = 2**-0.5
    assert torch.allclose(advantages, torch.tensor([[-a, 0], [a, 0], [0, -a], [0, a], [-a, 0], [a, 0], [0, 0],
                                                    [0, 0]]), atol=1e-6)


def test_branch_default_branches_at_every_step_but_the_last(make_plugin):
    # TempFlow-GRPO's released method: 4 steps → branch points 0, 1, 2 with K = 6 / 3 = 2 samples each; the trunk
    # is shared by all, each sample trains the step it branched at.
    plugin = make_plugin("sd3", credit={"strategy": "branch", "noise_weighting": True})
    assert plugin.config.num_actions() == 3
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 6)).validate()
    replay = rollout.replay
    assert replay["step_index"].tolist() == [[0, 1, 2]] * 6
    assert rollout.mask.tolist() == [[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1], [0, 0, 1]]
    for column in range(3):  # the two samples of a step leave the same trunk state with their own noise
        a, b = 2 * column, 2 * column + 1
        assert torch.equal(replay["latents"][a, column], replay["latents"][b, column])
        assert not torch.equal(replay["next_latents"][a, column], replay["next_latents"][b, column])
    assert plugin.model_evaluations["rollout"] == 3 + 2 * (3 + 2 + 1)  # trunk, then the branches to the end
    with pytest.raises(RolloutError, match=r"multiple of 3 with at least 2 per step \(e.g. 6"):
        plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 4))


def test_tree_edges_are_shared_trained_once_and_pruned(make_plugin):
    plugin = make_plugin("sd3", credit=STRATEGIES["tree"])
    rollout = plugin.rollout(plugin.policy(), _batch())
    replay = rollout.replay
    assert rollout.old_logp.shape == (8, 3) and replay["step_index"].tolist() == [[0, 1, 2]] * 8
    assert rollout.mask.tolist() == [[1, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]] * 2
    assert replay["tree_node"].tolist() == [[0, 0, 0], [0, 0, 1], [1, 1, 2], [1, 1, 3]] * 2
    for group in range(2):
        m = 4 * group
        for column in (0, 1):  # siblings of the first split share their path until the split at step 2
            for a, b in ((m, m + 1), (m + 2, m + 3)):
                assert torch.equal(replay["next_latents"][a, column], replay["next_latents"][b, column])
                assert rollout.old_logp[a, column] == rollout.old_logp[b, column]
        assert not torch.equal(replay["next_latents"][m, 0], replay["next_latents"][m + 2, 0])
        assert not torch.equal(replay["next_latents"][m, 2], replay["next_latents"][m + 1, 2])
        assert torch.equal(replay["latents"][m, 0], plugin.sampler.group_noise(group)[0])
    # node rewards: the mean of the leaves below; width pruning (0.5 of 4 leaves: best and worst) after step 2
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0, 4.0, 4.0, 0.0, 8.0])
    per_action = plugin.action_rewards(rollout, rewards)
    assert per_action.tolist() == [[2, 2, 1], [2, 2, 3], [4, 4, 2], [4, 4, 6], [4, 4, 4], [4, 4, 4], [4, 4, 0],
                                   [4, 4, 8]]
    assert (rollout.action_weights == 1).all()  # with S = 4 no trained step follows the last split (step 2)


def test_tree_width_pruning_zeroes_the_middle_leaves_after_the_last_split(make_plugin):
    plugin = make_plugin("sd3", num_steps=5, credit={"strategy": "tree",
                                                     "tree": {"split_points": [0, 2], "width_pruning": 0.5}})
    rollout = plugin.rollout(plugin.policy(), _batch())
    assert rollout.replay["step_index"][0].tolist() == [0, 1, 2, 3]
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0, 4.0, 5.0, 0.0, 8.0])
    plugin.action_rewards(rollout, rewards)
    # step 3 (after the last split) keeps the best and the worst leaf of each group: 6 and 1, 8 and 0
    assert rollout.action_weights[:, 3].tolist() == [1, 0, 0, 1, 0, 0, 1, 1]
    assert (rollout.action_weights[:, :3] == 1).all()
    counted = plugin.model_evaluations["forward"]
    with torch.no_grad():
        plugin.forward(plugin.policy(), rollout, need_reference=False)
    # only the active, unpruned edges are recomputed: (2 + 2 + 4 + 2) per group
    assert plugin.model_evaluations["forward"] - counted == 2 * (2 + 2 + 4 + 2)


def test_a_forward_without_trained_actions_still_has_a_graph(make_plugin):
    # With algorithm.action_chunk_size the trainer back-propagates every (micro-batch, column) forward; members 1 and
    # 3 of a tree train nothing in column 0 (their edge is trained on members 0 and 2), yet the backward must work.
    plugin = make_plugin("sd3", credit=STRATEGIES["tree"])
    rollout = plugin.rollout(plugin.policy(), _batch())
    part = rollout.select(torch.tensor([1, 3])).select_actions(torch.tensor([0]))
    assert part.mask.sum() == 0
    output = plugin.forward(plugin.policy(), part, need_reference=False, actions=torch.tensor([0]))
    assert output.logp.requires_grad
    (output.logp * part.mask).sum().backward()
    ratio = (output.logp.detach() - part.old_logp).exp()
    assert (ratio - 1).abs().max() < 1e-5  # the one recomputed action is the true log-prob, the other is the old one


def test_chunks_follow_the_sizes_and_untrained_chunks_cost_nothing(make_plugin):
    plugin = make_plugin("sd3", credit=STRATEGIES["chunk"])
    rollout = plugin.rollout(plugin.policy(), _batch())
    assert rollout.chunk_ids.tolist() == [[0, 1, 1]] * 8
    mask = rollout.mask
    assert ((mask[:, 0] == 1) ^ (mask[:, 1] == 1)).all() and torch.equal(mask[:, 1], mask[:, 2])  # one chunk each
    counted = plugin.model_evaluations["forward"]
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), rollout, need_reference=False)
    assert plugin.model_evaluations["forward"] - counted == int(mask.sum())
    assert torch.equal(output.logp[mask == 0], rollout.old_logp[mask == 0])
    with pytest.raises(RolloutError, match="action_chunk_size: null"):
        plugin.forward(plugin.policy(), rollout.select_actions(torch.tensor([0])), need_reference=False,
                       actions=torch.tensor([0]))
    adaptive = make_plugin("sd3", num_steps=6, credit={"strategy": "chunk", "chunk": {"num_chunks": 2}})
    ids = adaptive.rollout(adaptive.policy(), _batch()).chunk_ids
    assert ids.shape == (8, 5) and (ids[:, 0] == 0).all() and (ids.diff(dim=1) >= 0).all() and ids.max() <= 1


def test_chunk_mean_weighting_sets_gcpos_action_weights(make_plugin):
    # 3 trained steps in chunks [1, 2]: GCPO's chunk mean weighs step 0 by 3/(2·1) and steps 1, 2 by 3/(2·2), times
    # the noise-aware weights when both are on; the default 'step' weighting leaves the steps alike.
    plain = make_plugin("sd3", credit={"strategy": "chunk", "chunk": {"sizes": [1, 2]}})
    assert plain.rollout(plain.policy(), _batch()).action_weights is None
    plugin = make_plugin("sd3", credit={"strategy": "chunk", "noise_weighting": True,
                                        "chunk": {"sizes": [1, 2], "weighting": "chunk_mean"}})
    rollout = plugin.rollout(plugin.policy(), _batch())
    from mmrl.plugins.flow.credit.base import noise_aware_weights

    noise = noise_aware_weights("flow_grpo", plugin.sampler.sigma_grid(), 0.7)[:3].float()
    torch.testing.assert_close(rollout.action_weights, (torch.tensor([1.5, 0.75, 0.75]) * noise).expand(8, 3))


def test_sliding_window_follows_the_training_step_and_the_tail_solver_saves_calls(make_plugin):
    plugin = make_plugin("sd3", num_steps=6, credit={"strategy": "sliding_window",
                                                     "sliding_window": {"size": 2, "shift_every": 2}})
    starts = []
    for step in (0, 1, 2, 5, 6):
        rollout = plugin.rollout(plugin.policy(), _batch(step))
        starts.append(rollout.replay["step_index"][0, 0].item())
        assert (rollout.replay["step_index"] == rollout.replay["step_index"][:1]).all()  # one window for all
    # 3 positions (the window stays in steps 0..3 of 6, MixGRPO's range), moving every 2 steps, back to 0 at step 6
    assert starts == [0, 0, 1, 2, 0]
    flash = make_plugin("sd3", num_steps=6, credit={"strategy": "sliding_window", "sliding_window": {
        "size": 2, "shift_every": 2, "solver": "dpm2m", "solver_steps": 0.5}})
    plain, fast = (p.rollout(p.policy(), _batch(0)) for p in (plugin, flash))
    # the window (steps 0, 1) is sampled identically; the 4 steps after it take 2 DPM-Solver++(2M) steps
    for key in ("latents", "next_latents"):
        assert torch.equal(plain.replay[key], fast.replay[key])
    assert torch.equal(plain.old_logp, fast.old_logp)
    assert plain.metrics["model_evals_per_sample"] == 6 and fast.metrics["model_evals_per_sample"] == 4
    assert not torch.equal(plain.payload["images"], fast.payload["images"])


def test_ratio_norm_stores_the_old_means_and_weights_steps_by_one_over_delta(make_plugin):
    plugin = make_plugin("sd3", credit=STRATEGIES["guard"])
    rollout = plugin.rollout(plugin.policy(), _batch())
    assert rollout.replay["means"].shape == rollout.replay["latents"].shape
    sigmas = plugin.sampler.sigma_grid().double()
    inverse = 1 / (sigmas[:-1] - sigmas[1:])
    expected = (inverse / inverse[:-1].mean())[:3].float()
    torch.testing.assert_close(rollout.action_weights, expected.expand(8, 3))


def test_prefix_sharing_strategies_need_whole_groups(make_plugin):
    plugin = make_plugin("sd3", credit=STRATEGIES["tree"])
    split = prompt_batch(["a cat"], 4)
    split.rows, split.group_ids, split.seeds = split.rows[:3], split.group_ids[:3], split.seeds[:3]
    with pytest.raises(RolloutError, match="rollout.layout: contiguous"):
        plugin.rollout(plugin.policy(), split)
    with pytest.raises(RolloutError, match="leaves"):
        plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 2))
    branch = make_plugin("sd3", credit=STRATEGIES["branch"])
    with pytest.raises(RolloutError, match="evenly"):
        branch.rollout(branch.policy(), prompt_batch(["a cat"], 2))  # one sample per branch point: no comparison


def _config(**options):
    return from_dict(FlowPluginConfig, {"model": "unused", "prompts": ["a"], **options}, "plugin")


@pytest.mark.parametrize(("credit", "key"), [
    ({"strategy": "nope"}, "plugin.credit.strategy"),
    ({"strategy": "branch", "branch": {"points": [2, 1]}}, "plugin.credit.branch.points"),
    ({"strategy": "branch", "branch": {"points": [0, 10]}}, "plugin.credit.branch.points"),
    ({"strategy": "branch", "branch": {"points": []}}, "plugin.credit.branch.points"),
    ({"strategy": "tree", "tree": {"split_points": [0, 12]}}, "plugin.credit.tree.split_points"),
    ({"strategy": "tree", "tree": {"sde_steps": "splits", "width_pruning": 0.5}}, "plugin.credit.tree.width_pruning"),
    ({"strategy": "chunk", "chunk": {"sizes": [2, 2]}}, "plugin.credit.chunk.sizes"),
    ({"strategy": "sliding_window", "sliding_window": {"size": 4, "window_range": [0, 3]}},
     "plugin.credit.sliding_window.window_range"),
    # the last step (9 of 10) is never trained: Flow-GRPO trains steps 0..S−2, MixGRPO's window ends before S − 2
    ({"strategy": "sliding_window", "sliding_window": {"size": 4, "window_range": [4, 10]}},
     "plugin.credit.sliding_window.window_range"),
])
def test_impossible_credit_settings_are_config_errors(credit, key):
    with pytest.raises(ConfigError) as error:
        _config(credit=credit)
    assert error.value.key == key and "\n" not in str(error.value)


def test_action_budget_follows_the_strategy():
    assert _config().num_actions() == 9  # Flow-GRPO: 10 steps × 0.99
    assert _config(credit={"strategy": "branch", "branch": {"points": [0, 1, 2, 3]}}).num_actions() == 4
    assert _config(credit={"strategy": "sliding_window"}).num_actions() == 4
    assert _config(credit={"strategy": "sliding_window", "sliding_window": {"window_range": [5, 9]}}).num_actions() == 4
    with pytest.raises(ConfigError, match=r"null is \[0, 2\) with num_steps 4"):
        _config(num_steps=4, credit={"strategy": "sliding_window"})  # a window of 4 in steps 0..1
    assert _config(credit={"strategy": "tree"}).num_actions() == 10  # splits (0, 3, 6, 9): steps 0..8, and 9
    assert _config(credit={"strategy": "tree", "tree": {"sde_steps": "splits"}}).num_actions() == 4
    assert _config(num_steps=1, credit={"strategy": "branch", "branch": {"points": [0]}}).num_actions() == 1
    assert _config(credit={"strategy": "branch"}).num_actions() == 9  # TempFlow-GRPO: a branch at steps 0..8
    with pytest.raises(ConfigError, match="no step to branch at"):
        _config(num_steps=1, credit={"strategy": "branch"})
