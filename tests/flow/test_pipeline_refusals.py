"""Adapters chosen by name refuse, when they are built, a pipeline class they do not drive: in one line naming the
class found, the classes the adapter drives and the adapter that drives the class found (the one ``adapter: auto``
picks from ``model_index.json``), instead of failing later (``adapter: flux`` on a Chroma checkpoint raised a
TypeError inside ``ChromaPipeline.encode_prompt`` at the first prompt) or running a model with another model's inputs.

The rule lives in :func:`mmrl.plugins.flow.adapters.base.refuse_other_pipelines`, called when every built-in adapter
is built: by the FLUX.1 adapter (and so by ``chroma``, ``flux_kontext``, ``longcat_image`` and ``longcat_image_edit``,
its subclasses), ``sana``, and the root adapter of every other family (``sd3``, ``flux2`` and ``flux2_klein``,
``flux3``, ``qwen_image`` and ``qwen_image_edit``, ``qwen_image21``, ``wan`` with ``wan_i2v`` and ``wan_v2v``,
``z_image``, ``hunyuan_video15`` and its ``_i2v``, ``ltx2`` and ``ltx2_i2v``). The pipelines are the tiny ones of
``plugins/flow/testing.py``, other classes built from their components (the class is all the check reads); the Chroma
one is saved and loaded back through the plugin, and the Wan 2.2 TI2V one through ``wan_i2v``'s ``from_pretrained``,
the path a hub checkpoint takes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Chroma pipeline saved with ``save_pretrained``."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("chroma", tmp_path_factory.mktemp("flow_refusals") / "tiny-chroma")
    return {**pipelines, "chroma": folder}


def test_the_flux_adapter_refuses_a_chroma_checkpoint_and_names_chroma(make_plugin, pipelines):
    """``adapter: flux`` on a ChromaPipeline folder (the checkpoint ``auto`` gives to ``chroma``) is refused when the
    plugin builds the adapter, before any prompt is encoded; ``auto`` on the same folder picks what the line says."""
    from mmrl.config import from_dict
    from mmrl.plugins.flow.adapters.chroma import ChromaAdapter
    from mmrl.plugins.flow.config import FlowPluginConfig, adapter_class

    auto = from_dict(FlowPluginConfig, {"model": str(pipelines["chroma"]), "prompts": ["a cat"]}, "plugin")
    assert adapter_class(auto) is ChromaAdapter
    with pytest.raises(ValueError, match=r"^the flux adapter drives FluxPipeline, not ChromaPipeline: set "
                                         r"plugin.adapter: chroma \(or auto\)$"):
        make_plugin("chroma", adapter="flux")
    make_plugin("chroma", adapter="chroma")  # the adapter the line names builds on the same folder


def _flux(seed: int = 0) -> Any:
    from mmrl.plugins.flow.testing import build_flux_pipeline

    return build_flux_pipeline(seed)


def _flux_kontext() -> Any:
    from mmrl.plugins.flow.testing import build_flux_kontext_pipeline

    return build_flux_kontext_pipeline()


def _flux_img2img() -> Any:
    """FLUX.1's image-to-image pipeline: a class that no flow adapter drives."""
    from diffusers import FluxImg2ImgPipeline

    return FluxImg2ImgPipeline(**_flux().components)


def _sd3() -> Any:
    from mmrl.plugins.flow.testing import build_sd3_pipeline

    return build_sd3_pipeline()


@pytest.fixture(scope="module")
def longcat_pipelines() -> dict[str, Any]:
    """The tiny LongCat-Image pipeline and the edit pipeline of the same components, built once for the module."""
    from diffusers import LongCatImageEditPipeline

    from mmrl.plugins.flow.testing import build_longcat_image_pipeline

    text_to_image = build_longcat_image_pipeline()
    names = ("scheduler", "vae", "text_encoder", "tokenizer", "text_processor", "transformer")
    edit = LongCatImageEditPipeline(**{name: text_to_image.components[name] for name in names})
    return {"LongCatImagePipeline": text_to_image, "LongCatImageEditPipeline": edit}


