"""Model adapters: what the dLLM plugin needs to know about one family of masked diffusion language models.

An adapter loads a model and its tokenizer through transformers and turns the model into one callable,
``scorer(input_ids[B, T]) -> logits[B, T, V]`` where **position i scores token i**. That callable is all that
generation (:mod:`mmrl.plugins.dllm.generation`) and the likelihood estimators
(:mod:`mmrl.plugins.dllm.estimators`) see. It also owns the special ids: the mask token, the stop tokens that end a
completion (EOS), the token that fills a completion after its end and the token that left-pads prompts.

===================  ===================================================================================================
``masked_lm``        Any ``AutoModelForMaskedLM`` (BERT, ModernBERT, RoBERTa, ...; the toy checkpoint). No shift. Pad
                     positions are hidden from attention and positions are counted from the first real token, so the
                     logits of a sequence do not depend on how much left padding it carries.
``llada``            LLaDA / LLaDA-1.5 (``trust_remote_code``). No shift. The original modelling file ignores the
                     attention mask, so none is passed: left padding (with EOS, as d1 pads) is part of the input. Mask
                     id 126336; EOS 126081 and end-of-turn 126348 both stop a completion.
``dream``            Dream / DiffuCoder (``trust_remote_code``). The output at position i−1 predicts token i (the model
                     was adapted from an autoregressive LM); the adapter returns ``cat(logits[:, :1], logits[:, :-1])``
                     so that position i scores token i, as Dream's own sampler does. A 4-D bidirectional attention mask
                     and position ids counted from the first real token are passed when a sequence has left padding.
                     Dream pads with its EOS (151643); only the leading run of it is padding (:func:`padding_inputs`).
``diffusion_gemma``  DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``): a **canvas** model
                     (``noise = "uniform"``): no mask token and no single scorer; its sampler and likelihood live in
                     :mod:`mmrl.plugins.dllm.canvas`. Stop tokens from ``generation_config.json`` (what ``generate``
                     stops on); LoRA on the text layers' attention and dense-MLP projections, shared by the encoder
                     and the decoder as their weights are; full fine-tuning keeps the MoE routers frozen (NeMo
                     AutoModel's DiffusionGemma recipes) and, for text prompts, the vision tower.
===================  ===================================================================================================

Adapters are registered in :data:`dllm_adapters`; ``plugin.adapter: auto`` picks one from ``config.json``'s
``model_type``. Third-party packages register through the entry-point group ``mmrl.dllm_adapters``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mmrl.registry import Registry

dllm_adapters: Registry[type[DLLMAdapter]] = Registry("dllm model adapter", entry_point_group="mmrl.dllm_adapters")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DLLMAdapter:
    """One family of masked diffusion LMs (see the module docstring).

    Args:
        model: A local folder or a hub id.
        trust_remote_code: Let transformers run the modelling code shipped with the checkpoint.
        mask_id: Override of the mask token id (default: the model config's ``mask_token_id``, else the tokenizer's
            mask token, else the family's constant).
        stop_ids: Override of the token ids that end a completion (default: the tokenizer's EOS plus the family's
            extra stop tokens present in the vocabulary).
        pad_id: Override of the prompt padding id (default: the tokenizer's pad token, else the first stop id).
    """

    #: Registry name (``plugin.adapter``).
    name: ClassVar[str]
    #: ``config.json`` ``model_type`` values this adapter handles (``adapter: auto``).
    model_types: ClassVar[tuple[str, ...]] = ()
    #: Whether the model takes an attention mask (pad positions are then hidden from every query).
    supports_attention_mask: ClassVar[bool] = True
    #: Whether the model's output at position i−1 predicts token i (Dream); the scorer undoes the shift.
    shifted_logits: ClassVar[bool] = False
    #: The family's mask id when neither the config nor the tokenizer names one.
    default_mask_id: ClassVar[int | None] = None
    #: Stop tokens besides the tokenizer's EOS (used when present in the vocabulary).
    extra_stop_ids: ClassVar[tuple[int, ...]] = ()
    #: Default LoRA target module names (suffix match).
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    #: Whether loading needs ``trust_remote_code``.
    needs_remote_code: ClassVar[bool] = False
    #: ``"mask"``: masked diffusion (one scorer, a mask token); ``"uniform"``: a canvas model with uniform-token noise
    #: (:mod:`mmrl.plugins.dllm.canvas`; no mask token).
    noise: ClassVar[str] = "mask"
    #: peft ``exclude_modules`` of the default LoRA (None: nothing excluded).
    lora_exclude_modules: ClassVar[str | None] = None
    #: The rollout sampler of a null ``plugin.sampler`` for a masked model: ``"llada"`` (LLaDA's blocks) or
    #: ``"dream"`` (Dream's ``diffusion_generate``, :mod:`mmrl.plugins.dllm.dream_sampler`).
    default_sampler: ClassVar[str] = "llada"

    def __init__(self, model: str, *, trust_remote_code: bool = False, mask_id: int | None = None,
                 stop_ids: Sequence[int] | None = None, pad_id: int | None = None):
        if self.needs_remote_code and not trust_remote_code:
            raise ValueError(f"the {self.name} adapter loads modelling code shipped with {model}; set "
                             "plugin.trust_remote_code: true")
        self.model_path = str(model)
        self.trust_remote_code = bool(trust_remote_code)
        self.tokenizer = self.load_tokenizer()
        self.model_config = _raw_config(self.model_path)
        if self.noise == "uniform" and mask_id is not None:
            raise ValueError(f"{self.name} models have no mask token (their noise is a uniform random token); "
                             "leave plugin.mask_token_id null")
        self.mask_id: int | None = self._resolve_mask_id(mask_id) if self.noise == "mask" else None
        self.stop_ids = self._resolve_stop_ids(stop_ids)
        self.eos_id = self.stop_ids[0]
        self.pad_id = self._resolve_pad_id(pad_id)
        if self.mask_id is None:
            return
        if self.pad_id == self.mask_id:
            raise ValueError(f"pad id {self.pad_id} equals the mask id of {model}; set plugin.pad_token_id to another "
                             "token (d1 pads with EOS)")
        if self.mask_id in self.stop_ids:
            raise ValueError(f"mask id {self.mask_id} is also a stop token of {model}; set plugin.eos_token_ids")

    # ------------------------------------------------------------------ loading
    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)

    def load_model(self, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> nn.Module:
        """The model through ``from_pretrained`` (weights in ``dtype``; transformers' default attention when
        ``attn_implementation`` is None), without transformers' hub kernels: transformers picks those by the
        model's train/eval mode, and the plugin decodes in eval mode and trains in train mode, so they would give
        the rollout and the training forward different kernels (``plugins/vlm/adapters/base.py``'s ``load_model``
        says more)."""
        from transformers import AutoModel

        return AutoModel.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code, dtype=dtype,
                                         use_kernels=False, **_attention(attn_implementation))

    # ------------------------------------------------------------------ special ids
    def _resolve_mask_id(self, override: int | None) -> int:
        candidates = (override, self.model_config.get("mask_token_id"), getattr(self.tokenizer, "mask_token_id", None),
                      self.default_mask_id)
        for candidate in candidates:
            if candidate is not None:
                return int(candidate)
        raise ValueError(f"{self.model_path} names no mask token (config mask_token_id, tokenizer mask_token); set "
                         "plugin.mask_token_id")

    def _resolve_stop_ids(self, override: Sequence[int] | None) -> tuple[int, ...]:
        if override is not None:
            if not override:
                raise ValueError("plugin.eos_token_ids must name at least one token")
            return tuple(int(i) for i in override)
        found: list[int] = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = self.model_config.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            found.extend(int(i) for i in eos)
        elif eos is not None:
            found.append(int(eos))
        vocab_size = self.vocab_size
        found.extend(i for i in self.extra_stop_ids if i < vocab_size and i not in found)
        if not found:
            raise ValueError(f"{self.model_path} names no EOS token; set plugin.eos_token_ids")
        return tuple(found)

    def _resolve_pad_id(self, override: int | None) -> int:
        if override is not None:
            return int(override)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        size = self.model_config.get("vocab_size") or self.model_config.get("embedding_size")
        return int(size) if size else len(self.tokenizer)

    # ------------------------------------------------------------------ the scorer
    def model_logits(self, model: nn.Module, input_ids: Tensor) -> Tensor:
        """The model's raw logits (before any shift), with the attention inputs this family takes."""
        out = model(input_ids=input_ids)
        return out if isinstance(out, Tensor) else out.logits

    def logits(self, model: nn.Module, input_ids: Tensor) -> Tensor:
        """``[B, T, V]`` logits with position i scoring token i.

        Shapes:
            input_ids ``[B, T]`` → ``[B, T, V]``.
        """
        logits = self.model_logits(model, input_ids)
        if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
            raise ValueError(f"{self.name} model returned logits {tuple(logits.shape)} for input ids "
                             f"{tuple(input_ids.shape)}")
        if self.shifted_logits:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    def scorer(self, model: nn.Module) -> Callable[[Tensor], Tensor]:
        """``input_ids → logits`` for generation and the likelihood estimators."""
        return lambda input_ids: self.logits(model, input_ids)

    @property
    def pad_is_stop(self) -> bool:
        """Whether the prompt padding id is also a stop token (Dream, LLaDA): left padding is then recognised by its
        position (the leading run, see :func:`padding_inputs`), never by the id alone."""
        return self.pad_id in self.stop_ids

    def prepare_trainable(self, model: nn.Module, *, lora: bool) -> None:
        """Family-specific setup of what trains, after LoRA injection (``lora``) or for full fine-tuning."""

    def describe(self) -> str:
        return (f"{self.name} adapter: mask {self.mask_id}, stop {list(self.stop_ids)}, pad {self.pad_id}"
                f"{' (= a stop token: left padding is the leading run of it)' if self.pad_is_stop else ''}, "
                f"attention mask {'yes' if self.supports_attention_mask else 'no'}, "
                f"shifted logits {'yes' if self.shifted_logits else 'no'}")


def padding_inputs(input_ids: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """``(attention_mask, position_ids)`` of left-padded ids: the left padding hidden, positions counted from the first
    real token (pad positions get 0; nothing attends to them).

    The left padding is the run of ``pad_id`` at the start of a row, and only that: a ``pad_id`` after the first real
    token is a real token. This matters when the pad id is also the EOS (Dream: ``pad_token`` = ``eos_token`` =
    ``<|endoftext|>`` = 151643 in its ``tokenizer_config.json``, ``config.json`` and ``generation_config.json``):
    comparing every id with ``pad_id`` would hide each generated EOS and shift the positions after it, where Dream's
    own sampler takes the tokenizer's mask for the prompt and attends to every generated token (``generation_utils.py``
    of the Dream checkpoints: the prompt mask is padded with ones for the new tokens). Prompts must therefore not
    start with the pad id (the plugin checks it when it encodes them).

    Shapes:
        input_ids ``[B, T]`` → ``[B, T]`` long each.
    """
    attention = ((input_ids != pad_id).long().cumsum(dim=1) > 0).long()  # 0 only before the first real token
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return attention, positions


@dllm_adapters.register("masked_lm")
class MaskedLMAdapter(DLLMAdapter):
    """Bidirectional masked LMs loaded with ``AutoModelForMaskedLM`` (the toy checkpoint is a ``BertForMaskedLM``)."""

    name = "masked_lm"
    model_types = ("bert", "roberta", "modernbert", "distilbert", "electra", "deberta-v2", "xlm-roberta")
    lora_target_modules = ("query", "key", "value", "dense", "Wqkv", "Wo", "Wi")

    def load_model(self, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> nn.Module:
        from transformers import AutoModelForMaskedLM

        return AutoModelForMaskedLM.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code,
                                                    dtype=dtype, use_kernels=False, **_attention(attn_implementation))

    def model_logits(self, model: nn.Module, input_ids: Tensor) -> Tensor:
        attention, positions = padding_inputs(input_ids, self.pad_id)
        return model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits


@dllm_adapters.register("llada")
class LLaDAAdapter(DLLMAdapter):
    """LLaDA-8B-Base/Instruct and LLaDA-1.5 (Nie et al. 2025, arXiv:2502.09992) through their remote modelling code."""

    name = "llada"
    model_types = ("llada",)
    supports_attention_mask = False
    default_mask_id = 126336
    extra_stop_ids = (126081, 126348)  # |EOS| and <|eot_id|>
    needs_remote_code = True
    # The linear layers of LLaDA's LLaMA-style blocks. d1/wd1/SPG list (q,k,v,o,gate,up,down)_proj, of which only
    # q_proj, k_proj, v_proj and up_proj exist in LLaDA, so their adapters train those four.
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")

    def _resolve_pad_id(self, override: int | None) -> int:
        # d1 sets pad = EOS: LLaDA was fine-tuned with EOS padding and sees the padding (no attention mask).
        return int(override) if override is not None else self.eos_id

    def _resolve_stop_ids(self, override: Sequence[int] | None) -> tuple[int, ...]:
        if override is not None:
            return super()._resolve_stop_ids(override)
        # |EOS| first: it is also the token that fills a completion after its end (LLaDA's SFT padding).
        ids = [i for i in self.extra_stop_ids if i < self.vocab_size]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and int(eos) not in ids:
            ids.append(int(eos))
        if not ids:
            raise ValueError(f"{self.model_path} names no EOS token; set plugin.eos_token_ids")
        return tuple(ids)

    def model_logits(self, model: nn.Module, input_ids: Tensor) -> Tensor:
        return model(input_ids).logits  # the original modelling file ignores attention masks


@dllm_adapters.register("dream")
class DreamAdapter(DLLMAdapter):
    """Dream-7B and DiffuCoder (remote modelling code): shifted logits, honoured attention masks."""

    name = "dream"
    model_types = ("Dream", "dream")
    default_sampler = "dream"  # the checkpoints' diffusion_generate, which DiffuCoder's coupled-GRPO rollouts call
    shifted_logits = True
    default_mask_id = 151666
    needs_remote_code = True
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def model_logits(self, model: nn.Module, input_ids: Tensor) -> Tensor:
        attention, positions = padding_inputs(input_ids, self.pad_id)
        if bool(attention.all()):
            out = model(input_ids, attention_mask="full")
        else:  # [B, 1, T, T] bidirectional mask between real tokens
            pairs = attention.bool().unsqueeze(1).unsqueeze(-2) & attention.bool().unsqueeze(1).unsqueeze(-1)
            out = model(input_ids, attention_mask=pairs, position_ids=positions)
        return out if isinstance(out, Tensor) else out.logits


@dllm_adapters.register("diffusion_gemma")
class DiffusionGemmaAdapter(DLLMAdapter):
    """DiffusionGemma (``google/diffusiongemma-26B-A4B-it``): block diffusion with uniform-token noise, a causal encoder
    and a bidirectional decoder on shared weights (:mod:`mmrl.plugins.dllm.canvas`)."""

    name = "diffusion_gemma"
    model_types = ("diffusion_gemma",)
    noise = "uniform"
    # The text layers' attention and dense-MLP projections (NeMo AutoModel's diffusion_gemma_lora.yaml adapts
    # "attention and dense-MLP linears"; the fused experts are not nn.Linear). The vision tower's projections and the
    # self-conditioning MLP share the suffixes and are excluded.
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora_exclude_modules = r".*(vision_tower|embed_vision|self_conditioning).*"

    def load_model(self, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> nn.Module:
        from transformers import DiffusionGemmaForBlockDiffusion

        return DiffusionGemmaForBlockDiffusion.from_pretrained(self.model_path, dtype=dtype, use_kernels=False,
                                                               **_attention(attn_implementation))

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.get("text_config", {}).get("vocab_size") or len(self.tokenizer))

    @property
    def canvas_length(self) -> int:
        return int(self.model_config.get("canvas_length") or 256)

    @property
    def generation_config(self) -> dict[str, Any]:
        """The checkpoint's ``generation_config.json`` (empty when it has none)."""
        return _raw_json(self.model_path, "generation_config.json")

    def _resolve_stop_ids(self, override: Sequence[int] | None) -> tuple[int, ...]:
        if override is not None:
            return super()._resolve_stop_ids(override)
        eos = self.generation_config.get("eos_token_id")  # what generate() stops on
        if eos is None:
            return super()._resolve_stop_ids(None)
        return tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))

    def prepare_trainable(self, model: nn.Module, *, lora: bool) -> None:
        """LoRA: the encoder's adapter layers take the decoder's adapter weights (the two share their base weights,
        so one adaptation serves both, as NeMo AutoModel's single shared backbone). Full fine-tuning: the MoE
        routers (NeMo AutoModel freezes them) and the vision tower (text prompts never reach it) stay frozen."""
        if lora:
            tie_encoder_lora(model)
            return
        for name, parameter in model.named_parameters():
            if ".router." in name or "vision_tower" in name or "embed_vision" in name:
                parameter.requires_grad_(False)


def tie_encoder_lora(model: nn.Module) -> int:
    """Make each LoRA layer of DiffusionGemma's encoder text layers use its decoder twin's adapter parameters; return
    the number of layers tied. ``model.encoder.language_model.layers.i.X`` twins ``model.decoder.layers.i.X``."""
    from peft.tuners.lora import LoraLayer

    modules = dict(model.named_modules())
    tied = 0
    for name, module in modules.items():
        if not isinstance(module, LoraLayer) or ".encoder.language_model.layers." not in name:
            continue
        twin = modules.get(name.replace(".encoder.language_model.layers.", ".decoder.layers."))
        if not isinstance(twin, LoraLayer):
            raise ValueError(f"LoRA layer {name} has no decoder twin; target the same modules in both")
        for attribute in ("lora_A", "lora_B"):
            ours, theirs = getattr(module, attribute), getattr(twin, attribute)
            for adapter in ours:
                ours[adapter].weight = theirs[adapter].weight
        tied += 1
    return tied


def _raw_json(model: str, filename: str) -> dict[str, Any]:
    """A JSON file of a local folder or hub id as a dict; empty when the checkpoint has none."""
    path = Path(model).expanduser()
    if path.is_dir():
        target = path / filename
        return json.loads(target.read_text()) if target.is_file() else {}
    from transformers.utils import cached_file

    found = cached_file(model, filename, _raise_exceptions_for_missing_entries=False)
    return json.loads(Path(found).read_text()) if found else {}


def _attention(implementation: str | None) -> dict[str, str]:
    return {} if implementation is None else {"attn_implementation": implementation}


def _raw_config(model: str) -> dict[str, Any]:
    """``config.json`` as a dict, without running remote code (local folder or hub id)."""
    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return json.loads(config.read_text())
    from transformers import PretrainedConfig

    data, _ = PretrainedConfig.get_config_dict(model)
    return data


def adapter_for(model: str) -> type[DLLMAdapter]:
    """The registered adapter whose ``model_types`` contains the ``model_type`` of ``model``'s ``config.json``."""
    model_type = _raw_config(model).get("model_type")
    known: dict[str, str] = {}
    for name in dllm_adapters.names():
        adapter = dllm_adapters.get(name)
        for kind in adapter.model_types:
            known[kind] = name
            if kind == model_type:
                return adapter
    listed = ", ".join(f"{kind} ({name})" for kind, name in sorted(known.items()))
    raise ValueError(f"no dllm adapter handles model_type {model_type!r} of {model}; known: {listed}. Set "
                     "plugin.adapter explicitly")


__all__ = ["DLLMAdapter", "DTYPES", "DiffusionGemmaAdapter", "DreamAdapter", "LLaDAAdapter", "MaskedLMAdapter",
           "adapter_for", "dllm_adapters", "padding_inputs", "tie_encoder_lora"]
