"""Tiny random Qwen2-VL / Qwen2.5-VL (and Qwen3-VL, Qwen3.5, GLM-4.1V, GLM-4.5V, InternVL, Gemma 4, Gemma 3, Mistral 3)
checkpoints built offline, for tests, benchmarks and the toy run.

Nothing is downloaded: a byte-level BPE tokenizer with the Qwen special tokens is trained locally on a few hundred
words, wrapped as ``Qwen2Tokenizer`` with a Qwen-style chat template; the image processor keeps images small
(4·28² to 16·28² pixels by default); the model is built from its config classes with random weights. Everything is
written with ``save_pretrained`` so that the plugin loads it the way users load real checkpoints::

    python -m mmrl.plugins.vlm.testing qwen2_5_vl runs/vlm/tiny-qwen2_5_vl

Sizes (about 105k parameters): text hidden 32, intermediate 64, 2 layers, 4 heads, 2 KV heads, M-RoPE sections
[2, 1, 1] (their sum is head_dim / 2); vision depth 2, width 32, 4 heads, 14-pixel patches merged 2×2 (16-pixel
patches for Qwen3-VL and Qwen3.5), merger output = text hidden size; Qwen3.5 alternates Gated DeltaNet and
full-attention layers. A 100×80 image becomes a 6×8 patch grid, 12 image tokens. The GLM builds use a tokenizer with
GLM-4.1V's special tokens and chat layout (:data:`GLM_CHAT_TEMPLATE`) and half as many, twice as wide heads (GLM rotates
half of each head); the GLM-4.6V builds (:data:`GLM46V_FAMILIES`) put the same text models and tower under
``Glm46VConfig``. The InternVL build has InternVL3-hf's tokens and chat layout (:data:`INTERNVL_CHAT_TEMPLATE`), a
ViT on 56-pixel tiles (4 image tokens per tile; an image becomes 1 to ``max_pixels / 56²`` tiles, plus a thumbnail
when more than one) and a Qwen2 language model of the same text size; ``internvl_moe`` has InternVL3.5-30B-A3B's
Qwen3-MoE language model instead (4 experts, 2 per token, in every layer). The Gemma 4 build has Gemma 4's tokens
and chat layout (:data:`GEMMA4_CHAT_TEMPLATE`), a ViT on 4-pixel patches pooled 3 × 3 (70 soft tokens per image at the
tests' pixel bounds) and a 4-layer language model with every text feature of the released variants
(:func:`_gemma4_config`); ``gemma4_moe`` adds the 26B-A4B's routed experts to every layer (4 experts, 2 per token).
The Gemma 3 build has Gemma 3's tokens and chat layout (:data:`GEMMA3_CHAT_TEMPLATE`), a SigLIP tower on
:data:`GEMMA3_IMAGE`-pixel images of 4-pixel patches pooled 2 × 2 into 16 soft tokens per image (the released
checkpoints: 896 pixels, 14-pixel patches pooled 4 × 4 into 256) and a 4-layer language model with sliding-window
and full-attention layers (:func:`_gemma3_config`).
The Mistral 3 build has the Mistral tokens and chat layout (:data:`MISTRAL3_CHAT_TEMPLATE`), a Pixtral tower on
:data:`MISTRAL3_PATCH`-pixel patches merged 2 × 2 (images of up to :data:`MISTRAL3_LONGEST_EDGE` pixels a side, aspect
kept) and a 2-layer Ministral 3 language model with YaRN and its position-dependent query scaling
(:func:`_mistral3_config`).
The SmolVLM build (``smolvlm``; ``idefics3`` is the same model as transformers' Idefics3, the SmolVLM-Instruct v1
checkpoints) has SmolVLM's tokens and chat layout (:data:`SMOLVLM_CHAT_TEMPLATE`), images scaled to a longest edge of
:data:`SMOLVLM_LONGEST_EDGE` pixels and cut into :data:`SMOLVLM_TILE`-pixel tiles plus a global view, a SigLIP tower
on 7-pixel patches whose 4 × 4 patches pixel shuffle turns into :data:`SMOLVLM_TOKENS` tokens per tile, and a
2-layer Llama (SmolLM2) language model (:func:`_smolvlm_config`).
``size="small"`` (about 5M parameters: text hidden 256, 4 layers; vision width 128, depth 4) is for benchmarks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "glm4v", "glm4v_moe",
            "internvl", "internvl_moe", "gemma4", "gemma4_moe", "gemma3", "mistral3", "smolvlm", "idefics3",
            "glm46v", "glm46v_moe")
GLM_FAMILIES = ("glm4v", "glm4v_moe")
GLM46V_FAMILIES = ("glm46v", "glm46v_moe")
"""The GLM-4.6V builds (both ``model_type: glm46v``, loaded by ``family: glm46v``): ``glm46v`` has GLM-4.6V-Flash's
dense language model (``glm4v_text``), ``glm46v_moe`` GLM-4.6V's mixture of experts (``glm4v_moe_text``); GLM-4.1V's
tokenizer, chat layout and tower sizes (:func:`_glm46v_config`)."""
GEMMA4_FAMILIES = ("gemma4", "gemma4_moe")
"""The Gemma 4 builds: ``gemma4_moe`` is the same model with 26B-A4B's routed experts (both ``model_type: gemma4``,
loaded by ``family: gemma4``)."""
INTERNVL_FAMILIES = ("internvl", "internvl_moe")
SMOLVLM_FAMILIES = ("smolvlm", "idefics3")
"""The SmolVLM builds: ``smolvlm`` (SmolVLM2, ``SmolVLMForConditionalGeneration``) and ``idefics3`` (SmolVLM-Instruct
v1, ``Idefics3ForConditionalGeneration``, Idefics3's processor), the same tokens, sizes and chat layout."""
"""The InternVL builds: ``internvl_moe`` has InternVL3.5's Qwen3-MoE language model (both ``model_type: internvl``,
loaded by ``family: internvl``)."""

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's chat layout (``<|im_start|>role\\n...<|im_end|>``); each image becomes
``<|vision_start|><|image_pad|><|vision_end|>`` and each video ``<|vision_start|><|video_pad|><|vision_end|>`` (as
in the Qwen2-VL, Qwen2.5-VL and Qwen3-VL templates, without their "Picture k:"/"Video k:" labels)."""

GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|image|>", "<|video|>", "<|begin_of_box|>", "<|end_of_box|>",
)
"""GLM-4.1V's special tokens (its tokenizer_config.json's added tokens that the chat and the vision input use)."""

GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""GLM-4.1V's chat layout (``[gMASK]<sop>``, then ``<|role|>\n`` before each turn's content, no end-of-turn token: the
next role token ends a turn, so ``<|user|>`` and ``<|observation|>`` are generation EOS ids); each image becomes
``<|begin_of_image|><|image|><|end_of_image|>`` and each video ``<|begin_of_video|><|video|><|end_of_video|>``
(without the released template's thinking switches)."""

