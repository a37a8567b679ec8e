"""The toy plugin and the ``mmrl new-plugin`` scaffold take their KL reference from :mod:`mmrl.policy` (issue 23).

Full fine-tuning keeps ``frozen_copy``'s copy of the initial weights; a policy that carries a LoRA adapter
(``attach_lora``) is its own reference with the adapter switched off (``reference_policy``), so no copy is needed.
The expected log-probs are computed independently, from a copy of the base model taken before the adapter exists.
"""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch

from mmrl.config import from_dict
from mmrl.plugin import PromptBatch, Runtime
from mmrl.plugins.toy.plugin import ToyPlugin, ToyPluginConfig
from mmrl.policy import LoraConfig, attach_lora, lora_layers
from mmrl.reward import reward_functions
from mmrl.scaffold import new_plugin


def toy_plugin(runtime: Runtime):
    config = from_dict(ToyPluginConfig, {"train_size": 16, "eval_size": 4, "init_seed": 5}, "plugin")
    return ToyPlugin(config, runtime), ["head", "mix"]


def scaffold_plugin(runtime: Runtime, tmp_path, monkeypatch):
    root = new_plugin("ref_check", tmp_path / "pkg")
    monkeypatch.syspath_prepend(str(root))
    module = importlib.import_module("mmrl_ref_check.plugin")
    config = from_dict(module.RefCheckConfig, {"train_size": 16}, "plugin")
    return module.RefCheckPlugin(config, runtime), ["head"]


def build(kind: str, runtime: Runtime, tmp_path, monkeypatch):
    return toy_plugin(runtime) if kind == "toy" else scaffold_plugin(runtime, tmp_path, monkeypatch)


def rollout_of(plugin):
    rows = [dict(row) for row in plugin.dataset("train")[:4]]
    batch = PromptBatch(rows=rows, group_ids=torch.arange(4) // 2, group_size=2, seeds=torch.arange(4) + 7,
                        generator=torch.Generator(), training=True)
    return plugin.rollout(plugin.policy(), batch)


def token_logp(model, plugin, rollout) -> torch.Tensor:
    """Log-probs of the sampled tokens under ``model``, from its logits (not through the plugin's forward)."""
    replay = rollout.replay
    with torch.no_grad():
        if isinstance(plugin, ToyPlugin):
            logits = model(replay["prompt_ids"], replay["tokens"])  # [N, T, V]
        else:
            logits = model(replay["prompt_ids"])  # [N, L, V]
    log_probs = torch.log_softmax(logits.float() / plugin.config.temperature, dim=-1)
    return log_probs.gather(-1, replay["tokens"].unsqueeze(-1)).squeeze(-1)  # [N, A]


