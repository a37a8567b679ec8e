"""Tiny SD3, FLUX, Qwen-Image, FLUX.2 (dev, klein base and distilled), FLUX.3 (modular), Wan (2.1, 2.2 two-expert
and 2.2 TI2V), Z-Image, HunyuanVideo 1.5 and Sana pipelines with random weights and locally built tokenizers, for tests
and benchmarks.

Nothing is downloaded: every component comes from its config class, the CLIP tokenizer from a byte-level BPE
vocabulary written here and the T5 tokenizer from a small Unigram vocabulary. :func:`save_tiny_pipeline` writes a
pipeline folder with ``save_pretrained``, so the plugin loads it through the same ``from_pretrained`` path as a hub
id::

    folder = save_tiny_pipeline("sd3", tmp_path / "tiny-sd3")
    plugin = FlowPlugin(FlowPluginConfig(model=str(folder), prompts=["a cat"]), Runtime())

``size="sd35-medium"`` builds the SD3.5-Medium transformer and VAE at full size (random weights; about 2.2B
parameters) with one-layer text encoders of the real widths, for the rollout benchmark on a GPU: prompt encoding is
cached by the plugin and kept out of the timed region, so the text encoders' depth does not matter there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_RESOLUTION = 16
"""Image side of the tiny pipelines (latents are 8×8: the tiny VAE downsamples by 2)."""

# Words the tiny tokenizers know as whole pieces; anything else falls back to characters.
_WORDS = ("a", "an", "the", "of", "on", "in", "cat", "dog", "red", "blue", "green", "photo", "painting", "house",
          "tree", "sky", "car", "with", "and", "small", "big")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable unicode characters (byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(code) for code in codes), strict=True))


def tiny_clip_tokenizer(model_max_length: int = 16) -> Any:
    """A CLIP tokenizer over single byte-level characters plus a few whole words (with CLIP's ``</w>`` suffix)."""
    from transformers import CLIPTokenizer

    alphabet = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for token in [*alphabet, *(char + "</w>" for char in alphabet)]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        # Merge the word left to right: "c a", "ca t</w>" → "cat</w>".
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            merged = pieces[0] + pieces[1]
            vocab.setdefault(merged, len(vocab))
            pieces = [merged, *pieces[2:]]
    merges = list(dict.fromkeys(merges))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_t5_tokenizer(model_max_length: int = 32) -> Any:
    """A T5 tokenizer on a small Unigram vocabulary: T5's special tokens, letters, digits and a few words."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{word}", -3.0) for word in _WORDS]
    pieces += [(char, -5.0) for char in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    pieces += [(f"▁{char}", -6.0) for char in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _clip_text_encoder(vocab_size: int, hidden: int, projection: int, layers: int, positions: int,
                       with_projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=projection,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64) if hidden >= 64 else 2,
        max_position_embeddings=positions, hidden_act="gelu", bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    )
    model_class = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return model_class(config)


def _t5_encoder(vocab_size: int, d_model: int, layers: int, heads: int, d_ff: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_layers=layers,
        num_heads=heads, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int, block_out_channels: tuple[int, ...], groups: int, scaling: float,
         shift: float) -> Any:
    from diffusers import AutoencoderKL

    blocks = len(block_out_channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks, block_out_channels=block_out_channels,
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=groups,
        sample_size=TINY_RESOLUTION * 2, scaling_factor=scaling, shift_factor=shift,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def build_sd3_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``StableDiffusion3Pipeline`` with random weights: two CLIP encoders with projection, a T5 encoder, an MMDiT
    transformer, a VAE and the shift-3 flow-matching scheduler of SD3.5."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if size == "tiny":
            tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_clip_tokenizer()
            tokenizer_3 = tiny_t5_tokenizer()
            clip_width, clip_2_width, t5_width, layers = 8, 8, 32, 1
            transformer = SD3Transformer2DModel(
                sample_size=TINY_RESOLUTION // 2, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=t5_width,
                caption_projection_dim=16, pooled_projection_dim=clip_width + clip_2_width, pos_embed_max_size=16,
            )
            vae = _vae(4, (8, 16), 4, scaling=1.5305, shift=0.0609)
        elif size == "sd35-medium":
            tokenizer, tokenizer_2 = tiny_clip_tokenizer(77), tiny_clip_tokenizer(77)
            tokenizer_3 = tiny_t5_tokenizer(256)
            clip_width, clip_2_width, t5_width, layers = 768, 1280, 4096, 1
            transformer = SD3Transformer2DModel(  # stabilityai/stable-diffusion-3.5-medium transformer config
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
            )
            vae = _vae(16, (128, 256, 512, 512), 32, scaling=1.5305, shift=0.0609)
        else:
            raise ValueError(f"unknown pipeline size {size!r}; choose 'tiny' or 'sd35-medium'")
        clip_positions = tokenizer.model_max_length
        vocab = len(tokenizer)
        text_encoder = _clip_text_encoder(vocab, clip_width, clip_width, layers, clip_positions, True)
        text_encoder_2 = _clip_text_encoder(vocab, clip_2_width, clip_2_width, layers, clip_positions, True)
        text_encoder_3 = _t5_encoder(len(tokenizer_3), t5_width, layers, 4 if size == "tiny" else 64,
                                     2 * t5_width)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )


def build_flux_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``FluxPipeline`` with random weights: a CLIP text encoder (pooled output), a T5 encoder, a FLUX transformer
    with the guidance embedding (as FLUX.1-dev), a VAE and FLUX's dynamically shifted scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    if size != "tiny":
        raise ValueError(f"unknown FLUX pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        clip_width, t5_width, latent_channels = 8, 32, 4
        text_encoder = _clip_text_encoder(len(tokenizer), clip_width, clip_width, 1, tokenizer.model_max_length,
                                          False)
        text_encoder_2 = _t5_encoder(len(tokenizer_2), t5_width, 1, 4, 2 * t5_width)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=t5_width, pooled_projection_dim=clip_width,
            guidance_embeds=True, axes_dims_rope=(2, 2, 4),
        )
        vae = _vae(latent_channels, (8, 16), 4, scaling=0.3611, shift=0.1159)
        scheduler = FlowMatchEulerDiscreteScheduler(  # black-forest-labs/FLUX.1-dev scheduler config
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )


def build_flux_kontext_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``FluxKontextPipeline`` with the components of :func:`build_flux_pipeline` (the same seed, the same
    weights): FLUX.1 Kontext is FLUX.1-dev's architecture with the condition image's tokens appended."""
    from diffusers import FluxKontextPipeline

    flux = build_flux_pipeline(seed=seed, size=size)
    return FluxKontextPipeline(**{name: component for name, component in flux.components.items()
                                  if name in ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2",
                                              "tokenizer_2", "transformer")})


