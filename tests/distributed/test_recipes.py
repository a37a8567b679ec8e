"""The Accelerate recipes in configs/accelerate parse and carry the settings mmrl relies on."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
EXPECTED = {
    "single_gpu.yaml": "NO",
    "multi_gpu_ddp.yaml": "MULTI_GPU",
    "fsdp_lora.yaml": "FSDP",
    "fsdp_full.yaml": "FSDP",
    "deepspeed_zero2.yaml": "DEEPSPEED",
    "deepspeed_zero3.yaml": "DEEPSPEED",
    "multi_node.yaml": "MULTI_GPU",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_parses(name):
    config = load_config_from_file(str(RECIPES / name))
    assert config.distributed_type.value == EXPECTED[name]
    if config.distributed_type.value == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2
    if config.distributed_type.value == "DEEPSPEED":
        # mmrl sets the accumulation count itself; a fixed value here would silently rescale the loss.
        assert config.deepspeed_config["gradient_accumulation_steps"] == "auto"
    if name == "multi_node.yaml":
        assert config.num_machines == 2 and config.num_processes == 16


def test_every_recipe_is_covered():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED)
