"""The dLLM plugin passes the conformance kit (mmrl.testing.check_plugin) on the bundled toy checkpoint, with each
objective paired with its algorithm (check_config refuses the other pairings), mask plans redrawn per inner epoch
(the kit's runtime has two) and with a LoRA adapter."""

from __future__ import annotations

import pytest
import torch

from mmrl.plugin import plugin_registry
from mmrl.testing import PROPERTIES, ConformanceError, check_plugin

torch.set_num_threads(1)

CASES = {
    "grpo": ({}, {}),
    "wd1": ({"objective": "wd1"}, {"algorithm": {"policy_loss": "wd1", "advantage": "wd1"}}),
    "spg": ({"objective": "spg"}, {"algorithm": {"policy_loss": "spg"}}),
    "lora": ({"lora": {"rank": 4, "alpha": 8.0}}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dllm_plugin_passes_the_conformance_kit(case, tmp_path):
    plugin, sections = CASES[case]
    checked = check_plugin(plugin_registry.get("dllm"), {"train_size": 8, "eval_size": 4, **plugin},
                           train_config=sections, directory=tmp_path)
    assert checked == [p for p in PROPERTIES if p != "action chunks"]


def test_the_kit_reports_the_plugins_own_cross_section_check():
    with pytest.raises(ConformanceError, match="check_config refused the config: config key "
                       "'algorithm.policy_loss.name': got 'grpo'; allowed: spg with plugin.objective spg"):
        check_plugin(plugin_registry.get("dllm"), {"train_size": 8, "eval_size": 4, "objective": "spg"})


CANVAS_LORA = {"full": None, "lora": {"rank": 4, "alpha": 8.0},
               "lora_experts": {"rank": 4, "alpha": 8.0, "target_parameters": ["experts.gate_up_proj",
                                                                                "experts.down_proj"]}}


@pytest.mark.parametrize("lora", list(CANVAS_LORA))
def test_a_canvas_model_passes_the_conformance_kit(lora, tmp_path):
    """DiffusionGemma (a tiny one built from its config classes): its own sampler and the uniform-noise estimator;
    full fine-tuning, LoRA, and LoRA on the fused experts too (peft's target_parameters)."""
    from mmrl.plugins.dllm.testing import save_tiny_diffusion_gemma

    model = save_tiny_diffusion_gemma(tmp_path / "model", canvas_length=4)
    plugin = {"model": model, "train_size": 8, "eval_size": 4, "gen_length": 8, "block_length": 4, "steps": 4,
              **({"lora": CANVAS_LORA[lora]} if CANVAS_LORA[lora] else {})}
    checked = check_plugin(plugin_registry.get("dllm"), plugin, directory=tmp_path / "kit")
    assert checked == [p for p in PROPERTIES if p != "action chunks"]
