"""``mmrl export`` of dLLM runs on the bundled toy checkpoint: full fine-tuning loads with
``AutoModelForMaskedLM``/``AutoTokenizer``, a LoRA with ``PeftModel.from_pretrained``, and both reproduce the trained
policy's logits."""

from __future__ import annotations

import json

import pytest
import torch

from mmrl.config import load_config
from mmrl.plugins.dllm import toy
from mmrl.policy import EXPORT_INFO, export_run
from mmrl.trainer import Trainer
from tests.dllm.test_training import BASE


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()  # [n, L, V]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_loads_with_transformers_and_reproduces_the_trained_policy(tmp_path, lora):
    from peft import PeftModel
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    overrides = [f"run.output_dir={tmp_path / 'run'}", "run.max_steps=1", "algorithm.inner_epochs=1",
                 "optim.lr=1e-2", "eval.save_samples=false"]
    if lora:
        overrides.append("plugin.lora={rank: 4, alpha: 8.0}")
    trainer = Trainer(load_config(BASE, overrides))
    trainer.train()
    plugin = trainer.plugin
    input_ids, _ = plugin.encode_prompts(plugin.dataset("eval")[:3])  # [3, w]
    masked = torch.cat([input_ids, torch.full((3, 4), plugin.adapter.mask_id)], dim=1)  # prompt + masked answer
    ours = _logits(plugin.model, masked)

    out = export_run(tmp_path / "run", tmp_path / "export")
    assert json.loads((out / EXPORT_INFO).read_text())["format"] == ("peft_lora" if lora else "pretrained")
    def bundled():
        return AutoModelForMaskedLM.from_pretrained(str(toy.ASSETS), attn_implementation="eager")

    base = bundled()
    if lora:
        exported = PeftModel.from_pretrained(bundled(), str(out))
    else:
        exported = AutoModelForMaskedLM.from_pretrained(str(out), attn_implementation="eager")
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        assert tokenizer.get_vocab() == plugin.adapter.tokenizer.get_vocab()
    torch.testing.assert_close(_logits(exported.eval(), masked), ours, rtol=0, atol=1e-5)
    # An export of the bundled (untrained) weights fails that comparison: the step moved the logits far more.
    assert (_logits(base.eval(), masked) - ours).abs().max() > 1e-3