def build_chroma_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``ChromaPipeline`` with random weights: a T5 encoder (the only text encoder), a 1+1-block Chroma transformer
    (no guidance embedding; a one-layer approximator producing the modulations), the tiny FLUX VAE and FLUX's
    dynamically shifted scheduler config."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    if size != "tiny":
        raise ValueError(f"unknown Chroma pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer, t5_width, latent_channels = tiny_t5_tokenizer(), 32, 4
        text_encoder = _t5_encoder(len(tokenizer), t5_width, 1, 4, 2 * t5_width)
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=t5_width, axes_dims_rope=(2, 2, 4),
            approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1,
        )
        vae = _vae(latent_channels, (8, 16), 4, scaling=0.3611, shift=0.1159)
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)


#: QwenImagePipeline's prompt template (its ``prompt_template_encode``); the pipeline drops the first 34 tokens
#: (``prompt_template_encode_start_idx``): the system turn and ``<|im_start|>user\n`` in Qwen2.5-VL's tokenizer.
_QWEN_IMAGE_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)


def tiny_qwen_image_tokenizer() -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` with Qwen's special tokens, trained on QwenImagePipeline's prompt template
    and the test words, so that the template's system turn is 34 tokens as in the real tokenizer (each word one
    token): the pipeline's fixed ``drop_idx`` then removes exactly the template, as it does for Qwen-Image."""
    corpus = _QWEN_IMAGE_TEMPLATE_PREFIX + " ".join(_WORDS) + "<|im_end|>\n<|im_start|>assistant\n"
    return _qwen_template_tokenizer(corpus, _QWEN_IMAGE_TEMPLATE_PREFIX, 34, "Qwen-Image")


#: The pre-tokenizer split of Qwen2's tokenizer.json (Qwen2.5-VL's too): unlike GPT-2's byte-level split it keeps
#: each digit and the space before it apart, so a numbered list costs the tokens it does in the real tokenizer.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _qwen_template_tokenizer(corpus: str, prefix: str, prefix_tokens: int, what: str,
                             qwen_split: bool = False) -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` with Qwen's special tokens trained on ``corpus``; ``prefix`` (a pipeline's
    dropped template start) must come out as ``prefix_tokens`` tokens, as in the real tokenizer. ``qwen_split``
    pre-tokenizes with Qwen2's own split (:data:`_QWEN2_SPLIT`) instead of GPT-2's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from mmrl.plugins.vlm.testing import SPECIAL_TOKENS

    tokenizer = Tokenizer(models.BPE())
    if qwen_split:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([corpus] * 8, trainer)
    wrapped = Qwen2Tokenizer(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             unk_token=None)
    counted = len(wrapped(prefix).input_ids)
    if counted != prefix_tokens:
        raise RuntimeError(f"tiny {what} tokenizer: the template prefix is {counted} tokens, not {prefix_tokens}")
    return wrapped


def build_qwen_image_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``QwenImagePipeline`` with random weights: a two-layer Qwen2.5-VL text encoder (the tiny one of the VLM
    tests) with :func:`tiny_qwen_image_tokenizer`, a two-block Qwen-Image MMDiT, a causal 3-D VAE
    (``AutoencoderKLQwenImage``, one downsampling: 16 px images have 8×8 latents) with per-channel
    ``latents_mean``/``latents_std``, and Qwen-Image's dynamically shifted scheduler."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.plugins.vlm.testing import tiny_config

    if size != "tiny":
        raise ValueError(f"unknown Qwen-Image pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_qwen_image_tokenizer()
        text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_config("qwen2_5_vl", tokenizer))
        text_width, latent_channels = text_encoder.config.text_config.hidden_size, 4
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=text_width, axes_dims_rope=(2, 2, 4),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075], latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
        )
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image scheduler/scheduler_config.json
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        )
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


#: The Qwen-Image-Edit pipelines' system turn and the start of the user turn: their first 64 tokens in Qwen2.5-VL's
#: tokenizer (``prompt_template_encode_start_idx``), dropped from the text encoding.
_QWEN_IMAGE_EDIT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n"
)


def tiny_qwen_image_edit_tokenizer() -> Any:
    """:func:`tiny_qwen_image_tokenizer`'s kind of tokenizer trained on the Qwen-Image-Edit template, so that its
    system turn and ``<|im_start|>user\n`` are 64 tokens as in the real tokenizer: the pipelines' fixed ``drop_idx``
    then removes exactly the template before the image."""
    corpus = _QWEN_IMAGE_EDIT_TEMPLATE_PREFIX + " ".join(_WORDS) + "<|im_end|>\n<|im_start|>assistant\n Picture 1: "
    return _qwen_template_tokenizer(corpus, _QWEN_IMAGE_EDIT_TEMPLATE_PREFIX, 64, "Qwen-Image-Edit")


