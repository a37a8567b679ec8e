"""The shapes world's text-to-image model: a small latent ``StableDiffusion3Pipeline``, built from diffusers' and
transformers' own classes so that the flow plugin loads it exactly as it loads SD3.5 (``from_pretrained`` on a
pipeline folder, the ``sd3`` adapter).

=================  ================================================================================================
transformer        ``SD3Transformer2DModel`` (MMDiT) on 8×8×8 latents in 2×2 patches (16 image tokens), width 64
                   (2 heads × 32), 4 joint blocks, RMS q/k norm as SD3.5
text encoders      two ``CLIPTextModelWithProjection`` (width 32, 2 layers, 12 positions), as SD3's CLIP-L and
                   CLIP-G: their penultimate hidden states are concatenated (64 wide) and their projected EOS
                   states form the pooled vector; and a one-layer ``T5EncoderModel`` (width 64 = the joint
                   attention width) for the T5 half of the sequence (12 tokens); all trained with the
                   transformer in pretraining, frozen in RL as the plugin freezes SD3.5's
tokenizers         ``CLIPTokenizer`` (twice) with byte-pair merges learnt here on the world's 24 words and a
                   ``T5TokenizerFast`` on a Unigram vocabulary of the same words; letters are the fallback, nothing
                   is downloaded
VAE                ``AutoencoderTiny`` (TAESD's class), 32×32×3 pixels ↔ 8×8×8 latents, trained on the world's
                   renderings by :mod:`~mmrl.plugins.flow.shapes.autoencoder` before the flow model, with
                   ``shift_factor``/``scaling_factor`` that give the latents unit variance as SD3's do
scheduler          ``FlowMatchEulerDiscreteScheduler`` (rectified flow, shift 1: 8×8 latents need no shift)
=================  ================================================================================================

Why a latent model. The first version worked on pixels through an exact identity "VAE" (:func:`identity_vae`,
still available with ``ModelConfig(vae="identity")``): no autoencoder to train and the reward sees exactly what the
flow made. It pretrained to the same scores, but RL could not improve it: what separates its squares from its
circles is a dozen corner pixels, which the policy gradient over 3,072 dimensions of SDE noise barely sees
(docs/shapes.md). In the latent model an object is a few latent pixels that the decoder renders as a whole shape.

The identity VAE: ``AutoencoderTiny``'s decoder has no normalisation layer, so an exact identity is possible with
two 3×3 convolutions whose only non-zero taps are the centres: the adapter's decode computes u = z / scaling_factor
(scaling_factor 20, so |u| ≤ 0.05 and TAESD's input clamp tanh(u/3)·3 changes u by less than 5·10⁻⁶), the first
convolution maps u to (20u, −20u) = (z, −z), ReLU, and the last one returns (ReLU(z) − ReLU(−z)) / 2 + 1/2 =
(z + 1) / 2, the pixel in [0, 1], which diffusers maps to [-1, 1] and the adapter back to [0, 1]. Its encoder is
the exact inverse (two linear convolutions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mmrl.plugins.flow.shapes.autoencoder import build_autoencoder
from mmrl.plugins.flow.shapes.world import RESOLUTION, WORDS

VAE_SCALE = 20.0
"""scaling_factor of the identity VAE: the decoder's input is z / VAE_SCALE (see the module docstring)."""


@dataclass
class ModelConfig:
    """Sizes of the world's model (the committed checkpoint uses the defaults)."""

    width_per_head: int = 32
    heads: int = 2
    layers: int = 4
    patch_size: int = 2
    text_width: int = 32
    text_layers: int = 2
    text_positions: int = 12
    t5_layers: int = 1
    scheduler_shift: float = 1.0
    vae: str = "tiny"
    """``"tiny"``: a learned ``AutoencoderTiny`` (:mod:`~mmrl.plugins.flow.shapes.autoencoder`); ``"identity"``:
    the exact pixel identity (:func:`identity_vae`), the transformer then works on pixels."""
    vae_width: int = 32
    vae_levels: int = 3
    """Resolutions of the learned autoencoder: it downsamples by 2^(levels − 1)."""
    latent_channels: int = 8

    def __post_init__(self) -> None:
        if self.vae not in ("tiny", "identity"):
            raise ValueError(f"ModelConfig.vae must be 'tiny' or 'identity', got {self.vae!r}")

    @property
    def latent_side(self) -> int:
        return RESOLUTION if self.vae == "identity" else RESOLUTION // 2 ** (self.vae_levels - 1)

    @property
    def channels(self) -> int:
        return 3 if self.vae == "identity" else self.latent_channels

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def word_tokenizer(model_max_length: int = 12, words: Sequence[str] = WORDS) -> Any:
    """A ``CLIPTokenizer`` whose BPE merges rebuild every word of ``words`` (the world's :data:`WORDS`) as one token
    (with CLIP's ``</w>`` end-of-word suffix); other text falls back to letters and digits, anything else to the
    unknown token.

    The merges are learnt here by byte-pair encoding's own rule on the word list (merge the most frequent adjacent
    pair, ties broken alphabetically, until every word is one piece), which is what makes rank-ordered encoding
    rebuild each word exactly."""
    from transformers import CLIPTokenizer

    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab: dict[str, int] = {}
    for token in [*alphabet, *(char + "</w>" for char in alphabet)]:
        vocab.setdefault(token, len(vocab))
    spelled = [[*word[:-1], word[-1] + "</w>"] for word in words]
    merges: list[tuple[str, str]] = []
    while any(len(pieces) > 1 for pieces in spelled):
        counts: dict[tuple[str, str], int] = {}
        for pieces in spelled:
            for pair in zip(pieces, pieces[1:], strict=False):  # adjacent pairs
                counts[pair] = counts.get(pair, 0) + 1
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        for k, pieces in enumerate(spelled):
            merged, i = [], 0
            while i < len(pieces):
                if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == best:
                    merged.append(pieces[i] + pieces[i + 1])
                    i += 2
                else:
                    merged.append(pieces[i])
                    i += 1
            spelled[k] = merged
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length,
                         unk_token="<|endoftext|>")


