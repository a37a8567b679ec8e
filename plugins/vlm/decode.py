"""The vlm plugin's own decode loop (``plugin.decoder: mmrl``): prefill, then one single-token forward per new token.

transformers' ``generate`` wraps each of its single-token forwards in general-purpose machinery — input preparation
(``prepare_inputs_for_generation``: slicing and cloning every per-token input), the kwargs update (growing the
attention mask, position ids and token types by concatenation), a logits-processor list and a stopping-criteria list
— which on a small model costs as much as the forward itself. The rollout needs little of it: a fixed sampling
recipe (:class:`SamplingSettings`) over a KV cache. :func:`decode` runs exactly that:

1. **prefill**: the collated prompts (or, with ``share_prefill``, each distinct prompt once) through the model with
   a KV cache and their M-RoPE position ids (:meth:`VLMAdapter.rope_positions`), keeping only the last position's
   logits; a shared prefill's cache (and last logits) are then indexed out to the samples (``select_cache_rows``),
   so the G samples of a prompt start from one prompt computation, the last prompt token included;
2. **decode**: per step, sample every row's next token from the last logits (float32: suppressed tokens at −∞, then
   temperature, top-k, top-p — transformers' order — then ``softmax`` and ``torch.multinomial(probs, 1)``, or
   ``argmax`` for greedy), write pad after a row's EOS, and stop when every row has ended or ``max_new_tokens`` are
   out; otherwise feed the new tokens as one ``[n, 1]`` forward on the cache, with a view of a preallocated attention
   mask and the next M-RoPE position of each row.

The M-RoPE position of the k-th generated token (k = 0, 1, …) of a row is ``l + 1 + k`` on all three (temporal,
height, width) components, where ``l`` is the position of its prompt's last token (text: its three components are
equal): the position the model's own ``get_rope_index`` gives that token when the completion is fed back as part of
the sequence (text continues by one per token), so the teacher-forced log-probs score exactly the distribution
sampled from. ``generate`` continues from ``m + 1`` instead, ``m`` the prompt's largest position (its
``rope_deltas = m + 1 − prompt length``). The two agree whenever the prompt's last token holds its largest position,
which is the case for every image prompt. They differ for Qwen2-VL and Qwen2.5-VL videos in transformers 5.x: text
after a video restarts at the video's start plus its height or width in merged patches
(``get_rope_index``: ``current_pos += max(h, w) // merge``), below the video's temporal positions, which reach
``(t − 1)·interval`` (transformers 5.25.0 ``modeling_qwen2_5_vl.py`` ``get_rope_index``; transformers 4.x and
Qwen's original code started the text after the largest vision position, huggingface/transformers#35569). A prompt
whose video outlasts its following text then has ``m > l``, and ``generate``'s tokens would not be sampled from the
distribution the training pass scores; the plugin's ``decoder: hf`` refuses such prompts
(:meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.generate`).

The sampling consumes the global RNG exactly as ``generate``'s sampling does (one ``torch.multinomial(probs, 1)``
over every row, finished rows included, per step), so with the same logits and seed both pick the same tokens;
``tests/vlm/test_decode.py`` checks the tokens against ``generate`` for the three families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.vlm.adapters.base import _base_model, cache_argument, logit_softcap, select_cache_rows

DECODERS = ("mmrl", "hf")
"""``plugin.decoder`` values: this module's loop, or transformers' ``generate``."""


@dataclass(frozen=True)
class SamplingSettings:
    """What shapes the sampled tokens (the fields of a ``GenerationConfig`` the plugin sets).

    Attributes:
        max_new_tokens: Tokens per row at most.
        eos_token_ids: A row ends with the first of these it emits (kept in the output).
        pad_token_id: Written after a row's end.
        do_sample: Sample (True) or take the argmax (False, greedy evaluation).
        temperature: Logits are divided by it before top-k / top-p (sampling only).
        top_k: Keep the k highest logits (0: all).
        top_p: Keep the smallest set of highest-probability tokens whose mass exceeds ``top_p`` (1: all).
        suppress_token_ids: Never emitted (logit −∞ before everything else).
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    suppress_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"decode: max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.eos_token_ids:
            raise ValueError("decode: at least one EOS token id is needed to end a row")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"decode: temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"decode: top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode: top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_generation_config(cls, config: Any) -> SamplingSettings:
        """The settings of a transformers ``GenerationConfig`` (the plugin's :meth:`VLMPlugin.generation_config`),
        refusing the options this loop does not implement rather than ignoring them."""
        unsupported = []
        if (config.num_beams or 1) != 1:
            unsupported.append(f"num_beams={config.num_beams}")
        if config.repetition_penalty not in (None, 1.0):
            unsupported.append(f"repetition_penalty={config.repetition_penalty}")
        for name in ("min_p", "top_h", "bad_words_ids", "begin_suppress_tokens", "forced_bos_token_id",
                     "forced_eos_token_id", "stop_strings", "sequence_bias", "guidance_scale",
                     "exponential_decay_length_penalty", "watermarking_config", "penalty_alpha", "max_time"):
            if getattr(config, name, None) is not None:
                unsupported.append(f"{name}={getattr(config, name)!r}")
        for name, neutral in (("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0),
                              ("no_repeat_ngram_size", 0), ("min_new_tokens", None), ("min_length", 0),
                              ("num_return_sequences", 1), ("encoder_repetition_penalty", 1.0),
                              ("encoder_no_repeat_ngram_size", 0)):
            if getattr(config, name, neutral) not in (None, neutral):
                unsupported.append(f"{name}={getattr(config, name)!r}")
        if unsupported:
            raise ValueError(f"plugin.decoder 'mmrl' does not implement {', '.join(unsupported)}; use decoder 'hf'")
        if config.max_new_tokens is None:
            raise ValueError("plugin.decoder 'mmrl' needs max_new_tokens in the generation config")
        eos = config.eos_token_id
        eos_ids = (eos,) if isinstance(eos, int) else tuple(int(i) for i in (eos or ()))
        pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
        return cls(max_new_tokens=int(config.max_new_tokens), eos_token_ids=eos_ids, pad_token_id=int(pad),
                   do_sample=bool(config.do_sample), temperature=float(config.temperature or 1.0),
                   top_k=int(config.top_k or 0), top_p=float(config.top_p if config.top_p is not None else 1.0),
                   suppress_token_ids=tuple(int(i) for i in (config.suppress_tokens or ())))


def next_token_scores(logits: Tensor, settings: SamplingSettings, suppressed: Tensor | None = None) -> Tensor:
    """The scores the next token is drawn from (softmax) or argmax'ed: ``[n, V]`` float32.

    Suppressed tokens get −∞; for sampling the logits are then divided by the temperature, and top-k and top-p set
    every token outside their sets to −∞ (in this order, as transformers' logits processors apply them).

    Args:
        logits: ``[n, V]`` the last position's logits (any float dtype).
        settings: The sampling recipe.
        suppressed: ``[V]`` bool mask of the suppressed ids (built from the settings when None).
    """
    scores = logits.float()  # [n, V]
    if suppressed is None and settings.suppress_token_ids:
        suppressed = suppress_mask(settings, scores.shape[-1], scores.device)
    if suppressed is not None:
        scores = scores.masked_fill(suppressed, float("-inf"))
    if not settings.do_sample:
        return scores
    if settings.temperature != 1.0:
        scores = scores / settings.temperature
    if 0 < settings.top_k < scores.shape[-1]:
        kth = torch.topk(scores, settings.top_k, dim=-1).values[:, -1:]  # [n, 1] the k-th largest score
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th are kept
    if settings.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)  # [n, V]
        mass_below = ascending.softmax(-1).cumsum(-1)  # [n, V] probability of this token and every smaller one
        drop = mass_below <= 1 - settings.top_p
        drop[:, -1] = False  # the most probable token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def suppress_mask(settings: SamplingSettings, vocab_size: int, device: torch.device | str) -> Tensor | None:
    """``[V]`` bool, True at the suppressed ids (None when nothing is suppressed); ids past the vocabulary are
    ignored, as transformers' processor ignores them."""
    if not settings.suppress_token_ids:
        return None
    ids = torch.tensor([i for i in settings.suppress_token_ids if 0 <= i < vocab_size], dtype=torch.long)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return mask.to(device)


