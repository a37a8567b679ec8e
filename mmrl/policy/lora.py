"""LoRA options, attaching an adapter, and the reference policy (the adapter switched off, or a frozen copy).

One way for every model library: peft's :func:`peft.inject_adapter_in_model` puts LoRA layers into the module in place
(diffusers transformers and transformers models alike; no wrapper, so parameter names and the plugin's calls into the
model stay as they are), and ``module.peft_config`` records the adapter's config for peft's state-dict helpers, as
diffusers' own ``add_adapter`` does (diffusers 0.42.1 ``loaders/peft.py``, ``PeftAdapterMixin.add_adapter``).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from mmrl.config import ConfigError, config_field

ADAPTER_NAME = "default"
"""The name of the one adapter mmrl attaches (peft's default name, which its file formats use)."""

LORA_INITS = ("default", "gaussian")
"""``LoraConfig.init`` values: peft's ``init_lora_weights=True`` (Kaiming-uniform A) or ``"gaussian"`` (normal A);
B is zero either way, so the policy starts exactly at the base model and the KL to the reference starts at 0."""

_HELP = {
    "rank": "LoRA rank r.",
    "alpha": "LoRA alpha (the update is scaled by alpha / r).",
    "dropout": "LoRA dropout. Above 0 the training forward differs from the rollout's and from the core's old-policy "
    "pass (both run with dropout off), so the first-step ratio is no longer exactly 1.",
    "target_modules": "Module-name suffixes to adapt (peft matching). Null: the model adapter's defaults.",
    "target_parameters": "Parameter-name suffixes to adapt as well (peft's target_parameters: LoRA on an nn.Parameter, "
    "such as the fused expert weights of a mixture-of-experts layer, which are no nn.Linear), e.g. "
    "[experts.gate_up_proj, experts.down_proj] for Qwen3-VL MoE, Qwen3.5 MoE and DiffusionGemma. Null: none.",
    "init": "Initialisation of A: 'default' (peft's Kaiming-uniform) or 'gaussian'. B starts at zero either way, so "
    "the policy starts at the base model and the KL starts at 0.",
}


@dataclass
class LoraConfig:
    """LoRA options (a plugin's ``plugin.lora`` section; ``plugin.lora: null`` trains every weight instead).

    Plugins use :func:`lora_config_class` to get this class with their own defaults (rank, alpha, init, and the
    references they come from); the fields, their checks and their meaning are the same for every plugin.
    """

    rank: int = config_field(16, minimum=1, help=_HELP["rank"])
    alpha: float = config_field(32.0, minimum=0.0, exclusive_minimum=True, help=_HELP["alpha"])
    dropout: float = config_field(0.0, minimum=0.0, maximum=0.99, help=_HELP["dropout"])
    target_modules: list[str] | None = config_field(None, help=_HELP["target_modules"])
    init: Literal["default", "gaussian"] = config_field("default", help=_HELP["init"])
    target_parameters: list[str] | None = config_field(None, help=_HELP["target_parameters"])

    def validate(self, path: str) -> None:
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError(f"{path}.target_modules", self.target_modules,
                              "null (the model adapter's defaults) or a non-empty list of module-name suffixes")
        if self.target_parameters is not None and not self.target_parameters:
            raise ConfigError(f"{path}.target_parameters", self.target_parameters,
                              "null (no parameter targets) or a non-empty list of parameter-name suffixes")

    def peft_config(self, default_targets: Sequence[str], **extra: Any) -> Any:
        """The equivalent ``peft.LoraConfig`` (targets: :attr:`target_modules` or ``default_targets``, and
        :attr:`target_parameters`)."""
        from peft import LoraConfig as PeftLoraConfig

        if self.target_parameters:
            extra["target_parameters"] = list(self.target_parameters)
        return PeftLoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                              target_modules=list(self.target_modules or default_targets),
                              init_lora_weights=True if self.init == "default" else self.init, **extra)


