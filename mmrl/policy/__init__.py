"""The policy module: what a model plugin calls for LoRA, the reference policy, saving, loading and exporting.

One way for every model library (diffusers, transformers, anything peft can adapt):

- :class:`LoraConfig` is the ``plugin.lora`` section (rank, alpha, dropout, target modules, init);
  :func:`lora_config_class` gives it a plugin's defaults;
- :func:`attach_lora` injects the adapter in place (peft), freezing the base and keeping the adapter in float32;
- :func:`reference_policy` is the KL reference for the duration of a block: the adapter switched off, or full
  fine-tuning's frozen copy (:func:`frozen_copy`);
- :func:`save_policy` / :func:`load_policy` write and read the library's own formats (:data:`POLICY_FORMATS`):
  diffusers LoRA files (``pipeline.load_lora_weights``), peft adapter folders (``PeftModel.from_pretrained``),
  ``save_pretrained`` folders, and ``trainable.safetensors`` for checkpoints of full fine-tuning;
- :func:`export_run` is ``mmrl export``: a run's checkpoint as a folder the model's library loads.

docs/plugins.md ("The policy module") shows a plugin using it.
"""

from mmrl.policy.export import EXPORT_INFO, ExportError, export_run
from mmrl.policy.formats import (
    DIFFUSERS_LORA_WEIGHTS,
    PEFT_ADAPTER_CONFIG,
    PEFT_ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    POLICY_FORMATS,
    TRAINABLE_WEIGHTS,
    clean_parameter_name,
    load_adapter_state,
    load_policy,
    lora_state,
    save_peft_adapter,
    save_policy,
    trainable_state,
)
from mmrl.policy.lora import (
    ADAPTER_NAME,
    LORA_INITS,
    LoraConfig,
    attach_lora,
    check_reference_sync,
    frozen_copy,
    has_lora,
    lora_config_class,
    lora_layers,
    reference_policy,
    set_lora_enabled,
)

__all__ = [
    "ADAPTER_NAME",
    "DIFFUSERS_LORA_WEIGHTS",
    "EXPORT_INFO",
    "ExportError",
    "LORA_INITS",
    "LoraConfig",
    "PEFT_ADAPTER_CONFIG",
    "PEFT_ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "POLICY_FORMATS",
    "TRAINABLE_WEIGHTS",
    "attach_lora",
    "check_reference_sync",
    "clean_parameter_name",
    "export_run",
    "frozen_copy",
    "has_lora",
    "load_adapter_state",
    "load_policy",
    "lora_config_class",
    "lora_layers",
    "lora_state",
    "reference_policy",
    "save_peft_adapter",
    "save_policy",
    "set_lora_enabled",
    "trainable_state",
]
