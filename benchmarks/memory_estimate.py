"""Per-GPU memory of the shipped recipes at full size, estimated from parameter counts and activation sizes, and the
estimator checked against measurements on tiny models on the CPU (issue 26 item 4).

Parameter counts are exact: each model is built on PyTorch's ``meta`` device (no memory, no download) from its
published architecture with the library class mmrl loads (diffusers' ``SD3Transformer2DModel``,
``FluxTransformer2DModel``, ``WanTransformer3DModel``, ``QwenImageTransformer2DModel``, ``ZImageTransformer2DModel``,
``HunyuanVideo15Transformer3DModel``, ``ChromaTransformer2DModel``, ``LongCatImageTransformer2DModel`` and
``SanaTransformer2DModel``, transformers'
``Qwen2_5_VLForConditionalGeneration``, ``Gemma2Model``,
``Glm4vForConditionalGeneration``, ``Qwen2_5_VLTextModel`` and ``Qwen3Model``, and ``LlamaForCausalLM`` for
LLaDA-8B, whose architecture it shares: RMSNorm, SwiGLU, RoPE, full multi-head attention, no biases); LoRA counts
``r·(in + out)`` for every ``nn.Linear`` the plugin's adapter targets. Memory per GPU, in GiB:

- weights: the trained module (the frozen base in the recipe's weight dtype with LoRA; float32 master weights with
  full fine-tuning) and the frozen modules that stay on the device (text encoders and VAE for flow, the vision tower
  for vlm: counted in its module; the reward model is not counted);
- trainable state: float32 trainable weights (LoRA), their gradients and AdamW's two moments (4 + 4 + 8 bytes per
  trainable parameter), the EMA copy when the recipe keeps one;
- reference: a frozen float32 copy of the trained module when full fine-tuning has ``kl_coef > 0`` (LoRA disables
  the adapter instead: no copy);
- activations of one micro-batch's training forward, kept for its backward: tokens × blocks × bytes per token per
  block (:data:`ACTIVATION_BYTES`, counted with ``torch.autograd.graph.saved_tensors_hooks`` on tiny models of the
  same classes, see ``--check``), plus, for language models, the completion logits and their float32 log-softmax;
  with gradient checkpointing each block keeps only its input (h values per token) and one block is recomputed at a
  time;
- rollout: the KV cache of generation (vlm); it and the training transients are not alive at the same time;
- FSDP (FULL_SHARD over ``--gpus``): the trained module's weights, gradients, optimizer state, EMA and reference
  are divided by the number of GPUs; activations, frozen extras and the rollout are per GPU.

Not counted: the CUDA context and allocator fragmentation (budget 1–3 GiB), the reward model, the VAE decode and
text-encoder peaks, temporary copies inside kernels. The numbers are a floor to plan with, not a guarantee.

``--check`` builds tiny models of the same classes (sizes other than those the activation coefficients were counted on,
except Wan, Qwen-Image, Z-Image, HunyuanVideo 1.5, Chroma and Sana, checked at the tiny test pipelines' configs of
plugins/flow/testing.py, one of the sizes their terms were fitted on; LongCat-Image's blocks, which the LongCat rows
count with FLUX.1's coefficients, over LongCat-Image-Edit's joint sequence of generated, input-image and text tokens),
runs a forward and one AdamW step in float32 on
the CPU and compares the measured bytes (saved activations; weights, gradients and optimizer state) with the
estimator's; the Wan, Qwen-Image, Z-Image and HunyuanVideo 1.5 LoRA blocks are also measured at bfloat16 under
autocast, as the recipes train (reported, not fitted: float32 norms and peft's input
casts keep more than 2 bytes per counted value). ``--json`` writes ``settings`` (``gpus``, ``torch``), ``recipes`` (per
recipe and variant: ``parameters``, ``trainable``, ``gib`` per component, ``peak_gib``) and, with ``--check``, ``check``
(per tiny model: ``estimated_bytes``, ``measured_bytes``, ``ratio``).

Examples::

    python benchmarks/memory_estimate.py                   # the table for 1 GPU and for FSDP over 8
    python benchmarks/memory_estimate.py --gpus 1 4 --check --json memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

GIB = 1024**3
FLOW_SD3_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out")  # plugins/flow/adapters/sd3.py
FLOW_WAN_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                    "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")  # plugins/flow/adapters/wan.py
FLOW_QWEN_IMAGE_TARGETS = FLOW_SD3_TARGETS + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                              "txt_mlp.net.2")  # plugins/flow/adapters/qwen_image.py
FLOW_FLUX_TARGETS = FLOW_SD3_TARGETS + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                        "ff_context.net.2")  # plugins/flow/adapters/flux.py
# plugins/flow/adapters/hunyuan_video15.py: both streams' attention projections and MLPs (the FLUX double-block names)
FLOW_HUNYUAN_VIDEO15_TARGETS = FLOW_FLUX_TARGETS
# plugins/flow/adapters/chroma.py: FLUX.1's (Chroma's blocks keep FLUX's module names; the approximator is not matched)
FLOW_CHROMA_TARGETS = FLOW_FLUX_TARGETS
# plugins/flow/adapters/longcat_image.py: FLUX.1's (LongCat's blocks keep FLUX's module names)
FLOW_LONGCAT_IMAGE_TARGETS = FLOW_FLUX_TARGETS
FLOW_SANA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                     "attn2.to_v", "attn2.to_out.0")  # plugins/flow/adapters/sana.py
FLOW_Z_IMAGE_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")  # plugins/flow/adapters/z_image.py
LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # vlm and LLaDA adapters
GLM4V_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")  # the glm4v adapter's

# Bytes per token per transformer block saved for the backward, in units of the activation dtype's size D (so bytes =
# D · value), as counted on tiny models in float32 (--check re-measures them at other sizes). ``h`` hidden size,
# ``kv`` key/value width, ``f`` MLP width, ``r`` LoRA rank, ``heads`` attention heads. Decoder (Qwen2/Llama, sdpa
# attention, SwiGLU): the two RMSNorms' inputs and normalised outputs, the q/k/v input, q, k, v and the attention
# output, the o_proj input, the MLP input and four f-wide tensors (gate, silu, up, product); with LoRA the normalised
# outputs are not kept (the norm weights are frozen) and each of the 7 adapted linears keeps its r-wide intermediate.
# MMDiT and FLUX blocks (MLP 4h, adaLN modulation, qk RMSNorm): per token of either stream; SD3.5's dual-attention
# blocks keep more per image token. Wan (WanTransformerBlock: self-attention over the video tokens, cross-attention to
# the text, GELU MLP of width f, qk RMSNorm across heads): per video token, ``wan_context`` per text token (the
# cross-attention's keys and values) and ``wan_sequence`` per sequence (the block's timestep modulation). Qwen-Image
# (QwenImageTransformerBlock: MMDiT, both streams with 4h-wide GELU MLPs, qk RMSNorm per head, adaLN per stream): per
# token of either stream, and ``qwen_image_sequence`` per sequence. The Wan and Qwen-Image terms were fitted on tiny
# float32 models at h = 16…96 (2…6 heads, MLP 32…256, 16…80 image tokens, 10…20 text tokens, LoRA rank 4), where
# they reproduce the measured bytes exactly, as they do at a size left out of the fit (Wan h 60 with 3 heads and MLP
# 100, Qwen-Image h 80 with 5 heads); the ``heads`` and constant terms (per-head norm statistics, the attention's
# log-sum-exp) matter only at such tiny sizes. Z-Image (ZImageTransformerBlock: single stream over the image and
# caption tokens, each padded to a multiple of 32, SwiGLU MLP of width f = 8h/3, qk RMSNorm, four adaLN modulations):
# per token and ``z_image_sequence`` per sequence (the modulation); ``z_image_caption`` per caption token of a
# context-refiner block (no modulation). Fitted at h = 32…64 (2 and 4 heads, 32…64 image and caption tokens, LoRA
# ranks 4…16, each adapted linear keeping its r-wide intermediate), where they reproduce the measured bytes exactly.
# HunyuanVideo 1.5 (HunyuanVideo15TransformerBlock: MMDiT over the video and the concatenated Qwen2.5-VL, ByT5 and
# image-slot tokens, LayerNorm adaLN per stream, tanh-GELU MLP of width f, qk RMSNorm per head): per token of either
# stream, ``hunyuan_video15_sequence`` per sequence, and ``hunyuan_video15_mask`` per token² and sequence: its attention
# processor expands the padding mask to a dense [B, 1, L, L] mask that SDPA converts to the query's dtype and keeps for
# the backward (one value per token pair). Fitted at h = 16…64 (2…6 heads, MLP 32…256, 45…146 tokens, LoRA ranks
# 4…16): the LoRA terms reproduce the measured bytes exactly, the full ones within 0.2 values per block.
# Chroma (ChromaTransformerBlock / ChromaSingleTransformerBlock: FLUX.1's blocks with the modulation handed in by the
# approximator): per token of the joint sequence, ``chroma_*_sequence`` per sequence, and ``chroma_*_mask`` per token²
# and sequence: each block multiplies the [B, L] text-and-image mask into a dense [B, 1, L, L] pair mask (diffusers
# 0.42.1 transformer_chroma.py:245, 313) that SDPA keeps for the backward. Fitted at h = 16…96 (2…6 heads, 24…69
# tokens, LoRA ranks 4 and 8): exact, except that under full fine-tuning the approximator (trained then) keeps
# activations for the modulation rows each block adds (12 per double-stream, 3 per single-stream block): a constant
# per block at the tiny size (1,260 and 315 values), about 0.1 GiB for the whole approximator at Chroma1-HD's size,
# not counted. Sana (SanaTransformerBlock: ReLU linear self-attention whose q, k, v and scores are cast to float32,
# SDPA cross-attention to the padded text, the GLUMBConv feed-forward: a 1x1 convolution to 2f channels, a
# depthwise 3x3, a SiLU gate and a 1x1 back): per image token, ``sana_context`` per text token (the cross-attention's
# keys and values and its per-head mask) and ``sana_sequence`` per sequence (the linear attention's per-head
# (d + 1) x d scores, d = h / heads, and the block's modulation); ``sana15`` is Sana 1.5's block (qk RMSNorm across
# heads in both attentions, ``qk_norm: rms_norm_across_heads``). Fitted at h = 8…64 (1…7 heads of 8…32, MLP ratio
# 1.5…4, 9…81 image and 3…21 text tokens, LoRA ranks 4 and 8): exact on all 36 (Sana 1.0) and 12 (Sana 1.5) tiny
# models measured. LongCat-Image (LongCatImageTransformerBlock / LongCatImageSingleTransformerBlock: FLUX.1's blocks
# without the guidance and pooled embeddings) takes the ``flux_*`` coefficients, not refitted: --check measures its
# blocks at FLUX's check sizes over LongCat-Image-Edit's joint sequence (36 generated, 36 input-image and 10 text
# tokens), 0.998…1.008 of the estimate.
ACTIVATION_BYTES = {
    ("decoder", "full"): lambda h, kv, f, r, heads: 8 * h + 2 * kv + 4 * f,
    ("decoder", "lora"): lambda h, kv, f, r, heads: 6 * h + 2 * kv + 4 * f + 7 * r,
    ("mmdit", "full"): lambda h, kv, f, r, heads: 25.25 * h,
    ("mmdit", "lora"): lambda h, kv, f, r, heads: 14.5 * h,
    ("mmdit_dual_image", "full"): lambda h, kv, f, r, heads: 35.44 * h,
    ("mmdit_dual_image", "lora"): lambda h, kv, f, r, heads: 20.69 * h,
    ("flux_double", "full"): lambda h, kv, f, r, heads: 25.25 * h,
    ("flux_double", "lora"): lambda h, kv, f, r, heads: 19.63 * h,
    ("flux_single", "full"): lambda h, kv, f, r, heads: 21.22 * h,
    ("flux_single", "lora"): lambda h, kv, f, r, heads: 12.41 * h,
    ("wan", "full"): lambda h, kv, f, r, heads: 22 * h + 2 * f + 2 * heads + 9,
    ("wan", "lora"): lambda h, kv, f, r, heads: 15 * h + 2 * f + 8 * r + 2 * heads + 9,
    ("wan_context", "full"): lambda h, kv, f, r, heads: 4 * h + 1,
    ("wan_context", "lora"): lambda h, kv, f, r, heads: 3 * h + 2 * r + 1,
    ("wan_sequence", "full"): lambda h, kv, f, r, heads: 8 * h,
    ("wan_sequence", "lora"): lambda h, kv, f, r, heads: 8 * h,
    ("qwen_image", "full"): lambda h, kv, f, r, heads: 25 * h + 3 * heads + 5,
    ("qwen_image", "lora"): lambda h, kv, f, r, heads: 19 * h + 6 * r + 3 * heads + 5,
    ("qwen_image_sequence", "full"): lambda h, kv, f, r, heads: 18 * h,
    ("qwen_image_sequence", "lora"): lambda h, kv, f, r, heads: 16 * h,
    ("z_image", "full"): lambda h, kv, f, r, heads: 22 * h + 4 * f + 3 * heads + 4,
    ("z_image", "lora"): lambda h, kv, f, r, heads: 12 * h + 4 * f + 7 * r + 3 * heads + 4,
    ("z_image_sequence", "full"): lambda h, kv, f, r, heads: 4 * h,
    ("z_image_sequence", "lora"): lambda h, kv, f, r, heads: 4 * h,
    ("z_image_caption", "full"): lambda h, kv, f, r, heads: 18 * h + 4 * f + 3 * heads + 4,
    ("z_image_caption", "lora"): lambda h, kv, f, r, heads: 12 * h + 4 * f + 7 * r + 3 * heads + 4,
    ("hunyuan_video15", "full"): lambda h, kv, f, r, heads: 17 * h + 2 * f + 3 * heads + 4,
    ("hunyuan_video15", "lora"): lambda h, kv, f, r, heads: 11 * h + 2 * f + 6 * r + 3 * heads + 4,
    ("hunyuan_video15_sequence", "full"): lambda h, kv, f, r, heads: 18 * h,
    ("hunyuan_video15_sequence", "lora"): lambda h, kv, f, r, heads: 16 * h,
    ("hunyuan_video15_mask", "full"): lambda h, kv, f, r, heads: 1,
    ("hunyuan_video15_mask", "lora"): lambda h, kv, f, r, heads: 1,
    ("chroma_double", "full"): lambda h, kv, f, r, heads: 25 * h + 3 * heads + 4,
    ("chroma_double", "lora"): lambda h, kv, f, r, heads: 19 * h + 6 * r + 3 * heads + 4,
    ("chroma_double_sequence", "full"): lambda h, kv, f, r, heads: 28 * h,
    ("chroma_double_sequence", "lora"): lambda h, kv, f, r, heads: 28 * h,
    ("chroma_double_mask", "full"): lambda h, kv, f, r, heads: 1,
    ("chroma_double_mask", "lora"): lambda h, kv, f, r, heads: 1,
    ("chroma_single", "full"): lambda h, kv, f, r, heads: 21 * h + 3 * heads + 2,
    ("chroma_single", "lora"): lambda h, kv, f, r, heads: 12 * h + 3 * r + 3 * heads + 2,
    ("chroma_single_sequence", "full"): lambda h, kv, f, r, heads: 4 * h,
    ("chroma_single_sequence", "lora"): lambda h, kv, f, r, heads: 4 * h,
    ("chroma_single_mask", "full"): lambda h, kv, f, r, heads: 1,
    ("chroma_single_mask", "lora"): lambda h, kv, f, r, heads: 1,
    ("sana", "full"): lambda h, kv, f, r, heads: 18 * h + 8 * f + 4 * heads + 4,
    ("sana", "lora"): lambda h, kv, f, r, heads: 14 * h + 8 * f + 6 * r + 4 * heads + 4,
    ("sana_context", "full"): lambda h, kv, f, r, heads: 2 * h + heads,
    ("sana_context", "lora"): lambda h, kv, f, r, heads: 2 * h + 2 * r + heads,
    ("sana_sequence", "full"): lambda h, kv, f, r, heads: h * (h // heads) + 9 * h,
    ("sana_sequence", "lora"): lambda h, kv, f, r, heads: h * (h // heads) + 9 * h,
    ("sana15", "full"): lambda h, kv, f, r, heads: 24 * h + 8 * f + 4 * heads + 7,
    ("sana15", "lora"): lambda h, kv, f, r, heads: 17 * h + 8 * f + 6 * r + 4 * heads + 7,
    ("sana15_context", "full"): lambda h, kv, f, r, heads: 4 * h + heads + 1,
    ("sana15_context", "lora"): lambda h, kv, f, r, heads: 3 * h + 2 * r + heads + 1,
    ("sana15_sequence", "full"): lambda h, kv, f, r, heads: h * (h // heads) + 9 * h,
    ("sana15_sequence", "lora"): lambda h, kv, f, r, heads: h * (h // heads) + 9 * h,
}


# ---------------------------------------------------------------------------------------------------- models
def build_sd35_medium() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(  # stabilityai/stable-diffusion-3.5-medium, transformer/config.json
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")


def build_flux_dev() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(guidance_embeds=True)  # the class defaults are FLUX.1-dev's (19 + 38 blocks, 3072)


def build_qwen25vl(size: str) -> nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {"3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
            "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)}[size]
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=text["hidden_size"])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])
    return Qwen2_5_VLForConditionalGeneration(config)


def build_glm41v_9b() -> nn.Module:
    """GLM-4.1V-9B-Thinking: transformers' ``Glm4vConfig`` defaults are that checkpoint's architecture (its docstring's
    ``checkpoint="zai-org/GLM-4.1V-9B-Thinking"``: text hidden 4096, 40 layers, 32 heads, 2 KV heads, MLP 13696, vocab
    151,552; vision 24 blocks of 1536)."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration(Glm4vConfig())


