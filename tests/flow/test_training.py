"""The flow plugin end to end through ``mmrl.trainer.Trainer`` on tiny SD3 and FLUX pipelines (CPU, 2 steps)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from mmrl.trainer import Trainer
from tests.flow.conftest import EVAL_PROMPTS


def _snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _changed(before, module):
    return {name for name, p in module.named_parameters() if not torch.equal(before[name], p.detach())}


@pytest.mark.parametrize(("kind", "cfg"), [("sd3", True), ("sd3", False), ("flux", False)],
                         ids=["sd3-cfg", "sd3-nocfg", "flux"])
def test_two_lora_steps_train_the_adapter_only_with_ratio_one(train_config, kind, cfg, tmp_path):
    # 8 samples per step are sampled in one rollout batch and trained in micro-batches of 3, one step at a time.
    trainer = Trainer(train_config(kind, tmp_path, cfg=cfg))
    transformer = trainer.plugin.policy()
    frozen = {name: module for name, module in trainer.plugin.adapter.pipeline.components.items()
              if isinstance(module, torch.nn.Module) and name != "transformer"}
    before = {name: _snapshot(module) for name, module in [("transformer", transformer), *frozen.items()]}
    result = trainer.train()

    assert [record["step"] for record in result.history] == [1, 2]
    for record in result.history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5
        assert record["reward/std"] > 0  # the group has something to learn from
    changed = _changed(before["transformer"], transformer)
    lora = {name for name, _ in transformer.named_parameters() if "lora_" in name}
    # Every LoRA matrix moved (B at step 1, A once B is non-zero), nothing else did, except where no gradient
    # reaches: the text-stream queries of SD3's last block, whose text outputs are discarded (context_pre_only).
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}.attn.add_q_proj."
    unreachable = {name for name in lora if name.startswith(last)} if kind == "sd3" else set()
    assert changed == lora - unreachable
    for name, module in frozen.items():
        assert not _changed(before[name], module), f"{name} changed"

    grid = tmp_path / "samples" / "step_000002" / "eval.png"
    assert Image.open(grid).size[0] > 0
    records = (tmp_path / "samples" / "step_000002" / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in records] == EVAL_PROMPTS
    assert (tmp_path / "checkpoints" / "step-00000002" / "policy" / "pytorch_lora_weights.safetensors").is_file()


def test_kl_term_starts_at_zero_and_rollout_batch_may_equal_the_micro_batch(train_config, tmp_path):
    config = train_config("sd3", tmp_path, "algorithm.kl_coef=0.04", "rollout.batch_size=4",
                          "algorithm.micro_batch_size=4")
    history = Trainer(config).train().history
    assert history[0]["policy/kl"] == pytest.approx(0.0, abs=1e-12)  # the policy is the reference at step 1
    assert history[1]["policy/kl"] > 0
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)


def test_full_fine_tuning_with_a_reference_copy(train_config, tmp_path):
    config = train_config("flux", tmp_path, "algorithm.kl_coef=0.01", lora=None)
    trainer = Trainer(config)
    before = _snapshot(trainer.plugin.policy())
    history = trainer.train().history
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)
    assert history[0]["policy/kl"] == pytest.approx(0.0, abs=1e-12)
    assert _changed(before, trainer.plugin.policy())
    assert not _changed(before, trainer.plugin.reference)
    assert (tmp_path / "checkpoints" / "step-00000002" / "policy" / "trainable.safetensors").is_file()


def test_flow_grpo_fast_window_with_shared_noise_and_whole_groups(train_config, tmp_path):
    config = train_config("sd3", tmp_path, "rollout.layout=contiguous", "eval.save_samples=false",
                          num_steps=6, train_steps="window", window_size=2, share_initial_noise=True)
    history = Trainer(config).train().history
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)


def test_resuming_restores_the_adapter_exactly(train_config, tmp_path):
    straight = Trainer(train_config("flux", tmp_path / "straight", "eval.save_samples=false"))
    straight.train()
    Trainer(train_config("flux", tmp_path / "split", "run.max_steps=1", "eval.save_samples=false")).train()
    resumed = Trainer(train_config("flux", tmp_path / "split", "run.resume=latest", "eval.save_samples=false"))
    result = resumed.train()
    assert result.history[0]["step"] == 2
    expected, got = _snapshot(straight.plugin.policy()), _snapshot(resumed.plugin.policy())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-7)