INTERNVL_SPECIAL_TOKENS = SPECIAL_TOKENS + (
    "<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>",
)
"""The InternVL3-hf tokenizer's added tokens beside Qwen's: the image delimiters and context token, the video
placeholder, and the grounding tags ``<ref>``/``<box>``/``<quad>``."""

INTERNVL_TOKENIZER_ROLES = {"start_image_token": "<img>", "end_image_token": "</img>",
                            "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
"""The tokenizer attributes ``InternVLProcessor`` reads (``tokenizer.start_image_token`` and its ``_id``, ...): the
``extra_special_tokens`` of the InternVL3-hf tokenizer_config.json."""

INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'video' or 'video' in part %}<video>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""InternVL3-hf's chat layout (Qwen's ``<|im_start|>role\n...<|im_end|>``); each image is ``<IMG_CONTEXT>\n``, which the
processor expands to ``<img>`` + the tiles' context tokens + ``</img>`` (the turns and image lines only, not every
detail of the released template)."""

GEMMA4_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image|>", "<|image>", "<image|>", "<|video|>", "<|audio|>",
    "<|audio>", "<audio|>", "<|channel>", "<channel|>", "<|think|>",
)
"""The Gemma 4 tokenizer's special tokens that the chat, the image input and the tiny build use: PAD, EOS and BOS
(ids 0, 1, 2 as in the released vocabulary), the turn markers, the image placeholder and its delimiters, the video and
audio placeholders (the processor looks the audio delimiters up even for images) and the thinking channel."""

GEMMA4_TOKENIZER_ROLES = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                          "video_token": "<|video|>", "audio_token": "<|audio|>", "boa_token": "<|audio>",
                          "eoa_token": "<audio|>", "sot_token": "<|turn>", "eot_token": "<turn|>"}
"""The tokenizer attributes ``Gemma4Processor`` reads (``tokenizer.image_token`` and its ``_id``, ``boi_token``, ...):
the ``extra_special_tokens`` transformers' ``models/gemma4/convert_gemma4_weights.py`` writes."""

GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<|image|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|video|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
"""Gemma 4's chat layout (``<bos>``, then ``<|turn>role\n...<turn|>\n`` per turn, the assistant's role written
``model``); each image is ``<|image|>``, which the processor expands to ``<|image>`` + the image's soft tokens +
``<image|>`` (the turns and image markers only, not the released template's thinking and tool-call parts)."""

GEMMA3_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                         "<end_of_image>", "<image_soft_token>")
"""The Gemma 3 tokenizer's special tokens that the chat, the image input and the tiny build use: PAD, EOS, BOS and UNK
(ids 0 to 3 as in the released vocabulary), the turn markers, the image delimiters and the soft-token placeholder."""

