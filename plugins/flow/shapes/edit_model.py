"""The edit world's image-editing model: a small ``FluxKontextPipeline`` built from diffusers' and transformers' own
classes, so that the flow plugin loads it exactly as it loads FLUX.1 Kontext [dev] (``from_pretrained`` on a
pipeline folder, the ``flux_kontext`` adapter: the input image's latent tokens appended to the generated ones with
position ids whose first coordinate is 1).

=================  ================================================================================================
transformer        ``FluxTransformer2DModel`` on the shapes world's 8×8×8 latents packed in 2×2 patches (16
                   generated + 16 input-image tokens), width 64 (2 heads × 32), 2 double-stream and 2
                   single-stream blocks, rotary axes (8, 12, 12); no guidance embedding (a model trained here
                   is not guidance-distilled, so it samples with one pass and no guidance, as the RL recipe does)
text encoders      ``CLIPTextModel`` (width 32, 2 layers, 12 positions) for FLUX's pooled vector and a one-layer
                   ``T5EncoderModel`` (width 64) for the sequence; trained with the transformer in pretraining,
                   frozen in RL as the plugin freezes FLUX's
tokenizers         the shapes world's word-level ``CLIPTokenizer`` and ``T5TokenizerFast`` on the instructions'
                   words (:data:`~mmrl.plugins.flow.shapes.edits.WORDS`)
VAE                the shapes world's trained ``AutoencoderTiny`` (32×32×3 ↔ 8×8×8), copied from the committed
                   text-to-image pipeline, frozen
scheduler          ``FlowMatchEulerDiscreteScheduler``, shift 1 without dynamic shifting (8×8 latents need none)
=================  ================================================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.plugins.flow.shapes import edits
from mmrl.plugins.flow.shapes.model import word_t5_tokenizer, word_tokenizer
from mmrl.plugins.flow.shapes.world import RESOLUTION

SHAPES_PIPELINE = Path(__file__).parent / "assets" / "pipeline"
"""The shapes world's committed text-to-image pipeline, whose autoencoder the edit model shares."""


@dataclass
class EditModelConfig:
    """Sizes of the edit model (the committed checkpoint uses the defaults)."""

    width_per_head: int = 32
    heads: int = 2
    double_layers: int = 2
    single_layers: int = 2
    rope_axes: tuple[int, int, int] = (8, 12, 12)
    text_width: int = 32
    text_layers: int = 2
    t5_width: int = 64
    t5_layers: int = 1
    text_positions: int = 12

    def __post_init__(self) -> None:
        self.rope_axes = tuple(int(axis) for axis in self.rope_axes)  # type: ignore[assignment]
        if sum(self.rope_axes) != self.width_per_head:
            raise ValueError(f"EditModelConfig.rope_axes {self.rope_axes} must add up to width_per_head "
                             f"{self.width_per_head} (FLUX's rotary embedding covers each head)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shapes_autoencoder(folder: str | Path = SHAPES_PIPELINE) -> Any:
    """The shapes world's trained ``AutoencoderTiny`` (the ``vae`` of a pipeline folder), frozen."""
    from diffusers import AutoencoderTiny

    path = Path(folder) / "vae"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no autoencoder at {path}: give the shapes world's pipeline folder "
                                f"({SHAPES_PIPELINE})")
    return AutoencoderTiny.from_pretrained(str(path)).eval().requires_grad_(False)


