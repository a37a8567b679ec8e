"""The VLM plugin passes the conformance kit (mmrl.testing.check_plugin) on a tiny Qwen2.5-VL: with a LoRA adapter
(the reference is the adapter switched off) and with full fine-tuning (a frozen copy)."""

from __future__ import annotations

import pytest

from mmrl.plugin import plugin_registry
from mmrl.testing import PROPERTIES, check_plugin
from tests.vlm.conftest import plugin_options


@pytest.fixture(scope="module")
def tiny_qwen2_5_vl(tmp_path_factory):
    from mmrl.plugins.vlm.testing import build_tiny_model

    return build_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny_vlm") / "qwen2_5_vl")


@pytest.mark.parametrize("lora", [{"rank": 4, "alpha": 8.0}, None], ids=["lora", "full"])
def test_vlm_plugin_passes_the_conformance_kit(tiny_qwen2_5_vl, lora, tmp_path):
    options = plugin_options(tiny_qwen2_5_vl, lora=lora,
                             data={"synthetic": {"train_size": 4, "eval_size": 2, "tasks": ["grounding"], "seed": 2}})
    checked = check_plugin(plugin_registry.get("vlm"), options, directory=tmp_path)
    assert checked == [p for p in PROPERTIES if p != "action chunks"]  # one teacher-forced pass: no action chunks