def build_qwen_image_edit_pipeline(seed: int = 0, size: str = "tiny", plus: bool = False) -> Any:
    """A ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509/2511) with the
    components of :func:`build_qwen_image_pipeline` but a text encoder on :func:`tiny_qwen_image_edit_tokenizer`, and
    a ``Qwen2VLProcessor`` (what the released pipelines ship) whose image bounds (4 to 16 merged vision tokens) keep
    the text encoder's image small."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.plugins.vlm.testing import build_processor, tiny_config

    base = build_qwen_image_pipeline(seed=seed, size=size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        tokenizer = tiny_qwen_image_edit_tokenizer()
        processor = build_processor("qwen2_vl", tokenizer, min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
        text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_config("qwen2_5_vl", tokenizer))
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return pipeline_class(scheduler=base.scheduler, vae=base.vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          processor=processor, transformer=base.transformer)


def build_qwen_image_edit_plus_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """:func:`build_qwen_image_edit_pipeline` as a ``QwenImageEditPlusPipeline``."""
    return build_qwen_image_edit_pipeline(seed=seed, size=size, plus=True)


def build_qwen_image21_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``QwenImage21Pipeline`` (Qwen-Image 2.1) with random weights: a two-layer Qwen3-VL text encoder with a vision
    tower and a ``Qwen3VLProcessor`` (the tiny ones of the VLM tests: 16-pixel patches merged 2×2, so one image slot
    covers 32 px, the 2×2 latent tokens the transformer gives a slot; images of 32² to 128² pixels, a multiple of 32
    each side, keep their size, so ``image=`` inputs of that size fill as many slots as the pipeline's VAE gives
    their latents 2×2 groups), the processor's Qwen chat template, whose system turn sets the pipeline's
    ``_drop_idx``; a two-block single-stream transformer (block-causal attention, ``causal_condition``, RoPE axes
    2/2/4); the 4-channel (RGBA) 3-D VAE with four spatial downsamplings, the pipeline's fixed factor 16 (32 px images
    have 2×2 latents), random per-channel ``latents_mean``/``latents_std``; and Qwen-Image's dynamically shifted
    scheduler. ``sample_sigmas`` is left unset (the pipeline's linspace grid)."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLForConditionalGeneration

    from mmrl.plugins.vlm.testing import build_processor, build_tokenizer, tiny_config

    if size != "tiny":
        raise ValueError(f"unknown Qwen-Image 2.1 pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = build_tokenizer()
        # images of 32² to 128² pixels keep their size (one to 16 slots): the editing tests' inputs, as small as a
        # 32 px output (the pipeline's slots must match the VAE's 2×2 latent tokens, or its transformer refuses)
        processor = build_processor("qwen3_vl", tokenizer, min_pixels=32 * 32, max_pixels=16 * 32 * 32)
        text_encoder = Qwen3VLForConditionalGeneration(tiny_config("qwen3_vl", tokenizer))
        text_width, latent_channels = text_encoder.config.text_config.hidden_size, 8
        transformer = QwenImage21Transformer2DModel(
            patch_size=1, in_channels=latent_channels, out_channels=latent_channels, num_layers=2,
            attention_head_dim=8, num_attention_heads=2, context_in_dim=text_width, mlp_ratio=2,
            axes_dims_rope=(2, 2, 4),
        )
        statistics = torch.randn(2, latent_channels)
        vae = AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=latent_channels, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, False, False, False], latents_mean=statistics[0].mul(0.5).tolist(),
            latents_std=statistics[1].abs().add(0.5).tolist(),
        )
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler config
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        )
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)


_FLUX2_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                         "[IMG]", "[IMG_BREAK]", "[IMG_END]")
_FLUX2_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}"
)
"""Mistral's chat layout for text-only messages: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``."""


def tiny_pixtral_processor() -> Any:
    """A ``PixtralProcessor`` (what Flux2Pipeline's ``tokenizer`` is) around a byte-level BPE tokenizer with
    Mistral's special tokens, trained on FLUX.2's system message and the test words (about 33 tokens for the system
    turn), and a text-only Mistral chat template."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=list(_FLUX2_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([SYSTEM_MESSAGE + " " + " ".join(_WORDS)] * 8, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>", pad_token="<pad>")
    return PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=16), tokenizer=wrapped,
                            chat_template=_FLUX2_CHAT_TEMPLATE, patch_size=16, spatial_merge_size=2)


def _tiny_flux2_vae(latent_channels: int) -> Any:
    """The tiny FLUX.2 VAE (FLUX.3 uses the same one) with random batch-norm statistics, so that the decode's
    un-normalisation matters; drawn from the current random state."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=4, sample_size=TINY_RESOLUTION * 2,
    )
    with torch.no_grad():
        vae.bn.running_mean.normal_()
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def _tiny_flux2_parts(latent_channels: int, width: int, *, guidance_embeds: bool) -> tuple[Any, Any, Any]:
    """The tiny FLUX.2 transformer (1 + 1 blocks; text width 3 × ``width``, three stacked encoder layers), its VAE with
    random batch-norm statistics (so the decode's un-normalisation matters) and FLUX.1-dev's scheduler config; drawn
    from the current random state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=3 * width, timestep_guidance_channels=16,
        axes_dims_rope=(2, 2, 2, 2), guidance_embeds=guidance_embeds,
    )
    vae = _tiny_flux2_vae(latent_channels)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return transformer, vae, scheduler


def build_flux2_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``Flux2Pipeline`` with random weights: a Mistral-3 text encoder of 30 layers of width 16 (the pipeline
    stacks hidden layers 10, 20 and 30) with a one-layer Pixtral vision tower, a 1+1-block FLUX.2 transformer with
    the guidance embedding, a VAE whose batch-norm statistics are random (so the decode's un-normalisation
    matters), and FLUX.1-dev's scheduler config (FLUX.2's μ comes from ``compute_empirical_mu``)."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    if size != "tiny":
        raise ValueError(f"unknown FLUX.2 pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        processor = tiny_pixtral_processor()
        tokenizer = processor.tokenizer
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _FLUX2_SPECIAL_TOKENS}
        width, latent_channels = 16, 4
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=width,
                             intermediate_size=2 * width, num_hidden_layers=30, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                             bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"]),
            vision_config=dict(model_type="pixtral", hidden_size=width, intermediate_size=2 * width,
                               num_hidden_layers=1, num_attention_heads=2, head_dim=8, image_size=64, patch_size=16),
            image_token_index=ids["[IMG]"], spatial_merge_size=2, vision_feature_layer=-1,
        ))
        transformer, vae, scheduler = _tiny_flux2_parts(latent_channels, width, guidance_embeds=True)
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor,
                         transformer=transformer)


_Z_IMAGE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen3's chat layout for text-only messages, with its ``enable_thinking`` switch: ``false`` appends an empty
``<think>\n\n</think>\n\n`` to the generation prompt, anything else leaves it open (ZImagePipeline passes
``enable_thinking=True``, so a Z-Image prompt ends at ``<|im_start|>assistant\n``)."""


