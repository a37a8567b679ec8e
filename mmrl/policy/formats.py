"""Saving and loading a policy in the native format of its model library.

=================  =====================================================  =============================================
format             files                                                  loaded by
=================  =====================================================  =============================================
``diffusers_lora`` ``pytorch_lora_weights.safetensors``                   ``pipeline.load_lora_weights(folder)``
``peft_lora``      ``adapter_config.json``, ``adapter_model.safetensors`` ``PeftModel.from_pretrained(base, folder)``
``pretrained``     the library's ``save_pretrained`` folder               ``ModelClass.from_pretrained(folder)``
``trainable``      ``trainable.safetensors`` (trainable weights only)     :func:`load_policy` (checkpoints of full
                                                                          fine-tuning: a frozen vision tower is not
                                                                          copied into every checkpoint)
=================  =====================================================  =============================================

Saving takes the weights from ``state`` when given: the gathered state dict of a sharded model
(:meth:`mmrl.plugin.Plugin.gathered_trainable_state`), never the local shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mmrl.policy.lora import ADAPTER_NAME, LoraConfig

POLICY_FORMATS = ("diffusers_lora", "peft_lora", "pretrained", "trainable")
DIFFUSERS_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PEFT_ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_ADAPTER_CONFIG = "adapter_config.json"
TRAINABLE_WEIGHTS = "trainable.safetensors"
PEFT_PREFIX = "base_model.model."
"""The prefix of every weight name in a peft adapter file: the names of a ``PeftModel`` wrapping the base."""
DIFFUSERS_PREFIX = "transformer."
"""The component prefix of a diffusers LoRA file (``cls.transformer_name`` of every flow pipeline)."""
_DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"

_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def clean_parameter_name(name: str) -> str:
    """A parameter name without the components FSDP, activation checkpointing and torch.compile insert, so that names
    from a wrapped module, its unwrapped module and a gathered state dict compare equal."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)