def lora_config_class(name: str, module: str, *, rank: int, alpha: float, init: str = "default", doc: str,
                      refs: dict[str, str] | None = None, targets_help: str | None = None) -> type[LoraConfig]:
    """:class:`LoraConfig` with a plugin's defaults, as a subclass named ``name`` (its YAML keys are the same).

    Args:
        name: The class name, e.g. ``"FlowLoraConfig"``.
        module: The module that holds the class under ``name`` (``__name__`` of the caller), for pickling.
        rank: Default rank.
        alpha: Default alpha.
        init: Default :attr:`LoraConfig.init`.
        doc: The class docstring.
        refs: Where defaults come from, by field name (shown by ``mmrl explain``).
        targets_help: The help of ``target_modules`` naming the model adapter's defaults.
    """
    refs = refs or {}
    defaults = {"rank": rank, "alpha": float(alpha), "dropout": 0.0, "target_modules": None, "init": init,
                "target_parameters": None}
    bounds: dict[str, dict[str, Any]] = {"rank": {"minimum": 1}, "alpha": {"minimum": 0.0, "exclusive_minimum": True},
                                         "dropout": {"minimum": 0.0, "maximum": 0.99}}
    fields = []
    for field in dataclasses.fields(LoraConfig):
        help_text = targets_help if field.name == "target_modules" and targets_help else _HELP[field.name]
        fields.append((field.name, _FIELD_TYPES[field.name],
                       config_field(defaults[field.name], help=help_text, ref=refs.get(field.name),
                                    **bounds.get(field.name, {}))))
    cls = dataclasses.make_dataclass(name, fields, bases=(LoraConfig,), namespace={"__doc__": doc})
    cls.__module__ = module
    return cls


# The field types as objects (this module's annotations are strings), for the subclasses lora_config_class makes.
_FIELD_TYPES: dict[str, Any] = {"rank": int, "alpha": float, "dropout": float, "target_modules": list[str] | None,
                                "init": Literal["default", "gaussian"], "target_parameters": list[str] | None}


