"""The grounding world's model: a small Qwen2.5-VL (or Qwen2-VL) built from transformers' config classes.

Nothing is downloaded. The tokenizer is a byte-level BPE trained here on the world's own text (questions, the R1
format instruction, thinking parts and answers in every box convention) with Qwen2's pre-tokenisation (digits one
by one, as Qwen's tokenizers split numbers), the Qwen special tokens, and ``<think>``, ``</think>``, ``<answer>``,
``</answer>`` as single tokens; it is wrapped as ``Qwen2Tokenizer`` with the Qwen chat layout of
:mod:`mmrl.plugins.vlm.testing`. The image processor resizes images by smart_resize into
[:data:`MIN_PIXELS`, :data:`MAX_PIXELS`] (16 to 64 image tokens of 28 × 28 pixels). The model is
``Qwen2_5_VLForConditionalGeneration`` (or ``Qwen2VLForConditionalGeneration``) with the sizes of :data:`DIMS`:
a 4-layer language model of width 128 and a 4-block vision tower of width 96 (window attention in blocks 0–2, full
attention in block 3, as Qwen2.5-VL alternates them), about 1.6 M parameters, 6.4 MB in float32.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from mmrl.plugins.vlm.grounding import world

MIN_PIXELS = 16 * 28 * 28
"""Smallest resized image area: 16 image tokens."""
MAX_PIXELS = 64 * 28 * 28
"""Largest resized image area: 64 image tokens (224 × 224 pixels)."""
PROMPT_TEMPLATE = ("{question} Output the thinking process in <think> </think> and final answer in <answer> "
                   "</answer> tags.")
"""The R1 format instruction of R1-V, Visual-RFT and VLM-R1 (``mmrl.plugins.vlm.plugin.R1_TEMPLATE``)."""
REASONING_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
"""Qwen2's pre-tokenisation pattern (letters with one leading symbol, single digits, symbol runs, spaces)."""

DIMS: dict[str, Any] = dict(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, mrope=[4, 6, 6],
                            rope_theta=1_000_000.0, vision=96, vision_intermediate=256, depth=4, vision_heads=4)
"""Model sizes. M-RoPE sections sum to head_dim / 2 = 16 (temporal 4, height 6, width 6: Qwen2.5-VL's 16/24/24 of
64 scaled down); ``rope_theta`` is the language model's rotary base, Qwen2.5-VL's 10⁶: half of the 16 frequencies
then turn by at most 10⁻³ radians per position, so attention can match a colour word of the question against an
image token whatever their distance. Where an image token lies comes from the image itself (the world's coordinate
ramp, :func:`mmrl.plugins.vlm.grounding.world.ramp`), not from the rotary phase (docs/vlm.md, "The model")."""


def corpus(seed: int = 0, answers: int = 600) -> list[str]:
    """The tokenizer's training text: every question, the format instruction, chat role names, and the answers
    of ``answers`` random records in each box convention the families write."""
    from mmrl.plugins.vlm.testing import SPECIAL_TOKENS

    rng = random.Random(seed)
    texts = [PROMPT_TEMPLATE.format(question=world.QUESTIONS[kind].format(color=c, shape=s))
             for kind in world.KINDS for c in world.COLORS for s in world.SHAPES]
    texts += ["system user assistant You are a helpful assistant.", *world.PLACES, " ".join(SPECIAL_TOKENS)]
    for record in world.make_records(answers, "train", seed):
        size = record["image_size"]
        resized = [rng.randrange(4, 12) * 28, rng.randrange(4, 12) * 28]
        for convention in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
            texts.append(world.answer_text(record, convention, resized if convention == "qwen2_5_vl" else size))
    return texts


def build_tokenizer(vocab_size: int = 600, seed: int = 0) -> Any:
    """The world's ``Qwen2Tokenizer`` (see the module docstring); deterministic for a seed."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from mmrl.plugins.vlm.testing import SPECIAL_TOKENS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(seed), trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in REASONING_TOKENS])
    return Qwen2Tokenizer(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          unk_token=None)


def model_config(family: str, tokenizer: Any, dims: dict[str, Any] | None = None) -> Any:
    """The ``Qwen2_5_VLConfig`` (or ``Qwen2VLConfig``) of the world's model, its special ids from ``tokenizer``."""
    import transformers

    from mmrl.plugins.vlm.testing import SPECIAL_TOKENS

    dims = {**DIMS, **(dims or {})}
    half_head = dims["hidden"] // dims["heads"] // 2
    if sum(dims["mrope"]) != half_head:
        raise ValueError(f"M-RoPE sections {dims['mrope']} must sum to head_dim / 2 = {half_head}")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                num_key_value_heads=dims["kv_heads"], max_position_embeddings=1024, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "mrope_section": list(dims["mrope"]),
                                 "rope_theta": float(dims["rope_theta"])},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    width, depth = dims["vision"], dims["depth"]
    if family == "qwen2_5_vl":
        vision = dict(depth=depth, hidden_size=width, intermediate_size=dims["vision_intermediate"],
                      num_heads=dims["vision_heads"], out_hidden_size=dims["hidden"], patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[depth - 1], in_channels=3)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    if family == "qwen2_vl":
        # Qwen2-VL's vision config takes an integer MLP ratio: the nearest to vision_intermediate / vision (3 here).
        vision = dict(depth=depth, embed_dim=width, hidden_size=dims["hidden"], num_heads=dims["vision_heads"],
                      mlp_ratio=max(1, round(dims["vision_intermediate"] / width)), patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    raise ValueError(f"the grounding world builds qwen2_5_vl or qwen2_vl models, not {family!r}")


def build_model(family: str = "qwen2_5_vl", *, seed: int = 0, dims: dict[str, Any] | None = None
                ) -> tuple[Any, Any]:
    """A freshly initialised ``(model, processor)`` of the world (random weights from ``seed``)."""
    import torch
    import transformers

    from mmrl.plugins.vlm.testing import build_processor

    tokenizer = build_tokenizer()
    processor = build_processor(family, tokenizer, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    config = model_config(family, tokenizer, dims)
    model_class = (transformers.Qwen2_5_VLForConditionalGeneration if family == "qwen2_5_vl"
                   else transformers.Qwen2VLForConditionalGeneration)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                                            bos_token_id=tokenizer.pad_token_id)
    return model, processor


def save(model: Any, processor: Any, directory: str | Path) -> Path:
    """Write the checkpoint (``save_pretrained`` of model and processor) so that the VLM plugin loads it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
