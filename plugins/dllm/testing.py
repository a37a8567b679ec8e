"""Tiny checkpoints of the dLLM plugin's model families, built from their config classes (random weights, the toy
character tokenizer), saved the way a user's checkpoint is, so that tests load them through ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmrl.plugins.dllm import toy


def tiny_diffusion_gemma_config(tokenizer: Any, *, canvas_length: int = 4, hidden_size: int = 32,
                                num_layers: int = 2, sliding_window: int = 8) -> Any:
    """A ``DiffusionGemmaConfig`` over ``tokenizer``'s vocabulary: one sliding and one full attention layer, four
    experts (the text layers are always MoE), a one-layer vision tower, ``canvas_length`` tokens per canvas."""
    from transformers import DiffusionGemmaConfig

    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
        sliding_window=sliding_window, max_position_embeddings=256,
        layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
        num_experts=4, top_k_experts=2, moe_intermediate_size=hidden_size,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16,
                  pooling_kernel_size=2)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length,
                                # no image tokens in the toy vocabulary: ids outside it (only ever compared)
                                boi_token_id=len(tokenizer), eoi_token_id=len(tokenizer) + 1,
                                image_token_id=len(tokenizer) + 2)


def save_tiny_diffusion_gemma(folder: str | Path, *, seed: int = 0, generation_config: dict[str, Any] | None = None,
                              **sizes: Any) -> str:
    """Save a randomly initialised tiny ``DiffusionGemmaForBlockDiffusion`` with the toy tokenizer (and, when given, a
    ``generation_config.json``) to ``folder``; return its path."""
    from transformers import DiffusionGemmaForBlockDiffusion

    folder = Path(folder)
    tokenizer = toy.build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(tiny_diffusion_gemma_config(tokenizer, **sizes))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


__all__ = ["save_tiny_diffusion_gemma", "tiny_diffusion_gemma_config"]