def trainable_state(module: nn.Module, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The weights of every parameter of ``module`` that requires gradients, keyed by :func:`clean_parameter_name`,
    read from ``state`` (a gathered state dict) or from the module, detached on the CPU."""
    names = [clean_parameter_name(name) for name, p in module.named_parameters() if p.requires_grad]
    source = ({clean_parameter_name(name): tensor for name, tensor in state.items()} if state is not None
              else {clean_parameter_name(name): p for name, p in module.named_parameters()})
    missing = [name for name in names if name not in source]
    if missing:
        raise KeyError(f"trainable weights missing from the state dict: {missing[:3]}")
    return {name: source[name].detach().cpu().contiguous() for name in names}


def save_policy(module: nn.Module, directory: str | Path, fmt: str, *, state: dict[str, Tensor] | None = None
                ) -> Path:
    """Write ``module``'s policy to ``directory`` (created) in format ``fmt`` (:data:`POLICY_FORMATS`).

    Args:
        module: The policy, unwrapped (``Runtime.unwrap``). The LoRA formats need an adapter (:func:`attach_lora`).
        directory: The folder to write.
        fmt: ``"diffusers_lora"``, ``"peft_lora"``, ``"pretrained"`` or ``"trainable"``.
        state: Full weights to save instead of the module's own (LoRA and trainable formats): the gathered state of a
            sharded model, or :meth:`Plugin.gathered_trainable_state`.

    Returns:
        ``directory``.
    """
    directory = Path(directory)
    if fmt not in POLICY_FORMATS:
        raise ValueError(f"policy format {fmt!r}; allowed: {', '.join(POLICY_FORMATS)}")
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "trainable":
        save_file(trainable_state(module, state), str(directory / TRAINABLE_WEIGHTS))
    elif fmt == "pretrained":
        if not hasattr(module, "save_pretrained"):
            raise TypeError(f"{type(module).__name__} has no save_pretrained: save it as 'trainable' instead")
        module.save_pretrained(str(directory))
    elif fmt == "peft_lora":
        save_peft_adapter(module, state, directory)
    else:
        _save_diffusers_lora(module, state, directory)
    return directory


def load_policy(module: nn.Module, directory: str | Path, fmt: str, *, lora: LoraConfig | None = None) -> None:
    """Load into ``module`` what :func:`save_policy` wrote in format ``fmt``.

    Every expected tensor must be present and nothing else (a ``KeyError`` names the first differences). With
    ``lora``, an adapter of another rank or alpha is refused in one ``ValueError``.

    Raises:
        FileNotFoundError: ``directory`` lacks the format's weights file.
    """
    directory = Path(directory)
    if fmt == "trainable":
        _load_trainable(module, directory / TRAINABLE_WEIGHTS)
    elif fmt == "pretrained":
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"no save_pretrained folder at {directory} (config.json is missing)")
        loaded = type(module).from_pretrained(str(directory))
        module.load_state_dict(loaded.state_dict(), strict=True)
    elif fmt == "peft_lora":
        path = directory / PEFT_ADAPTER_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"no LoRA adapter at {path}")
        config_path = directory / PEFT_ADAPTER_CONFIG
        if lora is not None and config_path.is_file():
            saved = json.loads(config_path.read_text())
            _check_lora_shape(directory, saved.get("r"), saved.get("lora_alpha"), lora)
        load_adapter_state(module, load_file(str(path)), path)
    elif fmt == "diffusers_lora":
        path = directory / DIFFUSERS_LORA_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"no LoRA weights at {path}")
        with safe_open(str(path), framework="pt") as handle:
            metadata = json.loads((handle.metadata() or {}).get(_DIFFUSERS_METADATA_KEY, "{}"))
        if lora is not None:
            _check_lora_shape(path, metadata.get(f"{DIFFUSERS_PREFIX}r"), metadata.get(f"{DIFFUSERS_PREFIX}lora_alpha"),
                              lora)
        state = {name[len(DIFFUSERS_PREFIX):]: tensor for name, tensor in load_file(str(path)).items()
                 if name.startswith(DIFFUSERS_PREFIX)}
        load_adapter_state(module, state, path)
    else:
        raise ValueError(f"policy format {fmt!r}; allowed: {', '.join(POLICY_FORMATS)}")


# ---------------------------------------------------------------------------------------------- peft and diffusers
def lora_state(module: nn.Module, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The adapter weights of ``module`` under peft's names (the adapter name removed), from ``state`` (a gathered
    state dict whose names are the module's) or from the module; detached on the CPU."""
    from peft.utils import get_peft_model_state_dict

    if state is not None:
        state = _with_tied_names({clean_parameter_name(name): tensor for name, tensor in state.items()}, module)
    # mmrl never resizes a vocabulary: no embedding layers to add to the adapter (peft would look for them)
    adapter = get_peft_model_state_dict(module, state_dict=state, adapter_name=ADAPTER_NAME,
                                        save_embedding_layers=False)
    if not adapter:
        raise ValueError(f"{type(module).__name__} carries no LoRA adapter to save")
    # clone: a weight shared by two modules (DiffusionGemma's encoder and decoder) is written once under each name
    return {name: tensor.detach().cpu().contiguous().clone() for name, tensor in adapter.items()}


def _with_tied_names(state: dict[str, Tensor], module: nn.Module) -> dict[str, Tensor]:
    """``state`` (keyed by ``named_parameters``' names, which list a parameter shared by several modules once) with
    each shared parameter also under its other names, as ``module.state_dict()`` and peft's state dicts list it."""
    first = {id(parameter): clean_parameter_name(name) for name, parameter in module.named_parameters()}
    complete = dict(state)
    for name, parameter in module.named_parameters(remove_duplicate=False):
        name, canonical = clean_parameter_name(name), first[id(parameter)]
        if name not in complete and canonical in state:
            complete[name] = state[canonical]
    return complete


def save_peft_adapter(module: nn.Module, trainable: dict[str, Tensor] | None, directory: str | Path) -> None:
    """Write the LoRA adapter of ``module`` (injected by :func:`attach_lora`, or a ``PeftModel``) in peft's format,
    ``adapter_model.safetensors`` and ``adapter_config.json``: ``PeftModel.from_pretrained(base, directory)`` loads it.

    The weights come from ``trainable`` (the gathered trainable state) or from the module. peft names the weights of
    a ``PeftModel``, which wraps the base, ``base_model.model.<name>``; an injected module's names get that prefix.
    """
    adapter = lora_state(module, trainable)
    if not _is_peft_model(module):
        adapter = {PEFT_PREFIX + name: tensor for name, tensor in adapter.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(directory / PEFT_ADAPTER_WEIGHTS), metadata={"format": "pt"})
    module.peft_config[ADAPTER_NAME].save_pretrained(str(directory))


def load_adapter_state(module: nn.Module, state: dict[str, Tensor], source: str | Path) -> None:
    """Load ``state`` (peft's adapter names, with or without the ``PeftModel`` prefix) into the adapter of
    ``module``; every adapter tensor must be present and nothing else, else a ``KeyError`` names ``source`` and the
    first differences."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    wrapped = _is_peft_model(module)
    state = {(name if wrapped or not name.startswith(PEFT_PREFIX) else name[len(PEFT_PREFIX):]): tensor
             for name, tensor in state.items()}
    if wrapped:  # adapters saved from an injected module (mmrl before the policy module) lack the prefix
        state = {(name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name): tensor
                 for name, tensor in state.items()}
    expected = set(get_peft_model_state_dict(module, adapter_name=ADAPTER_NAME, save_embedding_layers=False))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"{source}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    set_peft_model_state_dict(module, state, adapter_name=ADAPTER_NAME)


def _save_diffusers_lora(module: nn.Module, state: dict[str, Tensor] | None, directory: Path) -> None:
    """diffusers' LoRA file: the adapter's peft names under the ``transformer.`` component prefix, and the adapter
    config (prefixed the same way) as JSON in the safetensors metadata, as diffusers' ``save_lora_weights`` writes it
    (diffusers 0.42.1 ``loaders/lora_base.py``: ``_save_lora_weights`` packs both, ``write_lora_layers`` writes them);
    ``load_lora_weights`` reads the metadata to rebuild the adapter's rank, alpha and targets."""
    adapter = lora_state(module, state)
    config = module.peft_config[ADAPTER_NAME].to_dict()
    config = {f"{DIFFUSERS_PREFIX}{key}": sorted(value) if isinstance(value, set) else value
              for key, value in config.items()}
    weights = {DIFFUSERS_PREFIX + name: tensor for name, tensor in adapter.items()}
    save_file(weights, str(directory / DIFFUSERS_LORA_WEIGHTS),
              metadata={"format": "pt", _DIFFUSERS_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)})


def _check_lora_shape(source: Any, rank: Any, alpha: Any, lora: LoraConfig) -> None:
    if rank is None and alpha is None:
        return
    if rank != lora.rank or (alpha is not None and float(alpha) != float(lora.alpha)):
        raise ValueError(f"{source} holds a LoRA of rank {rank} and alpha {alpha}; this run has rank {lora.rank} and "
                         f"alpha {lora.alpha}")


def _is_peft_model(module: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(module, PeftModel)


def _load_trainable(module: nn.Module, path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"no trainable weights at {path}")
    state = load_file(str(path))
    params = {clean_parameter_name(name): p for name, p in module.named_parameters()}
    missing = [name for name, p in params.items() if p.requires_grad and name not in state]
    unexpected = [name for name in state if name not in params]
    if missing or unexpected:
        raise KeyError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device))
