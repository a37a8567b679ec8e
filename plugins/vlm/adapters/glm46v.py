"""GLM-4.6V (zai-org/GLM-4.6V, 106B-A12B mixture of experts) and GLM-4.6V-Flash (zai-org/GLM-4.6V-Flash, 9B dense):
GLM-4.1V/4.5V's vision input and language models under one wrapper, ``model_type: glm46v``.

Both run through transformers' ``Glm46VForConditionalGeneration``, registered when the installed transformers has
``transformers.models.glm46v``. Compared line by line with ``models/glm4v`` (transformers 5.25; line numbers of that
release), GLM-4.6V differs in what follows, and in nothing else the plugin reads; so this adapter is
:class:`~mmrl.plugins.vlm.adapters.glm4v.Glm4vAdapter` (GLM's resizing, prompt tokens, video layout, image/video
refusal, box convention) with only these differences:

- **One wrapper, two language models.** ``Glm46VModel`` builds its tower and language model with
  ``AutoModel.from_config`` (``modeling_glm46v.py:70-73``) from ``Glm46VConfig``'s sub-configs
  (``configuration_glm46v.py:54-68``): the text model is ``glm4v_text`` (``Glm4vTextModel``, GLM-4.6V-Flash) or
  ``glm4v_moe_text`` (``Glm4vMoeTextModel``, GLM-4.6V), the tower ``glm4v_vision``. One ``model_type`` covers a dense
  and an MoE checkpoint, so :attr:`moe` and the LoRA targets are read per checkpoint from the text config's
  ``model_type`` (:data:`TEXT_MODEL_TYPES`; another is refused in one line). Everything else of the model is
  GLM-4.1V's code: ``get_rope_index`` and ``compute_3d_position_ids`` (M-RoPE positions, video frames split per
  temporal patch), ``get_placeholder_mask`` (every ``<|image|>`` token is an image *and* a video slot, hence the
  refusal of images with videos in one batch), ``get_image_features`` / ``get_video_features`` and the forward
  (``modeling_glm46v.py:79-431`` against ``modeling_glm4v.py``: the same statements). With the same weights,
  GLM-4.6V-Flash's logits are GLM-4.1V's and GLM-4.6V's are GLM-4.5V's (tests/vlm/test_glm46v.py).
- **LoRA targets.** GLM-4.6V-Flash's MLP is GLM-4.1V's (fused ``gate_up_proj``, ``down_proj``): GLM-4.1V's targets.
  GLM-4.6V's MLPs are GLM-4.5V's (dense first layers and a shared expert per MoE layer with ``gate_proj`` /
  ``up_proj`` / ``down_proj``, the routed experts fused parameters), but peft 0.21's rewrite of MoE targets (its
  transformers-v4 mapping, which moves those names onto the routed experts of ``model_type: glm4v_moe``) keys on the
  top config's ``model_type`` through transformers' ``_MODEL_TO_CONVERSION_PATTERN``, where ``glm46v`` has no entry:
  the targets stay on the dense and shared-expert MLPs. So GLM-4.6V takes the default targets (attention and the
  dense MLP names), unlike :class:`~mmrl.plugins.vlm.adapters.glm4v.Glm4vMoeAdapter`; the routed experts take
  ``lora.target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).
- **No router loss from the model.** ``Glm46VModel.forward`` hands ``output_router_logits`` on to the MoE language
  model, which records every router's logits (``Glm4vMoeTextModel._can_record_outputs``,
  ``modeling_glm4v_moe.py:918-921``), but wraps its output in ``MultimodalBaseModelOutputWithPast(**outputs, ...)``
  (``modeling_glm46v.py:428``), which has no ``router_logits`` field (a ``TypeError``), and
  ``Glm46VForConditionalGeneration.forward`` computes no ``aux_loss`` (``:475-559``; GLM-4.5V's does,
  ``modeling_glm4v_moe.py:1589-1596``). For a call that asks for them (the training pass with
  ``plugin.router_aux_loss_coef > 0``) the adapter takes the recorded logits out of the language model's output and
  puts them on the wrapper's (:meth:`carry_router_logits`, as for InternVL3.5's MoE), and
  :meth:`router_load_balancing_loss` computes GLM-4.5V's ``aux_loss``: transformers' ``load_balancing_loss_func``
  (``modeling_glm4v_moe.py:1392-1461``: softmax of each layer's logits, top ``num_experts_per_tok``, over the real
  tokens). The router's own choice (sigmoid scores plus the correction bias, grouped top-k) is not what the loss
  counts, as in transformers' GLM-4.5V.
- **Frame timestamps.** ``Glm46VProcessor.replace_frame_token_id`` writes a temporal patch's timestamp as
  ``"{t:.1f} seconds"`` after its ``<|end_of_image|>`` (``processing_glm46v.py:185-186``) where GLM-4.1V writes the
  whole seconds, ``int(t)`` (``processing_glm4v.py:185-186``). The processor writes the prompt, so the plugin's
  prompts are GLM-4.6V's; the timestamps are text tokens, which the M-RoPE positions count as text.
- **Frame sampling.** ``Glm46VVideoProcessor.sample_frames`` picks frames at 3, 1 or 0.5 per second by the clip's
  duration (at most 640; ``video_processing_glm46v.py:117-176``) where GLM-4.1V samples at its ``fps``. The plugin
  never samples: a row's video is its frames, already sampled, passed with ``do_sample_frames=False`` (sample them as
  GLM-4.6V does when preparing rows if the checkpoint should see its own rate). Resizing is GLM-4.1V's
  (``Glm46VImageProcessor`` and ``Glm46VVideoProcessor`` are its classes, the same ``smart_resize``, ``size`` and
  ``max_image_size``).
- **Boxes**: GLM-V's, ``[x1, y1, x2, y2]`` on a 0–1000 grid of the image inside ``<|begin_of_box|>`` …
  ``<|end_of_box|>`` (zai-org/GLM-V@8fc9756 README "Grounding", written for GLM-4.5V; zai-org's GLM-V grounding skill
  states the same 0–1000 normalisation for the GLM-V models): box convention ``glm4v``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.vlm.adapters.base import DEFAULT_LORA_TARGETS, lifted_router_logits, switch_load_balancing
from mmrl.plugins.vlm.adapters.glm4v import Glm4vAdapter

TEXT_MODEL_TYPES = {"glm4v_text": False, "glm4v_moe_text": True}
"""The language models a ``glm46v`` checkpoint may hold, and whether each is a mixture of experts."""


class Glm46vAdapter(Glm4vAdapter):
    """GLM-4.6V and GLM-4.6V-Flash through ``transformers.Glm46VForConditionalGeneration`` (see the module
    docstring): GLM-4.1V's adapter with the MoE language model's LoRA targets and router loss read per checkpoint."""

    name = "glm46v"
    model_types = ("glm46v",)
    model_class = "Glm46VForConditionalGeneration"

    def __init__(self, model: str, *, min_pixels: int, max_pixels: int, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, video_total_pixels: float | None = None):
        super().__init__(model, min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                         video_max_pixels=video_max_pixels, video_total_pixels=video_total_pixels)
        # Dense (GLM-4.6V-Flash) or MoE (GLM-4.6V) per checkpoint: one model_type covers both
        text_config = self.checkpoint_text_config()
        text_type = str(getattr(text_config, "model_type", ""))
        if text_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"glm46v: {self.model_path} has a {text_type!r} language model; this family takes "
                             f"{' or '.join(TEXT_MODEL_TYPES)} (GLM-4.6V-Flash, GLM-4.6V)")
        self.moe = TEXT_MODEL_TYPES[text_type]
        self.num_experts_per_tok = int(text_config.num_experts_per_tok) if self.moe else 0
        # GLM-4.1V's fused MLP names for the dense model; the dense MLP and shared-expert names for the MoE model,
        # which peft leaves on those modules for model_type glm46v (module docstring)
        self.lora_target_modules = DEFAULT_LORA_TARGETS if self.moe else Glm4vAdapter.lora_target_modules

    # ------------------------------------------------------------------ mixture of experts
    def completion_logits(self, model: nn.Module, inputs: dict[str, Tensor], num_completion: int) -> Tensor:
        """The base class's, with the router logits carried to the output when ``inputs`` asks for them
        (:meth:`carry_router_logits`)."""
        with self.carry_router_logits(model, inputs):
            return super().completion_logits(model, inputs, num_completion)

    def completion_hidden(self, model: nn.Module, inputs: dict[str, Tensor], num_completion: int
                          ) -> tuple[Tensor, nn.Module]:
        """The base class's, with the router logits carried to the output when ``inputs`` asks for them
        (:meth:`carry_router_logits`)."""
        with self.carry_router_logits(model, inputs):
            return super().completion_hidden(model, inputs, num_completion)

    @contextmanager
    def carry_router_logits(self, model: nn.Module, inputs: dict[str, Tensor]) -> Iterator[None]:
        """For the duration, a forward of ``model`` called with ``output_router_logits=True`` returns the MoE language
        model's router logits as its output's ``router_logits`` (one ``[n·L, E]`` per MoE layer, in layer order)
        instead of failing on them in ``Glm46VModel`` (module docstring). A no-op for other calls and for the dense
        model.

        One forward hook on the language model takes the logits out of its output before ``Glm46VModel`` wraps it;
        another on the outer model, put before any other hook there (the plugin's
        :class:`~mmrl.plugins.vlm.adapters.base.RouterAuxLoss` reads the output in its own), sets them on the
        wrapper's output. The hooks are removed on exit, so a backward that recomputes checkpointed layers outside
        the call records nothing."""
        if not (self.moe and inputs.get("output_router_logits")):
            yield
            return
        with lifted_router_logits(model, what="glm46v language model"):
            yield

    def router_load_balancing_loss(self, output: Any, attention_mask: Tensor | None) -> Tensor | None:
        """GLM-4.5V's ``aux_loss`` for GLM-4.6V: transformers' ``load_balancing_loss_func``
        (``modeling_glm4v_moe.py:1392-1461``) from the output's ``router_logits`` (:meth:`carry_router_logits`) over
        the real tokens of ``attention_mask [n, L]``: each layer's logits softmaxed (they are float32, the router
        computes them so) and :func:`~mmrl.plugins.vlm.adapters.base.switch_load_balancing` with
        ``num_experts_per_tok``. None when the output has none."""
        logits = getattr(output, "router_logits", None)
        if not logits:
            return None
        probabilities = [torch.softmax(layer.float(), dim=-1) for layer in logits]  # [n·L, E] per MoE layer
        return switch_load_balancing(probabilities, attention_mask, self.num_experts_per_tok)


__all__ = ["TEXT_MODEL_TYPES", "Glm46vAdapter"]
