"""The flow plugin passes the conformance kit (mmrl.testing.check_plugin) on the tiny SD3 pipeline: Flow-GRPO's
per-step credit (SDE log-densities returned by the rollout, action chunks) and BranchGRPO's tree (per-action rewards
from the credit hook)."""

from __future__ import annotations

import pytest

from mmrl.plugin import plugin_registry
from mmrl.testing import PROPERTIES, check_plugin
from tests.flow.conftest import plugin_options

CREDIT = {
    "step": ({"strategy": "step"}, 2),
    "tree": ({"strategy": "tree", "tree": {"split_points": [0, 2], "width_pruning": 0.5}}, 4),
}


@pytest.mark.parametrize("credit", list(CREDIT))
def test_flow_plugin_passes_the_conformance_kit(pipelines, credit, tmp_path):
    strategy, group_size = CREDIT[credit]
    options = plugin_options(pipelines["sd3"], credit=strategy)
    checked = check_plugin(plugin_registry.get("flow"), options, group_size=group_size, directory=tmp_path)
    assert checked == list(PROPERTIES)  # flow recomputes any subset of denoising steps: action chunks are checked


def test_flow_plugin_with_buckets_passes_the_conformance_kit(pipelines, tmp_path):
    """Aspect-ratio buckets on FLUX.1 (whose forward depends on the size): the kit's batches hold one bucket's rows,
    and the plugin's row_buckets meet the contract."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in [
        {"prompt": "a wide cat", "aspect_ratio": "2:1"}, {"prompt": "a dog"}, {"prompt": "a wide car",
                                                                                 "aspect_ratio": 2}]))
    options = plugin_options(pipelines["flux"], prompts=None, eval_prompts=None, dataset=str(prompts),
                             eval_dataset=str(prompts), buckets=[[16, 32], [16, 16]])
    checked = check_plugin(plugin_registry.get("flow"), options, group_size=2, directory=tmp_path / "run")
    assert checked == list(PROPERTIES)
