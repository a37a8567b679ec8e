"""Sana (``SanaPipeline``): NVIDIA's linear-attention DiT (Sana 1.0 0.6B/1.6B, Sana 1.5 1.6B/4.8B) on the 32×
compressed latents of the DC-AE autoencoder, text from a Gemma-2 decoder read with a "complex human instruction"
prefix, true classifier-free guidance.

What the adapter reproduces of ``SanaPipeline`` (diffusers 0.42.1, ``pipelines/sana/pipeline_sana.py``; line numbers
of that file):

- prompts (``_get_gemma_prompt_embeds`` 222-278, ``encode_prompt`` 280-409): each prompt is lowercased and stripped
  (``_text_preprocessing`` 495-518, ``clean_caption=False`` as ``__call__``'s default, line 695; its docstring, line
  774, says True, but the keyword's default is False), the instruction lines joined
  by newlines are put in front of it (256-258), the tokenizer right-pads (249) to the instruction's own token count
  (BOS included) + ``max_sequence_length`` − 2 (259-260) and truncates there, Gemma-2's last hidden state is read
  with the padding mask, and of that sequence the first token (BOS) and the last ``max_sequence_length`` − 1 are kept
  with their mask (354, 366-367): ``prompt_embeds [n, L, D]`` and ``prompt_attention_mask [n, L]``, L =
  ``max_sequence_length`` (default 300, the pipeline's). The adapter calls the pipeline's own ``encode_prompt``, so all
  of this is the pipeline's code; every prompt is padded to the same fixed length, and Gemma-2 is causal, so a
  prompt's row does not depend on the prompts encoded with it.
- the negative prompt (376-399): encoded **without** the instruction and without the selection: padded to
  ``max_sequence_length`` tokens from BOS on. :meth:`SanaAdapter.encode_negative_prompt` (the plugin's
  negative-prompt hook, :meth:`FlowAdapter.encode_negative_prompt`) runs that path of the pipeline's
  ``encode_prompt`` alone, once per run; prompts are cached in the prompt form only.
- guidance (866-873, 926-930): one ``[uncond; cond]`` call with the masks concatenated the same way,
  v = v_u + w·(v_c − v_u) in float32; default scale 4.5 and negative prompt ``""`` (``__call__``'s 678, 682).
- the transformer call (908-924): latents ``[n, C, h, w]`` (no packing: the DiT patchifies itself, patch size 1 in the
  released models), ``encoder_attention_mask`` = the text mask (the transformer turns it into a −10000 bias over the
  padded keys of its cross-attention), timestep t·``transformer.config.timestep_scale`` where t is the scheduler's
  timestep (σ·1000); a learned-σ output (``out_channels`` twice the input's) keeps its first half (932-934).
- noise (634-650, 885-893): float32 ``[C, H/32, W/32]`` per sample from its own generator, C =
  ``transformer.config.in_channels``; the VAE factor is 2^(len(``vae.config.encoder_block_out_channels``) − 1)
  (215-219).
- decode (956-972): ``vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor)`` (DC-AE has no shift factor),
  then [-1, 1] → [0, 1].
- sizes: ``check_inputs`` wants height and width divisible by 32 (440-441), which the adapter requires too.
  ``__call__``'s ``use_resolution_binning`` (default True, 808-822, 968-969) snaps the request to the nearest
  aspect-ratio bin of the checkpoint's ``sample_size`` and resizes the decoded image back; the adapter generates at the
  requested size, i.e. the pipeline with ``use_resolution_binning=False``: pick a size of the bins (1024 × 1024,
  768 × 1344, ...) to sample as the pipeline does.

The σ grid: a Sana checkpoint ships a flow DPM-Solver++ (``DPMSolverMultistepScheduler``, the pipeline's type hint,
with ``prediction_type="flow_prediction"``, ``use_flow_sigmas=True``, ``flow_shift``: a second-order multistep solver
whose grid ``set_timesteps`` builds from ``linspace(1, 1/1000, S + 1)``, ``scheduling_dpmsolver_multistep.py``
465-469, integer timesteps) or ``FlowMatchEulerDiscreteScheduler``. The flow plugin's SDE/ODE samplers are
first-order steps on a σ grid, so the adapter builds ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` from a
DPM-Solver config (:func:`euler_scheduler_for`) and takes σ and timesteps from it as ``SanaPipeline`` would with that
scheduler swapped in (the equality test swaps it the same way); a checkpoint that ships the Euler scheduler is used as
is. Evaluation images therefore are the Euler sampler's, not those of the checkpoint's DPM-Solver (another solver, and
another grid: 10 steps at shift 3 run σ = 0.9997 … 0.250, 0 there and 1 … 0.009, 0 here).

Not supported: Sana-Sprint (``SanaSprintPipeline``: a few-step sCM/TrigFlow consistency model whose transformer embeds
the guidance scale, ``guidance_embeds``), refused in one line, as is any other pipeline class or a dynamically shifting
Euler scheduler (``SanaPipeline`` passes it no μ, so the pipeline itself cannot run it). Sana's ControlNet and PAG
pipelines have no adapter.

``adapter_options: {clean_caption: true}`` is ``__call__(clean_caption=True)``: the pipeline's own
``_clean_caption`` (DeepFloyd IF's caption cleaning, 520-636: URLs, HTML through BeautifulSoup, ``ftfy.fix_text``,
punctuation, file names and the like), run twice per prompt and on the negative prompt too (361, 383). It needs
``beautifulsoup4`` and ``ftfy``; where one is missing the pipeline logs a warning and encodes the prompt uncleaned
(498-504), which the adapter refuses in one line instead. No file is downloaded.

Defaults: guidance 4.5 with the empty negative prompt (the pipeline's), LoRA on the query/key/value/output projections
of the self-attention (linear attention) and the cross-attention of every block, as the SD3 adapter's attention
targets (Flow-GRPO's).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, refuse_other_pipelines


def euler_scheduler_for(scheduler: Any) -> Any:
    """A first-order ``FlowMatchEulerDiscreteScheduler`` for a Sana checkpoint's ``scheduler``: a copy of it if it is
    one with a static shift, else one built from the ``num_train_timesteps`` and ``flow_shift`` of a flow-prediction
    ``DPMSolverMultistepScheduler`` (the scheduler ``SanaPipeline`` declares). Anything else: a one-line ValueError."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = scheduler.config
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        if config.get("use_dynamic_shifting", False):
            raise ValueError("sana adapter: the checkpoint's FlowMatchEulerDiscreteScheduler sets "
                             "use_dynamic_shifting, but SanaPipeline passes it no mu (it cannot sample with it); "
                             "expected a static shift")
        return scheduler.__class__.from_config(config)
    if (config.get("prediction_type") != "flow_prediction" or not config.get("use_flow_sigmas", False)
            or config.get("flow_shift") is None):
        raise ValueError(f"sana adapter: {type(scheduler).__name__} is not a flow scheduler (expected "
                         "FlowMatchEulerDiscreteScheduler, or DPMSolverMultistepScheduler with prediction_type "
                         "'flow_prediction', use_flow_sigmas and flow_shift, as SanaPipeline declares)")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=int(config.num_train_timesteps),
                                           shift=float(config.flow_shift))