def build_edit_pipeline(config: EditModelConfig | None = None, seed: int = 0, vae: Any = None) -> Any:
    """A ``FluxKontextPipeline`` with freshly initialised transformer and text encoders (module docstring) and the
    shapes world's autoencoder (or ``vae``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    config = config or EditModelConfig()
    vae = vae if vae is not None else shapes_autoencoder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = word_tokenizer(config.text_positions, edits.WORDS)
        tokenizer_2 = word_t5_tokenizer(config.text_positions, edits.WORDS)
        vocab = len(tokenizer)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=vocab, hidden_size=config.text_width, intermediate_size=2 * config.text_width,
            projection_dim=config.text_width, num_hidden_layers=config.text_layers, num_attention_heads=2,
            max_position_embeddings=config.text_positions, hidden_act="gelu", bos_token_id=vocab - 2,
            eos_token_id=vocab - 1, pad_token_id=vocab - 1,
        ))
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=config.t5_width, d_kv=config.t5_width // 2,
            d_ff=2 * config.t5_width, num_layers=config.t5_layers, num_heads=2, relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
            dropout_rate=0.0,  # no dropout: the world's data is exact, and sampling must not depend on the mode
        ))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=config.double_layers,
            num_single_layers=config.single_layers, attention_head_dim=config.width_per_head,
            num_attention_heads=config.heads, joint_attention_dim=config.t5_width,
            pooled_projection_dim=config.text_width, guidance_embeds=False, axes_dims_rope=config.rope_axes,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    for module in (clip, t5, transformer):
        module.eval()  # as from_pretrained leaves them; pretraining switches what it trains to train mode
    return FluxKontextPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tokenizer,
                               text_encoder_2=t5, tokenizer_2=tokenizer_2, transformer=transformer)


def adapter_for(pipeline: Any) -> Any:
    """The flow plugin's ``flux_kontext`` adapter on ``pipeline``, at the world's 32×32 size (on the CPU)."""
    from mmrl.plugins.flow.adapters.flux_kontext import FluxKontextAdapter

    adapter = FluxKontextAdapter(pipeline, torch.device("cpu"))
    adapter.set_size(RESOLUTION, RESOLUTION)
    return adapter


def condition_latents(adapter: Any, images: Tensor) -> Tensor:
    """``[N, T, 4C]`` packed input-image tokens of ``images`` ``[N, 3, R, R]`` in [0, 1], through the adapter's own
    encoding (``image_tokens``, what ``encode_condition_images`` uses; the world's images are already at the run's
    size, so its resize is the identity)."""
    return adapter.image_tokens(images * 2 - 1)


def to_pixels(images: np.ndarray | Sequence[np.ndarray]) -> Tensor:
    """``[N, R, R, 3]`` uint8 → ``[N, 3, R, R]`` float in [0, 1]."""
    return torch.from_numpy(np.asarray(images)).permute(0, 3, 1, 2).float() / 255


def read_images(rows: Sequence[dict[str, Any]], folder: str | Path | None = None) -> Tensor:
    """``[N, 3, R, R]`` in [0, 1]: the input image of each dataset row (``row["image"]``, relative to ``folder``, or
    as it is without one)."""
    from PIL import Image

    arrays = []
    for row in rows:
        with Image.open(Path(folder) / row["image"] if folder is not None else Path(row["image"])) as image:
            arrays.append(np.asarray(image.convert("RGB")))
    return to_pixels(arrays)


@torch.no_grad()
def sample_edits(pipeline: Any, prompts: Sequence[str], images: Tensor, *, num_steps: int, seed: int,
                 batch_size: int = 64, transformer: Any = None) -> Tensor:
    """``[N, 3, R, R]`` edited images in [0, 1] of ``images`` ``[N, 3, R, R]`` by ``prompts``, drawn as the flow
    plugin's evaluation draws them (the plain Euler ODE on the scheduler's σ grid through the ``flux_kontext``
    adapter's ``velocity``), the noise of sample k from a generator seeded with ``seed + k``."""
    from mmrl.plugins.flow.sde import sde_step

    adapter = adapter_for(pipeline)
    module = transformer if transformer is not None else pipeline.transformer
    sigmas, timesteps = adapter.schedule(num_steps)
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        n = len(chunk)
        conditioning = dict(adapter.encode_prompts(chunk, 12))
        conditioning["image_latents"] = condition_latents(adapter, images[start:start + n])
        latents = adapter.pack(torch.cat([
            torch.randn((1, *adapter.noise_shape()), generator=torch.Generator().manual_seed(seed + k))
            for k in range(start, start + n)
        ]))
        for s in range(num_steps):
            velocity = adapter.velocity(module, latents, timesteps[s].expand(n), conditioning, guidance_scale=1.0)
            latents = sde_step("ode", velocity, latents, sigmas[s], sigmas[s + 1], noise_level=0.0).prev_sample
        out.append(adapter.decode(latents))
    return torch.cat(out)