def tiny_qwen3_tokenizer() -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` (the class Qwen3 checkpoints ship) with Qwen's special tokens and
    ``<think>``/``</think>``, trained on the test words, with Qwen3's chat template (:data:`_Z_IMAGE_CHAT_TEMPLATE`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from mmrl.plugins.vlm.testing import SPECIAL_TOKENS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[*SPECIAL_TOKENS, "<think>", "</think>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([" ".join(_WORDS) + " user assistant\n"] * 8, trainer)
    return Qwen2Tokenizer(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          unk_token=None, chat_template=_Z_IMAGE_CHAT_TEMPLATE)


def _tiny_qwen3_config(tokenizer: Any, width: int, *, layers: int, tie: bool) -> Any:
    """A ``Qwen3Config`` of ``layers`` layers of width ``width`` (2 query heads, 1 key/value head of width/2, MLP
    2·width) for :func:`tiny_qwen3_tokenizer`."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tie,
    )


def build_z_image_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``ZImagePipeline`` with random weights: a three-layer ``Qwen3Model`` text encoder (the pipeline reads the
    second-to-last hidden state) on :func:`tiny_qwen3_tokenizer`, a Z-Image single-stream DiT with one noise refiner,
    one context refiner and two main blocks (2×2 patches, RoPE axes 2/2/4), a VAE with a shift factor (one
    downsampling: 16 px images have 8×8 latents, 4×4 tokens) and Z-Image's statically shifted scheduler (shift 3,
    Tongyi-MAI/Z-Image-Turbo's scheduler config). The transformer's timestep MLP and padding tokens are random too,
    so the learned caption and image padding (to multiples of 32 tokens) matters as in the real model."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    if size != "tiny":
        raise ValueError(f"unknown Z-Image pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_qwen3_tokenizer()
        text_width, latent_channels = 24, 4
        text_encoder = Qwen3Model(_tiny_qwen3_config(tokenizer, text_width, layers=3, tie=False))
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=32, n_layers=2,
            n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=text_width, axes_dims=[2, 2, 4],
            axes_lens=[256, 64, 64],
        )
        with torch.no_grad():  # released weights are not zero: make the padding tokens matter here too
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        vae = _vae(latent_channels, (8, 16), 4, scaling=0.3611, shift=0.1159)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)


def build_flux2_klein_pipeline(seed: int = 0, size: str = "tiny", distilled: bool = False) -> Any:
    """A ``Flux2KleinPipeline`` with random weights: a 27-layer width-16 ``Qwen3ForCausalLM`` text encoder (the
    pipeline stacks hidden layers 9, 18 and 27) on :func:`tiny_qwen3_tokenizer`, a 1+1-block FLUX.2 transformer
    without the guidance embedding, FLUX.2's batch-normalised VAE with random statistics, FLUX.1-dev's scheduler
    config (μ from ``compute_empirical_mu``); ``distilled`` sets the pipeline's ``is_distilled`` (no guidance)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    if size != "tiny":
        raise ValueError(f"unknown FLUX.2 [klein] pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_qwen3_tokenizer()
        width, latent_channels = 16, 4
        text_encoder = Qwen3ForCausalLM(_tiny_qwen3_config(tokenizer, width, layers=27, tie=True))
        transformer, vae, scheduler = _tiny_flux2_parts(latent_channels, width, guidance_embeds=False)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=distilled)


def build_flux2_klein_distilled_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """:func:`build_flux2_klein_pipeline` with ``is_distilled`` set, as the step-distilled klein checkpoints."""
    return build_flux2_klein_pipeline(seed=seed, size=size, distilled=True)


def tiny_qwen3_vl_processor() -> Any:
    """A ``Qwen3VLProcessor`` (the class FLUX.3's ``tokenizer`` component is) on :func:`tiny_qwen3_tokenizer` with
    Qwen-VL's vision tokens added; its image and video processors are the library defaults (FLUX.3 encodes text
    only)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = tiny_qwen3_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=tokenizer.chat_template)


def build_flux3_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``Flux3ModularPipeline`` (diffusers' modular FLUX.3, ``Flux3AutoBlocks``) with random weights: a 32-layer
    width-16 ``Qwen3VLForConditionalGeneration`` text encoder (the text encoder step stacks hidden layers 4, 8, ...,
    32) on :func:`tiny_qwen3_vl_processor`, a 1+1-block ``Flux3Transformer2DModel`` and FLUX.2's batch-normalised VAE
    with random statistics. The scheduler and the guider are not components a folder stores: the blocks create them
    from their own config (shift 6.93, CFG scale 3.5). ``save_pretrained`` writes ``modular_model_index.json``."""
    from diffusers.models import Flux3Transformer2DModel
    from diffusers.modular_pipelines import Flux3AutoBlocks
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if size != "tiny":
        raise ValueError(f"unknown FLUX.3 pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        processor = tiny_qwen3_vl_processor()
        tokenizer = processor.tokenizer
        width, latent_channels = 16, 4
        config = Qwen3VLConfig(
            text_config={"vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": 2 * width,
                         "num_hidden_layers": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                         "head_dim": width // 2, "max_position_embeddings": 256,
                         "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": width, "deepstack_visual_indexes": []},
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        )
        text_encoder = Qwen3VLForConditionalGeneration(config).eval()
        transformer = Flux3Transformer2DModel(
            in_channels=4 * latent_channels, cond_in_channels=4 * latent_channels, num_layers=1, num_single_layers=1,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8 * width, timestep_channels=16,
            axes_dims_rope=(2, 2, 2, 2),
        )
        vae = _tiny_flux2_vae(latent_channels)
    pipeline = Flux3AutoBlocks().init_pipeline()
    pipeline.update_components(text_encoder=text_encoder, tokenizer=processor, transformer=transformer, vae=vae)
    return pipeline


TINY_WAN_FRAMES = 5
"""Frames of the tiny Wan videos: the tiny VAE compresses time by 2, so 5 frames are 3 latent frames."""


def build_wan_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``WanPipeline`` with random weights: a one-layer UMT5 encoder on :func:`tiny_t5_tokenizer`, a two-block
    ``WanTransformer3DModel`` (patches of 1×2×2), a causal video VAE (``AutoencoderKLWan``) with one downsampling
    in space and time (16 px frames have 8×8 latents; 5 frames have 3 latent frames) and per-channel
    ``latents_mean``/``latents_std``, and Wan2.1-T2V-1.3B's scheduler (UniPC with flow sigmas, flow shift 3)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    if size != "tiny":
        raise ValueError(f"unknown Wan pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_t5_tokenizer()
        width, latent_channels = 32, 4
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=width, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            use_cache=False, tie_word_embeddings=False,
        ))
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=latent_channels,
            out_channels=latent_channels, text_dim=width, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
        )
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075], latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
            scale_factor_temporal=2, scale_factor_spatial=2,
        )
        scheduler = UniPCMultistepScheduler(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        )
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)


def _tiny_wan_transformer(latent_channels: int, text_width: int) -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=latent_channels,
        out_channels=latent_channels, text_dim=text_width, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )


def _tiny_umt5(tokenizer: Any, width: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        use_cache=False, tie_word_embeddings=False,
    ))


def build_wan_i2v_pipeline(seed: int = 0, size: str = "tiny", experts: bool = False, flf2v: bool = False) -> Any:
    """A ``WanImageToVideoPipeline`` with the text encoder, VAE and scheduler of :func:`build_wan_pipeline` and
    image-to-video transformers (``in_channels`` = 2 × 4 latent channels + the VAE's temporal factor 2 for the mask).
    Wan 2.1 I2V (default): one transformer with an image cross-attention (``image_dim``, ``added_kv_proj_dim``) and a
    two-layer CLIP vision tower with its processor. ``experts``: Wan 2.2 I2V-A14B, two experts (t >= 900 the first,
    Wan2.2-I2V-A14B's ``boundary_ratio`` 0.9) and no image encoder. ``flf2v``: Wan2.1-FLF2V (first and last frame),
    whose image embedder reads the two images' CLIP features side by side (``pos_embed_seq_len`` = 2 × 17 tokens of
    the tiny CLIP tower), its position embedding random so that the two images' places differ."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    base = build_wan_pipeline(seed=seed, size=size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        channels, temporal, width = 4, 2, 32
        image = {} if experts else {"image_dim": 16, "added_kv_proj_dim": 24}
        if flf2v:
            image["pos_embed_seq_len"] = 2 * (32 // 8) ** 2 + 2  # two images of 16 patches and a class token each

        def transformer() -> Any:
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=2 * channels + temporal,
                out_channels=channels, text_dim=width, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
                **image,
            )

        parts: dict[str, Any] = {"transformer": transformer()}
        if flf2v:
            with torch.no_grad():
                parts["transformer"].condition_embedder.image_embedder.pos_embed.normal_(0, 0.5)
        if experts:
            parts.update(transformer_2=transformer(), boundary_ratio=0.9)
        else:
            parts.update(image_encoder=CLIPVisionModel(CLIPVisionConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                patch_size=8, projection_dim=16)),
                image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}))
    return WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                                   scheduler=base.scheduler, **parts)


def build_wan22_ti2v_i2v_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """:func:`build_wan22_ti2v_pipeline`'s components as a ``WanImageToVideoPipeline`` with ``expand_timesteps``
    (Wan 2.2 TI2V-5B given an image: the image's latent frame replaces the first one, its tokens at timestep 0)."""
    from diffusers import WanImageToVideoPipeline

    ti2v = build_wan22_ti2v_pipeline(seed=seed, size=size)
    return WanImageToVideoPipeline(tokenizer=ti2v.tokenizer, text_encoder=ti2v.text_encoder, vae=ti2v.vae,
                                   scheduler=ti2v.scheduler, transformer=ti2v.transformer, expand_timesteps=True)


def build_wan_flf2v_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """:func:`build_wan_i2v_pipeline` as Wan2.1-FLF2V: first-and-last-frame-to-video."""
    return build_wan_i2v_pipeline(seed=seed, size=size, flf2v=True)


def build_wan22_i2v_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """:func:`build_wan_i2v_pipeline` with Wan 2.2 I2V-A14B's two experts and no image encoder."""
    return build_wan_i2v_pipeline(seed=seed, size=size, experts=True)


WAN22_BOUNDARY_RATIO = 0.875
"""``boundary_ratio`` of the tiny two-expert Wan 2.2 pipeline, Wan2.2-T2V-A14B's (Wan-Video/Wan2.2@42bf4cf
``wan/configs/wan_t2v_A14B.py:36``): the high-noise expert takes the steps with t >= 875."""


def build_wan22_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A two-expert Wan 2.2 ``WanPipeline`` (the layout of Wan-AI/Wan2.2-T2V-A14B-Diffusers) with random weights: the
    tiny Wan 2.1 components of :func:`build_wan_pipeline` (UMT5, the Wan 2.1 VAE, 4 latent channels) with two
    differently initialised two-block transformers, ``transformer`` (high-noise expert) and ``transformer_2``
    (low-noise expert), ``boundary_ratio`` 0.875 and UniPC with Wan2.2-T2V-A14B's flow shift 12
    (``wan_t2v_A14B.py:34`` ``sample_shift``): at 4 steps the timesteps are about 1000, 960, 857 and 12, so steps 0-1
    go to the high-noise expert and 2-3 to the low-noise one."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    if size != "tiny":
        raise ValueError(f"unknown Wan 2.2 pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_t5_tokenizer()
        width, latent_channels = 32, 4
        text_encoder = _tiny_umt5(tokenizer, width)
        transformer = _tiny_wan_transformer(latent_channels, width)
        transformer_2 = _tiny_wan_transformer(latent_channels, width)
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075], latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
            scale_factor_temporal=2, scale_factor_spatial=2,
        )
        scheduler = UniPCMultistepScheduler(
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0,
        )
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                       transformer_2=transformer_2, boundary_ratio=WAN22_BOUNDARY_RATIO, vae=vae, scheduler=scheduler)


def build_wan22_ti2v_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A Wan 2.2 TI2V ``WanPipeline`` (the layout of Wan-AI/Wan2.2-TI2V-5B-Diffusers) with random weights:
    ``expand_timesteps`` (the transformer gets one timestep per token), one two-block transformer on 6 latent
    channels and a tiny Wan 2.2 VAE: ``AutoencoderKLWan`` with ``is_residual`` (residual down/up blocks), a 2×2 pixel
    patchify (``patch_size`` 2, 12 input channels) and one downsampling in space and time, so ``scale_factor_spatial``
    is 4 (16 px frames have 4×4 latents; the released VAE: 16) and 5 frames have 3 latent frames; UniPC with
    TI2V-5B's flow shift 5 (Wan-Video/Wan2.2@42bf4cf ``wan/configs/wan_ti2v_5B.py:33`` ``sample_shift``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    if size != "tiny":
        raise ValueError(f"unknown Wan 2.2 TI2V pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_t5_tokenizer()
        width, latent_channels = 32, 6
        text_encoder = _tiny_umt5(tokenizer, width)
        transformer = _tiny_wan_transformer(latent_channels, width)
        # dim_mult must end with a repeated multiplier: the last residual down block does not downsample, and its
        # shortcut (AvgDown3D) needs in_dim divisible by out_dim (the released VAE: [1, 2, 4, 4]).
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=latent_channels, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True],
            # arbitrary per-channel statistics (the released VAE has 48 channels), so that the decode's
            # un-normalisation matters
            latents_mean=[-0.2, 0.0, -0.1, -0.2, -0.3, 0.1], latents_std=[0.5, 1.0, 0.45, 1.2, 0.5, 0.8],
            is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=2,
            scale_factor_spatial=4,
        )
        scheduler = UniPCMultistepScheduler(
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
        )
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler, expand_timesteps=True)


TINY_HUNYUAN_VIDEO15_FRAMES = 5
"""Frames of the tiny HunyuanVideo 1.5 videos: its tiny VAE compresses time by 4 (as the released one), so 5 frames
are 2 latent frames."""


def _hunyuan_video15_system_message() -> str:
    """HunyuanVideo15Pipeline's system message (the default of its ``_get_mllm_prompt_embeds``, which ``__init__``
    sets as ``system_message`` too), read from diffusers rather than copied."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def tiny_hunyuan_video15_tokenizer() -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` with Qwen's special tokens, Qwen2's pre-tokenizer split and Qwen's chat
    template (the VLM tests' :data:`~mmrl.plugins.vlm.testing.CHAT_TEMPLATE`), trained on HunyuanVideo15Pipeline's
    system turn and the test words, so that the rendered system turn and ``<|im_start|>user\\n`` are 108 tokens as
    in Qwen2.5-VL's tokenizer: the pipeline's fixed ``prompt_template_encode_start_idx`` (108) then crops exactly
    the template, as it does for the released model. Right padding, as the released tokenizer is saved."""
    from mmrl.plugins.vlm.testing import CHAT_TEMPLATE

    prefix = f"<|im_start|>system\n{_hunyuan_video15_system_message()}<|im_end|>\n<|im_start|>user\n"
    corpus = prefix + " ".join(_WORDS) + "<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = _qwen_template_tokenizer(corpus, prefix, 108, "HunyuanVideo 1.5", qwen_split=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer


def build_hunyuan_video15_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``HunyuanVideo15Pipeline`` (the layout of hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v) with
    random weights: a three-layer ``Qwen2_5_VLTextModel`` (the VLM tests' tiny Qwen2.5-VL text config with one more
    layer, so the pipeline's third-to-last hidden state is a layer's output) on
    :func:`tiny_hunyuan_video15_tokenizer`; a one-layer ``T5EncoderModel`` on diffusers' ``ByT5Tokenizer`` (byte-level,
    nothing to download) as the glyph encoder; a two-block ``HunyuanVideo15Transformer3DModel`` (one refiner block,
    patch 1, RoPE axes 2/2/4, the released ``in_channels`` = 2·C + 1 layout); an ``AutoencoderKLHunyuanVideo15`` with
    4 latent channels, 4× spatial and 4× temporal compression (16 px frames have 4×4 latents, 5 frames 2 latent
    frames) and the released ``scaling_factor``; the 480p scheduler (``FlowMatchEulerDiscreteScheduler``, shift 5)
    and guider (``ClassifierFreeGuidance``, scale 6), both as diffusers' conversion script
    (scripts/convert_hunyuan_video1_5_to_diffusers.py, ``SCHEDULER_CONFIGS`` / ``GUIDANCE_CONFIGS``) builds them."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from mmrl.plugins.vlm.testing import tiny_config

    if size != "tiny":
        raise ValueError(f"unknown HunyuanVideo 1.5 pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_hunyuan_video15_tokenizer()
        fields = tiny_config("qwen2_5_vl", tokenizer).text_config.to_dict()
        fields.pop("layer_types", None)  # rebuilt for the new depth
        text_config = Qwen2_5_VLTextConfig(**{**fields, "num_hidden_layers": 3})  # the pipeline reads hidden_states[-3]
        text_encoder = Qwen2_5_VLTextModel(text_config)
        tokenizer_2 = ByT5Tokenizer()
        glyph_width = 16
        text_encoder_2 = _t5_encoder(len(tokenizer_2), glyph_width, layers=1, heads=2, d_ff=32)
        latent_channels = 4
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * latent_channels + 1, out_channels=latent_channels, num_attention_heads=2,
            attention_head_dim=8, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
            text_embed_dim=text_config.hidden_size, text_embed_2_dim=glyph_width, image_embed_dim=8,
            rope_axes_dim=(2, 2, 4), target_size=TINY_RESOLUTION, task_type="t2v",
        )
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=latent_channels, block_out_channels=(8, 16, 16), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=4,
        )
        scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
        guider = ClassifierFreeGuidance(guidance_scale=6.0)
    return HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                  scheduler=scheduler, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                  guider=guider)


def build_hunyuan_video15_i2v_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``HunyuanVideo15ImageToVideoPipeline`` (the layout of hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v) with
    :func:`build_hunyuan_video15_pipeline`'s text encoders, VAE, scheduler and guider, its transformer's weights under
    the i2v config (``task_type="i2v"``, nothing else differs), and a one-layer ``SiglipVisionModel`` (32 px input,
    8 px patches: 16 image tokens of the transformer's ``image_embed_dim`` 8, where the released SigLIP gives 729 of
    1152) with a ``SiglipImageProcessor`` resizing to 32 × 32 as ``feature_extractor``."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Transformer3DModel
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    base = build_hunyuan_video15_pipeline(seed=seed, size=size)
    transformer = HunyuanVideo15Transformer3DModel.from_config({**base.transformer.config, "task_type": "i2v"})
    transformer.load_state_dict(base.transformer.state_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        image_encoder = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=int(transformer.config.image_embed_dim), intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, image_size=32, patch_size=8,
        ))
    feature_extractor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return HunyuanVideo15ImageToVideoPipeline(
        text_encoder=base.text_encoder, tokenizer=base.tokenizer, transformer=transformer, vae=base.vae,
        scheduler=base.scheduler, text_encoder_2=base.text_encoder_2, tokenizer_2=base.tokenizer_2, guider=base.guider,
        image_encoder=image_encoder, feature_extractor=feature_extractor,
    )


def tiny_gemma_tokenizer(corpus: list[str], vocab_size: int = 500) -> Any:
    """A ``GemmaTokenizer`` (BOS added, right padding by the pipelines) whose BPE is trained here on ``corpus``: spaces
    become ``▁`` and merges stay inside words, as in Gemma's SentencePiece vocabulary; Gemma's special tokens."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # training only: word pieces
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
                                  show_progress=False)
    trained.train_from_iterator(corpus * 4, trainer)
    merges = [tuple(pair) for pair in json.loads(trained.to_str())["model"]["merges"]]
    return GemmaTokenizer(vocab=trained.get_vocab(), merges=merges, add_bos_token=True, add_eos_token=False)


