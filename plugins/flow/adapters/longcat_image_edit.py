"""LongCat-Image-Edit (``LongCatImageEditPipeline``: meituan-longcat/LongCat-Image-Edit): LongCat-Image's MMDiT
editing an input image that it sees twice, through the Qwen2.5-VL text encoder, which reads the image (at half the
output's side) before the instruction, and as VAE latents appended to the generated tokens with their own rotary
modality.

What the adapter reproduces of ``LongCatImageEditPipeline.__call__`` (diffusers 0.42.1,
``pipelines/longcat_image/pipeline_longcat_image_edit.py``; line numbers of that file) besides LongCat-Image's noise,
packing, σ grid (μ of the generated tokens only, as the pipeline's ``image_seq_len``) and decode
(:class:`~mmrl.plugins.flow.adapters.longcat_image.LongCatImageAdapter`):

- prompts (``_encode_prompt`` 270-342): the edit template (a system turn "As an image editing expert, ...", then
  ``<|vision_start|>`` and the image's vision tokens, expanded by the processor's merge size), the instruction cut at
  quotes and tokenized as in text-to-image, padded to 512, the assistant turn after it; the last hidden state from
  ``<|vision_start|>`` on (the vision tokens are kept: the prompt row is ``[V + 512, D]``, V the image's merged
  vision tokens plus the two markers' positions as the pipeline cuts them) without the suffix. The text encoder's
  image is the input resized to the output's size and then to half of it (622-624). Each (prompt, image) pair is
  encoded alone and cached (the pipeline encodes ``prompt[0]`` only: one prompt per call), and with CFG each image is
  encoded with the negative prompt too (the pipeline passes it the same image, 631-637): every row has its own
  negative (:meth:`FlowAdapter.velocity` takes it from ``negative_prompt_embeds``).
- the VAE image (``prepare_latents`` 408-476, ``_encode_vae_image`` 391-402): resized and normalised by the
  pipeline's image processor, encoded with the VAE's mode, ``(latents − shift_factor)·scaling_factor``, packed; each
  step the transformer sees ``[generated tokens; image tokens]`` and the output is cut back to the generated tokens
  (690-719). Rotary ids: text (0, i, i) for i < L = V + 512, generated tokens (1, L + row, L + column), image tokens
  (2, L + row, L + column) (``prepare_pos_ids`` with ``start = prompt_embeds.shape[1]``, 446-462).
- guidance (719): plain true CFG, v = v_u + w·(v_c − v_u), default 4.5 with the negative prompt ``""``; the edit
  pipeline has **no cfg renorm** (and no ``enable_cfg_renorm`` keyword), so this adapter takes no
  ``adapter_options``. No prompt rewriting either.

Where mmrl differs: the pipeline sizes the output and the input alike at about 1024² pixels with the input's aspect
ratio (``calculate_dimensions(1024 * 1024, ratio)`` 593, multiples of 16). Here the output is ``plugin.height`` ×
``plugin.width`` and the input is brought to ``plugin.condition_size`` (null: the output's size, as the pipeline
has it), so that the rows of a batch share one shape; with images of the run's aspect ratio and that size the
computation is the pipeline's (the tests check it with the pipeline's size rule set to the test's size). A text
row's length depends on the input's size (its vision tokens); the rows of a batch share one input size (with
``plugin.buckets``, one bucket's; the encodings are cached by size), so they share one length (buckets are not
tested for this adapter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, encoded_latents
from mmrl.plugins.flow.adapters.longcat_image import LongCatImageAdapter


class LongCatImageEditAdapter(LongCatImageAdapter):
    """Adapter for ``LongCatImageEditPipeline`` (LongCat-Image-Edit): image editing, one input image per row, plain
    true CFG."""

    name = "longcat_image_edit"
    pipeline_classes = ("LongCatImageEditPipeline",)
    image_conditioned = True
    prompt_sees_image = True
    condition_size_free = True

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        self.enable_cfg_renorm = False  # LongCatImageEditPipeline combines without renorm (719)

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """No options: the edit pipeline has no cfg renorm and no other setting of its own."""
        FlowAdapter.configure(self, options, cfg=cfg)

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        raise NotImplementedError("the longcat_image_edit adapter encodes each prompt with its row's input image "
                                  "(encode_prompts_with_images)")

    def _resized(self, image: Any) -> Any:
        """The input image at :attr:`condition_size`, as the pipeline resizes it first (622)."""
        height, width = self.condition_size
        return self.pipeline.image_processor.resize(image, height, width)

    def _text_image(self, image: Any) -> Any:
        """The image the text encoder reads: resized to :attr:`condition_size`, then to half its sides (623)."""
        height, width = self.condition_size
        return self.pipeline.image_processor.resize(self._resized(image), height // 2, width // 2)

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        height, width = self.condition_size
        processor, vae = self.pipeline.image_processor, self.vae
        pixels = processor.preprocess([self._resized(image) for image in images], height, width)
        pixels = pixels.to(self.device, vae.dtype)  # [n, 3, H, W] in [-1, 1]
        latents = encoded_latents(vae.encode(pixels), vae)  # [n, C, h, w]: the pipeline's sample_mode="argmax"
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        n, channels, h, w = latents.shape
        packed = self.pipeline._pack_latents(latents, n, channels, h, w)  # [n, h/2·w/2, 4C]
        return {"image_latents": packed}, (pixels.float() / 2 + 0.5).clamp(0, 1)

    def encode_prompts_with_images(self, prompts: list[str], images: list[list[Any]], max_sequence_length: int
                                   ) -> Conditioning:
        self._check_length(max_sequence_length)
        rows = []
        for prompt, row_images in zip(prompts, images, strict=True):  # alone: the pipeline encodes prompt[0] only
            if len(row_images) != 1:
                raise ValueError(f"LongCatImageEditPipeline reads one input image per prompt, not {len(row_images)}")
            embeds, _ = self.pipeline.encode_prompt(prompt=[prompt], image=self._text_image(row_images[0]))
            rows.append(embeds.to(self.device))  # [1, V + 512, D]
        return {"prompt_embeds": torch.cat(rows)}  # one condition size: every row has the same V

    def _edit_ids(self, text_tokens: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """``(image ids [T + T_in, 3], text ids [L, 3])``: generated tokens (1, L + row, L + column) on the output's
        grid, then the input image's (2, L + row, L + column) on its own grid, text (0, i, i), float32 (the
        pipeline's float64 input ids hold the same integers; the transformer reads them as float)."""
        from diffusers.pipelines.longcat_image.pipeline_longcat_image_edit import prepare_pos_ids

        rows, columns = (side // 2 for side in self.latent_size())
        in_rows, in_columns = self.condition_grid(2)
        key = ("edit", rows, columns, in_rows, in_columns, text_tokens, like.device)
        if key not in self._ids:
            start = (text_tokens, text_tokens)
            generated = prepare_pos_ids(modality_id=1, type="image", start=start, height=rows, width=columns)
            image = prepare_pos_ids(modality_id=2, type="image", start=start, height=in_rows, width=in_columns)
            text = prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=text_tokens)
            self._ids[key] = (torch.cat([generated, image]).to(like.device), text.to(like.device))
        return self._ids[key]

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        rows, columns = (side // 2 for side in self.latent_size())
        if rows * columns != latents.shape[1]:
            raise ValueError(f"longcat_image_edit adapter: {latents.shape[1]} latent tokens, but a "
                             f"{self.height}x{self.width} image has {rows * columns} ({rows} x {columns})")
        images = conditioning["image_latents"].to(latents.dtype)  # [n, T_in, 4C]
        image_ids, text_ids = self._edit_ids(conditioning["prompt_embeds"].shape[1], latents)
        both = torch.cat([latents, images], dim=1)  # [n, T + T_in, 4C]
        output = self._transformer(module, both, image_ids, text_ids, timesteps, conditioning, guidance_scale)
        return output[:, :latents.shape[1]]  # the generated tokens' velocity, as the pipeline cuts it
