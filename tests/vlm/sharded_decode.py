"""One process of the two-process FSDP2 decode check (``tests/vlm/test_decode.py``).

    python tests/vlm/sharded_decode.py RANK WORLD_SIZE STORE_FILE MODEL_DIR OUT_JSON

Every process builds the same LoRA plugin on the tiny model (LoRA B filled from a fixed generator, so the adapter
changes the tokens), decodes the same interleaved, mixed-size prompts with the plugin's own loop, greedy and sampled,
then shards the model with torch's ``fully_shard`` (each decoder layer, then the whole model: the layout Accelerate's
FSDP2 recipes give) over a gloo group and decodes again. It writes whether the parameters were sharded and whether
each decoding gave the unsharded tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mmrl.plugins.vlm.decode import has_sharded_parameters  # noqa: E402
from tests.vlm.conftest import make_plugin  # noqa: E402
from tests.vlm.test_decode import _config, _generate, _prompts, fill_lora_b  # noqa: E402


def main() -> None:
    rank, world_size, store, model_dir, out = sys.argv[1:6]
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)  # the LoRA A initialisation, the same on every process
        plugin = make_plugin(model_dir, max_new_tokens=12)
        fill_lora_b(plugin.model, seed=3)
        prompts = _prompts(plugin)
        modes = {"greedy": False, "sampled": True}
        plain = {mode: _generate(plugin, prompts, _config(plugin, sampled), "mmrl", True, seed=5)
                 for mode, sampled in modes.items()}
        mesh = init_device_mesh("cpu", (world_size,))
        layers = [module for module in plugin.model.modules() if type(module).__name__.endswith("DecoderLayer")]
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(plugin.model, mesh=mesh)
        record = {"layers": len(layers), "sharded": has_sharded_parameters(plugin.model)}
        for mode, sampled in modes.items():
            tokens = _generate(plugin, prompts, _config(plugin, sampled), "mmrl", True, seed=5)
            record[mode] = {"equal": bool(torch.equal(tokens, plain[mode])), "shape": list(tokens.shape),
                            "distinct_tokens": len(set(tokens.flatten().tolist()))}
        Path(out).write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
