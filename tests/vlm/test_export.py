"""``mmrl export`` of VLM runs: a trained LoRA loads with ``PeftModel.from_pretrained``, a full fine-tune with the
family's model class and ``AutoProcessor``, and both reproduce the trained policy's token log-probs."""

from __future__ import annotations

import json

import pytest
import torch

from mmrl.config import load_config
from mmrl.plugins.vlm.plugin import replay_prompts
from mmrl.policy import EXPORT_INFO, export_run
from mmrl.reward import reward_functions
from mmrl.trainer import Trainer
from tests.vlm.conftest import plugin_options, prompt_batch


def distinct_characters(batch) -> list[float]:
    """Test reward with spread on a random model's text (its format reward is 0 everywhere): distinct characters."""
    return [float(len(set(text))) for text in batch.payload["completions"]]


reward_functions.register("test_export_distinct", distinct_characters)


def _logp(plugin, model, rollout):
    with torch.no_grad():
        logp, _ = plugin.token_logp(model, replay_prompts(rollout.replay), rollout.replay["completion_ids"],
                                    rollout.num_actions, with_entropy=False)
    return logp.masked_fill(rollout.mask == 0, 0.0)  # [N, A]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_export_loads_with_transformers_and_reproduces_the_trained_policy(tmp_path, tiny_models, lora):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    options = plugin_options(tiny_models["qwen2_5_vl"], **({} if lora else {"lora": None}))
    config = load_config({
        "plugin": {"name": "vlm", **options},
        "run": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 2, "group_size": 2},
        "algorithm": {"micro_batch_size": 4},
        "optim": {"lr": 5.0e-2},
        "rewards": {"functions": [{"name": "test_export_distinct"}]},
        "eval": {"at_start": False, "num_prompts": 1, "save_samples": False},
    })
    trainer = Trainer(config)
    trainer.train()
    plugin = trainer.plugin
    rollout = plugin.rollout(plugin.policy(), prompt_batch(plugin.dataset("train")[:2], 2, seed=5))
    ours = _logp(plugin, plugin.model, rollout)

    out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="step-00000001")
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["format"] == ("peft_lora" if lora else "pretrained") and info["step"] == 1
    base = plugin.adapter.load_model(dtype=torch.float32, attn_implementation="eager")
    if lora:
        exported = PeftModel.from_pretrained(plugin.adapter.load_model(dtype=torch.float32,
                                                                       attn_implementation="eager"), str(out))
    else:
        exported = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32,
                                                               attn_implementation="eager")
        assert type(exported) is type(base)
        assert AutoProcessor.from_pretrained(str(out)).tokenizer.get_vocab() == plugin.adapter.tokenizer.get_vocab()
    torch.testing.assert_close(_logp(plugin, exported, rollout), ours, rtol=0, atol=1e-5)
    # An export of the untrained weights fails that comparison: the step moved the log-probs far more.
    assert (_logp(plugin, base, rollout) - ours).abs().max() > 1e-3
