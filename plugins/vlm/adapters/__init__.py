"""Model adapters: what the VLM plugin needs to know about one family of vision-language models.

An adapter (:class:`~mmrl.plugins.vlm.adapters.base.VLMAdapter`) names the transformers model class, the box
coordinate convention the family writes (see :mod:`mmrl.rewards.boxes`), the default LoRA targets and where the vision
tower lives; the Qwen-style processing (chat template, ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids``,
per-sample splitting and collation) is shared in the base class. A new family is one adapter file plus one line
here, or, from another package, an entry point in the group ``mmrl.vlm_adapters``::

    [project.entry-points."mmrl.vlm_adapters"]
    my_family = "my_package.adapter:MyFamilyAdapter"

Adapters are registered lazily: listing them imports neither torch models nor transformers. Qwen3-VL, Qwen3-VL MoE,
Qwen3.5, Qwen3.5 MoE, GLM-4.1V, GLM-4.5V, GLM-4.6V, InternVL, Gemma 4, Gemma 3 and Mistral 3 are registered only
when the installed transformers ships them (``transformers.models.qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5``,
``qwen3_5_moe``, ``glm4v``, ``glm4v_moe``, ``glm46v``, ``internvl``, ``gemma4``, ``gemma3``, ``mistral3``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from mmrl.registry import Registry

if TYPE_CHECKING:
    from mmrl.plugins.vlm.adapters.base import VLMAdapter

vlm_adapters: Registry[type[VLMAdapter]] = Registry("vlm model adapter", entry_point_group="mmrl.vlm_adapters")

vlm_adapters.register_lazy("qwen2_vl", "mmrl.plugins.vlm.adapters.qwen2_vl:Qwen2VLAdapter")
vlm_adapters.register_lazy("qwen2_5_vl", "mmrl.plugins.vlm.adapters.qwen2_5_vl:Qwen25VLAdapter")


def _transformers_has_model(name: str) -> bool:
    """Whether the installed transformers ships ``transformers.models.<name>``, without importing transformers."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return False
    locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec is not None else []
    return any((Path(location) / "models" / name / "__init__.py").is_file() for location in locations)


if _transformers_has_model("qwen3_vl"):
    vlm_adapters.register_lazy("qwen3_vl", "mmrl.plugins.vlm.adapters.qwen3_vl:Qwen3VLAdapter")
for _family, _target in (("qwen3_vl_moe", "qwen3_vl_moe:Qwen3VLMoeAdapter"), ("qwen3_5", "qwen3_5:Qwen35Adapter"),
                         ("qwen3_5_moe", "qwen3_5_moe:Qwen35MoeAdapter"), ("glm4v", "glm4v:Glm4vAdapter"),
                         ("glm4v_moe", "glm4v:Glm4vMoeAdapter"), ("internvl", "internvl:InternVLAdapter"),
                         ("gemma4", "gemma4:Gemma4Adapter"), ("gemma3", "gemma3:Gemma3Adapter"),
                         ("mistral3", "mistral3:Mistral3Adapter")):
    if _transformers_has_model(_family):
        vlm_adapters.register_lazy(_family, f"mmrl.plugins.vlm.adapters.{_target}")
# SmolVLM2 (model_type smolvlm) and SmolVLM-Instruct v1 (model_type idefics3): one adapter module, registered only
# when the installed transformers ships transformers.models.smolvlm / idefics3
for _family, _target in (("smolvlm", "smolvlm:SmolVLMAdapter"), ("idefics3", "smolvlm:Idefics3Adapter")):
    if _transformers_has_model(_family):
        vlm_adapters.register_lazy(_family, f"mmrl.plugins.vlm.adapters.{_target}")
# GLM-4.6V and GLM-4.6V-Flash (model_type glm46v, an MoE or a dense language model), when transformers.models.glm46v is
# shipped
if _transformers_has_model("glm46v"):
    vlm_adapters.register_lazy("glm46v", "mmrl.plugins.vlm.adapters.glm46v:Glm46vAdapter")


def model_type_of(model: str) -> str:
    """The ``model_type`` of a checkpoint: read from ``config.json`` of a local folder, else through
    ``transformers.AutoConfig`` (a hub id; needs the hub or its cache)."""
    config_path = Path(model) / "config.json"
    if config_path.is_file():
        model_type = json.loads(config_path.read_text()).get("model_type")
    else:
        from transformers import AutoConfig

        model_type = getattr(AutoConfig.from_pretrained(model), "model_type", None)
    if not model_type:
        raise ValueError(f"{model}: its config.json has no model_type; set plugin.family explicitly")
    return str(model_type)


def adapter_for(family: str, model: str) -> type[VLMAdapter]:
    """The adapter class for ``family`` (a registered name, or ``"auto"``: match ``model``'s ``model_type``
    against each adapter's :attr:`~VLMAdapter.model_types`)."""
    if family != "auto":
        return vlm_adapters.get(family)
    model_type = model_type_of(model)
    known = []
    for name in vlm_adapters.names():
        adapter = vlm_adapters.get(name)
        known.extend(f"{t} ({name})" for t in adapter.model_types)
        if model_type in adapter.model_types:
            return adapter
    raise ValueError(f"no VLM adapter handles model_type {model_type!r} of {model}; known: {', '.join(known)}. "
                     "Set plugin.family or add an adapter (docs/vlm.md)")


__all__ = ["adapter_for", "model_type_of", "vlm_adapters"]