@pytest.mark.parametrize(("adapter", "build", "found", "drives", "instead"), [
    ("flux", _flux_kontext, "FluxKontextPipeline", "FluxPipeline", "set plugin.adapter: flux_kontext (or auto)"),
    ("flux_kontext", _flux, "FluxPipeline", "FluxKontextPipeline", "set plugin.adapter: flux (or auto)"),
    ("chroma", _sd3, "StableDiffusion3Pipeline", "ChromaPipeline", "set plugin.adapter: sd3 (or auto)"),
    ("flux", _flux_img2img, "FluxImg2ImgPipeline", "FluxPipeline",
     "no registered flow adapter drives it (docs/flow.md section 12 adds one)"),
    # FLUX.1-dev's transformer embeds guidance, as Sana-Sprint's does: the line is the general one, not Sprint's
    ("sana", _flux, "FluxPipeline", "SanaPipeline", "set plugin.adapter: flux (or auto)"),
], ids=["flux-on-kontext", "kontext-on-flux", "chroma-on-sd3", "flux-on-img2img", "sana-on-flux"])
def test_another_pipeline_class_is_refused_in_one_line(adapter, build, found, drives, instead):
    from mmrl.plugins.flow.adapters import flow_adapters

    pipeline = build()
    assert type(pipeline).__name__ == found
    with pytest.raises(ValueError) as refusal:
        flow_adapters.get(adapter)(pipeline, torch.device("cpu"))
    assert str(refusal.value) == f"the {adapter} adapter drives {drives}, not {found}: {instead}"


@pytest.mark.parametrize(("adapter", "found", "instead"), [
    ("longcat_image", "LongCatImageEditPipeline", "longcat_image_edit"),
    ("longcat_image_edit", "LongCatImagePipeline", "longcat_image"),
], ids=["t2i-on-edit", "edit-on-t2i"])
def test_the_longcat_adapters_refuse_each_others_pipeline(longcat_pipelines, adapter, found, instead):
    """The two LongCat pipelines share every component (the tiny edit pipeline here is the text-to-image one's
    components), so only the class tells them apart: each adapter refuses the other's and names it; each builds on
    its own."""
    from mmrl.plugins.flow.adapters import flow_adapters

    cls = flow_adapters.get(adapter)
    with pytest.raises(ValueError) as refusal:
        cls(longcat_pipelines[found], torch.device("cpu"))
    assert str(refusal.value) == (f"the {adapter} adapter drives {cls.pipeline_classes[0]}, not {found}: set "
                                  f"plugin.adapter: {instead} (or auto)")
    assert cls(longcat_pipelines[cls.pipeline_classes[0]], torch.device("cpu")).name == adapter


