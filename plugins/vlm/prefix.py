"""Teacher-forced hidden states with each distinct prompt computed once (``share_prompt_forward``).

GRPO scores G completions of every prompt. The plain teacher-forced pass runs the whole ``prompt + completion``
sequence of each of the n = P·G samples, so every prompt (image tokens included, most of the sequence for a VLM)
goes through the language model G times, in the training forward, its backward and the reference pass alike. Under
causal attention a prompt position's hidden states and keys/values depend on the prompt alone, so
:func:`shared_prompt_hidden` splits the pass in two:

1. the distinct prompts, once each (left-padded as :meth:`VLMAdapter.collate` pads them), with a KV cache: the last
   prompt position's hidden state (it predicts the first completion token) and every layer's keys and values;
2. the cache indexed out to the n samples (``index_select``, differentiable: the G samples' gradients flow back
   into their prompt's one computation and add up), then the n completions but their last token on top of it.

The M-RoPE position ids are computed once for the distinct prompts (:meth:`VLMAdapter.rope_positions`) and passed
explicitly; the completion positions continue the prompt's last (text) position by one per token, which is what
the model computes for the whole sequence. The result is the plain pass's ``[n, C, H]`` hidden states up to float
rounding (the attention over prompt and completion is split between two calls): the same function of the same
weights, so log-probs, the reference and gradients are unchanged. ``tests/vlm/test_prefix.py`` checks values and
gradients against the plain pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mmrl.plugins.vlm.adapters.base import (
    PromptInputs,
    VLMAdapter,
    _base_model,
    cache_argument,
    check_head,
    identity_head,
    select_cache_rows,
)

_PROMPT_TENSORS = ("input_ids", "image_grid_thw", "image_embeds", "image_deepstack", "pixel_values",
                   "image_position_ids", "video_grid_thw", "video_embeds", "video_deepstack", "pixel_values_videos",
                   "second_per_grid_ts")


def distinct_prompts(prompts: Sequence[PromptInputs]) -> tuple[list[PromptInputs], list[int]]:
    """The distinct prompts in first-appearance order and, per sample, the position of its prompt among them.

    Two samples share a prompt when its tensors are the same objects (the G copies of a rollout's group) or equal
    (the same prompt after a device copy); comparing values keeps the split exact whatever the caller did.
    """
    unique: list[PromptInputs] = []
    index: list[int] = []
    for prompt in prompts:
        for position, other in enumerate(unique):
            if _same_prompt(prompt, other):
                index.append(position)
                break
        else:
            index.append(len(unique))
            unique.append(prompt)
    return unique, index


def _same_prompt(a: PromptInputs, b: PromptInputs) -> bool:
    if a.keys() != b.keys():
        return False
    for key in _PROMPT_TENSORS:
        if key not in a:
            continue
        x, y = a[key], b[key]
        if x is y:
            continue
        if x.shape != y.shape or x.device != y.device or not torch.equal(x, y):
            return False
    return True


@dataclass(frozen=True, eq=False)
class PromptSplit:
    """The distinct prompts of a teacher-forced pass, prepared once for every pass over the same samples (the
    training forward and the reference pass of one micro-batch).

    Attributes:
        prefix: ``collate(unique)``'s inputs of the u distinct prompts, ``[u, P]``.
        index: ``[n]`` long, the position of each sample's prompt among them.
        positions: ``[3, u, P]`` the prompts' M-RoPE position ids (``[u, P]`` for plain rotary positions).
    """

    prefix: dict[str, Tensor]
    index: Tensor
    positions: Tensor


def prompt_split(adapter: VLMAdapter, model: nn.Module, prompts: Sequence[PromptInputs], inputs: dict[str, Tensor],
                 prompt_width: int) -> PromptSplit | None:
    """The split :func:`shared_prompt_hidden` runs for ``inputs`` (``collate(prompts, completions)``, prompts
    left-padded to ``prompt_width``), or None when the plain pass must run: no prompt repeats, prompts with images
    carry no ``mm_token_type_ids``, or a prompt ends in a vision token.

    ``model`` only provides the M-RoPE position computation (a function of the inputs and the model config), so a
    split serves the policy and its reference alike.
    """
    unique, index_list = distinct_prompts(prompts)
    if len(unique) == len(prompts):
        return None
    device = inputs["input_ids"].device
    prefix, width = adapter.collate(unique, device=device)  # [u, P]
    if width != prompt_width:
        raise RuntimeError(f"distinct prompts collate to {width} positions, the samples to {prompt_width}")
    if ("image_grid_thw" in prefix or "video_grid_thw" in prefix) and "mm_token_type_ids" not in prefix:
        return None  # no token types to compute the M-RoPE positions from (the model infers them in the plain pass)
    if "mm_token_type_ids" in prefix and bool(prefix["mm_token_type_ids"][:, -1].any()):
        return None  # the completions would continue a vision segment: its positions are not the text positions
    index = torch.tensor(index_list, device=device)  # [n]
    return PromptSplit(prefix, index, adapter.rope_positions(model, prefix))  # positions [3, u, P] or [u, P]


def shared_prompt_hidden(adapter: VLMAdapter, model: nn.Module, prompts: Sequence[PromptInputs],
                         inputs: dict[str, Tensor], prompt_width: int, num_completion: int, *,
                         split: PromptSplit | None = None) -> tuple[Tensor, nn.Module] | None:
    """Final hidden states ``[n, C, H]`` of the positions that predict the completion tokens, and the LM head —
    what :meth:`VLMAdapter.completion_hidden` returns for ``inputs`` — computing each distinct prompt once.

    Args:
        adapter: The family adapter (collation, M-RoPE positions).
        model: The model to run (called twice, the LM head swapped for an identity); it must not be a wrapper that
            expects one call per backward (DDP, FSDP), and must not drop its KV cache (gradient checkpointing in
            train mode does).
        prompts: The n samples' prompts, as passed to :meth:`VLMAdapter.collate`.
        inputs: ``collate(prompts, completions)``'s model inputs (prompts left-padded to ``prompt_width``,
            completions right-padded to ``num_completion``).
        prompt_width: P, the padded prompt length.
        num_completion: C >= 1.
        split: :func:`prompt_split`'s result for these inputs when the caller already has it (None: computed here).

    Returns:
        ``(hidden [n, C, H], head)``, or None when no prompt repeats, a prompt ends in a vision token, or prompts
        with images carry no ``mm_token_type_ids`` (the caller then runs the plain pass).
    """
    if split is None:
        split = prompt_split(adapter, model, prompts, inputs, prompt_width)
        if split is None:
            return None
    prefix, index, positions = split.prefix, split.index, split.positions
    device = inputs["input_ids"].device
    hf_model = _base_model(model)
    cache_name = cache_argument(hf_model)
    with identity_head(model) as head:
        output = model(**prefix, position_ids=positions, use_cache=True, logits_to_keep=1)
        last = output.logits[:, -1:]  # [u, 1, H]: the identity head returned the hidden states
        check_head(head, last.shape[-1])
        if num_completion == 1:
            return last.index_select(0, index), head
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if cache is None:
            raise RuntimeError(f"{type(hf_model).__name__} returned no KV cache for the shared prompt pass")
        select_cache_rows(cache, index)  # every layer's [u, heads, P, d] (and linear states) -> [n, ...]
        steps = torch.arange(1, num_completion, device=device)  # [C - 1]
        # [3, n, C - 1] ([n, C - 1] without M-RoPE): the last prompt token is text, so its three components are
        # equal; text continues by one.
        completion_positions = positions[..., -1:].index_select(-2, index) + steps
        rest = {"input_ids": inputs["input_ids"][:, prompt_width:prompt_width + num_completion - 1],
                "attention_mask": inputs["attention_mask"][:, :prompt_width + num_completion - 1]}
        if "mm_token_type_ids" in inputs:
            rest["mm_token_type_ids"] = inputs["mm_token_type_ids"][:, prompt_width:prompt_width + num_completion - 1]
        output = model(**rest, position_ids=completion_positions, use_cache=True, **{cache_name: cache})
        completion = output.logits  # [n, C - 1, H]
    return torch.cat([last.index_select(0, index), completion], dim=1), head


__all__ = ["PromptSplit", "distinct_prompts", "prompt_split", "shared_prompt_hidden"]