def attach_lora(module: nn.Module, options: LoraConfig, *, default_targets: Sequence[str], what: str = "the model",
                key: str = "plugin.lora", exclude_modules: str | Sequence[str] | None = None,
                base_model: str | None = None) -> nn.Module:
    """Freeze ``module`` and inject a LoRA adapter into it, in place (peft's injection, the same for diffusers and
    transformers models); return ``module``.

    The adapter's weights are float32 whatever the base's dtype (a half-precision base trains a float32 adapter, as
    peft's ``autocast_adapter_dtype``), and are the only parameters that require gradients.

    Args:
        module: The model to adapt.
        options: The LoRA options.
        default_targets: Module-name suffixes when ``options.target_modules`` is null (the model adapter's).
        what: The model, named in the error when no module matches.
        key: The config key of the options, named in that error.
        exclude_modules: peft's ``exclude_modules`` (e.g. a VLM's vision tower).
        base_model: The base model's path or hub id, written as ``base_model_name_or_path`` into the adapter config
            so that peft's ``AutoPeftModel`` can find the base of an exported adapter.

    Raises:
        ConfigError: No module of ``module`` matches the targets, a parameter target matches no parameter, or peft
            rewrote a module target onto fused MoE expert parameters (its transformers-v4 compatibility mapping; the
            adapter is then already injected into ``module``, which the caller discards).
    """
    from peft import inject_adapter_in_model

    config = options.peft_config(default_targets, exclude_modules=exclude_modules, base_model_name_or_path=base_model)
    names = [name for name, _ in module.named_parameters()]
    missing = [target for target in options.target_parameters or ()
               if not any(name == target or name.endswith("." + target) for name in names)]
    if missing:  # peft only warns about these
        raise ConfigError(f"{key}.target_parameters", list(options.target_parameters),
                          f"parameter-name suffixes present in {what} ({missing[0]!r} matches no parameter)")
    module.requires_grad_(False)
    requested = sorted(config.target_modules)
    requested_parameters = set(config.target_parameters or ())
    try:
        inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft: no module matched
        raise ConfigError(f"{key}.target_modules", requested,
                          f"module-name suffixes present in {what} ({' '.join(str(error).split())})") from None
    # peft >= 0.18 rewrites, in place, module targets of MoE models whose experts transformers 5 fused (its v4
    # compatibility mapping, peft/utils/transformers_weight_conversion.py): e.g. GLM-4.5V's gate_proj/up_proj/
    # down_proj become target_parameters on the routed experts, and its dense and shared-expert MLPs lose their LoRA.
    # peft also shortens a list of 20 or more module targets into the fewest suffixes that match the same modules
    # (tuners_utils._find_minimal_target_modules): that changes target_modules but adds no parameter targets, and is
    # not a rewrite.
    added_parameters = set(config.target_parameters or ()) - requested_parameters
    rewritten = sorted(target for target in requested if target not in set(config.target_modules))
    if rewritten and added_parameters:
        raise ConfigError(f"{key}.target_modules", requested,
                          f"module names peft keeps for {what}: peft rewrote {', '.join(rewritten)} into the fused "
                          f"experts' parameters ({', '.join(sorted(config.target_parameters or ()))}); drop them and "
                          f"name the experts in {key}.target_parameters")
    module.peft_config = {ADAPTER_NAME: config}  # what peft's state-dict helpers read
    for parameter in module.parameters():
        if parameter.requires_grad:  # float32 adapter weights on a half-precision base
            parameter.data = parameter.data.float()
    return module


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """The peft adapter layers inside ``module`` (empty when it has no adapter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [layer for layer in module.modules() if isinstance(layer, BaseTunerLayer)]


def _installed_lora_layers(module: nn.Module) -> list[nn.Module]:
    """:func:`lora_layers`, or none when peft is not installed or not yet imported (nothing can carry an adapter
    then: an adapter layer is an instance of a peft class). Not importing it for that answer keeps ~1.7 s of imports
    (peft pulls in transformers) out of every run without LoRA, the toy's and the CLI's tests included."""
    if "peft" not in sys.modules:
        return []
    try:
        return lora_layers(module)
    except ImportError:
        return []


def has_lora(module: nn.Module) -> bool:
    """Whether ``module`` carries a LoRA adapter (:func:`attach_lora`, or peft's own wrappers)."""
    return bool(_installed_lora_layers(module))


def set_lora_enabled(module: nn.Module, enabled: bool) -> None:
    """Switch every adapter layer of ``module`` on or off (off: the base model)."""
    for layer in lora_layers(module):
        layer.enable_adapters(enabled)


def frozen_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` that never trains (no gradients, eval mode): full fine-tuning's reference policy."""
    return copy.deepcopy(module).requires_grad_(False).eval()


def check_reference_sync(train_config: Any) -> None:
    """Refuse ``algorithm.ref_sync_every`` with a LoRA policy when the config is loaded (for a plugin's
    :meth:`~mmrl.plugin.Plugin.check_config`), before any model is built: a LoRA run's reference is the base weights
    under the adapter, not a module of its own to move (TRL refuses ``sync_ref_model`` with PEFT too).

    Args:
        train_config: The validated :class:`mmrl.config.TrainConfig`; its plugin section's ``lora`` is read.
    """
    every = train_config.algorithm.ref_sync_every
    if every and getattr(train_config.plugin.config, "lora", None) is not None:
        raise ConfigError("algorithm.ref_sync_every", every,
                          "0 with plugin.lora set (the reference is the base weights under the adapter, nothing to "
                          "sync), or plugin.lora: null (full fine-tuning keeps a reference copy that can be synced)")


@contextmanager
def reference_policy(module: nn.Module, frozen: nn.Module | None = None) -> Iterator[nn.Module]:
    """The reference policy of the KL term, for the duration of the block.

    With a LoRA adapter: ``module`` itself with the adapter switched off (the base model; switched back on when the
    block ends, also on an error). Without one (full fine-tuning): ``frozen``, the copy of the initial weights the
    plugin keeps (:func:`frozen_copy`, or the base checkpoint loaded again).

    Args:
        module: The policy, unwrapped from DDP/FSDP (``Runtime.unwrap``).
        frozen: Full fine-tuning's frozen copy; ignored with LoRA.

    Raises:
        RuntimeError: Full fine-tuning without a frozen copy (plugins keep one only when ``Runtime.needs_reference``).
    """
    layers = _installed_lora_layers(module)  # one walk over the modules for off and on
    if layers:
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield module
        finally:
            for layer in layers:
                layer.enable_adapters(True)
        return
    if frozen is None:
        raise RuntimeError("a reference policy was requested but Runtime.needs_reference was False (full "
                           "fine-tuning keeps a frozen copy only when algorithm.kl_coef > 0)")
    yield frozen