# ------------------------------------------------------------------------- the other families' adapters
def _empty(class_name: str) -> Any:
    """A diffusers pipeline of ``class_name`` with every component None: the class alone, for an adapter that must
    refuse it before reading anything (LTX-2's tiny pipeline, built in tests/flow/test_ltx2.py, takes seconds)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, class_name)
    return cls(**{name: None for name in inspect.signature(cls.__init__).parameters if name != "self"})


@pytest.fixture(scope="module")
def tiny():
    """``tiny(kind)``: the pipeline of ``kind``, built once for the module: a key of ``plugins/flow/testing.py``'s
    ``BUILDERS``, or ``wan_v2v`` (the tiny Wan's components as a ``WanVideoToVideoPipeline``), ``flux3_distilled`` (a
    ``Flux3DistilledModularPipeline`` without components) or ``ltx2`` / ``ltx2_i2v`` (:func:`_empty`)."""
    from mmrl.plugins.flow.testing import BUILDERS

    built: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in built:
            if kind == "wan_v2v":
                from diffusers import WanVideoToVideoPipeline

                # the pipeline's own components: it declares no transformer_2 (one expert)
                parts = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
                built[kind] = WanVideoToVideoPipeline(**{name: get("wan").components[name] for name in parts})
            elif kind == "flux3_distilled":
                from diffusers.modular_pipelines import Flux3DistilledAutoBlocks

                built[kind] = Flux3DistilledAutoBlocks().init_pipeline()
            elif kind in ("ltx2", "ltx2_i2v"):
                built[kind] = _empty("LTX2Pipeline" if kind == "ltx2" else "LTX2ImageToVideoPipeline")
            else:
                built[kind] = BUILDERS[kind]()
        return built[kind]

    return get


# (adapter, pipeline kind, class found, classes the adapter drives, adapter the line names): the confusions a user
# can make between the checkpoints of one family, each adapter refusing at least one class
WRONG = [
    ("sd3", "flux", "FluxPipeline", "StableDiffusion3Pipeline", "flux"),
    ("flux2", "flux2_klein", "Flux2KleinPipeline", "Flux2Pipeline", "flux2_klein"),
    ("flux2_klein", "flux2", "Flux2Pipeline", "Flux2KleinPipeline", "flux2"),
    ("flux3", "flux2", "Flux2Pipeline", "Flux3ModularPipeline", "flux2"),
    ("z_image", "flux2_klein", "Flux2KleinPipeline", "ZImagePipeline", "flux2_klein"),
    ("qwen_image", "qwen_image_edit", "QwenImageEditPipeline", "QwenImagePipeline", "qwen_image_edit"),
    ("qwen_image_edit", "qwen_image", "QwenImagePipeline", "QwenImageEditPipeline or QwenImageEditPlusPipeline",
     "qwen_image"),
    ("qwen_image", "qwen_image21", "QwenImage21Pipeline", "QwenImagePipeline", "qwen_image21"),
    ("qwen_image21", "qwen_image", "QwenImagePipeline", "QwenImage21Pipeline", "qwen_image"),
    ("wan", "wan_i2v", "WanImageToVideoPipeline", "WanPipeline", "wan_i2v"),
    ("wan_i2v", "wan", "WanPipeline", "WanImageToVideoPipeline", "wan"),  # Wan 2.1 T2V: no image condition
    ("wan", "wan_v2v", "WanVideoToVideoPipeline", "WanPipeline", "wan_v2v"),
    ("wan_v2v", "wan_i2v", "WanImageToVideoPipeline", "WanVideoToVideoPipeline or WanPipeline",
     "wan_i2v"),
    ("hunyuan_video15", "hunyuan_video15_i2v", "HunyuanVideo15ImageToVideoPipeline", "HunyuanVideo15Pipeline",
     "hunyuan_video15_i2v"),
    ("hunyuan_video15_i2v", "hunyuan_video15", "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline",
     "hunyuan_video15"),
    ("ltx2", "ltx2_i2v", "LTX2ImageToVideoPipeline", "LTX2Pipeline", "ltx2_i2v"),
    ("ltx2_i2v", "ltx2", "LTX2Pipeline", "LTX2ImageToVideoPipeline", "ltx2"),
]


@pytest.mark.parametrize(("adapter", "kind", "found", "drives", "instead"), WRONG,
                         ids=[f"{row[0]}-on-{row[1]}" for row in WRONG])
def test_every_family_refuses_another_class_and_names_the_adapter_that_builds_on_it(tiny, adapter, kind, found,
                                                                                   drives, instead):
    """The line names the adapter ``auto`` gives the class (``adapter_for_pipeline``, as for a ``model_index.json``),
    and that adapter builds on the very pipeline refused (except LTX-2's component-less stand-ins): the advice
    works, and the check does not refuse what it should drive."""
    from mmrl.plugins.flow.adapters import adapter_for_pipeline, flow_adapters

    pipeline = tiny(kind)
    assert type(pipeline).__name__ == found
    with pytest.raises(ValueError) as refusal:
        flow_adapters.get(adapter)(pipeline, torch.device("cpu"))
    assert str(refusal.value) == f"the {adapter} adapter drives {drives}, not {found}: set plugin.adapter: " \
                                 f"{instead} (or auto)"
    assert adapter_for_pipeline(found, "a checkpoint").name == instead
    if not kind.startswith("ltx2"):
        assert flow_adapters.get(instead)(pipeline, torch.device("cpu")).name == instead


@pytest.mark.parametrize(("adapter", "kind"), [
    ("sd3", "sd3"), ("flux3", "flux3"), ("z_image", "z_image"), ("qwen_image_edit", "qwen_image_edit_plus"),
    ("wan_v2v", "wan"), ("wan_v2v", "wan22_ti2v"), ("wan", "wan22_ti2v"),
], ids=["sd3", "flux3", "z_image", "qwen_image_edit-plus", "wan_v2v-on-t2v", "wan_v2v-on-ti2v", "wan-on-ti2v"])
def test_each_adapter_builds_on_the_classes_it_drives(tiny, adapter, kind):
    """The adapters the previous test does not build, on their own classes; ``qwen_image_edit`` on its second class
    (Edit-Plus), and ``wan_v2v`` on a ``WanPipeline``: the V2V model is a Wan text-to-video checkpoint, whose
    ``model_index.json`` names that class (Wan 2.1 and Wan 2.2 TI2V-5B alike), though ``auto`` gives it to ``wan``."""
    from mmrl.plugins.flow.adapters import flow_adapters

    assert flow_adapters.get(adapter)(tiny(kind), torch.device("cpu")).name == adapter


def test_flux3_names_the_distilled_pipeline_as_such(tiny):
    """A ``Flux3DistilledModularPipeline`` is refused with the step-distilled model's reason, read from the class
    before any component (this one has none), not with the general line, which would call it a class nothing drives;
    a class ``auto`` knows still gets the general line (previous tests)."""
    from mmrl.plugins.flow.adapters.flux3 import Flux3Adapter

    with pytest.raises(ValueError, match=r"^the flux3 adapter does not train step-distilled \(flow-map\) FLUX.3: its "
                                         r"velocity also takes the timestep each step jumps to"):
        Flux3Adapter(tiny("flux3_distilled"), torch.device("cpu"))


def test_wan_i2v_loads_a_ti2v_checkpoint_as_image_to_video_and_refuses_a_text_to_video_one(tmp_path):
    """Wan 2.2 TI2V-5B's ``model_index.json`` names ``WanPipeline`` (one checkpoint for text- and image-to-video):
    ``wan_i2v``'s ``from_pretrained`` makes it the pipeline diffusers' own ``WanImageToVideoPipeline.from_pretrained``
    loads from that folder (class, config, components); a Wan 2.1 text-to-video folder, whose transformer takes no
    image condition, stays a ``WanPipeline`` and is refused naming ``wan``."""
    from diffusers import WanImageToVideoPipeline

    from mmrl.plugins.flow.adapters.wan_i2v import WanImageToVideoAdapter
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    cpu = torch.device("cpu")
    ti2v = save_tiny_pipeline("wan22_ti2v", tmp_path / "ti2v")
    assert json.loads((ti2v / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    adapter = WanImageToVideoAdapter.from_pretrained(str(ti2v), dtype=torch.float32, device=cpu)
    reference = WanImageToVideoPipeline.from_pretrained(str(ti2v))
    assert type(adapter.pipeline) is WanImageToVideoPipeline
    def settings(pipeline: Any) -> dict[str, Any]:  # the config without its private keys (the folder's path)
        return {key: value for key, value in pipeline.config.items() if not key.startswith("_")}

    assert settings(adapter.pipeline) == settings(reference)  # expand_timesteps true, no boundary, no image encoder
    assert adapter.expand_timesteps
    for name, module in reference.components.items():
        mine = adapter.pipeline.components[name]
        assert type(mine) is type(module), name
        if isinstance(module, torch.nn.Module):
            assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), module.state_dict().values(),
                                                         strict=True)), name
    text_to_video = save_tiny_pipeline("wan", tmp_path / "t2v")
    with pytest.raises(ValueError, match=r"^the wan_i2v adapter drives WanImageToVideoPipeline, not WanPipeline: set "
                                         r"plugin.adapter: wan \(or auto\)$"):
        WanImageToVideoAdapter.from_pretrained(str(text_to_video), dtype=torch.float32, device=cpu)