def build_llada_8b() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=32, vocab_size=126464,
                                        tie_word_embeddings=False))


def build_text_encoders(kind: str) -> list[nn.Module]:
    """The pipeline's text encoders (CLIP-L, OpenCLIP bigG and T5-XXL for SD3.5; CLIP-L and T5-XXL for FLUX)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_l = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                        num_attention_heads=12, projection_dim=768))
    t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, vocab_size=32128,
                                 feed_forward_proj="gated-gelu"))
    if kind == "flux":
        return [clip_l, t5]
    clip_g = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                        num_attention_heads=20, projection_dim=1280))
    return [clip_l, clip_g, t5]


def build_vae() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         layers_per_block=2)


def build_wan(size: str) -> nn.Module:
    """Wan2.1-T2V-1.3B or -14B: the transformer configs of diffusers' scripts/convert_wan_to_diffusers.py
    (``Wan-T2V-1.3B``/``Wan-T2V-14B``, as the Wan-AI/Wan2.1-T2V-*-Diffusers transformer/config.json), the same as
    Wan-Video/Wan2.1's wan/configs/wan_t2v_1_3B.py and wan_t2v_14B.py (dim 1536/5120, ffn 8960/13824, 12/40 heads,
    30/40 layers); the 14B one is also ``WanTransformer3DModel``'s defaults."""
    from diffusers import WanTransformer3DModel

    shape = {"1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
             "14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)}[size]
    return WanTransformer3DModel(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16,
                                 text_dim=4096, freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 eps=1e-6, **shape)


def build_wan_extras() -> list[nn.Module]:
    """WanPipeline's UMT5-XXL encoder (google/umt5-xxl's encoder, the Wan2.1 Diffusers text_encoder/config.json:
    d_model 4096, d_ff 10240, 24 layers, 64 heads, vocabulary 256384, per diffusers'
    scripts/convert_wan_to_diffusers.py) and the Wan 2.1 VAE (``AutoencoderKLWan``'s defaults: base_dim 96, z_dim 16,
    dim_mult [1, 2, 4, 4], the converted Wan2.1_VAE.pth)."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    umt5 = UMT5EncoderModel(UMT5Config(d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
                                       vocab_size=256384, relative_attention_num_buckets=32,
                                       feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    return [umt5, AutoencoderKLWan()]


def build_qwen_image() -> nn.Module:
    """Qwen-Image's 20B MMDiT: ``QwenImageTransformer2DModel``'s defaults are Qwen/Qwen-Image's transformer config
    (60 blocks of 24 heads × 128, joint_attention_dim 3584 from Qwen2.5-VL-7B, in_channels 64 = 16 latent channels in
    2×2 patches, axes_dims_rope (16, 56, 56))."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                       guidance_embeds=False, axes_dims_rope=(16, 56, 56))


def build_qwen_image_extras() -> list[nn.Module]:
    """QwenImagePipeline's text encoder, the whole Qwen2.5-VL-7B-Instruct (``Qwen2_5_VLForConditionalGeneration``:
    the vision tower and the LM head are loaded too), and its 3-D VAE (``AutoencoderKLQwenImage``'s defaults, the
    Wan 2.1 VAE's layout)."""
    from diffusers import AutoencoderKLQwenImage

    return [build_qwen25vl("7b"), AutoencoderKLQwenImage()]


def build_z_image() -> nn.Module:
    """Z-Image's 6B single-stream DiT: ``ZImageTransformer2DModel``'s defaults are Tongyi-MAI/Z-Image(-Turbo)'s
    transformer config (dim 3840, 30 layers and 2 + 2 refiner layers of 30 heads, SwiGLU 10240, caption features 2560
    from Qwen3-4B, 16 latent channels in 2 × 2 patches)."""
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel()


def build_z_image_extras() -> list[nn.Module]:
    """ZImagePipeline's text encoder, Qwen3-4B without its LM head (``Qwen3Model``: hidden 2560, 36 layers, 32 query
    and 8 key/value heads of 128, SwiGLU 9728, vocabulary 151936, tied embeddings), and FLUX.1's 16-channel VAE
    (the SD3 layout of :func:`build_vae`)."""
    from transformers import Qwen3Config, Qwen3Model

    qwen3 = Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   tie_word_embeddings=True))
    return [qwen3, build_vae()]