def build_sana_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``SanaPipeline`` with random weights in the layout of Efficient-Large-Model/Sana_1600M_1024px_diffusers: a
    two-layer width-16 ``Gemma2Model`` text encoder on :func:`tiny_gemma_tokenizer` trained on the pipeline's complex
    human instruction and the test words (the instruction is about 300 tokens, so the pipeline's token selection keeps
    part of it for short prompts, as with the real tokenizer), a two-block Sana DiT (linear self-attention,
    cross-attention, GLUMBConv), a two-stage DC-AE (``AutoencoderDC``, factor 2: 32 px images have 16×16 latents) and
    Sana 1.0's scheduler, a flow DPM-Solver++ (``DPMSolverMultistepScheduler``, flow_prediction, flow_shift 3)."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from mmrl.plugins.flow.adapters.sana import default_complex_human_instruction

    if size != "tiny":
        raise ValueError(f"unknown Sana pipeline size {size!r}; only 'tiny' is built here")
    instruction = "\n".join(default_complex_human_instruction(SanaPipeline))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_gemma_tokenizer([instruction, " ".join(_WORDS)])
        text_width, latent_channels = 16, 4
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, sliding_window=64,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )).eval()
        transformer = SanaTransformer2DModel(
            in_channels=latent_channels, out_channels=latent_channels, num_attention_heads=2, attention_head_dim=8,
            num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
            caption_channels=text_width, mlp_ratio=2.5, sample_size=32, patch_size=1,
            timestep_scale=0.5,  # not the default 1.0, so that a timestep passed unscaled changes the images
        )
        vae = AutoencoderDC(
            in_channels=3, latent_channels=latent_channels, attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1), downsample_block_type="conv", upsample_block_type="interpolate",
            decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
        )
        scheduler = DPMSolverMultistepScheduler(
            algorithm_type="dpmsolver++", solver_order=2, prediction_type="flow_prediction", use_flow_sigmas=True,
            flow_shift=3.0, final_sigmas_type="zero", lower_order_final=True,
        )
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler)