def word_t5_tokenizer(model_max_length: int = 12, words: Sequence[str] = WORDS) -> Any:
    """A ``T5TokenizerFast`` on a Unigram vocabulary: T5's special tokens, every word of ``words`` (the world's
    :data:`WORDS`) as one piece, then letters and digits as a fallback."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(f"\u2581{word}", -3.0) for word in words]
    pieces += [(char, -5.0) for char in "abcdefghijklmnopqrstuvwxyz0123456789"]
    pieces += [(f"\u2581{char}", -6.0) for char in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def t5_encoder(vocab_size: int, config: ModelConfig) -> Any:
    from transformers import T5Config, T5EncoderModel

    width = 2 * config.text_width  # the joint attention width: CLIP-L ⊕ CLIP-G hidden states are padded to it
    t5 = T5Config(
        vocab_size=vocab_size, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=config.t5_layers,
        num_heads=2, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        use_cache=False, tie_word_embeddings=False,
    )
    return T5EncoderModel(t5)


def text_encoder(vocab_size: int, config: ModelConfig) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    text = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=config.text_width, intermediate_size=2 * config.text_width,
        projection_dim=config.text_width, num_hidden_layers=config.text_layers, num_attention_heads=2,
        max_position_embeddings=config.text_positions, hidden_act="gelu", bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    )
    return CLIPTextModelWithProjection(text)


def identity_vae() -> Any:
    """``AutoencoderTiny`` that maps pixels p in [0, 1] (given to ``encode`` as 2p − 1) to latents z = 2p − 1 and
    back, exactly (module docstring). ``scaling_factor`` = :data:`VAE_SCALE`, ``shift_factor`` = 0."""
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny(
        in_channels=3, out_channels=3, latent_channels=3, act_fn="relu",
        encoder_block_out_channels=(3,), num_encoder_blocks=(0,),
        decoder_block_out_channels=(6,), num_decoder_blocks=(0,),
        scaling_factor=VAE_SCALE, shift_factor=0.0,
    )
    centre = (slice(None), slice(None), 1, 1)
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.Conv2d):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
        encoder_in, encoder_out = [m for m in vae.encoder.modules() if isinstance(m, torch.nn.Conv2d)]
        encoder_in.weight[centre] = torch.eye(3)  # EncoderTiny feeds (x + 1) / 2 = p
        encoder_out.weight[centre] = torch.eye(3) * (2.0 / VAE_SCALE)  # u = (2p − 1) / 20 = z / 20
        encoder_out.bias.fill_(-1.0 / VAE_SCALE)
        decoder_in, decoder_out = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
        decoder_in.weight[centre] = torch.cat([torch.eye(3), -torch.eye(3)]) * VAE_SCALE  # (z, −z)
        decoder_out.weight[centre] = torch.cat([torch.eye(3), -torch.eye(3)], dim=1) * 0.5
        decoder_out.bias.fill_(0.5)  # (ReLU(z) − ReLU(−z)) / 2 + 1/2 = p; DecoderTiny returns 2p − 1
    return vae


def build_pipeline(config: ModelConfig | None = None, seed: int = 0, vae: Any = None) -> Any:
    """A ``StableDiffusion3Pipeline`` with freshly initialised transformer and text encoders (module docstring);
    ``vae`` is a trained autoencoder (:mod:`~mmrl.plugins.flow.shapes.autoencoder`), or a fresh one is built from
    ``config`` (the pixel identity with ``config.vae == "identity"``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    config = config or ModelConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = word_tokenizer(config.text_positions)
        tokenizer_2 = word_tokenizer(config.text_positions)
        encoder = text_encoder(len(tokenizer), config)
        encoder_2 = text_encoder(len(tokenizer_2), config)
        tokenizer_3 = word_t5_tokenizer(config.text_positions)
        encoder_3 = t5_encoder(len(tokenizer_3), config)
        inner = config.width_per_head * config.heads
        transformer = SD3Transformer2DModel(
            sample_size=config.latent_side, patch_size=config.patch_size, in_channels=config.channels,
            out_channels=config.channels,
            num_layers=config.layers, attention_head_dim=config.width_per_head, num_attention_heads=config.heads,
            joint_attention_dim=2 * config.text_width, caption_projection_dim=inner,
            pooled_projection_dim=2 * config.text_width, pos_embed_max_size=config.latent_side // config.patch_size,
            qk_norm="rms_norm",
        )
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=config.scheduler_shift)
        if vae is None:
            vae = identity_vae() if config.vae == "identity" else build_autoencoder(
                config.vae_width, config.latent_channels, config.vae_levels)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=encoder, tokenizer=tokenizer, text_encoder_2=encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=encoder_3, tokenizer_3=tokenizer_3,
    )


def pixels_to_latents(pipeline: Any, images: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` pixels in [0, 1] → the latents the flow model generates (through the pipeline's VAE)."""
    vae = pipeline.vae
    encoded = vae.encode(images * 2 - 1, return_dict=False)[0]
    return (encoded - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


def encode_prompts(pipeline: Any, prompts: list[str], max_sequence_length: int = 12) -> dict[str, torch.Tensor]:
    """The conditioning of ``prompts`` exactly as the flow plugin's SD3 adapter computes it (``encode_prompt``)."""
    prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, device=pipeline.transformer.device, num_images_per_prompt=1,
        do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
    )
    return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