def caption_cleaning_packages() -> dict[str, bool]:
    """Whether each package ``SanaPipeline._clean_caption`` needs is importable, by its pip name, as diffusers checks
    them (``is_bs4_available``, ``is_ftfy_available``; pipeline_sana.py 60-64, 496-504)."""
    from diffusers.utils import is_bs4_available, is_ftfy_available

    return {"beautifulsoup4": is_bs4_available(), "ftfy": is_ftfy_available()}


def default_complex_human_instruction(pipeline: Any) -> list[str]:
    """The instruction lines ``SanaPipeline.__call__`` (of ``pipeline``, an instance or the class) puts in front of
    every prompt by default: its keyword's default in the installed diffusers, read from the signature."""
    cls = pipeline if isinstance(pipeline, type) else type(pipeline)  # a pipeline or its class
    return list(inspect.signature(cls.__call__).parameters["complex_human_instruction"].default or [])


class SanaAdapter(FlowAdapter):
    """Adapter for ``SanaPipeline`` (Sana 1.0 and 1.5; text-to-image, true CFG)."""

    name = "sana"
    pipeline_classes = ("SanaPipeline",)
    # q/k/v/out of the linear self-attention (attn1) and of the cross-attention to the text (attn2) of every block
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
    default_guidance_scale = 4.5  # SanaPipeline.__call__'s default
    supports_cfg = True
    default_max_sequence_length = 300  # SanaPipeline.__call__'s default

    def __init__(self, pipeline: Any, device: torch.device):
        kind = type(pipeline).__name__
        # Sana-Sprint first, with its own reason: a SanaSprintPipeline, or a SanaPipeline holding a Sprint transformer
        # (guidance_embeds). Another class's transformer is not read: FLUX.1-dev's also embeds guidance.
        sprint_transformer = kind == "SanaPipeline" and getattr(pipeline.transformer.config, "guidance_embeds", False)
        if kind.startswith("SanaSprint") or sprint_transformer:
            raise ValueError(f"the sana adapter does not train Sana-Sprint ({kind}): a few-step sCM consistency model "
                             "with an embedded guidance scale, not SanaPipeline's flow-matching sampler")
        refuse_other_pipelines(type(self), pipeline)
        super().__init__(pipeline, device)
        self.scheduler = euler_scheduler_for(pipeline.scheduler)  # the private copy the σ grids come from
        #: The instruction lines put in front of every prompt (``adapter_options.complex_human_instruction``).
        self.complex_human_instruction = default_complex_human_instruction(pipeline)
        #: ``adapter_options.clean_caption``: the pipeline's caption cleaning of prompts and negative prompt.
        self.clean_caption = False

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """``adapter_options``: ``complex_human_instruction``, a list of strings (the lines put before every prompt;
        ``[]`` for none, as the pipeline's ``complex_human_instruction=None``); default the pipeline's own.
        ``clean_caption``, true or false (default false, ``__call__``'s): the pipeline's caption cleaning, which
        needs ``beautifulsoup4`` and ``ftfy`` (refused when either is missing, where the pipeline would warn and
        encode the prompt uncleaned)."""
        unknown = sorted(set(options) - {"complex_human_instruction", "clean_caption"})
        if unknown:
            raise ValueError(f"keys of complex_human_instruction, clean_caption (the {self.name} adapter's); "
                             f"{unknown[0]!r} is not one")
        if "clean_caption" in options:
            value = options["clean_caption"]
            if not isinstance(value, bool):
                raise ValueError(f"clean_caption: true or false (SanaPipeline's caption cleaning); got {value!r}")
            missing = [name for name, available in caption_cleaning_packages().items() if not available]
            if value and missing:
                raise ValueError(f"clean_caption: false, or true with beautifulsoup4 and ftfy installed (SanaPipeline "
                                 f"would encode the prompts uncleaned without them); {' and '.join(missing)} missing: "
                                 f"pip install {' '.join(missing)}")
            self.clean_caption = value
        if "complex_human_instruction" in options:
            lines = options["complex_human_instruction"]
            if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
                raise ValueError(f"complex_human_instruction: a list of strings ([] for none); got {lines!r}")
            self.complex_human_instruction = list(lines)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.encoder_block_out_channels) - 1)  # DC-AE: 32 in the released models

    def resolution_multiple(self) -> int:
        # SanaPipeline.check_inputs requires multiples of 32 whatever the VAE; the DiT patchifies the latents
        patch = int(getattr(self.transformer.config, "patch_size", 1) or 1)
        return math.lcm(32, self.vae_scale_factor * patch)

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=self.device, max_sequence_length=max_sequence_length,
            complex_human_instruction=self.complex_human_instruction or None, clean_caption=self.clean_caption,
        )
        # embeds [n, L, D] (BOS + the last L - 1 positions of instruction + prompt), mask [n, L] (1: a real token)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def encode_negative_prompt(self, prompt: str, max_sequence_length: int) -> Conditioning:
        """``prompt`` as ``SanaPipeline.encode_prompt`` encodes its ``negative_prompt`` (376-399): no instruction, no
        token selection, padded to ``max_sequence_length`` from BOS on. The pipeline's own call, with a placeholder
        for the prompt embeddings so that it runs only its negative path (with ``prompt_embeds`` given it encodes no
        prompt, 356; the placeholder is only reshaped, 370-374, and dropped here; the negative path is 377-398)."""
        placeholder = torch.zeros(1, 1, 1, device=self.device)  # [1, 1, 1]: one "prompt" row, never read
        _, _, embeds, mask = self.pipeline.encode_prompt(
            None, do_classifier_free_guidance=True, negative_prompt=[prompt], device=self.device,
            prompt_embeds=placeholder, prompt_attention_mask=torch.ones(1, 1, device=self.device),
            max_sequence_length=max_sequence_length, clean_caption=self.clean_caption,
        )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}  # [1, L, D], [1, L]

    def noise_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, *self.latent_size())  # [C, H/32, W/32], as prepare_latents

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        config = self.transformer.config
        output = module(
            latents,  # [n, C, h, w]
            encoder_hidden_states=conditioning["prompt_embeds"],  # [n, L, D]
            encoder_attention_mask=conditioning["prompt_attention_mask"],  # [n, L]: 1 keeps a text key
            timestep=timesteps * float(config.timestep_scale),  # [n]: σ·1000 times Sana's timestep scale
            return_dict=False,
        )[0]
        if config.out_channels // 2 == config.in_channels:  # a learned-σ head: the velocity is the first half
            output = output.chunk(2, dim=1)[0]
        return output

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """DC-AE decode as ``SanaPipeline``: latents cast to the VAE's dtype, over ``scaling_factor`` (no shift)."""
        vae = self.vae
        images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