def build_hunyuan_video15() -> nn.Module:
    """HunyuanVideo 1.5's dual-stream DiT: ``HunyuanVideo15Transformer3DModel``'s defaults are the released 480p
    checkpoints' layout (54 blocks of 16 heads × 128, MLP ratio 4, patch 1, in_channels 65 = 2 × 32 latent channels
    + the condition mask, text_embed_dim 3584 from Qwen2.5-VL-7B, text_embed_2_dim 1472 from the ByT5 glyph encoder,
    image_embed_dim 1152 for SigLIP's 729 tokens): 8.33B parameters, the published 8.3B (docs/flow.md, section 15)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel()


def build_hunyuan_video15_extras() -> list[nn.Module]:
    """HunyuanVideo15Pipeline's Qwen2.5-VL-7B text model (``Qwen2_5_VLTextModel``: the 7B text config of
    :func:`build_qwen25vl`, no vision tower, no LM head) and its VAE (``AutoencoderKLHunyuanVideo15``'s defaults:
    32 latent channels, 16× spatial and 4× temporal compression and the scaling factor 1.03682 of the released
    checkpoints, as plugins/flow/testing.py notes). Not counted: the ByT5 glyph encoder and, for image-to-video, the
    SigLIP vision tower, whose full configurations are not established here (only their output widths, 1472 and
    1152, are the transformer's)."""
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    text = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                                    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064))
    return [text, AutoencoderKLHunyuanVideo15()]


def build_chroma() -> nn.Module:
    """Chroma1-HD's transformer: ``ChromaTransformer2DModel``'s defaults, which are the Chroma authors' training
    config (lodestone-rock/flow@bb5274c ``src/models/chroma/model.py:38-56`` ``chroma_params``: in_channels 64 = 16
    latent channels in 2 × 2 patches, T5 context 4096, hidden 3072 = 24 heads × 128, MLP ratio 4, 19 double- and 38
    single-stream blocks, RoPE axes (16, 56, 56), an approximator of 5 layers of 5120 from 64 channels): 8.90B
    parameters, the published 8.9B. (The hub's lodestones/Chroma1-HD transformer/config.json could not be read
    offline; those values are what the parameter count rests on.)"""
    from diffusers import ChromaTransformer2DModel

    return ChromaTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                    axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
                                    approximator_hidden_dim=5120, approximator_layers=5)


def build_chroma_extras() -> list[nn.Module]:
    """ChromaPipeline's T5-XXL encoder (the T5 of :func:`build_text_encoders`; no CLIP) and FLUX.1's VAE
    (:func:`build_vae`)."""
    return [build_text_encoders("flux")[1], build_vae()]


def build_longcat_image() -> nn.Module:
    """LongCat-Image's transformer: ``LongCatImageTransformer2DModel`` with 10 double- and 20 single-stream blocks of
    width 3072 (24 heads × 128), Qwen2.5-VL-7B context 3584, 64 input channels (16 latent channels in 2 × 2 patches),
    RoPE axes (16, 56, 56) (the class defaults but the block counts: 10 + 20 as mflux's LongCat port documents,
    filipstrand/mflux ``src/mflux/models/longcat/model/longcat_transformer/longcat_transformer.py``; the hub's
    meituan-longcat/LongCat-Image transformer/config.json could not be read offline): 6.3B parameters, the published
    6B."""
    from diffusers import LongCatImageTransformer2DModel

    return LongCatImageTransformer2DModel(patch_size=1, in_channels=64, num_layers=10, num_single_layers=20,
                                          attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                          pooled_projection_dim=3584, axes_dims_rope=[16, 56, 56])


def build_longcat_image_extras() -> list[nn.Module]:
    """LongCatImagePipeline's text encoder, the whole Qwen2.5-VL-7B (:func:`build_qwen25vl`, vision tower included,
    as the pipeline loads it), and the FLUX.1-style 16-channel VAE (:func:`build_vae`)."""
    return [build_qwen25vl("7b"), build_vae()]