GEMMA3_TOKENIZER_ROLES = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                          "eoi_token": "<end_of_image>"}
"""The tokenizer attributes ``Gemma3Processor`` reads (``tokenizer.image_token`` and its ``_id``, ``boi_token``,
``eoi_token``; transformers 5.25 ``models/gemma3/processing_gemma3.py`` ``Gemma3Processor.__init__``)."""

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_prefix = (messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'][0]['text']) + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ first_prefix if loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma 3's chat layout (the ``chat_template`` of google/gemma-3-4b-it's tokenizer_config.json): ``<bos>``, then
``<start_of_turn>role\n...<end_of_turn>\n`` per turn, the assistant's role written ``model``, texts trimmed; Gemma 3
has no system role: a system message's text and a blank line open the first user turn. Each image is
``<start_of_image>``, which the processor expands to ``\n\n<start_of_image>`` + the image's soft tokens +
``<end_of_image>\n\n`` (without the released template's role-alternation check)."""

GEMMA3_IMAGE, GEMMA3_PATCH, GEMMA3_TOKENS = 32, 4, 16
"""Image side, patch side and soft tokens per image of the tiny Gemma 3 build (the released checkpoints: 896, 14 and
256): 8 × 8 patches average-pooled 2 × 2 by the projector into 4 × 4 soft tokens."""

GEMMA3_PROJECTION_STD = 0.1
"""Initial spread of the tiny Gemma 3 build's ``mm_input_projection_weight``, which transformers initialises at zero
(``Gemma3PreTrainedModel._init_weights``: the released weights replace it), so that the image features are not zero
and the images change the log-probs."""

MISTRAL3_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                           "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[PAD]", "[IMG_BREAK]",
                           "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
"""The first special tokens of Mistral's tekken vocabulary, at their released ids (``<s>`` 1, ``</s>`` 2, ``[INST]`` 3,
``[/INST]`` 4, ``[IMG]`` 10 = ``Mistral3Config.image_token_index``'s default, ``[PAD]`` 11, ``[IMG_BREAK]`` 12,
``[IMG_END]`` 13, ``[SYSTEM_PROMPT]`` 17, ``[/SYSTEM_PROMPT]`` 18; mistralai/Mistral-Small-3.1-24B-Instruct-2503
``tokenizer.json``)."""

MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "[SYSTEM_PROMPT]{{ messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'][0]['text'] }}[/SYSTEM_PROMPT]{% set turns = messages[1:] %}"
    "{% else %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
"""Mistral Small 3.1's chat layout (the ``chat_template`` of mistralai/Mistral-Small-3.1-24B-Instruct-2503):
``<s>``, a system message as ``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]``, each user turn ``[INST]...[/INST]`` with an
``[IMG]`` per image (which the processor expands to the image's rows of ``[IMG]`` ended by ``[IMG_BREAK]``, the last
by ``[IMG_END]``), an assistant turn its text and ``</s>``. There is no generation prompt: the assistant answers
right after ``[/INST]``. The released template writes a long default system prompt with the day's date
(``strftime_now``) when the chat has none, and refuses other part types; this one writes none."""

SMOLVLM_ROW_COL_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
"""The tile position tokens ``<row_r_col_c>`` of SmolVLM's vocabulary (6 × 6 of them; transformers' Idefics3Processor
looks up ``<row_{1..6}_col_{1..6}>``, ``processing_idefics3.py:60-62``)."""

SMOLVLM_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>",
                          "<fake_token_around_image>", "<image>", "<global-img>", "<video>") + SMOLVLM_ROW_COL_TOKENS
"""The SmolVLM tokenizer's special tokens that the chat and the image input use: UNK ``<|endoftext|>``, BOS
``<|im_start|>``, PAD ``<|im_end|>``, EOS ``<end_of_utterance>`` (the roles of the released SmolVLM2
tokenizer_config.json as far as checked here), the image delimiter, placeholder and global-view tokens, the video
placeholder and the tile position tokens."""

SMOLVLM_TOKENIZER_ROLES = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                           "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
"""The tokenizer attributes ``SmolVLMProcessor`` reads (``tokenizer.image_token``, ``fake_image_token``, ...;
transformers 5.25 ``models/smolvlm/processing_smolvlm.py:118-124``)."""

SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
"""SmolVLM's chat layout (transformers 5.25 ``processing_smolvlm.py:45`` ``DEFAULT_CHAT_TEMPLATE``, the released
SmolVLM2 template with its video part): ``<|im_start|>`` once, then ``Role: text<end_of_utterance>\n`` per turn, the
role capitalised (``User``, ``System``, ``Assistant``), no space after the colon when the turn opens with an image; the
generation prompt is ``Assistant:``. Each image is ``<image>``, which the processor expands to the image's tiles and
global view."""

SMOLVLM_TILE, SMOLVLM_LONGEST_EDGE, SMOLVLM_PATCH, SMOLVLM_SCALE = 28, 112, 7, 2
"""Tile side (``max_image_size``, the tower's ``image_size``), the image processor's ``longest_edge`` (4 tiles, as
released: SmolVLM2-2.2B 384 and 1536), the tower's patch side and the connector's pixel-shuffle factor of the tiny
SmolVLM builds (released 2.2B: 14 and 3; 256M/500M: 512-pixel tiles, 16 and 4). At the tests' pixel bounds (4·28² to
16·28²) the longest edge stays 112 = √(16·28²) and the smallest canvas, 112 × 28, is exactly ``min_pixels``."""
SMOLVLM_TOKENS = (SMOLVLM_TILE // SMOLVLM_PATCH) ** 2 // SMOLVLM_SCALE ** 2
"""Image tokens per tile or global view (``image_seq_len``): 4 × 4 patches shuffled 2 × 2 into 4 (released 2.2B: 81,
256M/500M: 64)."""

MISTRAL3_PATCH, MISTRAL3_MERGE, MISTRAL3_LONGEST_EDGE = 8, 2, 128
"""Patch side, spatial merge and the image processor's ``longest_edge`` of the tiny Mistral 3 build (the released
checkpoints: 14, 2 and 1540): an image token covers 16 × 16 pixels."""

GEMMA4_PATCH, GEMMA4_POOLING = 4, 3
"""Patch side and pooling kernel of the tiny Gemma 4 builds (the released checkpoints: 16 and 3): an image becomes
soft tokens of 12 × 12 pixels, at most ``max_soft_tokens`` of them (70 at the tests' pixel bounds)."""

INTERNVL_TILE = 56
"""Tile side of the tiny InternVL builds (the released checkpoints: 448): 4 × 4 patches of 14 pixels, 2 × 2 image
tokens per tile after pixel shuffle."""

_CORPUS = (
    "Where is the red circle? Where is the green square? Where is the blue triangle? Where is the yellow circle? "
    "How many squares are there in the image? How many circles are there? How many triangles are there? "
    "Output the thinking process in <think> </think> and final answer in <answer> </answer> tags. "
    "<think> I see a red circle at the top left. </think> <answer> {\"bbox_2d\": [12, 34, 56, 78], "
    "\"label\": \"red circle\"} </answer> <answer> 3 </answer> [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] (10,20),(30,40) "
    "You are a helpful assistant. Please provide the bounding box coordinate of the region this sentence describes. "
    "Answer the question with a number. system user assistant image object box"
)


def _bpe(special_tokens: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``special_tokens``, trained on the small fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS] * 8, trainer)
    return tokenizer


def build_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` with the Qwen special tokens (EOS ``<|im_end|>``, PAD
    ``<|endoftext|>``), trained on a small fixed corpus; deterministic."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(tokenizer_object=_bpe(SPECIAL_TOKENS, vocab_size), eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", unk_token=None)


def build_glm_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with GLM-4.1V's special tokens (EOS and PAD ``<|endoftext|>``), trained on the same
    small corpus; deterministic."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(GLM_SPECIAL_TOKENS, vocab_size), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def build_internvl_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` with the Qwen special tokens and InternVL's (:data:`INTERNVL_SPECIAL_TOKENS`,
    the roles of :data:`INTERNVL_TOKENIZER_ROLES`), trained on the same small corpus; deterministic."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(tokenizer_object=_bpe(INTERNVL_SPECIAL_TOKENS, vocab_size), eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", unk_token=None,
                          extra_special_tokens=dict(INTERNVL_TOKENIZER_ROLES))