def build_longcat_image_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``LongCatImagePipeline`` with random weights: a two-layer Qwen2.5-VL text encoder (the tiny one of the VLM
    tests) on :func:`tiny_qwen_image_tokenizer` (byte-level, so LongCat's own template and the character-by-character
    tokens of quoted text tokenize too; the pipeline measures the template's length itself) with a
    ``Qwen2VLProcessor`` (the pipeline's declared ``text_processor``, read only by its prompt rewriting), a 1+1-block
    LongCat transformer, a tiny FLUX-style VAE with 16 latent channels (shift and scale) and FLUX.1's dynamically
    shifted scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatImagePipeline, LongCatImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.plugins.vlm.testing import build_processor, tiny_config

    if size != "tiny":
        raise ValueError(f"unknown LongCat-Image pipeline size {size!r}; only 'tiny' is built here")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_qwen_image_tokenizer()
        processor = build_processor("qwen2_vl", tokenizer, min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
        text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_config("qwen2_5_vl", tokenizer))
        # 16 latent channels: LongCatImagePipeline.__call__ hard-codes num_channels_latents = 16
        text_width, latent_channels = text_encoder.config.text_config.hidden_size, 16
        transformer = LongCatImageTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=text_width, pooled_projection_dim=text_width,
            axes_dims_rope=[2, 2, 4],
        )
        vae = _vae(latent_channels, (8, 16), 4, scaling=0.3611, shift=0.1159)
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
    return LongCatImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                text_processor=processor, transformer=transformer)