def qwen2_vl_grid(height: int, width: int, min_pixels: int = 56 * 56,
                  max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The (rows, columns) of merged vision tokens Qwen2-VL's image processor makes of a ``height`` × ``width`` image
    (one per 28 × 28 px: 14 px patches merged 2 × 2). Its ``smart_resize`` (transformers
    ``models/qwen2_vl/image_processing_qwen2_vl.py``; the default pixel bounds, which Qwen2.5-VL's processor keeps)
    rounds each side to the nearest multiple of 28, then, if the area falls outside [min_pixels, max_pixels], scales
    both sides by the square root of the area ratio, rounding down (too large) or up (too small) to multiples of 28.
    Written out here: transformers' image processing imports torchvision, seconds of start-up for one formula."""
    factor = 28
    rows, columns = round(height / factor), round(width / factor)
    if rows * columns * factor**2 > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        rows, columns = (max(1, math.floor(side / scale / factor)) for side in (height, width))
    elif rows * columns * factor**2 < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        rows, columns = (math.ceil(side * scale / factor) for side in (height, width))
    return rows, columns


def longcat_edit_text_tokens(height: int, width: int, min_pixels: int = 56 * 56,
                             max_pixels: int = 28 * 28 * 1280) -> int:
    """The length of ``LongCatImageEditPipeline``'s text row for an input image brought to ``height`` × ``width``: the
    pipeline keeps the text encoder's states from ``<|vision_start|>`` on (pipeline_longcat_image_edit.py:310-341):
    that marker, the input's merged vision tokens, ``<|vision_end|>`` and the 512 padded instruction tokens. The text
    encoder reads the input at half its sides (622-623), through the processor's pixel bounds
    (:func:`qwen2_vl_grid`)."""
    rows, columns = qwen2_vl_grid(height // 2, width // 2, min_pixels, max_pixels)
    return 1 + rows * columns + 1 + 512


def build_sana(size: str) -> nn.Module:
    """Sana's linear-attention DiT: diffusers' scripts/convert_sana_to_diffusers.py (huggingface/diffusers@065628f,
    ``model_kwargs`` and ``transformer_kwargs``): 70 heads × 32 = 2240 wide, cross-attention 20 heads × 112, caption
    channels 2304 (Gemma-2-2B's hidden size), MLP ratio 2.5, in/out channels 32 (DC-AE f32c32), patch 1, no attention
    bias, norms without affine weights; 20 blocks for Sana 1.0 1.6B (``SanaMS_1600M_P1_D20``, 1.60B parameters) and
    60 for Sana 1.5 4.8B (``SanaMS1.5__4800M_P1_D60``, with ``qk_norm="rms_norm_across_heads"`` as the script sets for
    Sana 1.5: 4.72B parameters, published as 4.8B)."""
    from diffusers import SanaTransformer2DModel

    layers, qk_norm = {"1.6b": (20, None), "4.8b": (60, "rms_norm_across_heads")}[size]
    return SanaTransformer2DModel(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32,
                                  num_layers=layers, num_cross_attention_heads=20, cross_attention_head_dim=112,
                                  cross_attention_dim=2240, caption_channels=2304, mlp_ratio=2.5, attention_bias=False,
                                  sample_size=32, patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6,
                                  qk_norm=qk_norm)


def build_sana_extras() -> list[nn.Module]:
    """SanaPipeline's text encoder, Gemma-2-2B's decoder without its LM head (``Gemma2Model``, as the conversion script
    keeps ``get_decoder()`` of Efficient-Large-Model/gemma-2-2b-it: hidden 2304, 26 layers, 8 query and 4 key/value
    heads of 256, MLP 9216, vocabulary 256000, the google/gemma-2-2b config and transformers' ``Gemma2Config``
    defaults; 2.61B parameters, the published 2.6B), and the DC-AE f32c32 autoencoder (``AutoencoderDC`` with
    diffusers' scripts/convert_dcae_to_diffusers.py ``get_ae_config("dc-ae-f32c32-sana-1.0")``,
    huggingface/diffusers@074817c: 32 latent channels, stages of 128, 256, 512, 512, 1024, 1024 channels, three
    ResBlock then three EfficientViT stages with multiscale 5, 2/2/2/3/3/3 encoder and 3 decoder layers per stage,
    convolution down- and interpolation upsampling; 0.31B parameters). Sana 1.5 ships the sana-1.1 DC-AE, assumed here
    to have the same architecture (its config could not be read offline)."""
    from diffusers import AutoencoderDC
    from transformers import Gemma2Config, Gemma2Model

    gemma = Gemma2Model(Gemma2Config(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=256))
    blocks = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    multiscales = ((),) * 3 + ((5,),) * 3
    dc_ae = AutoencoderDC(in_channels=3, latent_channels=32, attention_head_dim=32, encoder_block_types=blocks,
                          decoder_block_types=blocks, encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                          decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                          encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
                          encoder_qkv_multiscales=multiscales, decoder_qkv_multiscales=multiscales,
                          downsample_block_type="conv", upsample_block_type="interpolate",
                          decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
    return [gemma, dc_ae]


def lora_parameters(module: nn.Module, targets: tuple[str, ...], rank: int, exclude: str | None = None) -> int:
    """``rank · (in + out)`` over the ``nn.Linear`` modules whose name ends with one of ``targets`` (PEFT's rule)."""
    total = 0
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            if exclude is None or exclude not in name:
                total += rank * (child.in_features + child.out_features)
    return total


# ---------------------------------------------------------------------------------------------------- recipes
@dataclass
class Blocks:
    """A stack of ``count`` blocks of kind ``kind`` (see :data:`ACTIVATION_BYTES`) seeing ``tokens`` tokens per
    sequence (``dual_image_tokens`` of them through SD3.5's dual-attention image path), and ``context_tokens`` text
    tokens that only enter a cross-attention (Wan: kind ``f"{kind}_context"``). A kind with a ``f"{kind}_sequence"``
    entry also keeps that many values per block and sequence (timestep modulation)."""

    kind: str
    count: int
    tokens: int
    dual_image_tokens: int = 0
    context_tokens: int = 0


@dataclass
class Recipe:
    """One configuration to estimate: a model, a training mode and the recipe's batch geometry.

    ``sequences`` is the number of sequences in one training forward (micro-batch × 2 with CFG), ``completion`` the
    scored positions per sequence of a language model (logits), ``kv_cache`` (samples, positions) of generation.
    """

    name: str
    config: str
    build: Any
    hidden: int
    kv_width: int
    mlp: int
    blocks: list[Blocks]
    sequences: int
    lora_targets: tuple[str, ...]
    lora_rank: int | None
    weight_bytes: int  # bytes per frozen base weight under LoRA (the recipe's dtype)
    activation_bytes: int = 2
    heads: int = 0  # attention heads: read by the Wan, Qwen-Image, Z-Image, HunyuanVideo, Chroma and Sana terms
    checkpointing: bool = False
    kl: bool = False
    ema: bool = False
    frozen_in_module: str | None = None  # submodule name kept frozen under full fine-tuning too (vision tower)
    extras: Any = None  # callable → frozen modules resident on the device (text encoders, VAE)
    extras_bytes: int = 2
    vocab: int = 0
    completion: int = 0
    kv_cache: tuple[int, int] = (0, 0)
    layers_for_cache: int = 0
    notes: list[str] = field(default_factory=list)


def recipes() -> list[Recipe]:
    sd3_tokens = (512 // 16) ** 2 + 77 + 256  # 1024 image patches (512 px, VAE /8, patch 2) + CLIP 77 + T5 256
    flux_tokens = (720 // 16) ** 2 + 512  # 2025 packed latents (720 px) + T5 512
    vlm_seq = 401408 // (28 * 28) + 80 + 512  # ≤ 512 image tokens (max_pixels), ~80 prompt tokens, 512 new tokens
    llada_seq = 200 + 256  # max_prompt_length + gen_length
    glm_seq = 401408 // (28 * 28) + 80 + 1024  # ≤ 512 image tokens, ~80 prompt tokens, 1024 new tokens (thinking)
    # SD3.5-M: the first 13 of 24 blocks add a second attention over the 1024 image tokens (MMDiT-X)
    sd35_blocks = [Blocks("mmdit", 13, sd3_tokens, dual_image_tokens=1024), Blocks("mmdit", 11, sd3_tokens)]
    # Wan 2.1 at 480 x 832: the VAE compresses 8x in space and 4x in time, the transformer patches 1 x 2 x 2, so F
    # frames are ((F - 1) / 4 + 1) x 30 x 52 tokens (33 frames: 14,040; 81 frames: 32,760); text padded to 226 tokens
    wan_tokens = {frames: ((frames - 1) // 4 + 1) * (480 // 16) * (832 // 16) for frames in (33, 81)}
    wan_text = 226  # configs/flow/wan_t2v.yaml max_sequence_length

    def wan(size: str, frames: int, lora: bool) -> Recipe:
        hidden, mlp, heads, layers = {"1.3b": (1536, 8960, 12, 30), "14b": (5120, 13824, 40, 40)}[size]
        name = f"Wan2.1-{size.upper()} {'LoRA r128' if lora else 'full'} {frames}f"
        changes = [*(["14B model"] if size == "14b" else []), *([f"num_frames {frames}"] if frames != 33 else [])]
        config = "configs/flow/wan_t2v.yaml" + (f" ({', '.join(changes)})" if changes else "")
        return Recipe(name, config, lambda: build_wan(size), hidden, hidden, mlp,
                      [Blocks("wan", layers, wan_tokens[frames], context_tokens=wan_text)], sequences=1 * 2,
                      lora_targets=FLOW_WAN_TARGETS if lora else (), lora_rank=128 if lora else None, weight_bytes=2,
                      heads=heads, checkpointing=True, extras=build_wan_extras,
                      notes=["micro-batch 1 x 2 (CFG), one denoising step per backward (action_chunk_size 1)"])

    def wan22_a14b() -> Recipe:
        # Wan2.2-T2V-A14B: two experts of Wan2.1-14B's shape (Wan-Video/Wan2.2@42bf4cf wan/configs/wan_t2v_A14B.py:
        # dim 5120, ffn 13824, 40 heads, 40 layers), both resident with a LoRA each; one denoising step per backward
        # runs one expert, so the activations are one expert's; the Wan 2.1 VAE and UMT5-XXL as for Wan 2.1.
        tokens = wan_tokens[33]
        return Recipe("Wan2.2-A14B LoRA r64 (2 experts) 33f", "configs/flow/wan22_t2v.yaml",
                      lambda: nn.ModuleList([build_wan("14b"), build_wan("14b")]), 5120, 5120, 13824,
                      [Blocks("wan", 40, tokens, context_tokens=512)], sequences=1 * 2,
                      lora_targets=FLOW_WAN_TARGETS, lora_rank=64, weight_bytes=2, heads=40, checkpointing=True,
                      ema=True, extras=build_wan_extras,
                      notes=["both experts resident, one expert's activations per backward (action_chunk_size 1)"])

    def qwen_image(resolution: int) -> Recipe:
        tokens = (resolution // 16) ** 2 + 128  # packed latents (VAE /8, 2x2 patches) + 128 text tokens
        config = "configs/flow/qwen_image_pickscore.yaml" + ("" if resolution == 512 else f" (resolution {resolution})")
        return Recipe(f"Qwen-Image LoRA r64 {resolution}px", config, build_qwen_image, 3072, 3072, 12288,
                      [Blocks("qwen_image", 60, tokens)], sequences=2 * 2, lora_targets=FLOW_QWEN_IMAGE_TARGETS,
                      lora_rank=64, weight_bytes=2, heads=24, checkpointing=True, ema=True,
                      extras=build_qwen_image_extras,
                      notes=["micro-batch 2 x 2 (CFG), one denoising step per backward (action_chunk_size 1)"])

    def z_image_turbo() -> Recipe:
        # 512 px: 64 x 64 latents in 2 x 2 patches = 1024 image tokens; the caption at most 128 tokens (its
        # max_sequence_length, a multiple of 32 as the transformer pads it); micro-batch 2, no CFG pass (Turbo).
        image, caption = (512 // 16) ** 2, 128
        return Recipe("Z-Image-Turbo LoRA r64 512px", "configs/flow/z_image_turbo_pickscore.yaml", build_z_image,
                      3840, 3840, 10240, [Blocks("z_image", 30, image + caption), Blocks("z_image", 2, image),
                                          Blocks("z_image_caption", 2, caption)],
                      sequences=2, lora_targets=FLOW_Z_IMAGE_TARGETS, lora_rank=64, weight_bytes=2, heads=30,
                      checkpointing=True, ema=True, extras=build_z_image_extras,
                      notes=["micro-batch 2, no CFG pass, one denoising step per backward (action_chunk_size 1)"])

    def hunyuan_video15(task: str) -> Recipe:
        # 53 frames at 480 x 480: the VAE compresses 16x in space and 4x in time, the transformer patches 1 x 1 x 1, so
        # 14 x 30 x 30 = 12,600 video tokens; the text sequence is max_sequence_length 256 Qwen2.5-VL tokens, 256 ByT5
        # glyph tokens and 729 image slots (masked in text-to-video, the SigLIP features in image-to-video): 1,241.
        # Micro-batch 1 x 2 (true CFG's [uncond; cond] call), rank-128 LoRA, no EMA, no KL.
        tokens = 14 * (480 // 16) ** 2 + 256 + 256 + 729
        name = f"HunyuanVideo-1.5 {task} LoRA r128 53f"
        return Recipe(name, f"configs/flow/hunyuan_video15_{task}.yaml", build_hunyuan_video15, 2048, 2048, 8192,
                      [Blocks("hunyuan_video15", 54, tokens)], sequences=1 * 2,
                      lora_targets=FLOW_HUNYUAN_VIDEO15_TARGETS, lora_rank=128, weight_bytes=2, heads=16,
                      checkpointing=True, extras=build_hunyuan_video15_extras,
                      notes=["micro-batch 1 x 2 (CFG), one denoising step per backward (action_chunk_size 1)",
                             "not counted: the ByT5 glyph encoder" + (" and SigLIP" if task == "i2v" else "")])

    def edits() -> list[Recipe]:
        # The editing recipes at 384 px: 24 x 24 = 576 packed tokens for the edited image and as many for the input
        # image appended to the sequence (both resized to the run's size); the blocks are the text-to-image models'
        # (the same coefficients per token), so only the sequence grows.
        image = (384 // 16) ** 2
        kontext = Recipe("FLUX.1-Kontext LoRA r64 384px", "configs/flow/flux_kontext_pickscore.yaml", build_flux_dev,
                         3072, 3072, 12288, [Blocks("flux_double", 19, 2 * image + 512),
                                             Blocks("flux_single", 38, 2 * image + 512)],
                         sequences=2, lora_targets=FLOW_FLUX_TARGETS, lora_rank=64, weight_bytes=2,
                         checkpointing=True, ema=True, extras=lambda: [*build_text_encoders("flux"), build_vae()],
                         notes=["micro-batch 2 (embedded guidance), the input image's 576 tokens appended"])
        # Qwen-Image-Edit-2509: text at most max_sequence_length 512 (template, the image's vision tokens, the
        # instruction), CFG with a negative per row: micro-batch 2 x 2.
        qwen_edit = Recipe("Qwen-Image-Edit LoRA r64 384px", "configs/flow/qwen_image_edit_pickscore.yaml",
                           build_qwen_image, 3072, 3072, 12288, [Blocks("qwen_image", 60, 2 * image + 512)],
                           sequences=2 * 2, lora_targets=FLOW_QWEN_IMAGE_TARGETS, lora_rank=64, weight_bytes=2,
                           heads=24, checkpointing=True, ema=True, extras=build_qwen_image_extras,
                           notes=["micro-batch 2 x 2 (CFG), the input image's 576 tokens appended, text <= 512"])
        # LongCat-Image-Edit: LongCat-Image's transformer (10 + 20 FLUX-style blocks) over the generated image's 576
        # tokens, the input image's 576 appended (the pipeline's prepare_latents) and the text row: from
        # <|vision_start|> on, the input's merged vision tokens at half the output's side (192 px: 7 x 7 = 49 after
        # Qwen2-VL's smart_resize to multiples of 28), <|vision_end|> and the 512 padded instruction tokens
        # (pipeline_longcat_image_edit.py:310-341); micro-batch 2 x 2 (CFG with a negative per row).
        longcat_text = longcat_edit_text_tokens(384, 384)
        longcat_edit = Recipe("LongCat-Image-Edit LoRA r64 384px", "configs/flow/longcat_image_edit_pickscore.yaml",
                              build_longcat_image, 3072, 3072, 12288,
                              [Blocks("flux_double", 10, 2 * image + longcat_text),
                               Blocks("flux_single", 20, 2 * image + longcat_text)],
                              sequences=2 * 2, lora_targets=FLOW_LONGCAT_IMAGE_TARGETS, lora_rank=64, weight_bytes=2,
                              heads=24, checkpointing=True, ema=True, extras=build_longcat_image_extras,
                              notes=["micro-batch 2 x 2 (CFG), the input image's 576 tokens appended, text "
                                     f"{longcat_text} (its {longcat_text - 514} vision tokens, 2 markers, 512)",
                                     "activation coefficients of FLUX.1's blocks (checked on tiny LongCat blocks)"])
        return [kontext, qwen_edit, longcat_edit]

    def chroma() -> Recipe:
        # 512 px: 64 x 64 latents in 2 x 2 patches = 1024 image tokens + 512 T5 tokens (max_sequence_length, the
        # pipeline's); micro-batch 2 x 2 (true CFG), rank-64 LoRA on FLUX.1's targets, EMA, no KL; checkpointed.
        tokens = (512 // 16) ** 2 + 512
        return Recipe("Chroma1-HD LoRA r64 512px", "configs/flow/chroma_pickscore.yaml", build_chroma, 3072, 3072,
                      12288, [Blocks("chroma_double", 19, tokens), Blocks("chroma_single", 38, tokens)],
                      sequences=2 * 2, lora_targets=FLOW_CHROMA_TARGETS, lora_rank=64, weight_bytes=2, heads=24,
                      checkpointing=True, ema=True, extras=build_chroma_extras,
                      notes=["micro-batch 2 x 2 (CFG), one denoising step per backward (action_chunk_size 1)",
                             "each block keeps its dense [L, L] text-and-image mask (L = 1536)"])

    def longcat_image() -> Recipe:
        # 512 px: 64 x 64 latents in 2 x 2 patches = 1024 image tokens + the pipeline's fixed 512 Qwen tokens;
        # micro-batch 2 x 2 (true CFG), rank-64 LoRA on FLUX.1's targets, EMA, no KL; checkpointed. LongCat's blocks
        # are FLUX.1's (AdaLN-Zero, qk RMSNorm, GELU MLP of ratio 4, no mask): FLUX's activation coefficients.
        tokens = (512 // 16) ** 2 + 512
        return Recipe("LongCat-Image LoRA r64 512px", "configs/flow/longcat_image_pickscore.yaml", build_longcat_image,
                      3072, 3072, 12288, [Blocks("flux_double", 10, tokens), Blocks("flux_single", 20, tokens)],
                      sequences=2 * 2, lora_targets=FLOW_LONGCAT_IMAGE_TARGETS, lora_rank=64, weight_bytes=2,
                      heads=24, checkpointing=True, ema=True, extras=build_longcat_image_extras,
                      notes=["micro-batch 2 x 2 (CFG), one denoising step per backward (action_chunk_size 1)",
                             "activation coefficients of FLUX.1's blocks (the same block structure)"])

    def sana(size: str) -> Recipe:
        # 1024 px: DC-AE compresses 32x and the DiT takes patch 1, so 32 x 32 = 1024 image tokens; 300 Gemma-2 tokens
        # enter only the cross-attention; micro-batch 9 x 2 (true CFG), rank-32 LoRA, EMA, KL 0.01 (LoRA: the
        # adapter is disabled for the reference, no copy); no checkpointing as shipped.
        layers, kind, name = {"1.6b": (20, "sana", "Sana-1.6B"), "4.8b": (60, "sana15", "Sana1.5-4.8B")}[size]
        config = "configs/flow/sana_pickscore.yaml" + (" (4.8B model)" if size == "4.8b" else "")
        return Recipe(f"{name} LoRA r32", config, lambda: build_sana(size), 2240, 2240, 5600,
                      [Blocks(kind, layers, (1024 // 32) ** 2, context_tokens=300)], sequences=9 * 2,
                      lora_targets=FLOW_SANA_TARGETS, lora_rank=32, weight_bytes=2, heads=70, kl=True, ema=True,
                      extras=build_sana_extras,
                      notes=["micro-batch 9 x 2 (CFG), one denoising step per backward (action_chunk_size 1)"])

    return [
        Recipe("SD3.5-M LoRA r32", "configs/flow/sd35_pickscore.yaml", build_sd35_medium, 1536, 1536, 6144,
               sd35_blocks, sequences=9 * 2, lora_targets=FLOW_SD3_TARGETS,
               lora_rank=32, weight_bytes=2, kl=True, ema=True, extras=lambda: [*build_text_encoders("sd3"),
                                                                                   build_vae()],
               notes=["micro-batch 9 × 2 (CFG), one denoising step per backward (action_chunk_size 1)"]),
        Recipe("SD3.5-M full", "configs/flow/sd35_pickscore.yaml", build_sd35_medium, 1536, 1536, 6144,
               sd35_blocks, sequences=9 * 2, lora_targets=(), lora_rank=None, weight_bytes=2,
               kl=True, ema=True, extras=lambda: [*build_text_encoders("sd3"), build_vae()]),
        Recipe("FLUX.1-dev LoRA r128", "configs/flow/flux_hpsv2.yaml", build_flux_dev, 3072, 3072, 12288,
               [Blocks("flux_double", 19, flux_tokens), Blocks("flux_single", 38, flux_tokens)], sequences=4,
               lora_targets=FLOW_FLUX_TARGETS, lora_rank=128, weight_bytes=2, checkpointing=True,
               extras=lambda: [*build_text_encoders("flux"), build_vae()]),
        Recipe("FLUX.1-dev full", "configs/flow/flux_hpsv2.yaml", build_flux_dev, 3072, 3072, 12288,
               [Blocks("flux_double", 19, flux_tokens), Blocks("flux_single", 38, flux_tokens)], sequences=4,
               lora_targets=(), lora_rank=None, weight_bytes=2, checkpointing=True,
               extras=lambda: [*build_text_encoders("flux"), build_vae()]),
        Recipe("Qwen2.5-VL-3B LoRA r64", "configs/vlm/qwen25vl_3b_grounding.yaml", lambda: build_qwen25vl("3b"),
               2048, 256, 11008, [Blocks("decoder", 36, vlm_seq)], sequences=8, lora_targets=LM_TARGETS,
               lora_rank=64, weight_bytes=2, checkpointing=True, kl=True, frozen_in_module="visual", vocab=151936,
               completion=512, kv_cache=(64, vlm_seq), layers_for_cache=36),
        Recipe("Qwen2.5-VL-3B full", "configs/vlm/qwen25vl_counting.yaml", lambda: build_qwen25vl("3b"),
               2048, 256, 11008, [Blocks("decoder", 36, vlm_seq)], sequences=4, lora_targets=(), lora_rank=None,
               weight_bytes=4, checkpointing=True, kl=True, frozen_in_module="visual", vocab=151936, completion=512,
               kv_cache=(128, vlm_seq), layers_for_cache=36),
        Recipe("Qwen2.5-VL-7B LoRA r64", "configs/vlm/qwen25vl_3b_grounding.yaml (7B model)",
               lambda: build_qwen25vl("7b"), 3584, 512, 18944, [Blocks("decoder", 28, vlm_seq)], sequences=8,
               lora_targets=LM_TARGETS, lora_rank=64, weight_bytes=2, checkpointing=True, kl=True,
               frozen_in_module="visual", vocab=152064, completion=512, kv_cache=(64, vlm_seq), layers_for_cache=28),
        Recipe("Qwen2.5-VL-7B full", "configs/vlm/qwen25vl_counting.yaml (7B model)", lambda: build_qwen25vl("7b"),
               3584, 512, 18944, [Blocks("decoder", 28, vlm_seq)], sequences=4, lora_targets=(), lora_rank=None,
               weight_bytes=4, checkpointing=True, kl=True, frozen_in_module="visual", vocab=152064, completion=512,
               kv_cache=(128, vlm_seq), layers_for_cache=28),
        Recipe("GLM-4.1V-9B LoRA r64", "configs/vlm/glm41v_grounding.yaml", build_glm41v_9b, 4096, 256, 13696,
               [Blocks("decoder", 40, glm_seq)], sequences=4, lora_targets=GLM4V_TARGETS, lora_rank=64,
               weight_bytes=2, checkpointing=True, kl=True, frozen_in_module="visual", vocab=151552, completion=1024,
               kv_cache=(64, glm_seq), layers_for_cache=40,
               notes=["activation coefficients of the Qwen/Llama decoder block (GLM's adds two RMSNorms)"]),
        Recipe("LLaDA-8B LoRA r128", "configs/dllm/llada8b_gsm8k_lora.yaml", build_llada_8b, 4096, 4096, 12288,
               [Blocks("decoder", 32, llada_seq)], sequences=6, lora_targets=LM_TARGETS, lora_rank=128,
               weight_bytes=2, kl=True, vocab=126464, completion=256,
               notes=["no KV cache: each of the 128 decoding steps is a full forward of 6 sequences"]),
        wan("1.3b", 33, lora=True),
        wan("1.3b", 81, lora=True),
        wan("1.3b", 33, lora=False),
        wan("14b", 33, lora=True),
        wan("14b", 81, lora=True),
        wan22_a14b(),
        qwen_image(512),
        qwen_image(1024),
        z_image_turbo(),
        *edits(),
        hunyuan_video15("t2v"),
        hunyuan_video15("i2v"),
        chroma(),
        longcat_image(),
        sana("1.6b"),
        sana("4.8b"),
    ]


# ---------------------------------------------------------------------------------------------------- estimate
def activation_bytes(recipe: Recipe, mode: str) -> float:
    """Saved activations of one training forward (one micro-batch), in bytes."""
    h, d = recipe.hidden, recipe.activation_bytes
    rank = recipe.lora_rank or 0
    total, largest_block = 0.0, 0.0
    for blocks in recipe.blocks:
        shape = (h, recipe.kv_width, recipe.mlp, rank, recipe.heads)
        per_token = ACTIVATION_BYTES[(blocks.kind, mode)](*shape)
        per_block = per_token * blocks.tokens
        if blocks.dual_image_tokens:
            extra = ACTIVATION_BYTES[("mmdit_dual_image", mode)](*shape) - per_token
            per_block += extra * blocks.dual_image_tokens
        if blocks.context_tokens:
            per_block += ACTIVATION_BYTES[(blocks.kind + "_context", mode)](*shape) * blocks.context_tokens
        if (blocks.kind + "_sequence", mode) in ACTIVATION_BYTES:
            per_block += ACTIVATION_BYTES[(blocks.kind + "_sequence", mode)](*shape)
        if (blocks.kind + "_mask", mode) in ACTIVATION_BYTES:  # a dense per-pair attention mask (HunyuanVideo 1.5)
            per_block += ACTIVATION_BYTES[(blocks.kind + "_mask", mode)](*shape) * blocks.tokens ** 2
        per_block *= d * recipe.sequences
        largest_block = max(largest_block, per_block)
        if recipe.checkpointing:  # each block keeps its input; one block at a time is recomputed in the backward
            total += blocks.count * blocks.tokens * h * d * recipe.sequences
        else:
            total += blocks.count * per_block
    if recipe.checkpointing:
        total += largest_block
    if recipe.vocab:  # completion logits in the activation dtype and their float32 log-softmax
        total += recipe.sequences * recipe.completion * recipe.vocab * (d + 4)
    return total


#: :func:`parameter_counts` by (build, extras, LoRA targets and rank, frozen submodule): a recipe's variants (with and
#: without checkpointing, 1 GPU and FSDP) share one meta-device build instead of one each.
_COUNTS: dict[tuple[Any, ...], dict[str, int]] = {}


def parameter_counts(recipe: Recipe) -> dict[str, int]:
    """``total``, ``frozen_part`` (in ``frozen_in_module``), ``lora`` (the adapter's parameters, 0 without LoRA) and
    ``extras`` parameters of ``recipe``'s modules, built once on the meta device and remembered."""
    key = (recipe.build, recipe.extras, recipe.lora_targets, recipe.lora_rank, recipe.frozen_in_module)
    if key not in _COUNTS:
        with torch.device("meta"):
            module = recipe.build()
            extras = recipe.extras() if recipe.extras else []
        _COUNTS[key] = {
            "total": sum(p.numel() for p in module.parameters()),
            "frozen_part": sum(p.numel() for n, p in module.named_parameters()
                               if recipe.frozen_in_module and recipe.frozen_in_module in n),
            "lora": lora_parameters(module, recipe.lora_targets, recipe.lora_rank, exclude=recipe.frozen_in_module)
            if recipe.lora_rank else 0,
            "extras": sum(p.numel() for m in extras for p in m.parameters()),
        }
    return _COUNTS[key]


def estimate(recipe: Recipe, gpus: int, fsdp: bool) -> dict[str, Any]:
    """Per-GPU memory of ``recipe`` (GiB per component and the peak)."""
    counts = parameter_counts(recipe)
    total, frozen_part = counts["total"], counts["frozen_part"]
    mode = "lora" if recipe.lora_rank else "full"
    if mode == "lora":
        trainable = counts["lora"]
        weights = total * recipe.weight_bytes
        sharded = 16 * trainable  # float32 adapter weights, gradients, two AdamW moments
    else:
        trainable = total - frozen_part
        weights = frozen_part * recipe.weight_bytes + trainable * 4  # float32 master weights
        sharded = 12 * trainable  # gradients and two AdamW moments
    ema = 4 * trainable if recipe.ema else 0
    reference = total * 4 if (recipe.kl and mode == "full") else 0  # a float32 copy (flow and vlm plugins)
    extras_bytes = counts["extras"] * recipe.extras_bytes
    shards = gpus if fsdp else 1
    kv = 0.0
    if recipe.kv_cache[0]:
        samples, positions = recipe.kv_cache
        kv = samples * positions * recipe.layers_for_cache * 2 * recipe.kv_width * recipe.activation_bytes
    activations = activation_bytes(recipe, mode)
    parts = {"weights": weights / shards, "trainable_state": (sharded + ema) / shards, "reference": reference / shards,
             "frozen_extras": extras_bytes, "activations": activations, "rollout_kv_cache": kv}
    # Gradients and activations live during training; the KV cache during generation: not at the same time.
    static = parts["weights"] + parts["trainable_state"] + parts["reference"] + parts["frozen_extras"]
    peak = static + max(parts["activations"], parts["rollout_kv_cache"])
    return {"parameters": total, "trainable": trainable, "gib": {k: v / GIB for k, v in parts.items()},
            "peak_gib": peak / GIB}


# ---------------------------------------------------------------------------------------------------- check
def saved_activation_bytes(model: nn.Module, run: Any) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while ``run()`` builds the graph."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


def check() -> list[dict[str, Any]]:
    """Tiny models of the same classes in float32 on the CPU: measured against estimated bytes (module docstring).

    The activation difference between a 4-block and a 2-block model isolates two blocks (embeddings, final norm and
    head cancel); the state check sums parameter, gradient and AdamW state storages after one optimizer step."""
    from diffusers import (
        ChromaTransformer2DModel,
        FluxTransformer2DModel,
        LongCatImageTransformer2DModel,
        SD3Transformer2DModel,
    )
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    h, heads, head_dim, f, kv_heads, rank, batch = 96, 6, 16, 256, 2, 4, 2
    rows = []

    def decoder(layers: int, lora: bool) -> nn.Module:
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                                             num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=101,
                                             max_position_embeddings=128, attn_implementation="sdpa"))
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=list(LM_TARGETS))) if lora \
            else model

    def sd3(layers: int, lora: bool, dual: bool) -> nn.Module:
        model = SD3Transformer2DModel(sample_size=12, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
                                      attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
                                      caption_projection_dim=h, pooled_projection_dim=16, pos_embed_max_size=32,
                                      dual_attention_layers=tuple(range(layers)) if dual else (),
                                      qk_norm="rms_norm")
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=list(FLOW_SD3_TARGETS))) \
            if lora else model

    def flux(double: int, single: int, lora: bool) -> nn.Module:
        model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
                                       attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
                                       pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=list(FLOW_FLUX_TARGETS))) \
            if lora else model

    def chroma(double: int, single: int, lora: bool) -> nn.Module:
        # FLUX's sizes; a small approximator (its activations are not counted, see ACTIVATION_BYTES)
        model = ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
                                         attention_head_dim=head_dim, num_attention_heads=heads,
                                         joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
                                         approximator_hidden_dim=16, approximator_layers=1)
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=list(FLOW_CHROMA_TARGETS))) \
            if lora else model

    def longcat(double: int, single: int, lora: bool) -> nn.Module:
        # LongCat-Image's blocks (FLUX.1's structure, no guidance or pooled embedding) at FLUX's check sizes
        model = LongCatImageTransformer2DModel(patch_size=1, in_channels=16, num_layers=double,
                                               num_single_layers=single, attention_head_dim=head_dim,
                                               num_attention_heads=heads, joint_attention_dim=32,
                                               pooled_projection_dim=32, axes_dims_rope=[4, 6, 6])
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=8,
                                                target_modules=list(FLOW_LONGCAT_IMAGE_TARGETS))) if lora else model

    seq, image_side, text = 40, 12, 10
    ids = torch.randint(0, 101, (batch, seq))
    latents, context = torch.randn(batch, 4, image_side, image_side), torch.randn(batch, text, 32)
    pooled, timestep = torch.randn(batch, 16), torch.rand(batch) * 1000
    flux_tokens = 36
    packed, image_ids, text_ids = torch.randn(batch, flux_tokens, 16), torch.zeros(flux_tokens, 3), torch.zeros(text, 3)

    # Chroma's mask as ChromaPipeline builds it: the text mask (the second prompt padded after 6 tokens) then ones for
    # the image tokens, in the model's dtype (diffusers 0.42.1's float mask)
    chroma_mask = torch.ones(batch, text + flux_tokens)
    chroma_mask[1:, 6:text] = 0

    def run_chroma(model: nn.Module) -> Any:
        return lambda: model(hidden_states=packed, encoder_hidden_states=context, timestep=timestep / 1000,
                             img_ids=image_ids, txt_ids=text_ids, attention_mask=chroma_mask).sample.sum()

    # LongCat-Image-Edit's joint sequence (LongCatImageEditPipeline.__call__, diffusers 0.42.1): the text, the
    # generated image's tokens and the input image's appended after them, with the edit's rotary ids (text (0, i, i),
    # generated (1, L + row, L + column), input (2, L + row, L + column); pipeline_longcat_image_edit.py:446-462)
    # its own generator: the global stream, and so every other case's inputs, stay as they were without this case
    input_tokens = torch.randn(batch, flux_tokens, 16, generator=torch.Generator().manual_seed(1))  # [B, T, 16]
    edit_tokens = torch.cat([packed, input_tokens], dim=1)  # [B, 2T, 16]
    grid = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij"), -1).reshape(-1, 2) + text
    edit_ids = torch.cat([torch.cat([torch.full((flux_tokens, 1), float(modality)), grid.float()], dim=1)
                          for modality in (1, 2)])  # [2T, 3]
    edit_text_ids = torch.arange(text).float()[:, None].expand(text, 3) * torch.tensor([0.0, 1.0, 1.0])  # [L, 3]

    def run_longcat_edit(model: nn.Module) -> Any:
        return lambda: model(hidden_states=edit_tokens, encoder_hidden_states=context, timestep=timestep / 1000,
                             img_ids=edit_ids, txt_ids=edit_text_ids).sample.sum()

    def run_decoder(model: nn.Module) -> Any:
        return lambda: model(input_ids=ids, logits_to_keep=1).logits.sum()

    def run_sd3(model: nn.Module) -> Any:
        return lambda: model(hidden_states=latents, encoder_hidden_states=context, pooled_projections=pooled,
                             timestep=timestep).sample.sum()

    def run_flux(model: nn.Module) -> Any:
        return lambda: model(hidden_states=packed, encoder_hidden_states=context, pooled_projections=pooled,
                             timestep=timestep / 1000, img_ids=image_ids, txt_ids=text_ids,
                             guidance=torch.full((batch,), 3.5)).sample.sum()

    sd3_tokens = (image_side // 2) ** 2 + text
    cases = [("decoder", seq, lambda n, lora: decoder(n, lora), run_decoder, 0),
             ("mmdit", sd3_tokens, lambda n, lora: sd3(n, lora, False), run_sd3, 0),
             ("mmdit (dual attention)", sd3_tokens, lambda n, lora: sd3(n, lora, True), run_sd3,
              (image_side // 2) ** 2),
             ("flux_double", flux_tokens + text, lambda n, lora: flux(n, 1, lora), run_flux, 0),
             ("flux_single", flux_tokens + text, lambda n, lora: flux(1, n, lora), run_flux, 0),
             ("chroma_double", flux_tokens + text, lambda n, lora: chroma(n, 1, lora), run_chroma, 0),
             ("chroma_single", flux_tokens + text, lambda n, lora: chroma(1, n, lora), run_chroma, 0),
             ("flux_double (LongCat-Image-Edit blocks)", 2 * flux_tokens + text, lambda n, lora: longcat(n, 1, lora),
              run_longcat_edit, 0),
             ("flux_single (LongCat-Image-Edit blocks)", 2 * flux_tokens + text, lambda n, lora: longcat(1, n, lora),
              run_longcat_edit, 0)]
    for kind, tokens, build, runner, dual_tokens in cases:
        for mode in ("full", "lora"):
            small, large = build(2, mode == "lora"), build(4, mode == "lora")
            measured = (saved_activation_bytes(large, runner(large)) - saved_activation_bytes(small, runner(small)))
            block_kind = kind.split(" ")[0]
            recipe = Recipe(kind, "", None, h, kv_heads * head_dim, f, [Blocks(block_kind, 2, tokens, dual_tokens)],
                            sequences=batch, lora_targets=(), lora_rank=rank if mode == "lora" else None,
                            weight_bytes=4, activation_bytes=4, heads=heads)
            estimated = activation_bytes(recipe, mode)
            rows.append({"model": f"{kind} ({mode}), 2 blocks of activations", "estimated_bytes": estimated,
                         "measured_bytes": measured, "ratio": measured / estimated})
    rows += check_flow_blocks(batch, rank)
    for mode in ("full", "lora"):  # weights, gradients and AdamW state after one step
        model = decoder(2, mode == "lora")
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        run_decoder(model)().backward()
        optimizer.step()
        measured = sum(p.numel() * p.element_size() for p in model.parameters())
        measured += sum(p.grad.numel() * p.grad.element_size() for p in trainable)
        measured += sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                        if t.dim() > 0)
        total = sum(p.numel() for p in model.parameters())
        count = sum(p.numel() for p in trainable)
        estimated = total * 4 + 12 * count  # float32 weights, gradients and two moments of the trainable ones
        rows.append({"model": f"decoder ({mode}), weights + gradients + AdamW state", "estimated_bytes": estimated,
                     "measured_bytes": measured, "ratio": measured / estimated})
    return rows


def check_flow_blocks(batch: int, rank: int) -> list[dict[str, Any]]:
    """The Wan, Qwen-Image and Z-Image blocks at the tiny test pipelines' transformer configs (plugins/flow/testing.py,
    the depth changed to 2 and 4 blocks): a 5-frame 16 px video (3 × 8 × 8 latents, 48 tokens) with 12 text tokens,
    a 16 px image (16 packed tokens) with 12 text tokens, the second prompt padded (masked) after 7 as the plugin
    pads, a 16 px Z-Image sample (16 image and 12 caption tokens, each padded to 32 by the transformer), and a 5-frame
    16 px HunyuanVideo 1.5 video (2 × 4 × 4 latents, 32 tokens) with 12 Qwen2.5-VL, 8 ByT5 and 4 image-slot tokens,
    and a 64 px Sana image (8 × 8 latents of the tiny DC-AE's factor 2 at the 32× pipeline's scale: 64 tokens) with 12
    Gemma-2 tokens, as Sana 1.0's block and with Sana 1.5's qk RMSNorm (``sana15``).
    """
    from peft import LoraConfig, get_peft_model

    from mmrl.plugins.flow.testing import (
        build_hunyuan_video15_pipeline,
        build_qwen_image_pipeline,
        build_sana_pipeline,
        build_wan_pipeline,
        build_z_image_pipeline,
    )

    wan_config = dict(build_wan_pipeline().transformer.config)
    qwen_config = dict(build_qwen_image_pipeline().transformer.config)
    text = 12
    video = torch.randn(batch, wan_config["in_channels"], 3, 8, 8)  # [B, C, F_lat, h, w]
    wan_context = torch.randn(batch, text, wan_config["text_dim"])  # [B, T, text_dim]
    side = 4  # 8 x 8 latents in 2 x 2 patches
    packed = torch.randn(batch, side * side, qwen_config["in_channels"])  # [B, L, 4C]
    qwen_context = torch.randn(batch, text, qwen_config["joint_attention_dim"])  # [B, T, D]
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[1:, 7:] = False
    timestep = torch.rand(batch)

    def build(config: dict[str, Any], layers: int, lora: bool, targets: tuple[str, ...], bf16: bool) -> nn.Module:
        from diffusers import (
            HunyuanVideo15Transformer3DModel,
            QwenImageTransformer2DModel,
            SanaTransformer2DModel,
            WanTransformer3DModel,
            ZImageTransformer2DModel,
        )

        kwargs = {key: value for key, value in config.items() if not key.startswith("_")}
        if "caption_channels" in config:  # Sana (qk_norm set for Sana 1.5's block)
            model = SanaTransformer2DModel(**{**kwargs, "num_layers": layers})
        elif "text_embed_2_dim" in config:  # HunyuanVideo 1.5 (its refiner blocks cancel in the difference)
            model = HunyuanVideo15Transformer3DModel(**{**kwargs, "num_layers": layers})
        elif "cap_feat_dim" in config:  # Z-Image: n_layers main blocks (the refiners cancel in the difference)
            model = ZImageTransformer2DModel(**{**kwargs, "n_layers": layers})
        else:
            model_class = WanTransformer3DModel if "text_dim" in config else QwenImageTransformer2DModel
            model = model_class(**{**kwargs, "num_layers": layers})
        if bf16:  # as from_pretrained(torch_dtype=bfloat16): the model's _keep_in_fp32_modules stay float32
            model.to(torch.bfloat16)
            keep = getattr(model, "_keep_in_fp32_modules", None) or []
            for name, child in model.named_modules():
                if any(part in keep for part in name.split(".")):
                    child.to(torch.float32)
        # peft's adapters are float32 on a bfloat16 base (autocast_adapter_dtype), as mmrl.policy.lora attaches them
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))) \
            if lora else model

    def run_wan(model: nn.Module, dtype: torch.dtype) -> Any:
        return lambda: model(hidden_states=video.to(dtype), timestep=timestep * 1000,
                             encoder_hidden_states=wan_context.to(dtype), return_dict=False)[0].float().sum()

    def run_qwen(model: nn.Module, dtype: torch.dtype) -> Any:
        return lambda: model(hidden_states=packed.to(dtype), timestep=timestep.to(dtype),
                             encoder_hidden_states=qwen_context.to(dtype), encoder_hidden_states_mask=mask,
                             img_shapes=[[(1, side, side)]] * batch, return_dict=False)[0].float().sum()

    z_config = dict(build_z_image_pipeline().transformer.config)
    z_latents = [torch.randn(z_config["in_channels"], 1, 8, 8) for _ in range(batch)]  # 16 tokens, padded to 32
    z_captions = [torch.randn(text, z_config["cap_feat_dim"]) for _ in range(batch)]  # 12 tokens, padded to 32

    def run_z_image(model: nn.Module, dtype: torch.dtype) -> Any:
        return lambda: torch.stack(model(x=[x.to(dtype) for x in z_latents], t=timestep,
                                         cap_feats=[c.to(dtype) for c in z_captions], return_dict=False)[0]
                                   ).float().sum()

    hy_config = dict(build_hunyuan_video15_pipeline().transformer.config)
    hy_video = torch.randn(batch, hy_config["in_channels"], 2, 4, 4)  # [B, 2C + 1, F_lat, h, w]: 32 tokens
    hy_text = torch.randn(batch, text, hy_config["text_embed_dim"])  # [B, T, D]
    hy_glyph, hy_slots = torch.randn(batch, 8, hy_config["text_embed_2_dim"]), 4
    hy_image = torch.randn(batch, hy_slots, hy_config["image_embed_dim"])

    def run_hunyuan_video15(model: nn.Module, dtype: torch.dtype) -> Any:
        return lambda: model(hidden_states=hy_video.to(dtype), timestep=(timestep * 1000).to(dtype),
                             encoder_hidden_states=hy_text.to(dtype), encoder_attention_mask=mask.float(),
                             encoder_hidden_states_2=hy_glyph.to(dtype),
                             encoder_attention_mask_2=torch.ones(batch, hy_glyph.shape[1]),
                             image_embeds=hy_image.to(dtype), return_dict=False)[0].float().sum()

    sana_config = dict(build_sana_pipeline().transformer.config)
    sana_latents = torch.randn(batch, sana_config["in_channels"], 8, 8)  # [B, C, h, w]: 64 image tokens
    sana_text = torch.randn(batch, text, sana_config["caption_channels"])  # [B, T, D]

    def run_sana(model: nn.Module, dtype: torch.dtype) -> Any:
        return lambda: model(sana_latents.to(dtype), encoder_hidden_states=sana_text.to(dtype),
                             encoder_attention_mask=mask.float(), timestep=timestep * 1000,
                             return_dict=False)[0].float().sum()

    cases = [("wan", wan_config, FLOW_WAN_TARGETS, run_wan, Blocks("wan", 2, 3 * 4 * 4, context_tokens=text)),
             ("qwen_image", qwen_config, FLOW_QWEN_IMAGE_TARGETS, run_qwen,
              Blocks("qwen_image", 2, side * side + text)),
             ("z_image", z_config, FLOW_Z_IMAGE_TARGETS, run_z_image, Blocks("z_image", 2, 32 + 32)),
             ("hunyuan_video15", hy_config, FLOW_HUNYUAN_VIDEO15_TARGETS, run_hunyuan_video15,
              Blocks("hunyuan_video15", 2, 32 + text + hy_glyph.shape[1] + hy_slots)),
             ("sana", sana_config, FLOW_SANA_TARGETS, run_sana, Blocks("sana", 2, 64, context_tokens=text)),
             ("sana15", {**sana_config, "qk_norm": "rms_norm_across_heads"}, FLOW_SANA_TARGETS, run_sana,
              Blocks("sana15", 2, 64, context_tokens=text))]
    rows = []
    for kind, config, targets, runner, blocks in cases:
        if "cap_feat_dim" in config:  # Z-Image: dim, n_heads, SwiGLU width int(dim / 3 * 8)
            heads, hidden = config["n_heads"], config["dim"]
            mlp = int(hidden / 3 * 8)
        elif "caption_channels" in config:  # Sana: GLUMBConv of width int(mlp_ratio * hidden)
            heads, hidden = config["num_attention_heads"], config["num_attention_heads"] * config["attention_head_dim"]
            mlp = int(config["mlp_ratio"] * hidden)
        elif "text_embed_2_dim" in config:  # HunyuanVideo 1.5: FeedForward(mult=mlp_ratio)
            heads, hidden = config["num_attention_heads"], config["num_attention_heads"] * config["attention_head_dim"]
            mlp = int(hidden * config["mlp_ratio"])
        else:
            heads, hidden = config["num_attention_heads"], config["num_attention_heads"] * config["attention_head_dim"]
            mlp = config.get("ffn_dim", 4 * hidden)
        # float32 (what the coefficients count), and LoRA as the recipes train: a bfloat16 base under bfloat16
        # autocast, where float32 norms and modulation (Wan's FP32LayerNorm) and peft's casts of each adapted
        # linear's input keep more than 2 bytes per counted value: reported, not part of the estimate.
        for mode, bf16 in (("full", False), ("lora", False), ("lora", True)):
            dtype = torch.bfloat16 if bf16 else torch.float32
            small, large = (build(config, n, mode == "lora", targets, bf16) for n in (2, 4))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                measured = (saved_activation_bytes(large, runner(large, dtype))
                            - saved_activation_bytes(small, runner(small, dtype)))
            recipe = Recipe(kind, "", None, hidden, hidden, mlp, [blocks], sequences=batch, lora_targets=(),
                            lora_rank=rank if mode == "lora" else None, weight_bytes=4,
                            activation_bytes=2 if bf16 else 4, heads=heads)
            estimated = activation_bytes(recipe, mode)
            label = f"{kind} ({mode}{', bf16 autocast' if bf16 else ''}), 2 blocks of activations"
            rows.append({"model": label, "estimated_bytes": estimated, "measured_bytes": measured,
                         "ratio": measured / estimated})
    return rows


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8], help="FSDP world sizes to estimate (and 1 GPU).")
    parser.add_argument("--only", nargs="*", default=None, help="Recipes whose name contains one of these.")
    parser.add_argument("--check", action="store_true", help="Also check the estimator on tiny CPU models.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if any(g < 1 for g in args.gpus):
        parser.error("--gpus must be positive integers")
    return args


def without_with(rows: dict[bool, Any], key: str, part: str | None, own: bool) -> str:
    """``"a/b"``: a value without and with gradient checkpointing, the recipe's own setting marked ``*``."""
    values = [rows[c][key]["gib"][part] if part else rows[c][key]["peak_gib"] for c in (False, True)]
    marks = ["*" if c == own else "" for c in (False, True)]
    return f"{values[0]:.1f}{marks[0]}/{values[1]:.1f}{marks[1]}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"settings": {"gpus": args.gpus, "torch": torch.__version__}, "recipes": {}}
    print("GiB per GPU; peaks without / with gradient checkpointing (the recipe's own setting marked *)")
    print(f"{'recipe':26} {'params':>7} {'trained':>8} {'weights':>7} {'state':>6} {'ref':>5} {'extras':>6} "
          f"{'act':>11} {'kv':>5} {'1 GPU':>13}" + "".join(f" {'FSDP ' + str(g):>13}" for g in args.gpus))
    for recipe in recipes():
        if args.only and not any(part.lower() in recipe.name.lower() for part in args.only):
            continue
        rows = {}
        for checkpointing in (False, True):
            variant = replace(recipe, checkpointing=checkpointing)
            rows[checkpointing] = {"one_gpu": estimate(variant, 1, fsdp=False),
                                   **{f"fsdp_{g}": estimate(variant, g, fsdp=True) for g in args.gpus}}
        results["recipes"][recipe.name] = {"config": recipe.config, "recipe_checkpointing": recipe.checkpointing,
                                           "without_checkpointing": rows[False], "with_checkpointing": rows[True]}

        own = recipe.checkpointing
        single = rows[own]["one_gpu"]
        gib = single["gib"]
        activations = without_with(rows, "one_gpu", "activations", own)
        peaks = [without_with(rows, key, None, own) for key in ["one_gpu", *(f"fsdp_{g}" for g in args.gpus)]]
        print(f"{recipe.name:26} {single['parameters'] / 1e9:6.2f}B {single['trainable'] / 1e6:7.1f}M "
              f"{gib['weights']:7.1f} {gib['trainable_state']:6.1f} {gib['reference']:5.1f} "
              f"{gib['frozen_extras']:6.1f} {activations:>11} {gib['rollout_kv_cache']:5.1f}"
              + "".join(f" {peak:>13}" for peak in peaks))
    if args.check:
        results["check"] = check()
        print("\ncheck on tiny CPU models, float32 unless marked (measured / estimated bytes):")
        for row in results["check"]:
            print(f"  {row['model']:58} {row['measured_bytes']:>10,} / {row['estimated_bytes']:>12,.0f}"
                  f" = {row['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
