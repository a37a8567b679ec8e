"""Every family's prompt ids are the ones transformers builds from the same messages: ``adapter.encode`` on the
rendered chat (:meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.chat_text`) against
``processor.apply_chat_template(..., tokenize=True)`` (transformers 5.25 ``ProcessorMixin.apply_chat_template``, which
renders the same template and tokenizes a prompt that starts with the BOS token without special tokens,
``processing_utils.py:2515-2517``), on each tiny build, a batch of two prompts of different lengths with a system
message and one or two images of different sizes.

The BOS rule (:meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.adds_special_tokens`): Gemma's chat template writes
``<bos>``; the released Gemma 3 tokenizer also adds one to every text it encodes and the released Gemma 4 tokenizer
does not (``convert_gemma4_weights.py``: ``add_bos_token=False``), and the tiny builds do as the released ones. With
the tokenizer switched either way, both Gemma families' prompts start with exactly one ``<bos>``, transformers'
prompt, where the processor's plain call on the rendered chat starts with two whenever the tokenizer adds BOS; the
same for Mistral 3, whose template writes ``<s>`` (Mistral-Small-3.1-24B-Instruct-2503's ``{{- bos_token }}``), and
for SmolVLM (SmolVLM2 and v1's Idefics3 processor), whose template writes ``<|im_start|>``, its tokenizer's BOS (the
tiny tokenizer adds none to an encoded text, as the SmolLM2 tokenizers' GPT-2 style does as far as checked here). The
tiny Qwen, GLM (GLM-4.6V's too) and InternVL tokenizers have no BOS token, like the released ones as far as checked here
(``Qwen2Tokenizer``, which InternVL3-hf also loads, and ``Qwen3_5Tokenizer`` default ``bos_token=None``; GLM-4.1V's
tokenizer names EOS and PAD only), so the rule leaves them to the processor's defaults, as transformers does. Images
only: Gemma 3, Gemma 4, Mistral 3, InternVL and SmolVLM take no videos; the Qwen video prompts are checked against the
processor in test_video.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "internvl", "gemma4", "gemma3", "mistral3",
            "glm46v", "smolvlm", "idefics3")
"""One build per processor and chat layout (the MoE builds share their dense sibling's tokenizer and processor)."""
QUESTIONS = ("Where is the red circle?", "How many squares are there in the image? Answer the question with a number.")
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """A tiny build per family of :data:`FAMILIES` that the installed transformers has, built on first use."""
    from mmrl.plugins.vlm.testing import build_tiny_model

    root = tmp_path_factory.mktemp("chat_prompts")
    paths = {}

    def build(family):
        if family == "smolvlm":  # transformers' SmolVLMProcessor imports num2words
            pytest.importorskip("num2words", reason="transformers' SmolVLMProcessor needs num2words")
        if family not in paths:
            paths[family] = build_tiny_model(family, root / family)
        return paths[family]

    return build


def adapter_for(family, path):
    from mmrl.plugins.vlm.adapters import vlm_adapters

    if family not in vlm_adapters:
        pytest.skip(f"transformers has no {family}")
    return vlm_adapters[family](str(path), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def with_add_bos(path, target, add_bos):
    """A copy of the checkpoint at ``path`` in ``target`` whose tokenizer adds BOS to every text it encodes or not
    (``add_bos_token``, saved as a checkpoint would carry it)."""
    from transformers import AutoTokenizer

    shutil.copytree(path, target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.add_bos_token = add_bos  # rebuilds the post-processor that writes (or not) BOS
    tokenizer.save_pretrained(target)
    return target


def prompts_and_reference(adapter):
    """The adapter's prompt ids of two rendered chats encoded in one batch, and transformers' for each (the adapter's
    loaded images placed in the messages' image parts, so that both see the same images)."""
    images = [adapter.load_images([random_image(100, 80, 1)]),
              adapter.load_images([random_image(64, 120, 2), random_image(150, 60, 3)])]
    chats = [adapter.messages(question, len(group), "Be brief.") for question, group in zip(QUESTIONS, images,
                                                                                         strict=True)]
    prompts = adapter.encode([adapter.chat_text(chat) for chat in chats], images)
    references = []
    for chat, group in zip(chats, images, strict=True):
        loaded = iter(group)
        messages = [{**message, "content": [{**part, "image": next(loaded)} if part["type"] == "image" else part
                                            for part in message["content"]]} for message in chat]
        inputs = adapter.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                       add_generation_prompt=True, return_tensors="pt")
        references.append(inputs["input_ids"][0])
    return [prompt["input_ids"] for prompt in prompts], references


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_are_transformers_apply_chat_template(builds, family):
    """Each prompt of a batch (two prompts, one and two images, a system message) has the ids transformers'
    ``apply_chat_template(tokenize=True)`` gives its messages; a Gemma prompt starts with exactly one ``<bos>``, a
    Mistral 3 prompt with one ``<s>``."""
    adapter = adapter_for(family, builds(family))
    ours, theirs = prompts_and_reference(adapter)
    assert len(ours) == 2 and ours[0].shape != ours[1].shape  # two prompts of different lengths, unpadded
    for got, expected in zip(ours, theirs, strict=True):
        assert torch.equal(got, expected)
    bos = adapter.tokenizer.bos_token_id
    if family.startswith("gemma") or family in ("mistral3", "smolvlm", "idefics3"):
        assert all(int(ids[0]) == bos and int((ids == bos).sum()) == 1 for ids in ours)
    else:
        assert bos is None


def test_the_tiny_gemma_tokenizers_add_bos_as_the_released_ones(builds):
    """Gemma 4's tiny tokenizer adds no ``<bos>`` to an encoded text (the released one is built with
    ``add_bos_token=False`` by transformers' ``convert_gemma4_weights.py``), Gemma 3's adds one (google/gemma-3-4b-it
    ``tokenizer_config.json``: ``add_bos_token: true``); all chat templates write it. Mistral 3's tiny tokenizer adds
    ``<s>`` (the Llama-style default; whether each released Mistral tokenizer does is not checked here, and the
    prompts hold one ``<s>`` either way, test_one_bos_whichever_way_the_tokenizer_is_set)."""
    expected = {"gemma4": False, "gemma3": True, "mistral3": True}
    for family, adds in expected.items():
        adapter = adapter_for(family, builds(family))
        tokenizer = adapter.tokenizer
        assert (tokenizer("Where is it?")["input_ids"][0] == tokenizer.bos_token_id) is adds
        assert adapter.chat_text(adapter.messages("Where is it?", 1)).startswith(tokenizer.bos_token)


@pytest.mark.parametrize("add_bos", [False, True], ids=["tokenizer-without-bos", "tokenizer-adds-bos"])
@pytest.mark.parametrize("family", ["gemma4", "gemma3", "mistral3", "smolvlm", "idefics3"])
def test_one_bos_whichever_way_the_tokenizer_is_set(builds, family, add_bos, tmp_path):
    """With the checkpoint's tokenizer set to add BOS or not, the prompts are still transformers' and start with
    one ``<bos>``, the template's; the processor's plain call on the rendered chat gives two when the tokenizer adds
    BOS (the double ``<bos>`` the rule prevents) and one otherwise."""
    adapter = adapter_for(family, with_add_bos(builds(family), tmp_path / family, add_bos))
    bos = adapter.tokenizer.bos_token_id
    ours, theirs = prompts_and_reference(adapter)
    for got, expected in zip(ours, theirs, strict=True):
        assert torch.equal(got, expected)
        assert int(got[0]) == bos and int((got == bos).sum()) == 1
    text = adapter.chat_text(adapter.messages(QUESTIONS[0], 0))
    plain = adapter.processor(text=[text], return_tensors="pt")["input_ids"][0]
    assert int((plain[:2] == bos).sum()) == (2 if add_bos else 1)


def test_a_batch_mixing_prompts_with_and_without_bos_is_refused(builds):
    """Rendered chats of one batch either all start with the BOS token or none does: a mix is refused in one line
    (transformers' rule looks at a batch's first prompt only, which would give the others a wrong BOS count)."""
    adapter = adapter_for("gemma4", builds("gemma4"))
    text = adapter.chat_text(adapter.messages(QUESTIONS[0], 0))
    assert adapter.adds_special_tokens([text, text]) is False
    assert adapter.adds_special_tokens([text.removeprefix("<bos>")]) is True
    with pytest.raises(ValueError, match=r"1 of 2 prompts start with the BOS token '<bos>'"):
        adapter.encode([text, text.removeprefix("<bos>")], [[], []])