def build_longcat_image_edit_pipeline(seed: int = 0, size: str = "tiny") -> Any:
    """A ``LongCatImageEditPipeline`` with the components of :func:`build_longcat_image_pipeline` (the same seed, the
    same weights): LongCat-Image-Edit is LongCat-Image's architecture with the input image read by the text encoder
    (the tiny Qwen2.5-VL's vision tower, through the ``Qwen2VLProcessor``'s image processor: 4 to 16 merged vision
    tokens) and appended as latent tokens."""
    from diffusers import LongCatImageEditPipeline

    base = build_longcat_image_pipeline(seed=seed, size=size)
    return LongCatImageEditPipeline(**{name: component for name, component in base.components.items()
                                       if name in ("scheduler", "vae", "text_encoder", "tokenizer", "text_processor",
                                                   "transformer")})

BUILDERS = {"sd3": build_sd3_pipeline, "flux": build_flux_pipeline, "qwen_image": build_qwen_image_pipeline,
            "qwen_image21": build_qwen_image21_pipeline,
            "flux2": build_flux2_pipeline, "wan": build_wan_pipeline, "wan22": build_wan22_pipeline,
            "wan22_ti2v": build_wan22_ti2v_pipeline, "z_image": build_z_image_pipeline,
            "flux2_klein": build_flux2_klein_pipeline, "flux2_klein_distilled": build_flux2_klein_distilled_pipeline,
            "flux3": build_flux3_pipeline, "chroma": build_chroma_pipeline,
            "flux_kontext": build_flux_kontext_pipeline, "qwen_image_edit": build_qwen_image_edit_pipeline,
            "qwen_image_edit_plus": build_qwen_image_edit_plus_pipeline, "wan_i2v": build_wan_i2v_pipeline,
            "wan22_i2v": build_wan22_i2v_pipeline, "wan22_ti2v_i2v": build_wan22_ti2v_i2v_pipeline,
            "wan_flf2v": build_wan_flf2v_pipeline, "hunyuan_video15": build_hunyuan_video15_pipeline,
            "hunyuan_video15_i2v": build_hunyuan_video15_i2v_pipeline, "sana": build_sana_pipeline,
            "longcat_image": build_longcat_image_pipeline, "longcat_image_edit": build_longcat_image_edit_pipeline}


