"""Image-editing rewards: how an edited image relates to its input image, in CLIP space.

Registered rewards (each loads its open_clip model once, in ``__init__``, as ``clip_score`` does):

- ``clip_image_similarity``: cos(E_I(edit), E_I(input)), the "CLIP-I" consistency of editing and subject-driven
  generation benchmarks (InstructPix2Pix, Brooks et al. 2023, arXiv:2211.09800, Fig. 8's "CLIP image similarity";
  DreamBooth, Ruiz et al. 2023, arXiv:2208.12242, "CLIP-I"): how much of the input the edit keeps.
- ``clip_directional``: cos(E_I(edit) − E_I(input), E_T(target caption) − E_T(source caption)), the CLIP
  directional similarity of StyleGAN-NADA (Gal et al. 2022, arXiv:2108.00946, Eq. 3's direction) that
  InstructPix2Pix reports as "CLIP text-image direction similarity": whether the image moved the way the captions
  say. A sample whose image or captions did not move at all (a zero difference) scores 0.

The edit is ``payload["images"]`` and the input ``payload["condition_images"]`` (the flow plugin's image-editing
adapters put both there: docs/flow.md, section 10); ``output`` and ``reference`` name other entries. Images are read
as every image reward reads them (:func:`mmrl.rewards.images.read_images`: 8-bit RGB, CLIP's preprocessing); a
sample with a non-finite pixel in either image scores NaN. Combine them with an instruction-following reward (e.g.
``clip_score`` or ``pickscore`` on the target caption) with weights: consistency alone is maximised by not editing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from mmrl.reward import Reward, RewardError, RewardInput
from mmrl.rewards.image_models import BatchSize, OpenClip, _check_positive, _unique, pick_device
from mmrl.rewards.images import read_images


class ClipImageSimilarity(Reward):
    """CLIP image-image cosine between each edited image and its input image (CLIP-I), in [-1, 1]."""

    name: ClassVar[str] = "clip_image_similarity"

    def __init__(self, model: str = "ViT-L-14", pretrained: str | None = "openai", output: str = "images",
                 reference: str = "condition_images", batch_size: BatchSize = 32, device: str | None = None):
        """Options (the config's ``args``).

        Args:
            model: open_clip architecture name, a model-config JSON path, or hf-hub:ORG/REPO / local-dir:PATH.
            pretrained: open_clip pretrained tag (e.g. openai), a local checkpoint file, or hf-hub:ORG/REPO/FILE.
            output: Payload entry holding the edited images.
            reference: Payload entry holding the input images they are compared with.
            batch_size: Image pairs per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        _check_positive(self.name, batch_size=batch_size)
        self.output, self.reference, self.batch_size = output, reference, batch_size
        self.clip = OpenClip(self.name, model, pretrained, pick_device(self.name, device))

    def __call__(self, batch: RewardInput) -> Tensor:
        edits = read_images(batch, self.output, self.name)
        inputs = read_images(batch, self.reference, self.name)
        scores = torch.full((len(edits),), float("nan"), dtype=torch.float64)
        valid = (edits.finite & inputs.finite).nonzero().flatten().tolist()
        if valid:
            context = self._context(batch, valid)
            with torch.no_grad():
                for start in range(0, len(valid), self.batch_size):
                    chunk = valid[start:start + self.batch_size]
                    edit = self.clip.image_features([edits.images[i] for i in chunk])  # [c, D], unit norm
                    source = self.clip.image_features([inputs.images[i] for i in chunk])
                    scores[chunk] = self._score(edit, source, chunk, context).to("cpu", torch.float64)
        return scores

    def _context(self, batch: RewardInput, valid: list[int]) -> Any:
        return None

    def _score(self, edit: Tensor, source: Tensor, chunk: list[int], context: Any) -> Tensor:
        return (edit * source).sum(-1)  # both unit-norm: the cosine


class ClipDirectional(ClipImageSimilarity):
    """CLIP directional similarity: cos(E_I(edit) − E_I(input), E_T(target) − E_T(source)), in [-1, 1] (0 where
    either difference is zero)."""

    name: ClassVar[str] = "clip_directional"

    def __init__(self, model: str = "ViT-L-14", pretrained: str | None = "openai",
                 source_field: str = "source_caption", target_field: str = "target_caption", output: str = "images",
                 reference: str = "condition_images", batch_size: BatchSize = 32, device: str | None = None):
        """Options (the config's ``args``).

        Args:
            model: open_clip architecture name, a model-config JSON path, or hf-hub:ORG/REPO / local-dir:PATH.
            pretrained: open_clip pretrained tag (e.g. openai), a local checkpoint file, or hf-hub:ORG/REPO/FILE.
            source_field: Dataset column captioning the input image.
            target_field: Dataset column captioning the image the edit should produce.
            output: Payload entry holding the edited images.
            reference: Payload entry holding the input images.
            batch_size: Image pairs per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        super().__init__(model=model, pretrained=pretrained, output=output, reference=reference,
                         batch_size=batch_size, device=device)
        self.source_field, self.target_field = source_field, target_field

    def _context(self, batch: RewardInput, valid: list[int]) -> Any:
        captions = []
        for field in (self.source_field, self.target_field):
            try:
                column = batch.column(field)
            except RewardError as error:
                raise RewardError(f"reward {self.name!r}: {error}; set args.source_field / args.target_field to the "
                                  "columns captioning the input and the wanted image") from None
            captions.append([str(text) for text in column])
        texts, positions = _unique(captions[0] + captions[1])
        with torch.no_grad():
            features = self.clip.text_features(texts)  # [T, D]
        n = len(batch)
        direction = features[positions[n:].to(features.device)] - features[positions[:n].to(features.device)]
        return direction  # [N, D]: target − source per sample

    def _score(self, edit: Tensor, source: Tensor, chunk: list[int], context: Any) -> Tensor:
        text = context[torch.tensor(chunk, device=context.device)]  # [c, D]
        return F.cosine_similarity(edit - source, text.to(edit.device), dim=-1, eps=1e-8)
