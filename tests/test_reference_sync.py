"""The soft update of the KL reference (``algorithm.ref_sync_every``; TR-DPO arXiv:2404.09656, TRL sync_ref_model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mmrl.config import ConfigError, load_config
from mmrl.plugins.toy.plugin import ToyPlugin
from mmrl.trainer import Trainer
from mmrl.trainer.reference import ReferenceSync
from tests.helpers import toy_config

ROOT = Path(__file__).resolve().parents[1]
SYNC = ("algorithm.kl_coef=0.1", "algorithm.ref_sync_every=2", "algorithm.ref_sync_mix=0.6", "run.max_steps=4")


def test_sync_blends_every_tau_optimizer_steps_by_hand():
    policy = nn.Parameter(torch.tensor([1.0, 2.0]))
    reference = torch.tensor([0.0, 4.0])
    sync = ReferenceSync([("w", policy, reference)], every=3, mix=0.6)
    assert [sync.after_optimizer_step(k) for k in (1, 2)] == [False, False]
    assert torch.equal(reference, torch.tensor([0.0, 4.0]))
    assert sync.after_optimizer_step(3)  # 0.6·[1, 2] + 0.4·[0, 4] (TRL: ref·(1 − α) + α·θ)
    torch.testing.assert_close(reference, torch.tensor([0.6, 2.8]))
    with torch.no_grad():
        policy.copy_(torch.tensor([2.0, 0.0]))
    assert not sync.after_optimizer_step(4) and sync.after_optimizer_step(6)
    torch.testing.assert_close(reference, torch.tensor([0.6 * 2 + 0.4 * 0.6, 0.4 * 2.8]))
    assert sync.syncs == 2


def test_sync_blends_in_float32_and_rounds_once_to_the_reference_dtype():
    policy = nn.Parameter(torch.tensor([1.0 + 2**-9]))  # not representable in bfloat16
    reference = torch.tensor([1.0], dtype=torch.bfloat16)
    ReferenceSync([("w", policy, reference)], every=1, mix=1.0).sync()
    assert reference.dtype == torch.bfloat16 and reference.item() == torch.tensor(1.0 + 2**-9).bfloat16().item()


def _trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_training_moves_the_reference_toward_the_policy_as_trl_does(tmp_path):
    trainer = Trainer(toy_config(tmp_path, *SYNC))
    initial = _trainable(trainer.plugin.reference)
    after_steps: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        after_steps.append(_trainable(trainer.plugin.model))
        return out

    trainer.optimizer.step = recorded
    result = trainer.train()
    assert len(after_steps) == 4 and trainer.reference_sync.syncs == 2
    for name, value in initial.items():  # ref ← 0.6·θ + 0.4·ref after optimizer steps 2 and 4
        expected = 0.6 * after_steps[1][name] + 0.4 * value
        expected = 0.6 * after_steps[3][name] + 0.4 * expected
        torch.testing.assert_close(dict(trainer.plugin.reference.named_parameters())[name], expected)
    assert [row.get("ref/syncs") for row in result.history] == [None, 1.0, None, 2.0]


def test_a_copied_reference_gives_a_zero_kl_on_the_next_step(tmp_path):
    # mix 1 after every step: each step's KL is measured against the weights that sampled it (the first micro-batch is
    # the whole step here), so it is 0 up to rounding, where the fixed reference's KL grows.
    runs = {}
    for every in (0, 1):
        trainer = Trainer(toy_config(tmp_path / str(every), "algorithm.kl_coef=0.1",
                                     f"algorithm.ref_sync_every={every}", "algorithm.ref_sync_mix=1.0",
                                     "run.max_steps=4"))
        runs[every] = [row["policy/kl"] for row in trainer.train().history]
    assert all(abs(kl) < 1e-6 for kl in runs[1])
    assert runs[0][0] == pytest.approx(runs[1][0], abs=1e-6) and min(runs[0][1:]) > 1e-4


def test_the_synced_reference_is_checkpointed_and_restored(tmp_path):
    trainer = Trainer(toy_config(tmp_path, *SYNC))
    trainer.train()
    resumed = Trainer(toy_config(tmp_path, *SYNC, "run.resume=latest"))
    assert not torch.equal(next(resumed.plugin.reference.parameters()), next(trainer.plugin.reference.parameters()))
    resumed.restore_checkpoint()
    assert resumed.reference_sync.syncs == 2
    for a, b in zip(resumed.plugin.reference.parameters(), trainer.plugin.reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_run_resumed_after_a_sync_trains_as_one_that_was_not_stopped(tmp_path):
    # Steps 3-4 take their KL against the reference synced at step 2: resuming with the initial reference (what
    # TRL's callback does) would train differently.
    sync = ["algorithm.kl_coef=0.5", "algorithm.ref_sync_every=2", "algorithm.ref_sync_mix=0.6"]
    straight = Trainer(toy_config(tmp_path / "straight", *sync, "run.max_steps=4"))
    straight.train()
    Trainer(toy_config(tmp_path / "split", *sync, "run.max_steps=2")).train()
    resumed = Trainer(toy_config(tmp_path / "split", *sync, "run.max_steps=4", "run.resume=latest"))
    resumed.train()
    assert resumed.reference_sync.syncs == straight.reference_sync.syncs == 2
    for module in ("model", "reference"):
        expected = dict(getattr(straight.plugin, module).named_parameters())
        for name, value in getattr(resumed.plugin, module).named_parameters():
            assert torch.equal(value, expected[name]), (module, name)


def test_sync_without_the_kl_term_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.ref_sync_every.*kl_coef"):
        toy_config(tmp_path, "algorithm.ref_sync_every=8")


@pytest.mark.parametrize("config", ["configs/flow/shapes.yaml", "configs/vlm/toy_grounding.yaml",
                                    "configs/dllm/llada8b_gsm8k_lora.yaml"])
def test_lora_recipes_refuse_the_sync_when_the_config_is_loaded(config):
    # before any model is built: a LoRA run's reference is the base weights under the adapter
    sync = ["algorithm.kl_coef=0.04", "algorithm.ref_sync_every=4"]
    with pytest.raises(ConfigError, match=r"algorithm\.ref_sync_every.*plugin\.lora: null"):
        load_config(str(ROOT / config), sync)
    assert load_config(str(ROOT / config), [*sync, "plugin.lora=null"]).algorithm.ref_sync_every == 4


def test_a_plugin_without_a_separate_reference_is_refused_at_start_up(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyPlugin, "reference_module", lambda self: None)  # as a LoRA policy's plugin answers
    with pytest.raises(ConfigError, match=r"algorithm\.ref_sync_every.*no separate reference model"):
        Trainer(toy_config(tmp_path, *SYNC))


def test_a_reference_that_does_not_match_the_policy_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyPlugin, "reference_module", lambda self: nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="has no parameter"):
        Trainer(toy_config(tmp_path, *SYNC))