@pytest.mark.parametrize("kind", ["toy", "scaffold"])
def test_a_lora_policy_is_its_own_reference_with_the_adapter_off(kind, tmp_path, monkeypatch):
    # needs_reference False: no frozen copy exists, so the reference can only be the disabled adapter.
    plugin, targets = build(kind, Runtime(), tmp_path, monkeypatch)
    policy = plugin.policy()
    base = copy.deepcopy(policy)
    attach_lora(policy, LoraConfig(rank=2, alpha=4.0), default_targets=targets)
    with torch.no_grad():  # B starts at zero: make the adapter change the policy
        for layer in lora_layers(policy):
            for weight in layer.lora_B.values():
                weight.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    rollout = rollout_of(plugin)
    output = plugin.forward(policy, rollout, need_reference=True)
    mask = rollout.mask > 0
    torch.testing.assert_close(output.ref_logp[mask], token_logp(base, plugin, rollout)[mask], rtol=0, atol=1e-5)
    # the adapter is back on afterwards: the policy's own log-probs are not the base's
    assert float((output.logp.detach() - output.ref_logp).abs()[mask].max()) > 1e-2
    torch.testing.assert_close(output.logp.detach()[mask], token_logp(policy, plugin, rollout)[mask], rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize("kind", ["toy", "scaffold"])
def test_full_fine_tuning_keeps_the_initial_weights_as_reference(kind, tmp_path, monkeypatch):
    plugin, _ = build(kind, Runtime(needs_reference=True), tmp_path, monkeypatch)
    policy = plugin.policy()
    initial = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    rollout = rollout_of(plugin)
    output = plugin.forward(policy, rollout, need_reference=True)
    mask = rollout.mask > 0
    torch.testing.assert_close(output.ref_logp[mask], token_logp(initial, plugin, rollout)[mask], rtol=0, atol=1e-5)
    assert not output.ref_logp.requires_grad


@pytest.mark.parametrize("kind", ["toy", "scaffold"])
def test_no_reference_without_a_copy_or_an_adapter(kind, tmp_path, monkeypatch):
    plugin, _ = build(kind, Runtime(), tmp_path, monkeypatch)
    rollout = rollout_of(plugin)
    with pytest.raises(RuntimeError, match="needs_reference was False"):
        plugin.forward(plugin.policy(), rollout, need_reference=True)


def test_a_loss_that_reads_the_reference_keeps_it_without_a_kl_term(tmp_path):
    """``dgpo`` reads ``ref_logp`` (its group weights compare the policy with the reference): the trainer tells the
    plugin it needs a reference whatever ``kl_coef`` (``needs_reference``), so a fully fine-tuned toy keeps its frozen
    copy with ``kl_coef: 0`` and trains, its first group weights σ(0) = 1/2 (the policy is the reference)."""
    from mmrl.trainer import Trainer
    from mmrl.trainer.learn import needs_reference
    from tests.helpers import toy_config

    config = toy_config(tmp_path, "run.max_steps=2", "algorithm.kl_coef=0", "rollout.layout=contiguous",
                        "algorithm.policy_loss={name: dgpo, beta_dpo: 5.0}")
    assert needs_reference(config) and not needs_reference(toy_config(tmp_path / "grpo", "algorithm.kl_coef=0"))
    trainer = Trainer(config)
    assert trainer.runtime.needs_reference and trainer.plugin.reference is not None
    history = trainer.train().history
    assert history[0]["policy/group_weight_mean"] == pytest.approx(0.5, abs=1e-6)
    assert len(history) == 2 and all(math.isfinite(record["loss/total"]) for record in history)


@reward_functions.register("test_nan_second_sample")
def _nan_second_sample(batch):
    """Token accuracy-like 0/1 scores by prompt parity, NaN for the second sample of every scored batch."""
    return [float("nan") if i == 1 else float(len(p) % 2) for i, p in enumerate(batch.prompts)]


def test_a_group_coupled_loss_sees_whole_groups_after_a_skipped_sample(tmp_path):
    """``rewards.on_nonfinite: skip`` moves the dropped sample after the kept ones (padding, mask 0); the learner puts
    it back beside its group before dealing groups, so every call of ``dgpo`` holds whole groups (each id G times)
    and the dropped sample, masked, adds nothing to its group's sum."""
    from mmrl.trainer import Trainer
    from tests.helpers import toy_config

    config = toy_config(tmp_path, "run.max_steps=1", "rollout.layout=contiguous", "algorithm.micro_batch_size=4",
                        "rewards.functions=[{name: test_nan_second_sample}]", "rewards.on_nonfinite=skip",
                        "algorithm.policy_loss={name: dgpo, beta_dpo: 5.0}")
    trainer = Trainer(config)
    calls: list[tuple[list[int], list[float]]] = []
    loss = trainer.learner.policy_loss

    def recorded(logp, old_logp, advantages, mask, **options):
        calls.append((options["group_ids"].tolist(), mask[:, 0].tolist()))
        return loss(logp, old_logp, advantages, mask, **options)

    trainer.learner.policy_loss = recorded
    trainer.train()
    assert calls
    for ids, _ in calls:
        assert all(ids.count(i) == config.rollout.group_size for i in ids), ids
    dropped = [(ids[0], mask.count(0.0)) for ids, mask in calls if 0.0 in mask]
    assert dropped == [(calls[0][0][0], 1)]  # the second sample of the batch: group 0's, masked, kept in its group


def test_a_batch_that_holds_part_of_a_group_is_refused_for_a_group_coupled_loss(tmp_path):
    """Sorting by group id cannot make whole groups of a batch that holds only part of one (dynamic sampling padding
    with a group that on_nonfinite: skip had cut): the learner refuses it in one line instead of summing part of a
    group; a batch whose groups are whole but out of order comes back sorted, advantages alongside."""
    from mmrl.rollout import Rollout, RolloutError
    from mmrl.trainer import Trainer
    from tests.helpers import toy_config

    config = toy_config(tmp_path, "run.max_steps=1", "rollout.layout=contiguous", "rollout.group_size=2",
                        "algorithm.micro_batch_size=2", "algorithm.policy_loss={name: dgpo, beta_dpo: 5.0}")
    learner = Trainer(config).learner
    shuffled = Rollout(group_ids=torch.tensor([3, 5, 3, 5]), old_logp=None, mask=torch.ones(4, 2))
    rollout, advantages = learner._groups_together(shuffled, torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert rollout.group_ids.tolist() == [3, 3, 5, 5] and advantages.tolist() == [0.0, 2.0, 1.0, 3.0]
    partial = Rollout(group_ids=torch.tensor([3, 3, 4, 5]), old_logp=None, mask=torch.ones(4, 2))
    with pytest.raises(RolloutError, match=r"^policy_loss 'dgpo' needs whole groups, but this process's batch holds "
                                           r"part of a group \(group ids \[\[3, 3\], \[4, 5\]\]\)"):
        learner._groups_together(partial, torch.zeros(4))