def save_tiny_pipeline(kind: str, directory: str | Path, seed: int = 0, size: str = "tiny",
                       dtype: torch.dtype | None = None) -> Path:
    """Build the ``kind`` pipeline (a key of :data:`BUILDERS`: ``"sd3"``, ``"flux"``, ``"qwen_image"``,
    ``"qwen_image21"``, ``"flux2"``,
    ``"wan"``, ``"wan22"`` (two experts), ``"wan22_ti2v"`` (per-token timesteps), ``"z_image"``,
    ``"flux2_klein"``, ``"flux2_klein_distilled"``, ``"flux3"``, ``"chroma"``, ``"flux_kontext"``,
    ``"qwen_image_edit"``, ``"qwen_image_edit_plus"``, ``"wan_i2v"``, ``"wan22_i2v"``, ``"wan22_ti2v_i2v"``,
    ``"wan_flf2v"``, ``"hunyuan_video15"``, ``"hunyuan_video15_i2v"``, ``"sana"``, ``"longcat_image"``,
    ``"longcat_image_edit"``) and
    ``save_pretrained`` it to ``directory`` (in ``dtype`` if given, e.g. bfloat16 to halve the 2.2B-parameter
    SD3.5-Medium transformer on disk)."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown pipeline kind {kind!r}; choose one of {', '.join(BUILDERS)}")
    directory = Path(directory)
    pipeline = BUILDERS[kind](seed=seed, size=size)  # on the current default device (see torch.device(...))
    if dtype is not None:
        pipeline.to(dtype=dtype)
    # a modular pipeline (FLUX.3) records where its components are: here, the folder written
    options = {"overwrite_modular_index": True} if kind == "flux3" else {}
    pipeline.to("cpu").save_pretrained(str(directory), **options)
    return directory


def main(argv: list[str] | None = None) -> int:
    """``python -m mmrl.plugins.flow.testing {sd3,flux,qwen_image,flux2,...,z_image} FOLDER``:
    write a tiny pipeline for CPU smoke runs."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random flow pipeline folder (SD3, FLUX, ..., Z-Image).")
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(save_tiny_pipeline(args.kind, args.folder, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
