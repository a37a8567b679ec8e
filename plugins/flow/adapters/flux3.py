"""FLUX.3 (diffusers' modular ``Flux3ModularPipeline``, text-to-image): a Qwen3-VL text encoder, the
``Flux3Transformer2DModel`` and FLUX.2's batch-normalised VAE. diffusers 0.42 ships FLUX.3 only as a modular pipeline
(``diffusers/modular_pipelines/flux3/``: ``Flux3AutoBlocks`` in ``modular_blocks_flux3.py``, steps in
``encoders.py``, ``before_denoise.py``, ``denoise.py``, ``decoders.py``); a checkpoint folder has a
``modular_model_index.json`` instead of a ``model_index.json``, which ``adapter: auto`` reads for a local folder.

What this adapter reproduces, step by step, and where mmrl differs:

- loading: ``ModularPipeline.from_pretrained`` (the class named in ``modular_model_index.json``), then
  ``load_components`` of what the folder stores (text encoder, its processor, transformer, VAE) except the prompt
  upsampler; what it does not store the blocks create from their own config (``FlowMatchEulerDiscreteScheduler``
  with shift 6.93, ``ClassifierFreeGuidance`` at 3.5; a guider with ``guidance_rescale`` or
  ``use_original_formulation`` is refused, and a null ``guidance_scale`` is 3.5 whatever a stored guider says).
  The prompt upsampler (a Qwen3.5 model the auto blocks run first to expand the
  request into a full caption) is not loaded: prompts are used as written, as when the pipeline is composed without
  its ``prompt_upsampler`` block (rewarding an upsampled caption would train on text the dataset never gave).
- prompts: ``Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`` (``encoders.py``) itself, one prompt per call as the
  step does: the processor's chat template with the generation prompt, right-padded to a multiple of 80 tokens
  capped at ``max_sequence_length``, padding position ids 1, hidden layers 4, 8, ..., 32 stacked layer-major along
  the width (``[1, L, 8·D]``). The transformer takes no text mask and attends to the padding, so each prompt's window
  length is part of its conditioning: rows are stored zero-padded to ``max_sequence_length`` with their window
  length (``prompt_lengths``), and :meth:`call_transformer` runs one transformer call per window length on the
  window alone, exactly the pipeline's per-prompt input. The pipeline's cap is 8192 tokens; mmrl's default is 512
  (every row is stored at the cap's width), which gives the same windows for prompts up to 512 tokens.
- latents: ``Flux3PrepareLatentsStep`` (``before_denoise.py``): noise ``[in_channels, H/16, W/16]`` drawn in float32
  and packed to tokens by ``flatten(2).transpose(1, 2)``; image position ids ``(0, row·0.5, column·0.5, 0)``
  (``_prepare_image_ids`` with the image RoPE scale 0.5) and text ids ``(0, 0, 0, position)``
  (``Flux3TextRoPEInputsStep._prepare_text_ids``), both ``[seq, 4]`` without a batch axis.
- schedule: ``Flux3SetTimestepsStep``: σ = linspace(1, 1/S, S) through the scheduler's constant shift 6.93; the
  transformer gets t/1000 in the latents' dtype.
- guidance: ``Flux3LoopDenoiser`` runs the guider's conditional and unconditional passes (negative prompt ""), and
  ``ClassifierFreeGuidance`` combines v_u + w·(v_c − v_u) (default w 3.5, off at w = 1) in the model's dtype; here
  the two passes share the plugin's [uncond; cond] batch (split by window length) and combine in float32.
- decode: ``Flux3UnpackLatentsStep`` and ``Flux3DecodeStep`` (``decoders.py``): tokens back to ``[4C, H/16, W/16]``,
  batch-norm un-normalisation, 2×2 unpatchify, VAE decode, ``output_type="pt"`` (x/2 + 0.5 clamped).

Not supported: the step-distilled checkpoints (``Flux3DistilledModularPipeline``, a flow-map transformer with
``flow_map=True``): each step's velocity also depends on the timestep the step jumps to (``target_timestep``), which
the plugin's per-step velocity does not carry; reference-image conditioning (``image=``); the prompt upsampler.
LoRA targets: the attention projections and feed-forward layers of every block (no sourced FLUX.3 training setting
exists yet).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import (
    Conditioning,
    FlowAdapter,
    adapter_driving,
    call_per_group,
    check_pipeline_folder,
    refuse_other_pipelines,
)


def _unused(name: str) -> bool:
    """The prompt upsampler and its processor: listed by a FLUX.3 folder, never run by the adapter."""
    return name.startswith("prompt_upsampler")


def _other_folder_hint(path: Path) -> str:
    """For a folder that is not a modular pipeline: the adapter its ``model_index.json`` class takes (``auto``'s
    choice), so the refusal says what to set; empty when the folder has no index or its class no adapter."""
    import json

    index = path / "model_index.json"
    if not index.is_file():
        return ""
    class_name = str(json.loads(index.read_text()).get("_class_name"))
    driver = adapter_driving(class_name)
    return f": its model_index.json names {class_name}; set plugin.adapter: {driver} (or auto)" if driver else ""


def load_modular_pipeline(model: str, dtype: torch.dtype) -> Any:
    """A diffusers modular pipeline from a local folder with ``modular_model_index.json`` (checked complete) or a hub
    id, with every component it stores loaded in ``dtype`` except the prompt upsampler; the others (scheduler, guider,
    image processor where a folder stores none) are the blocks' defaults."""
    import json

    from diffusers.modular_pipelines import ModularPipeline

    path = Path(model).expanduser()
    if path.is_dir():
        index = path / "modular_model_index.json"
        if not index.is_file():
            raise FileNotFoundError(f"flow model folder {path} has no modular_model_index.json (not a diffusers "
                                    f"modular pipeline, which the flux3 adapter loads){_other_folder_hint(path)}")
        listed = json.loads(index.read_text())
        check_pipeline_folder(path, {key: value for key, value in listed.items() if not _unused(key)})
        model = str(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pipeline = ModularPipeline.from_pretrained(model)
        names = [name for name, spec in pipeline._component_specs.items()
                 if spec.default_creation_method == "from_pretrained" and spec.pretrained_model_name_or_path
                 and not _unused(name)]
        pipeline.load_components(names=names, torch_dtype=dtype)
    return pipeline


class Flux3Adapter(FlowAdapter):
    """Adapter for ``Flux3ModularPipeline`` (the FLUX.3 base checkpoints; text-to-image, true CFG)."""

    name = "flux3"
    pipeline_classes = ("Flux3ModularPipeline",)
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out")
    default_guidance_scale = 3.5  # Flux3LoopDenoiser's ClassifierFreeGuidance config
    supports_cfg = True
    default_max_sequence_length = 512  # the pipeline's cap is 8192; see the module docstring

    def __init__(self, pipeline: Any, device: torch.device):
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        kind = type(pipeline).__name__
        # The step-distilled FLUX.3 first, with its own reason: its modular pipeline class, or the base class holding a
        # flow-map transformer. Another class's transformer is not read (refuse_other_pipelines names its adapter).
        distilled = kind == "Flux3DistilledModularPipeline" or (
            kind in self.pipeline_classes and getattr(pipeline.transformer.config, "flow_map", False))
        if distilled:
            raise ValueError("the flux3 adapter does not train step-distilled (flow-map) FLUX.3: its velocity also "
                             "takes the timestep each step jumps to, which the flow plugin's steps do not carry")
        refuse_other_pipelines(type(self), pipeline)
        guider = getattr(pipeline, "guider", None)
        if guider is not None and (guider.guidance_rescale or guider.use_original_formulation):
            raise ValueError("the flux3 adapter combines guidance as v_u + w·(v_c − v_u): this pipeline's guider sets "
                             "guidance_rescale or use_original_formulation")
        super().__init__(pipeline, device)
        step = Flux3TextEncoderStep()
        self.pad_multiple = int(step.pad_multiple)
        self.text_layers = tuple(next(p.default for p in step.inputs if p.name == "text_encoder_out_layers"))
        self._ids: dict[tuple[Any, ...], Tensor] = {}

    @classmethod
    def from_pretrained(cls, model: str, *, dtype: torch.dtype, device: torch.device) -> FlowAdapter:
        """Load the modular pipeline at ``model`` (:func:`load_modular_pipeline`)."""
        return cls(load_modular_pipeline(model, dtype), device)

    def resolution_multiple(self) -> int:
        return self.vae_scale_factor * 2  # 2×2 patches of the VAE latents

    def _token_grid(self) -> tuple[int, int]:
        height, width = self.size
        return height // self.resolution_multiple(), width // self.resolution_multiple()

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        rows = [Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
            self.pipeline.text_encoder, self.pipeline.tokenizer, prompt, device=self.device,
            max_sequence_length=max_sequence_length, pad_multiple=self.pad_multiple,
            hidden_states_layers=self.text_layers) for prompt in prompts]  # [1, L_i, 8·D] each
        embeds = rows[0].new_zeros(len(rows), max_sequence_length, rows[0].shape[-1])
        for i, row in enumerate(rows):
            embeds[i, :row.shape[1]] = row[0]
        lengths = torch.tensor([row.shape[1] for row in rows], device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_lengths": lengths}

    def noise_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, *self._token_grid())  # as Flux3PrepareLatentsStep

    def pack(self, noise: Tensor) -> Tensor:
        return noise.flatten(2).transpose(1, 2)  # [n, h·w, C]

    def unpack(self, latents: Tensor) -> Tensor:
        rows, columns = self._token_grid()
        n, tokens, channels = latents.shape
        if rows * columns != tokens:
            raise ValueError(f"FLUX.3 adapter: {tokens} latent tokens, but a {self.height}x{self.width} image has "
                             f"{rows * columns} ({rows} x {columns})")
        return latents.view(n, rows, columns, channels).permute(0, 3, 1, 2)  # as Flux3UnpackLatentsStep

    def image_seq_len(self) -> int:
        rows, columns = self._token_grid()
        return rows * columns

    def default_sigmas(self, num_steps: int) -> list[float]:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()  # as Flux3SetTimestepsStep

    def _image_ids(self, like: Tensor) -> Tensor:
        from diffusers.modular_pipelines.flux3.before_denoise import Flux3PrepareLatentsStep, _prepare_image_ids

        rows, columns = self._token_grid()
        key = (rows, columns, like.device)
        if key not in self._ids:
            scale = Flux3PrepareLatentsStep().image_rope_scale
            self._ids[key] = _prepare_image_ids(rows, columns, scale).to(like.device)
        return self._ids[key]

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep

        image_ids = self._image_ids(latents)

        def window(rows: Tensor | None, length: int) -> Tensor:  # the rows whose text window is `length` tokens
            pick = (lambda value: value) if rows is None else (lambda value: value.index_select(0, rows))
            text = pick(conditioning["prompt_embeds"])[:, :length]  # [m, L, D]
            return module(
                hidden_states=pick(latents),
                encoder_hidden_states=text,
                timestep=pick(timesteps).to(latents.dtype) / 1000,  # Flux3LoopDenoiser: t/1000 in the latents' dtype
                img_ids=image_ids,
                txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text).to(latents.device),
                return_dict=False,
            )[0]

        # one call per text window, as the pipeline feeds each prompt alone
        return call_per_group(conditioning["prompt_lengths"].long(), window)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from diffusers.modular_pipelines.flux3.decoders import Flux3DecodeStep

        from mmrl.plugins.flow.adapters.flux2 import decode_flux2_latents

        return decode_flux2_latents(self.vae, self.unpack(latents), Flux3DecodeStep._unpatchify_latents)
