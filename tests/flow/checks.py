"""Checks every model family's tests make the same way: ratio 1 on-policy for any micro-batch split, two GRPO steps
that move only the LoRA, an exported LoRA that gives the policy's velocities in diffusers, and prompt rows naming
input images (image editing, image-to-video)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.flow.conftest import prompt_batch

SPLITS = ([0, 1, 2, 3, 4, 5], [5], [4, 0, 2])
"""Micro-batches of a 6-sample rollout: all, one, and a shuffled three (other sizes, orders and companions)."""


def perturb_lora(plugin: Any, scale: float = 0.5, seed: int = 0) -> None:
    """Random LoRA weights (B starts at zero, so a fresh adapter does nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in plugin.policy().named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def ratio_deviation(output: Any, part: Any) -> float:
    """The largest |exp(logp − old_logp) − 1| of a recomputed micro-batch."""
    return float((output.logp - part.old_logp).exp().sub(1).abs().max())


def assert_ratio_one_for_any_split(plugin: Any, rollout: Any, splits: tuple[list[int], ...] = SPLITS) -> None:
    """The training forward recomputes the rollout's log-probs (ratio 1 within 1e-5) for every micro-batch of
    ``splits``, and other LoRA weights move the ratio (> 1e-3), so the check can fail."""
    policy = plugin.policy()
    with torch.no_grad():
        for split in splits:
            part = rollout.select(torch.tensor(split))
            assert ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
        perturb_lora(plugin, seed=1)
        assert ratio_deviation(plugin.forward(policy, rollout, need_reference=False), rollout) > 1e-3


def assert_loaded_lora_gives_the_policy_velocities(plugin: Any, rollout: Any, transformer: Any,
                                                   guidance: float) -> None:
    """``transformer``, a diffusers transformer with the plugin's exported adapter loaded, gives the policy's
    velocities at the second step of ``rollout``, and the bare transformer does not (> 1e-3: the check can fail)."""
    latents, timesteps = rollout.replay["latents"][:, 1], rollout.replay["timesteps"][:, 1]
    conditioning = rollout.replay["conditioning"]
    adapter = plugin.adapter
    bare_transformer = type(transformer).from_pretrained(plugin.config.model, subfolder="transformer")
    with torch.no_grad():
        ours = adapter.call_transformer(plugin.policy(), latents, timesteps, conditioning, guidance)
        theirs = adapter.call_transformer(transformer, latents, timesteps, conditioning, guidance)
        bare = adapter.call_transformer(bare_transformer, latents, timesteps, conditioning, guidance)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    assert float((bare - ours).abs().max()) > 1e-3


def train_two_steps(trainer: Any, *, frozen_components: bool = False) -> set[str]:
    """Runs ``trainer`` (a 2-step LoRA config) and checks that both steps start at ratio 1, that only LoRA weights
    move (with ``frozen_components``, that the pipeline's other modules do not either) and that the step-2 checkpoint
    holds diffusers' LoRA file. Returns the names of the transformer parameters that changed."""
    from pathlib import Path

    transformer = trainer.plugin.policy()
    others = {name: module for name, module in trainer.plugin.adapter.pipeline.components.items()
              if frozen_components and isinstance(module, torch.nn.Module) and name != "transformer"}
    before = {name: {key: p.detach().clone() for key, p in module.named_parameters()}
              for name, module in [("transformer", transformer), *others.items()]}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)
    changed = {key for key, p in transformer.named_parameters() if not torch.equal(before["transformer"][key], p)}
    assert changed and all("lora_" in key for key in changed)  # only the adapter moves
    for name, module in others.items():
        assert all(torch.equal(before[name][key], p) for key, p in module.named_parameters()), f"{name} changed"
    checkpoint = Path(trainer.config.run.output_dir) / "checkpoints" / "step-00000002" / "policy"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    return changed


def write_image_rows(root: Path, rows: list[tuple[str, tuple[int, int]]], folder: str = "images") -> Path:
    """``root/train.jsonl`` with a row ``{"prompt", "image"}`` per ``(prompt, (width, height))``, each image a random
    RGB PNG in ``root/folder`` named by a path relative to the file, as a user's dataset would; returns the file."""
    from PIL import Image

    (root / folder).mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    lines = []
    for index, (prompt, (width, height)) in enumerate(rows):
        Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(root / folder / f"{index}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"{folder}/{index}.png"}) + "\n")
    path = root / "train.jsonl"
    path.write_text("".join(lines))
    return path


def image_rows(path: Path, adapter: str, *indices: int) -> list[dict[str, Any]]:
    """Rows ``indices`` of the JSONL at ``path`` as the plugin loads them for an image-conditioned ``adapter``
    (image paths resolved against the file's folder)."""
    from mmrl.plugins.flow.config import FlowPluginConfig, load_rows

    rows = load_rows(FlowPluginConfig(model="m", dataset=str(path)), "train", images=adapter)
    return [rows[index] for index in indices]


def row_images(row: dict[str, Any]) -> list[Any]:
    """The RGB PIL images a loaded prompt row names (``"image"``: a path or a list of paths), in its order."""
    from PIL import Image

    from mmrl.plugins.flow.config import row_image_paths

    opened = []
    for path in row_image_paths(row):
        with Image.open(path) as image:
            opened.append(image.convert("RGB"))
    return opened


def image_batch(rows: list[dict[str, Any]], group_size: int, **options: Any) -> Any:
    """A PromptBatch of each row (prompt and image) repeated ``group_size`` times (:func:`prompt_batch`'s seeds)."""
    batch = prompt_batch([row["prompt"] for row in rows], group_size, **options)
    batch.rows = [dict(row) for row in rows for _ in range(group_size)]
    return batch


def run_recipe_step(recipe: str, model: Path, output_dir: Path, *overrides: str) -> Any:
    """``configs/flow/{recipe}`` as written, for one step on a tiny pipeline ``model``: a rank-4 LoRA, one thread's
    worth of work (2 prompts × 4 samples, one evaluation prompt), float32, ``overrides`` last. Checks the step starts
    at ratio 1 and returns the trainer."""
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    path = Path(__file__).resolve().parents[2] / "configs" / "flow" / recipe
    config = load_config(path, [
        f"plugin.model={model}", "plugin.lora={rank: 4, alpha: 8}", f"run.output_dir={output_dir}", "run.max_steps=1",
        "run.cpu=true", "run.progress=false", "run.mixed_precision='no'", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "eval.num_prompts=1", *overrides,
    ])
    trainer = Trainer(config)
    history = trainer.train().history
    assert [record["step"] for record in history] == [1]
    assert history[0]["loss/first_step_ratio_deviation"] < 1e-5
    return trainer
