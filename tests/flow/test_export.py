"""``mmrl export`` of flow runs: a trained LoRA loads with diffusers' ``load_lora_weights``, a fully fine-tuned
transformer with its class's ``from_pretrained``, and both reproduce the trained policy's velocities."""

from __future__ import annotations

import pytest
import torch

from mmrl.cli import main
from mmrl.trainer import Trainer
from tests.flow.conftest import prompt_batch


def _velocities(plugin, model, rollout):
    """The transformer's velocity at the second sampled step of ``rollout``, ``[N, C, h, w]``."""
    replay = rollout.replay
    with torch.no_grad():
        return plugin.adapter.call_transformer(model, replay["latents"][:, 1], replay["timesteps"][:, 1],
                                               replay["conditioning"], plugin.guidance_scale)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_export_loads_with_diffusers_and_reproduces_the_trained_policy(train_config, tmp_path, capsys, lora):
    plugin_options = {} if lora else {"lora": None}
    config = train_config("sd3", tmp_path / "run", "run.max_steps=1", "eval.every=0", "eval.save_samples=false",
                          cfg=False, **plugin_options)
    trainer = Trainer(config)
    trainer.train()
    plugin, policy = trainer.plugin, trainer.plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 2))

    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert f"exported step-00000001 of {tmp_path / 'run'} (flow plugin" in capsys.readouterr().out
    pipeline_class = type(plugin.adapter.pipeline)
    base = pipeline_class.from_pretrained(config.plugin.config.model).transformer
    if lora:
        assert (out / "pytorch_lora_weights.safetensors").is_file()
        pipeline = pipeline_class.from_pretrained(config.plugin.config.model)
        pipeline.load_lora_weights(str(out))
        exported = pipeline.transformer
    else:
        assert (out / "config.json").is_file()
        exported = type(policy).from_pretrained(str(out))
    ours = _velocities(plugin, policy, rollout)
    torch.testing.assert_close(_velocities(plugin, exported, rollout), ours, rtol=1e-5, atol=1e-5)
    # The training step moved the policy away from the base model by far more than the tolerance: an export of
    # the base weights (or of an untrained adapter) fails the comparison above.
    assert (_velocities(plugin, base, rollout) - ours).abs().max() > 1e-3

    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(out)]) == 1  # refuses to write over it, in one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "export folder" in err and "already exists and is not empty" in err
