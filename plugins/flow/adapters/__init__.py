"""Model adapters: what the flow plugin needs to know about one family of diffusers flow pipelines.

An adapter turns a diffusers pipeline into five operations (see :class:`~mmrl.plugins.flow.adapters.base.FlowAdapter`):
encode prompts, draw initial noise, build the σ schedule, predict the velocity, decode latents to images. The
plugin's sampler, log-probs, KL, LoRA and checkpointing are shared by every model.

Built-in adapters are registered lazily (listing them does not import diffusers); a new model is one adapter file
plus one line here, or, from another package, an entry point in the group ``mmrl.flow_adapters``::

    [project.entry-points."mmrl.flow_adapters"]
    my_model = "my_package.adapter:MyModelAdapter"

docs/flow.md walks through writing one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmrl.registry import Registry

if TYPE_CHECKING:
    from mmrl.plugins.flow.adapters.base import FlowAdapter

flow_adapters: Registry[type[FlowAdapter]] = Registry("flow model adapter", entry_point_group="mmrl.flow_adapters")

flow_adapters.register_lazy("sd3", "mmrl.plugins.flow.adapters.sd3:SD3Adapter")
flow_adapters.register_lazy("flux", "mmrl.plugins.flow.adapters.flux:FluxAdapter")
flow_adapters.register_lazy("chroma", "mmrl.plugins.flow.adapters.chroma:ChromaAdapter")
flow_adapters.register_lazy("flux_kontext", "mmrl.plugins.flow.adapters.flux_kontext:FluxKontextAdapter")
flow_adapters.register_lazy("flux2", "mmrl.plugins.flow.adapters.flux2:Flux2Adapter")
flow_adapters.register_lazy("flux2_klein", "mmrl.plugins.flow.adapters.flux2_klein:Flux2KleinAdapter")
flow_adapters.register_lazy("flux3", "mmrl.plugins.flow.adapters.flux3:Flux3Adapter")
flow_adapters.register_lazy("flux2_edit", "mmrl.plugins.flow.adapters.flux2_edit:Flux2EditAdapter")
flow_adapters.register_lazy("flux2_klein_edit", "mmrl.plugins.flow.adapters.flux2_edit:Flux2KleinEditAdapter")
flow_adapters.register_lazy("qwen_image", "mmrl.plugins.flow.adapters.qwen_image:QwenImageAdapter")
flow_adapters.register_lazy("qwen_image_edit", "mmrl.plugins.flow.adapters.qwen_image_edit:QwenImageEditAdapter")
flow_adapters.register_lazy("qwen_image21", "mmrl.plugins.flow.adapters.qwen_image21:QwenImage21Adapter")
flow_adapters.register_lazy("qwen_image21_edit",
                            "mmrl.plugins.flow.adapters.qwen_image21_edit:QwenImage21EditAdapter")
flow_adapters.register_lazy("wan", "mmrl.plugins.flow.adapters.wan:WanAdapter")
flow_adapters.register_lazy("wan_i2v", "mmrl.plugins.flow.adapters.wan_i2v:WanImageToVideoAdapter")
flow_adapters.register_lazy("wan_v2v", "mmrl.plugins.flow.adapters.wan_v2v:WanVideoToVideoAdapter")
flow_adapters.register_lazy("z_image", "mmrl.plugins.flow.adapters.z_image:ZImageAdapter")
flow_adapters.register_lazy("hunyuan_video15",
                            "mmrl.plugins.flow.adapters.hunyuan_video15:HunyuanVideo15Adapter")
flow_adapters.register_lazy("hunyuan_video15_i2v",
                            "mmrl.plugins.flow.adapters.hunyuan_video15_i2v:HunyuanVideo15ImageToVideoAdapter")
flow_adapters.register_lazy("ltx2", "mmrl.plugins.flow.adapters.ltx2:LTX2Adapter")
flow_adapters.register_lazy("ltx2_i2v", "mmrl.plugins.flow.adapters.ltx2_i2v:LTX2ImageToVideoAdapter")
flow_adapters.register_lazy("sana", "mmrl.plugins.flow.adapters.sana:SanaAdapter")
flow_adapters.register_lazy("longcat_image", "mmrl.plugins.flow.adapters.longcat_image:LongCatImageAdapter")
flow_adapters.register_lazy("longcat_image_edit",
                            "mmrl.plugins.flow.adapters.longcat_image_edit:LongCatImageEditAdapter")


def adapter_for_pipeline(class_name: str, model: str) -> type[FlowAdapter]:
    """The registered adapter that declares ``class_name`` (a ``model_index.json`` ``_class_name``) among its
    :attr:`~FlowAdapter.pipeline_classes`."""
    known: dict[str, Any] = {}
    for name in flow_adapters.names():
        adapter = flow_adapters.get(name)
        for pipeline_class in adapter.pipeline_classes:
            known[pipeline_class] = name
            if pipeline_class == class_name:
                return adapter
    listed = ", ".join(f"{cls} ({name})" for cls, name in sorted(known.items()))
    raise ValueError(
        f"no flow adapter handles pipeline class {class_name!r} of {model}; known: {listed}. "
        "Set plugin.adapter explicitly or add an adapter (docs/flow.md)"
    )


__all__ = ["adapter_for_pipeline", "flow_adapters"]
