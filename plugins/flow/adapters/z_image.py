"""Z-Image (``ZImagePipeline``): Tongyi-MAI's 6B single-stream DiT (Z-Image and the 8-step distilled Z-Image-Turbo),
text from the second-to-last hidden layer of a Qwen3 encoder run on its chat template, latents of FLUX.1's VAE.

What the adapter reproduces from ``ZImagePipeline.__call__`` (diffusers 0.42):

- prompts: ``pipeline.encode_prompt`` (Qwen3's chat template with ``enable_thinking=True``, tokens padded to
  ``max_sequence_length``, the text encoder's ``hidden_states[-2]``), which returns each prompt's real tokens only, a
  ragged list. The plugin caches prompts as tensors with the sample axis first, so the adapter zero-pads them to
  ``max_sequence_length`` with ``prompt_embeds_mask`` marking the real tokens, and cuts each row back to its real
  tokens before the transformer call. The transformer pads every caption to a multiple of 32 tokens with a *learned*
  padding token that takes part in attention, so the caption's own length is part of the model's input: the
  pipeline's ragged list, rebuilt exactly, is what makes the plugin's velocity the pipeline's.
- noise ``[C, h, w]`` per sample (``prepare_latents``: C = ``transformer.in_channels``, h = 2·⌊H/16⌋), drawn in
  float32 as the pipeline draws it; σ from ``torch.linspace(1, 1/S, S)`` (``get_default_z_image_sigmas``) through the
  scheduler (Z-Image's ships a static shift of 3; μ for a dynamically shifting config, as the pipeline passes it).
- the transformer takes lists: each sample's latents ``[C, 1, h, w]`` (a frame axis of one) and its caption
  ``[L_i, D]``, and Z-Image's own time convention: t = (1000 − timestep)/1000 = 1 − σ (0 at pure noise). Its output
  points from noise to data, so the velocity the scheduler steps with is its negation (the pipeline's
  ``noise_pred = -noise_pred``).
- guidance: the pipeline's ``pred = pos + w·(pos − neg)`` (:meth:`ZImageAdapter.combine_guidance`), which is
  standard CFG at scale 1 + w: ``guidance_scale`` means what ``ZImagePipeline``'s does, not SD3's. The pipeline runs
  the unconditional pass whenever w > 0; here ``plugin.cfg`` decides (on by default). Z-Image-Turbo is distilled
  for w = 0: its recipes set ``plugin.cfg: false``. The pipeline's optional rules, off by default there and here:
  ``cfg_normalization`` c (``plugin.cfg_normalization``) rescales a sample's guided output whose norm (over the whole
  latent) exceeds c·‖pos‖ down to c·‖pos‖; ``cfg_truncation`` τ (``plugin.cfg_truncation``) drops guidance at the
  steps whose (1000 − timestep)/1000 exceeds τ, where the pipeline makes no unconditional pass and takes pos alone
  (here the pass is still made and weighted 0, which gives pos exactly; the cap does not apply there, as in the
  pipeline). Flow-Factory applies both the same way in its rollouts and training forward (z_image.py
  ``forward``).
- decode: latents / ``scaling_factor`` + ``shift_factor``, then the VAE (the base adapter's decode).

Flow-Factory trains Z-Image the same way (X-GenGroup/Flow-Factory@a0b2bc5, ``src/flow_factory/models/z_image/
z_image.py``: the reversed time, the negated output, the ``pos + w·(pos − neg)`` combination in float32); its LoRA
defaults are the attention projections and the three feed-forward linears of every block, ``attention.to_{q,k,v}``,
``attention.to_out.0``, ``feed_forward.w{1,2,3}``, which are this adapter's too (they match the two refiner stages'
blocks as well as the 30 main blocks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, GuidanceScale, refuse_other_pipelines


class ZImageAdapter(FlowAdapter):
    """Adapter for ``ZImagePipeline`` (Tongyi-MAI/Z-Image, Tongyi-MAI/Z-Image-Turbo and fine-tunes with the same
    pipeline class)."""

    name = "z_image"
    pipeline_classes = ("ZImagePipeline",)
    lora_target_modules = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    default_guidance_scale = 5.0  # ZImagePipeline.__call__'s default (Z-Image-Turbo: 0, with plugin.cfg false)
    supports_cfg = True
    unguided_scale = 0.0  # the pipeline's 'no guidance' (Z-Image-Turbo's setting)
    default_max_sequence_length = 512  # ZImagePipeline.__call__'s default
    guidance_rules = True
    #: ``plugin.cfg_normalization`` and ``plugin.cfg_truncation`` (None: off), set by the plugin.
    cfg_normalization: float | None = None
    cfg_truncation: float | None = None

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)

    def resolution_multiple(self) -> int:
        return self.vae_scale_factor * 2  # 2×2 patches (the pipeline's image processor uses the same multiple)

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        # encode_prompt writes the templated text back into the list it is given: hand it a copy
        rows, _ = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=max_sequence_length)
        width = rows[0].shape[-1]
        padded = rows[0].new_zeros(len(rows), max_sequence_length, width)  # [n, L_max, D]
        mask = torch.zeros(len(rows), max_sequence_length, dtype=torch.long, device=rows[0].device)  # [n, L_max]
        for index, row in enumerate(rows):  # row [L_i, D]: the prompt's real tokens, in order
            padded[index, :row.shape[0]] = row
            mask[index, :row.shape[0]] = 1
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    def noise_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, *self.latent_size())  # [C, h, w], as prepare_latents

    def default_sigmas(self, num_steps: int) -> list[float]:
        return torch.linspace(1.0, 1 / num_steps, num_steps).tolist()  # get_default_z_image_sigmas (float32)

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        embeds, mask = conditioning["prompt_embeds"], conditioning["prompt_embeds_mask"].bool()  # [n, L, D], [n, L]
        captions = [embeds[row][mask[row]] for row in range(embeds.shape[0])]  # n × [L_i, D], the pipeline's list
        output = module(
            x=list(latents.unsqueeze(2).unbind(0)),  # n × [C, 1, h, w]
            t=(1000 - timesteps) / 1000,  # Z-Image's time: 0 at pure noise (the pipeline computes it in float32)
            cap_feats=captions,
            return_dict=False,
        )[0]
        return -torch.stack(output).squeeze(2)  # [n, C, h, w]: the model points from noise to data

    def guidance_for(self, timesteps: Tensor, guidance_scale: GuidanceScale) -> float | Tensor:
        """The scale w, or with ``cfg_truncation`` τ a per-row ``[n, 1, 1, 1]`` w that is 0 where
        (1000 − timestep)/1000 > τ: the pipeline's rule, its t computed in float32 and compared in float64."""
        scale = super().guidance_for(timesteps, guidance_scale)
        if self.cfg_truncation is None:
            return scale
        late = ((1000 - timesteps.float()) / 1000).double() > self.cfg_truncation  # [n]
        return torch.where(late, 0.0, float(scale)).float().view(-1, 1, 1, 1)

    def combine_guidance(self, uncond: Tensor, cond: Tensor, guidance_scale: float | Tensor) -> Tensor:
        """ZImagePipeline's guidance, ``cond + w·(cond − uncond)`` on the float32 velocities (the pipeline combines
        the transformer outputs before negating them; negation commutes with the combination and the norms), with
        ``cfg_normalization`` c: a guided row (w > 0) whose norm exceeds c·‖cond‖ scaled down to it."""
        guided = cond + guidance_scale * (cond - uncond)  # [n, C, h, w]
        if self.cfg_normalization is None:
            return guided
        cap = self.cfg_normalization * torch.linalg.vector_norm(cond.flatten(1), dim=1)  # [n]
        norm = torch.linalg.vector_norm(guided.flatten(1), dim=1)  # [n]
        weight = torch.as_tensor(guidance_scale, device=guided.device).flatten()
        rescale = (norm > cap) & (weight > 0)  # rows the pipeline guided (scale 0: no CFG branch, no cap)
        factor = torch.where(rescale, cap / norm, torch.ones_like(norm))
        return guided * factor.view(-1, *([1] * (guided.dim() - 1)))