def pick_tokens(scores: Tensor, settings: SamplingSettings) -> Tensor:
    """``[n]`` next tokens: ``multinomial(softmax(scores), 1)`` when sampling (one draw per row from the global
    RNG, as ``generate`` draws), the argmax otherwise."""
    if settings.do_sample:
        return torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
    return scores.argmax(-1)


@dataclass
class DecodeOutput:
    """:func:`decode`'s result.

    Attributes:
        tokens: ``[n, C']`` generated tokens, C' = the longest completion (``max_new_tokens`` at most); a row's first
            EOS is followed by pad.
        scores: With ``output_scores``, the ``[n, V]`` float32 scores each token was drawn from, one per step.
    """

    tokens: Tensor
    scores: list[Tensor] | None = None


@torch.no_grad()
def decode(model: nn.Module, inputs: dict[str, Tensor], positions: Tensor, settings: SamplingSettings, *,
           select: Tensor | None = None, output_scores: bool = False) -> DecodeOutput:
    """Prefill ``inputs`` and decode under ``settings`` (module docstring).

    Args:
        model: The model (a transformers VL model, possibly inside a peft wrapper), called as ``model(**kwargs)``.
        inputs: Collated prompts (:meth:`VLMAdapter.collate`), left-padded: ``input_ids [u, P]``,
            ``attention_mask [u, P]`` and the image inputs.
        positions: ``[3, u, P]`` their M-RoPE position ids (:meth:`VLMAdapter.rope_positions`), or ``[u, P]`` plain
            rotary positions for a family without M-RoPE (InternVL).
        settings: The sampling recipe.
        select: ``[n]`` long, the prompt of each of the n decoded rows (a shared prefill: ``u`` distinct prompts, the
            cache indexed out to the samples); None: row i decodes prompt i.
        output_scores: Also return each step's scores (tests).

    Returns:
        :class:`DecodeOutput`.
    """
    attention = inputs["attention_mask"]  # [u, P]
    device = attention.device
    if positions.shape not in ((3, *attention.shape), tuple(attention.shape)):
        raise ValueError(f"decode: positions must be [3, u, P] (M-RoPE) or [u, P] = [{attention.shape[0]}, "
                         f"{attention.shape[1]}], got {tuple(positions.shape)}")
    output = model(**inputs, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
    if cache is None:
        raise RuntimeError(f"{type(model).__name__} returned no KV cache from the prefill")
    logits = output.logits[:, -1]  # [u, V]
    # The next M-RoPE position of each prompt: one past its last token's (left padding: the last column is a real
    # token, text, whose three components are equal), as the teacher-forced sequence continues it (module docstring).
    last = positions[..., -1]  # [3, u] or [u]
    next_position = (last.amax(dim=0) if positions.dim() == 3 else last) + 1  # [u]
    if select is not None:
        select_cache_rows(cache, select)
        logits, attention, next_position = logits[select], attention[select], next_position[select]
    n, width = attention.shape
    steps = settings.max_new_tokens
    # Every decode step attends to a prefix of this mask: the prompt's padding, then every generated position.
    full_attention = torch.cat([attention, attention.new_ones(n, steps)], dim=1)  # [n, P + steps]
    eos = torch.tensor(settings.eos_token_ids, device=device)
    suppressed = suppress_mask(settings, logits.shape[-1], device)
    pad = torch.full((n,), settings.pad_token_id, dtype=torch.long, device=device)
    running = torch.ones(n, dtype=torch.bool, device=device)  # rows that have not emitted an EOS yet
    sharded = has_sharded_parameters(model)
    step = _single_token_step(model, full_attention, whole_model=sharded)
    tokens: list[Tensor] = []
    scores_out: list[Tensor] | None = [] if output_scores else None
    with nullcontext() if sharded else plain_lora_forwards(model):
        for index in range(steps):
            scores = next_token_scores(logits, settings, suppressed)  # [n, V]
            if scores_out is not None:
                scores_out.append(scores)
            token = torch.where(running, pick_tokens(scores, settings), pad)  # [n]
            tokens.append(token)
            running = running & ~torch.isin(token, eos)
            if index + 1 == steps or not bool(running.any()):
                break
            position = (next_position + index).view(n, 1)  # [n, 1]
            if positions.dim() == 3:
                position = position.unsqueeze(0).expand(3, n, 1)  # [3, n, 1]: text, its components equal
            logits = step(token.unsqueeze(1), width + index + 1, position, cache)  # [n, V]
    return DecodeOutput(torch.stack(tokens, dim=1), scores_out)


def has_sharded_parameters(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a sharded ``DTensor`` (FSDP2's ``fully_shard``, tensor parallelism).

    Such parameters are gathered by hooks on the sharded modules' forwards, the root module's (embeddings, final
    norm, LM head) among them; a decode step that called the language model and the head directly would skip the
    root's hook, so :func:`decode` then runs every step through the whole model, with peft's own LoRA forwards.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without torch.distributed: nothing can be sharded
        return False
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def _single_token_step(model: nn.Module, attention: Tensor, *, whole_model: bool = False
                       ) -> Callable[[Tensor, int, Tensor, Any], Tensor]:
    """A function ``(tokens [n, 1], length, position_ids [3, n, 1], cache) -> logits [n, V]`` that runs one decode
    step attending to the first ``length`` positions of ``attention [n, P + steps]`` (the 2D padding mask).

    A decode step has no image inputs, so it calls the language model and the LM head directly when the model has
    them (``model.language_model`` and ``get_output_embeddings()``, transformers >= 4.52), skipping the
    vision-language wrapper's per-call work (its input checks, placeholder masks and position logic, the output
    dataclasses), with the attention mask prebuilt once in the kernel's 4D form (:func:`decode_step_mask`; the 2D
    mask for a language model with sliding-window layers, whose masks differ per layer type); LoRA layers live
    inside those modules, so they apply alike. A model that soft-caps its logits after the head (Gemma's
    ``final_logit_softcapping``, :func:`~mmrl.plugins.vlm.adapters.base.logit_softcap`) has the cap applied to the
    head's output. Otherwise, or with ``whole_model`` (sharded parameters, :func:`has_sharded_parameters`), it calls
    the whole model.
    """
    base = _base_model(model)
    backbone = getattr(base, "model", None)
    language_model = getattr(backbone, "language_model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not whole_model and isinstance(language_model, nn.Module) and isinstance(head, nn.Module):
        name = cache_argument(language_model)
        config = getattr(language_model, "config", None)
        kind = getattr(config, "_attn_implementation", None)
        # A 4D mask is taken as it is by every layer, so sliding-window layers (Gemma 4's) would attend past their
        # window, over keys their cache no longer holds: they get the 2D mask, from which transformers builds each
        # layer type's own mask.
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
        mask = attention if sliding else decode_step_mask(attention, kind,
                                                          language_model.get_input_embeddings().weight.dtype)
        cap = logit_softcap(base)  # the model caps its logits after the head (Gemma): so must a step that calls it

        def step(tokens: Tensor, length: int, positions: Tensor, cache: Any) -> Tensor:
            hidden = language_model(input_ids=tokens, attention_mask=mask[..., :length], position_ids=positions,
                                    use_cache=True, **{name: cache})[0]  # [n, 1, H]
            logits = head(hidden[:, -1:])  # [n, 1, V]
            if cap is not None:  # in the logits' dtype and order, as the model's forward does
                logits = torch.tanh(logits / cap) * cap
            return logits[:, -1]  # [n, V]

        return step
    name = cache_argument(base)

    def whole_model_step(tokens: Tensor, length: int, positions: Tensor, cache: Any) -> Tensor:
        output = model(input_ids=tokens, attention_mask=attention[:, :length], position_ids=positions,
                       use_cache=True, **{name: cache})
        return output.logits[:, -1]

    return whole_model_step


def decode_step_mask(attention: Tensor, kind: str | None, dtype: torch.dtype) -> Tensor:
    """The attention mask of single-token steps in the 4D form the attention kernel takes, ``[n, 1, 1, L]`` (a step
    attending to the first ``l`` positions uses ``[..., :l]``), from the 2D padding mask ``attention [n, L]``:
    transformers passes a 4D mask through as it is, so a step skips its mask construction (~0.1 ms a step).
    ``sdpa``: True where attended; ``eager``: 0 there and the dtype's minimum elsewhere (what transformers builds for
    one query position: causality adds nothing, every cached position is in the past). Other kernels (flash
    attention's 2D mask, flex attention's block masks) get the 2D mask unchanged."""
    if kind == "sdpa":
        return attention.bool()[:, None, None, :]
    if kind == "eager":
        blocked = torch.finfo(dtype).min
        return torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill(
            attention == 0, blocked)[:, None, None, :]
    return attention


@contextmanager
def plain_lora_forwards(model: nn.Module) -> Iterator[int]:
    """For the block's duration, run each plain LoRA linear layer of ``model`` (peft ``lora.Linear`` on an
    ``nn.Linear``, one active unmerged adapter without dropout, variant, hooks, wrapped forwards or mixed-batch
    adapters) as
    ``W x + b + B(A x) · scaling`` in three ``F.linear`` calls: the sum peft's ``forward`` computes, in the same
    operations and order, without its per-call Python (adapter bookkeeping, three module calls) — a third of a
    small model's decode step. Yields the number of layers switched; other layers keep peft's forward."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        yield 0
        return
    switched = []
    for layer in model.modules():
        forward = _plain_lora_forward(layer) if type(layer) is LoraLinear else None
        if forward is not None:
            layer.forward = forward  # an instance attribute: nn.Module.__call__ runs it instead of the class's
            switched.append(layer)
    try:
        yield len(switched)
    finally:
        for layer in switched:
            del layer.forward


def _plain_lora_forward(layer: Any) -> Callable[[Tensor], Tensor] | None:
    adapters = list(layer.active_adapters)
    if layer.disable_adapters or layer.merged or len(adapters) != 1 or getattr(layer, "fan_in_fan_out", False):
        return None
    name = adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    base, down, up = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    modules = (layer, base, down, up)
    if type(base) is not nn.Linear or type(down) is not nn.Linear or type(up) is not nn.Linear:
        return None
    # A module whose forward is wrapped (hooks, or an instance attribute as accelerate's device hooks set) keeps it.
    if not isinstance(layer.lora_dropout[name], nn.Identity) or any(
            m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in modules):
        return None
    scaling = layer.scaling[name]
    cast = getattr(layer, "cast_input_dtype_enabled", True)

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs:  # peft-specific arguments (adapter_names, ...): peft's own forward handles them
            return type(layer).forward(layer, x, *args, **kwargs)
        result = nn.functional.linear(x, base.weight, base.bias)
        dtype = result.dtype
        low = x.to(down.weight.dtype) if cast and x.dtype != down.weight.dtype else x
        result = result + nn.functional.linear(nn.functional.linear(low, down.weight, down.bias), up.weight,
                                               up.bias) * scaling
        return result.to(dtype)

    return forward


def check_decoder(name: str) -> str:
    """``name`` if it is a known decoder; a one-line error otherwise."""
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; choose one of {', '.join(DECODERS)}")
    return name


__all__ = ["DECODERS", "DecodeOutput", "SamplingSettings", "check_decoder", "decode", "has_sharded_parameters",
           "next_token_scores", "pick_tokens", "suppress_mask"]
