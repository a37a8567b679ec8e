"""Adapters chosen by name refuse, when they are built, a pipeline class they do not drive: in one line naming the
class found, the classes the adapter drives and the adapter that drives the class found (the one ``adapter: auto``
picks from ``model_index.json``), instead of failing later (``adapter: flux`` on a Chroma checkpoint raised a
TypeError inside ``ChromaPipeline.encode_prompt`` at the first prompt) or running a model with another model's inputs.

The rule lives in :func:`mmrl.plugins.flow.adapters.flux.refuse_other_pipelines`, called by the FLUX.1 adapter (and so
by ``chroma``, ``flux_kontext``, ``longcat_image`` and ``longcat_image_edit``, its subclasses) and by ``sana``. The
pipelines are the tiny ones of ``plugins/flow/testing.py``; the Chroma one is saved and loaded back through the
plugin, the path a hub checkpoint takes."""

from __future__ import annotations

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