def build_gemma4_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with Gemma 4's special tokens (:data:`GEMMA4_SPECIAL_TOKENS`, BOS ``<bos>``, EOS
    ``<eos>``, PAD ``<pad>``, the roles of :data:`GEMMA4_TOKENIZER_ROLES`), trained on the same small corpus;
    deterministic. Like the released tokenizer it adds no ``<bos>`` to the texts it encodes (transformers'
    ``convert_gemma4_weights.py`` builds it with ``add_bos_token=False``): the chat template writes the one ``<bos>``
    (:data:`GEMMA4_CHAT_TEMPLATE`, as the released template's ``{{- bos_token }}`` does)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(GEMMA4_SPECIAL_TOKENS, vocab_size), bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>", add_bos_token=False,
                                   extra_special_tokens=dict(GEMMA4_TOKENIZER_ROLES))


def build_gemma3_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with Gemma 3's special tokens (:data:`GEMMA3_SPECIAL_TOKENS`, BOS ``<bos>``, EOS
    ``<eos>``, PAD ``<pad>``, the roles of :data:`GEMMA3_TOKENIZER_ROLES`), trained on the same small corpus;
    deterministic. Like the released tokenizer (``add_bos_token: true``) it writes ``<bos>`` before every text it
    encodes with special tokens, which the chat template also writes: whoever tokenizes a rendered chat must not add
    it again (:meth:`~mmrl.plugins.vlm.adapters.gemma3.Gemma3Adapter.encode`)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(GEMMA3_SPECIAL_TOKENS, vocab_size), bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", add_bos_token=True,
                                   extra_special_tokens=dict(GEMMA3_TOKENIZER_ROLES))


def build_mistral3_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with Mistral's special tokens (:data:`MISTRAL3_SPECIAL_TOKENS`, BOS ``<s>``, EOS
    ``</s>``, PAD ``[PAD]``), trained on the same small corpus; deterministic. It writes ``<s>`` before every text it
    encodes with special tokens (``add_bos_token``, the Llama-style tokenizers' default), which the chat template also
    writes: a rendered chat is tokenized without special tokens (transformers' rule,
    :meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.adds_special_tokens`), so the prompts hold one ``<s>`` either
    way."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(MISTRAL3_SPECIAL_TOKENS, vocab_size), bos_token="<s>",
                                   eos_token="</s>", pad_token="[PAD]", unk_token="<unk>", add_bos_token=True)


def build_smolvlm_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with SmolVLM's special tokens (:data:`SMOLVLM_SPECIAL_TOKENS`, BOS ``<|im_start|>``,
    EOS ``<end_of_utterance>``, PAD ``<|im_end|>``, UNK ``<|endoftext|>``, the roles of
    :data:`SMOLVLM_TOKENIZER_ROLES`), trained on the same small corpus; deterministic. It adds no BOS to the texts it
    encodes (the SmolLM2 tokenizers' GPT-2 style); the chat template writes ``<|im_start|>`` once."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(SMOLVLM_SPECIAL_TOKENS, vocab_size), bos_token="<|im_start|>",
                                   eos_token="<end_of_utterance>", pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                   add_bos_token=False, extra_special_tokens=dict(SMOLVLM_TOKENIZER_ROLES))


def build_processor(family: str, tokenizer: Any, *, min_pixels: int, max_pixels: int) -> Any:
    """The family's processor around ``tokenizer`` with the chat template and small image bounds."""
    import transformers

    if family in INTERNVL_FAMILIES:  # tiles of INTERNVL_TILE pixels, as many as the pixel bounds allow (adapter's rule)
        from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

        tile = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
        area = INTERNVL_TILE ** 2
        image_processor = transformers.GotOcr2ImageProcessor(
            size=tile, crop_to_patches=True, min_patches=max(1, -(-min_pixels // area)),
            max_patches=max(1, max_pixels // area))
        return transformers.InternVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                              video_processor=InternVLVideoProcessor(size=tile),
                                              image_seq_length=(INTERNVL_TILE // 14 // 2) ** 2,
                                              chat_template=INTERNVL_CHAT_TEMPLATE)

    if family in GEMMA4_FAMILIES:  # every image resized to fill its soft-token budget (min_pixels plays no part)
        from mmrl.plugins.vlm.adapters.gemma4 import soft_token_budget

        budget = dict(patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOLING,
                      max_soft_tokens=soft_token_budget(max_pixels, GEMMA4_PATCH, GEMMA4_POOLING))
        return transformers.Gemma4Processor(
            feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
            image_processor=transformers.Gemma4ImageProcessor(**budget), tokenizer=tokenizer,
            video_processor=transformers.Gemma4VideoProcessor(**budget), chat_template=GEMMA4_CHAT_TEMPLATE,
            image_seq_length=budget["max_soft_tokens"])

    if family == "gemma3":  # every image resized to the tower's fixed square (the pixel bounds play no part)
        image_processor = transformers.Gemma3ImageProcessor(size={"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE})
        return transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=GEMMA3_TOKENS)

    if family in SMOLVLM_FAMILIES:  # longest edge scaled to SMOLVLM_LONGEST_EDGE, cut into SMOLVLM_TILE tiles
        sizes = dict(size={"longest_edge": SMOLVLM_LONGEST_EDGE}, max_image_size={"longest_edge": SMOLVLM_TILE},
                     do_image_splitting=True)
        if family == "idefics3":
            return transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessor(**sizes),
                                                  tokenizer=tokenizer, image_seq_len=SMOLVLM_TOKENS,
                                                  chat_template=SMOLVLM_CHAT_TEMPLATE)
        return transformers.SmolVLMProcessor(image_processor=transformers.SmolVLMImageProcessor(**sizes),
                                             tokenizer=tokenizer, video_processor=transformers.SmolVLMVideoProcessor(),
                                             image_seq_len=SMOLVLM_TOKENS, chat_template=SMOLVLM_CHAT_TEMPLATE)

    if family == "mistral3":  # longest edge at most MISTRAL3_LONGEST_EDGE, sides multiples of patch x merge
        image_processor = transformers.PixtralImageProcessor(size={"longest_edge": MISTRAL3_LONGEST_EDGE},
                                                             patch_size={"height": MISTRAL3_PATCH,
                                                                         "width": MISTRAL3_PATCH})
        return transformers.PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                             patch_size=MISTRAL3_PATCH, spatial_merge_size=MISTRAL3_MERGE,
                                             chat_template=MISTRAL3_CHAT_TEMPLATE)

    if family in GLM46V_FAMILIES:  # GLM-4.1V's resizing under GLM-4.6V's classes (its frame timestamps differ)
        image_processor = transformers.Glm46VImageProcessor(
            size={"shortest_edge": 2 * min_pixels, "longest_edge": 2 * max_pixels})
        return transformers.Glm46VProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            video_processor=transformers.Glm46VVideoProcessor(),
                                            chat_template=GLM_CHAT_TEMPLATE)

    if family in GLM_FAMILIES:  # GLM-4.5V ships GLM-4.1V's processor; its bounds count an image as 2 frames
        from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

        image_processor = transformers.Glm4vImageProcessor(
            size={"shortest_edge": 2 * min_pixels, "longest_edge": 2 * max_pixels})
        return transformers.Glm4vProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                           video_processor=Glm4vVideoProcessor(), chat_template=GLM_CHAT_TEMPLATE)

    qwen3 = family.startswith("qwen3")
    patch_size = 16 if qwen3 else 14
    image_processor = transformers.Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels,
                                                         patch_size=patch_size, merge_size=2)
    if qwen3:  # Qwen3.5 and the MoE models ship Qwen3-VL's processor (transformers' processing_auto)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return transformers.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                             video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor_class = transformers.Qwen2VLProcessor if family == "qwen2_vl" else transformers.Qwen2_5_VLProcessor
    return processor_class(image_processor=image_processor, tokenizer=tokenizer,
                           video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)


SIZES: dict[str, dict[str, Any]] = {
    # text width, MLP width, layers, heads, KV heads, M-RoPE sections (sum = head_dim / 2), vision width and depth
    "tiny": dict(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, mrope=[2, 1, 1], vision=32, depth=2),
    "small": dict(hidden=256, intermediate=1024, layers=4, heads=8, kv_heads=4, mrope=[8, 4, 4], vision=128,
                  depth=4),
}
"""Model sizes: ``tiny`` (~105k parameters, tests) and ``small`` (a few million, benchmarks where compute should
dominate Python overhead)."""


def tiny_config(family: str, tokenizer: Any, size: str = "tiny") -> Any:
    """The model config of a tiny ``family`` model whose vocabulary and special ids match ``tokenizer``."""
    import transformers

    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {', '.join(SIZES)}")
    dims = SIZES[size]
    if family in GLM_FAMILIES:
        return _glm_config(family, tokenizer, dims)
    if family in GLM46V_FAMILIES:
        return _glm46v_config(family, tokenizer, dims)
    if family in INTERNVL_FAMILIES:
        return _internvl_config(tokenizer, dims, moe=family == "internvl_moe")
    if family in GEMMA4_FAMILIES:
        return _gemma4_config(tokenizer, dims, moe=family == "gemma4_moe")
    if family == "gemma3":
        return _gemma3_config(tokenizer, dims)
    if family == "mistral3":
        return _mistral3_config(tokenizer, dims)
    if family in SMOLVLM_FAMILIES:
        return _smolvlm_config(family, tokenizer, dims)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    hidden, width, depth, heads = dims["hidden"], dims["vision"], dims["depth"], dims["heads"]
    fullatt = [depth - 1]
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if family == "qwen2_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": dims["mrope"]}
        vision = dict(depth=depth, embed_dim=width, hidden_size=hidden, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    if family == "qwen2_5_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": dims["mrope"]}
        vision = dict(depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=4, out_hidden_size=hidden,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=fullatt, in_channels=3)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    # MoE layers: 4 experts of width intermediate / 2, 2 per token (Qwen3-VL-30B-A3B: 128 and 8; Qwen3.5-MoE: 256
    # and 8, with a shared expert).
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=dims["intermediate"] // 2)
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        text.update(head_dim=hidden // heads, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": dims["mrope"],
                                                               "mrope_interleaved": True})
        vision = dict(depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=4,
                      out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=64, deepstack_visual_indexes=fullatt, in_channels=3)
        if family == "qwen3_vl_moe":
            text.update(moe, decoder_sparse_step=1)
            return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **special)
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **special)
    if family in ("qwen3_5", "qwen3_5_moe"):
        # Gated DeltaNet (linear attention) and full attention alternate, as Qwen3.5's full_attention_interval does.
        layers = max(2, dims["layers"])
        text.update(head_dim=hidden // heads, num_hidden_layers=layers, linear_conv_kernel_dim=4,
                    linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads,
                    linear_num_key_heads=dims["kv_heads"], linear_num_value_heads=heads,
                    layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": dims["mrope"],
                                     "mrope_interleaved": True, "partial_rotary_factor": 1.0})
        vision = dict(depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=4,
                      out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=64, in_channels=3)
        if family == "qwen3_5_moe":
            text.pop("intermediate_size")
            text.update(moe, shared_expert_intermediate_size=dims["intermediate"] // 2)
            return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **special)
        return transformers.Qwen3_5Config(text_config=text, vision_config=vision, **special)
    raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")


def _glm_config(family: str, tokenizer: Any, dims: dict[str, Any]) -> Any:
    """GLM-4.1V / GLM-4.5V: half the head dimension rotates (partial_rotary_factor 0.5, as the released configs), so
    the heads are twice as wide as the Qwen builds' to keep M-RoPE sections [2, 1, 1]; the MoE text model has 4
    routed experts (2 per token) and a shared expert after one dense layer (GLM-4.5V: 128 and 8, first_k_dense 1)."""
    import transformers

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in GLM_SPECIAL_TOKENS}
    hidden, heads = dims["hidden"], max(1, dims["heads"] // 2)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"], num_attention_heads=heads, num_key_value_heads=max(1, dims["kv_heads"] // 2),
        max_position_embeddings=1024, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": dims["mrope"]},
    )
    vision = dict(depth=dims["depth"], hidden_size=dims["vision"], intermediate_size=2 * dims["vision"], num_heads=4,
                  out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=56,
                  in_channels=3)
    special = dict(image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                   image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                   video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
                   tie_word_embeddings=True)
    if family == "glm4v_moe":
        text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=dims["intermediate"] // 2,
                    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, attention_bias=True)
        return transformers.Glm4vMoeConfig(text_config=text, vision_config=vision, **special)
    return transformers.Glm4vConfig(text_config=text, vision_config=vision, **special)


def _glm46v_config(family: str, tokenizer: Any, dims: dict[str, Any]) -> Any:
    """GLM-4.6V-Flash (``glm46v``) and GLM-4.6V (``glm46v_moe``) under ``Glm46VConfig``: the text model of the tiny
    GLM-4.1V build (``glm4v_text``) or of the tiny GLM-4.5V build (``glm4v_moe_text``: 4 routed experts, 2 per token, a
    shared expert after one dense layer), and the tiny GLM-4.1V tower (``glm4v_vision``, ``Glm46VConfig``'s default
    vision model), with the vision token ids of GLM's tokenizer; the LM head untied, ``Glm46VConfig``'s default."""
    import transformers

    text = _glm_config("glm4v_moe" if family == "glm46v_moe" else "glm4v", tokenizer, dims)
    tower = _glm_config("glm4v", tokenizer, dims)
    special = {key: getattr(tower, key) for key in ("image_token_id", "video_token_id", "image_start_token_id",
                                                    "image_end_token_id", "video_start_token_id",
                                                    "video_end_token_id")}
    return transformers.Glm46VConfig(text_config=text.text_config.to_dict(),
                                     vision_config=tower.vision_config.to_dict(), tie_word_embeddings=False,
                                     **special)


def _internvl_config(tokenizer: Any, dims: dict[str, Any], *, moe: bool = False) -> Any:
    """InternVL3: InternViT on :data:`INTERNVL_TILE`-pixel tiles (14-pixel patches, a CLS token dropped by the
    "default" feature strategy, pixel shuffle 0.5) and a Qwen2 language model with plain 1-D rotary positions (the
    size's text dimensions; InternVL3.5 has a Qwen3 language model instead).

    ``moe``: InternVL3.5-30B-A3B's Qwen3-MoE language model (``text_config.model_type: qwen3_moe``; transformers'
    ``Qwen3MoeSparseMoeBlock``: a router ``mlp.gate`` and fused experts ``mlp.experts.gate_up_proj [E, 2·I, H]``,
    ``mlp.experts.down_proj [E, H, I]``) in every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``, top-k
    weights renormalised: ``norm_topk_prob``, as the released Qwen3-30B-A3B config), here 4 experts of width
    intermediate / 2, 2 per token (128 and 8 released)."""
    import transformers

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in INTERNVL_SPECIAL_TOKENS}
    text = dict(
        model_type="qwen2", vocab_size=len(tokenizer), hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"], num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    if moe:
        text.update(model_type="qwen3_moe", head_dim=dims["hidden"] // dims["heads"], num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=dims["intermediate"] // 2, decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=True)
    vision = dict(hidden_size=dims["vision"], num_hidden_layers=dims["depth"], num_attention_heads=4,
                  intermediate_size=2 * dims["vision"], image_size=INTERNVL_TILE, patch_size=14)
    return transformers.InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
                                       image_seq_length=(INTERNVL_TILE // 14 // 2) ** 2, downsample_ratio=0.5,
                                       tie_word_embeddings=True)


def _gemma4_config(tokenizer: Any, dims: dict[str, Any], *, moe: bool = False) -> Any:
    """Gemma 4 with every text feature of the released variants in one tiny model (transformers'
    ``models/gemma4/convert_gemma4_weights.py`` ``_VARIANTS``): sliding-window and full-attention layers (a window of
    16 tokens, shorter than the tests' prompts, so the windows bind), the last two layers reusing the first two's keys
    and values (E2B/E4B's ``num_kv_shared_layers``), per-layer input embeddings (E2B/E4B), bidirectional attention
    inside image blocks, shared key/value projections and their own KV heads and head width on the full-attention
    layers (31B, 26B-A4B: ``use_bidirectional_attention: vision``, ``attention_k_eq_v``), and the final logit
    soft-capping every variant has, at 2.0 instead of 30.0 with embeddings initialised 15 times wider than the default
    (0.3 against 0.02) so that the random model's logits reach the cap's bend and dropping it shows in the log-probs.
    The vision tower: 2 layers on :data:`GEMMA4_PATCH`-pixel patches pooled :data:`GEMMA4_POOLING` × 3.

    ``moe``: the 26B-A4B's mixture of experts (``enable_moe_block``): every decoder layer adds, beside its dense MLP,
    a router (``router.proj``, ``router.scale``, ``router.per_expert_scale``) and fused experts
    (``experts.gate_up_proj [E, 2·I, H]``, ``experts.down_proj [E, H, I]``; transformers' ``Gemma4TextDecoderLayer``),
    here 4 experts of width intermediate / 2, 2 per token."""
    import transformers

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in GEMMA4_SPECIAL_TOKENS}
    hidden, heads = dims["hidden"], dims["heads"]
    text = dict(
        vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer), hidden_size=hidden,
        intermediate_size=dims["intermediate"], num_hidden_layers=4, num_attention_heads=heads,
        num_key_value_heads=dims["kv_heads"], head_dim=hidden // heads, global_head_dim=2 * hidden // heads,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
        use_bidirectional_attention="vision", final_logit_softcapping=2.0, max_position_embeddings=1024,
        initializer_range=0.3,
        **(dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=dims["intermediate"] // 2)
           if moe else {}),
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}},
    )
    vision = dict(hidden_size=dims["vision"], intermediate_size=2 * dims["vision"], num_hidden_layers=dims["depth"],
                  num_attention_heads=4, num_key_value_heads=4, head_dim=dims["vision"] // 4,
                  patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOLING, position_embedding_size=128)
    return transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                     image_token_id=ids["<|image|>"], boi_token_id=ids["<|image>"],
                                     eoi_token_id=ids["<image|>"], video_token_id=ids["<|video|>"],
                                     audio_token_id=ids["<|audio|>"], boa_token_id=ids["<|audio>"],
                                     eoa_token_index=ids["<audio|>"], tie_word_embeddings=True)


def _gemma3_config(tokenizer: Any, dims: dict[str, Any]) -> Any:
    """Gemma 3 (4B/12B/27B: ``Gemma3ForConditionalGeneration``) with the released text features: sliding-window and
    full-attention layers alternating over 4 layers (a window of 16 tokens, shorter than the tests' prompts, so the
    window binds; the released models: 1,024 tokens, five sliding layers per full one; two full layers here, so that
    the image tokens' states reach the completion visibly), RoPE with base 10,000 on the sliding layers and base 10⁶
    with linear scaling 8 on the full ones (google/gemma-3-4b-it config.json), QK-norm, no logit soft-capping, the
    attention scaled by ``query_pre_attn_scalar`` = head width. The vision tower: a 2-layer SigLIP on
    :data:`GEMMA3_IMAGE`-pixel images of :data:`GEMMA3_PATCH`-pixel patches without the pooling head
    (``vision_use_head: false``, as released), whose 8 × 8 patches the projector pools into :data:`GEMMA3_TOKENS`
    soft tokens."""
    import transformers

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in GEMMA3_SPECIAL_TOKENS}
    hidden, heads = dims["hidden"], dims["heads"]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=dims["intermediate"], num_hidden_layers=4,
        num_attention_heads=heads, num_key_value_heads=dims["kv_heads"], head_dim=hidden // heads,
        query_pre_attn_scalar=hidden // heads, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        final_logit_softcapping=None, attn_logit_softcapping=None, max_position_embeddings=1024,
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
    )
    vision = dict(model_type="siglip_vision_model", hidden_size=dims["vision"], intermediate_size=2 * dims["vision"],
                  num_hidden_layers=dims["depth"], num_attention_heads=4, image_size=GEMMA3_IMAGE,
                  patch_size=GEMMA3_PATCH, vision_use_head=False)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS,
                                     boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                                     image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)


def _mistral3_config(tokenizer: Any, dims: dict[str, Any]) -> Any:
    """Mistral 3 (``Mistral3ForConditionalGeneration``) with Ministral 3's language model (``model_type:
    ministral3``, mistralai/Ministral-3-8B-Instruct-2512 ``config.json``): YaRN rotary positions and Llama 4's
    position-dependent query scaling ``1 + β · log(1 + ⌊position / original_max_position_embeddings⌋)``
    (``modeling_ministral3.py`` ``get_llama_4_attn_scale``) with ``original_max_position_embeddings`` 16 here
    (released: 16,384), so that the scale changes within the tests' prompts and a row at the wrong positions is
    scored otherwise; no sliding window; untied head. Mistral Small 3.1/3.2 and Magistral have a plain ``mistral``
    language model, the same layers without the scaling. The vision tower: a 2-layer Pixtral on
    :data:`MISTRAL3_PATCH`-pixel patches with 2-D rotary positions up to :data:`MISTRAL3_LONGEST_EDGE` pixels a side,
    its 2 × 2 patches merged by the projector (``spatial_merge_size``, as released)."""
    import transformers

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in MISTRAL3_SPECIAL_TOKENS}
    hidden, heads = dims["hidden"], dims["heads"]
    text = dict(
        model_type="ministral3", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"], num_attention_heads=heads, num_key_value_heads=dims["kv_heads"],
        head_dim=hidden // heads, max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 32.0,
                         "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        pad_token_id=ids["[PAD]"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
    )
    vision = dict(model_type="pixtral", hidden_size=dims["vision"], intermediate_size=2 * dims["vision"],
                  num_hidden_layers=dims["depth"], num_attention_heads=4, head_dim=dims["vision"] // 4,
                  image_size=MISTRAL3_LONGEST_EDGE, patch_size=MISTRAL3_PATCH)
    return transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=ids["[IMG]"],
                                       spatial_merge_size=MISTRAL3_MERGE, vision_feature_layer=-1,
                                       tie_word_embeddings=False)


def _smolvlm_config(family: str, tokenizer: Any, dims: dict[str, Any]) -> Any:
    """SmolVLM2 (``SmolVLMConfig``) or SmolVLM-Instruct v1 (``Idefics3Config``): a SigLIP tower on
    :data:`SMOLVLM_TILE`-pixel tiles of :data:`SMOLVLM_PATCH`-pixel patches, the connector's pixel shuffle by
    :data:`SMOLVLM_SCALE` and linear projection, and a Llama (SmolLM2) language model with plain rotary positions
    (base 100,000, as SmolVLM2-500M's ``rope_theta``), untied head."""
    import transformers

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SMOLVLM_SPECIAL_TOKENS}
    hidden, heads = dims["hidden"], dims["heads"]
    text = dict(
        model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"], num_attention_heads=heads, num_key_value_heads=dims["kv_heads"],
        head_dim=hidden // heads, max_position_embeddings=1024, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 100_000.0},
        tie_word_embeddings=False, pad_token_id=ids["<|im_end|>"], bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
    )
    vision = dict(hidden_size=dims["vision"], intermediate_size=2 * dims["vision"], num_hidden_layers=dims["depth"],
                  num_attention_heads=4, image_size=SMOLVLM_TILE, patch_size=SMOLVLM_PATCH)
    config_class = transformers.Idefics3Config if family == "idefics3" else transformers.SmolVLMConfig
    return config_class(text_config=text, vision_config=vision, scale_factor=SMOLVLM_SCALE,
                        image_token_id=ids["<image>"], pad_token_id=ids["<|im_end|>"], tie_word_embeddings=False)


def build_tiny_model(family: str, directory: str | Path, *, seed: int = 0, min_pixels: int = 4 * 28 * 28,
                     max_pixels: int = 16 * 28 * 28, size: str = "tiny") -> Path:
    """Build a tiny random ``family`` checkpoint (model, tokenizer, processor, generation config) in ``directory``.

    The folder is written under a temporary name and renamed into place, so concurrent builders (several
    processes on first use) never leave a half-written checkpoint; an existing folder is left untouched.

    Returns:
        ``directory`` as a Path.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    glm = family in GLM_FAMILIES + GLM46V_FAMILIES
    tokenizer = (build_glm_tokenizer() if glm else build_internvl_tokenizer() if family in INTERNVL_FAMILIES
                 else build_gemma4_tokenizer() if family in GEMMA4_FAMILIES
                 else build_gemma3_tokenizer() if family == "gemma3"
                 else build_mistral3_tokenizer() if family == "mistral3"
                 else build_smolvlm_tokenizer() if family in SMOLVLM_FAMILIES else build_tokenizer())
    processor = build_processor(family, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels)
    config = tiny_config(family, tokenizer, size)
    model_class = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
                   "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}.get(family)
    if model_class is None:
        model_class = getattr(transformers, {"qwen3_vl": "Qwen3VLForConditionalGeneration",
                                             "qwen3_5": "Qwen3_5ForConditionalGeneration",
                                             "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                                             "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                                             "glm4v": "Glm4vForConditionalGeneration",
                                             "glm4v_moe": "Glm4vMoeForConditionalGeneration",
                                             "glm46v": "Glm46VForConditionalGeneration",
                                             "glm46v_moe": "Glm46VForConditionalGeneration",
                                             "internvl": "InternVLForConditionalGeneration",
                                             "internvl_moe": "InternVLForConditionalGeneration",
                                             "gemma4": "Gemma4ForConditionalGeneration",
                                             "gemma4_moe": "Gemma4ForConditionalGeneration",
                                             "gemma3": "Gemma3ForConditionalGeneration",
                                             "mistral3": "Mistral3ForConditionalGeneration",
                                             "smolvlm": "SmolVLMForConditionalGeneration",
                                             "idefics3": "Idefics3ForConditionalGeneration"}[family])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        if family == "gemma3":  # transformers initialises the projection at zero: images would not reach the model
            with torch.no_grad():
                model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=GEMMA3_PROJECTION_STD)
    # GLM-4.1V's generation_config.json ends a completion at <|endoftext|>, <|user|> or <|observation|>; Gemma 4's
    # instruction-tuned conversion at <eos> and the end of the turn (convert_gemma4_weights.py: eos_token_id [1, 106]);
    # Gemma 3's at <eos> and <end_of_turn> (google/gemma-3-4b-it generation_config.json: eos_token_id [1, 106]);
    # Mistral 3's at </s> (Mistral-Small-3.1-24B-Instruct-2503 generation_config.json: eos_token_id 2);
    # SmolVLM's at <end_of_utterance>, which ends every turn of its chat template (SMOLVLM_CHAT_TEMPLATE).
    ends = (("<turn|>", "<eos>") if family in GEMMA4_FAMILIES else ("<end_of_turn>", "<eos>") if family == "gemma3"
            else ("</s>",) if family == "mistral3"
            else ("<end_of_utterance>",) if family in SMOLVLM_FAMILIES
            else ("<|endoftext|>", "<|user|>", "<|observation|>")
            if glm else ("<|im_end|>", "<|endoftext|>"))
    eos = [tokenizer.convert_tokens_to_ids(token) for token in ends]
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                                            bos_token_id=tokenizer.pad_token_id)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        try:
            os.replace(staging, directory)
        except OSError:
            if not (directory / "config.json").is_file():  # not a concurrent builder that won the race
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.vlm.testing",
                                     description="Build a tiny random VLM checkpoint for offline runs.")
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.family, args.directory, seed=args.seed, size=args.size)
    print(f"tiny {args.family} checkpoint in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
