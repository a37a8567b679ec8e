"""Floor of the vlm plugin: a transformers vision-language model (Qwen2-VL family) with its LoRA adapter.

- generation: per rollout call, the vision tower once over the call's distinct images (the plugin caches the frozen
  tower's features per prompt), the prefill of each distinct prompt (a group's samples share it, as the plugin's
  ``share_prompt_prefill`` does; its last position's logits give every sample's first token) with the KV cache
  copied to the samples, then one single-token forward over the whole batch per generated token but the last (as
  many as the longest completion, less one), fed the sampled tokens — the plugin's decode loop
  (``plugin.decoder: mmrl``); the sampler's token choice is left out. (HF ``generate``, ``decoder: hf``, prefills
  all but the last prompt token and runs that token as one more step over the whole batch);
- forward and backward: per backward pass, the teacher-forced forward of the pass's samples (prompt with the cached
  image features, completion), the LM head over the completion positions, reduced to a scalar, then one backward.
  When the plugin shares the prompt's forward across a group (``share_prompt_forward`` with ``fused_lm_head``, as
  :func:`~mmrl.plugins.vlm.prefix.shared_prompt_hidden` does), so does the floor, since that is the least the step
  computes: each distinct prompt of the pass once (with its KV cache), the cache indexed out to the samples, the
  completions on top of it; otherwise (no prompt repeats in the pass, or sharing off) the whole ``prompt +
  completion`` sequence per sample;
- extras: ``reference``, the same teacher-forced forwards (shared the same way) without gradients and with the LoRA
  adapter disabled (or the frozen copy), when ``kl_coef > 0``; ``old_logp``, the core's teacher-forced no-grad pass
  over each rollout call when the run needs it; ``logprob_math``, the plugin's tempered log-softmax of the
  completion tokens (:func:`~mmrl.plugins.vlm.logprobs.selective_log_softmax`, with entropy when configured) on
  logits of the same shapes, for every scoring pass (with gradients and their backward for the training passes).

Inputs are prepared outside the timed region: the collated batches, the distinct prompts and the index of each
sample's prompt, and the M-RoPE position ids (the floor does not pay for collation or the model's rope-index
computation; the step does, in ``other``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmrl.plugins.vlm.adapters.base import _base_model, cache_argument, identity_head, select_cache_rows
from mmrl.plugins.vlm.plugin import replay_prompts
from mmrl.plugins.vlm.prefix import distinct_prompts
from mmrl.trainer.learn import needs_old_logp

from . import Floor, scalar


class VLMFloor(Floor):
    """Floor of the ``vlm`` plugin (module docstring)."""

    def __init__(self, trainer: Any, capture: Any):
        super().__init__(trainer, capture)
        plugin = self.plugin
        if not plugin.cache_features:
            raise SystemExit("benchmarks/step_floors.py: the vlm floor assumes the frozen vision tower's features are "
                             "cached (plugin.freeze_vision and plugin.cache_image_features)")
        self.adapter = plugin.adapter
        self.hf = _base_model(self.policy)
        self.cache_name = cache_argument(self.hf)
        # The step's teacher-forced passes share each distinct prompt's forward when the plugin does (see
        # VLMPlugin.token_logp); the policy is in train mode with gradients on here, as in the training forward.
        self.shares_prompts = plugin.config.fused_lm_head and plugin._can_share_prompts(self.policy)
        self.calls = [self._generation_inputs(batch, call) for batch, call in zip(capture.batches, capture.rollouts,
                                                                                   strict=True)]

    # ------------------------------------------------------------------ inputs
    def positions(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """M-RoPE position ids ``[3, n, T]`` of collated inputs."""
        return self.hf.model.get_rope_index(
            inputs["input_ids"], mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_grid_thw=inputs.get("image_grid_thw"), attention_mask=inputs["attention_mask"])[0]

    def _generation_inputs(self, batch: Any, call: Any) -> dict[str, Any]:
        prompts = replay_prompts(call.replay)  # per sample
        completions = call.replay["completion_ids"]
        groups = [int(g) for g in batch.group_ids.tolist()]
        first = {group: i for i, group in reversed(list(enumerate(groups)))}  # a group's first sample
        unique = [prompts[i] for i in first.values()]
        order = {group: k for k, group in enumerate(first)}
        raw = self.plugin.encode_rows(batch.rows, batch.group_ids)  # pixel values, one entry per sample
        with_images = [raw[i] for i in first.values() if raw[i]["image_grid_thw"].numel()]
        pixels = torch.cat([p["pixel_values"] for p in with_images]).to(self.device)  # [Σ rows, D]
        grids = torch.cat([p["image_grid_thw"] for p in with_images]).to(self.device)  # [Σ images, 3]
        prefill, width = self.adapter.collate(unique, device=self.device)
        prefill["position_ids"] = self.positions(prefill)
        full, _ = self.adapter.collate(prompts, completions, device=self.device)
        steps = max(len(c) for c in completions)
        full_positions = self.positions(full)  # [3, n, P + C]
        attention = torch.cat([full["attention_mask"][:, :width],
                               torch.ones_like(full["attention_mask"][:, width:])], dim=1)  # generated: all attend
        return {"pixels": pixels, "grids": grids, "prefix": prefill, "width": width, "steps": steps,
                "select": torch.tensor([order[group] for group in groups], device=self.device),
                "tokens": full["input_ids"], "attention": attention, "positions": full_positions,
                "teacher": {**full, "position_ids": full_positions}}

    # ------------------------------------------------------------------ model calls
    def generation(self) -> None:
        for call in self.calls:
            self.hf.get_image_features(call["pixels"], call["grids"], return_dict=True)
            output = self.hf(**call["prefix"], use_cache=True, logits_to_keep=1)
            cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
            select_cache_rows(cache, call["select"])
            width = call["width"]
            for t in range(call["steps"] - 1):  # the prefill's logits sampled the first token
                position = width + t
                self.hf(input_ids=call["tokens"][:, position:position + 1],
                        attention_mask=call["attention"][:, :position + 1],
                        position_ids=call["positions"][..., position:position + 1],
                        use_cache=True, logits_to_keep=1, **{self.cache_name: cache})

    def teacher_forced(self, module: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Logits ``[n, C, V]`` of the completion positions (the LM head over those positions only), computing each
        distinct prompt once when ``inputs`` hold a shared split (:meth:`pass_inputs`)."""
        completion, shared = inputs["completion"], inputs["shared"]
        hf = _base_model(module)
        if shared is None:
            return hf(**inputs["teacher"], logits_to_keep=completion + 1, use_cache=False).logits[:, :-1]
        with identity_head(hf) as head:  # the model's "logits" are its hidden states, as in shared_prompt_hidden
            output = hf(**shared["prefix"], use_cache=True, logits_to_keep=1)
            last = output.logits[:, -1:].index_select(0, shared["index"])  # [n, 1, H]
            if completion == 1:
                return head(last)
            cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
            select_cache_rows(cache, shared["index"])  # [u, heads, P, d] -> [n, heads, P, d]
            output = hf(**shared["rest"], use_cache=True, **{self.cache_name: cache})
            hidden = torch.cat([last, output.logits], dim=1)  # [n, C, H]
        return head(hidden)  # [n, C, V]

    def pass_inputs(self, prompts: list[Any], completions: list[torch.Tensor]) -> dict[str, Any]:
        """The prepared inputs of one teacher-forced pass: ``teacher`` (the collated ``prompt + completion``
        batch with its position ids), ``completion`` (C) and ``shared`` (the split of
        :func:`~mmrl.plugins.vlm.prefix.shared_prompt_hidden` when the plugin would take it, else None)."""
        teacher, width = self.adapter.collate(prompts, completions, device=self.device)
        teacher["position_ids"] = self.positions(teacher)
        completion = int(teacher["input_ids"].shape[1]) - width
        return {"teacher": teacher, "completion": completion,
                "shared": self._shared_split(prompts, teacher, width, completion) if self.shares_prompts else None}

    def _shared_split(self, prompts: list[Any], teacher: dict[str, torch.Tensor], width: int, completion: int
                      ) -> dict[str, Any] | None:
        """The distinct prompts' collated batch with its positions (``prefix``), each sample's prompt (``index``)
        and the completions' inputs but the last token (``rest``), or None where the plugin runs the plain pass
        (the same conditions as :func:`~mmrl.plugins.vlm.prefix.shared_prompt_hidden`)."""
        unique, index_list = distinct_prompts(prompts)
        if len(unique) == len(prompts):
            return None
        prefix, _ = self.adapter.collate(unique, device=self.device)
        if "image_grid_thw" in prefix and "mm_token_type_ids" not in prefix:
            return None
        if "mm_token_type_ids" in prefix and bool(prefix["mm_token_type_ids"][:, -1].any()):
            return None
        index = torch.tensor(index_list, device=self.device)  # [n]
        positions = self.adapter.rope_positions(self.hf, prefix)  # [3, u, P]
        steps = torch.arange(1, completion, device=self.device)  # [C - 1]
        rest = {"input_ids": teacher["input_ids"][:, width:width + completion - 1],
                "attention_mask": teacher["attention_mask"][:, :width + completion - 1],
                "position_ids": positions[:, :, -1:].index_select(1, index) + steps}  # [3, n, C - 1]
        if "mm_token_type_ids" in teacher:
            rest["mm_token_type_ids"] = teacher["mm_token_type_ids"][:, width:width + completion - 1]
        return {"prefix": {**prefix, "position_ids": positions}, "index": index, "rest": rest}

    def unit_inputs(self, epoch: int, indices: list[int], columns: torch.Tensor | None) -> Any:
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        part = self.rollout.select(index)
        return self.pass_inputs(replay_prompts(part.replay), part.replay["completion_ids"])

    def loss(self, inputs: Any) -> torch.Tensor:
        return scalar(self.teacher_forced(self.hf, inputs))

    # ------------------------------------------------------------------ extras
    def extras(self) -> dict[str, Callable[[], None]]:
        plugin, runtime = self.plugin, self.plugin.runtime
        units = [unit.inputs for minibatch in self.schedule for unit in minibatch]
        extras: dict[str, Callable[[], None]] = {}
        algorithm = self.trainer.config.algorithm
        if algorithm.kl_coef > 0:
            def reference() -> None:
                with torch.no_grad(), plugin.reference_model(self.policy) as module, runtime.autocast():
                    for inputs in units:
                        self.teacher_forced(module, inputs)

            extras["reference"] = reference
        old_passes = []
        if needs_old_logp(self.trainer.config):  # the core's old-policy pass (the rollout leaves old_logp out)
            old_passes = [self.pass_inputs(replay_prompts(call.replay), call.replay["completion_ids"])
                          for call in self.capture.rollouts]

            def old_logp() -> None:
                with torch.no_grad(), runtime.autocast():
                    for inputs in old_passes:
                        self.teacher_forced(self.hf, inputs)

            extras["old_logp"] = old_logp

        def tokens(inputs: dict[str, Any]) -> torch.Tensor:  # [n, C]
            return inputs["teacher"]["input_ids"][:, -inputs["completion"]:]

        scored = [(tokens(inputs), False) for inputs in old_passes]
        if "reference" in extras:
            scored += [(tokens(inputs), False) for inputs in units]
        scored += [(tokens(inputs), True) for inputs in units]
        vocab = self.hf.get_output_embeddings().weight.shape[0]
        logits = [(torch.randn(*tokens.shape, vocab, device=self.device), tokens, grad) for tokens, grad in scored]
        suppress = torch.tensor(plugin.suppressed_ids, dtype=torch.long, device=self.device)
        config = plugin.config

        def logprob_math() -> None:
            from mmrl.plugins.vlm.logprobs import selective_log_softmax

            for values, tokens, grad in logits:
                with torch.set_grad_enabled(grad):
                    leaf = values.detach().requires_grad_(grad)
                    logp, entropy = selective_log_softmax(
                        leaf, tokens, temperature=config.temperature, chunk_size=config.logprob_chunk_size,
                        with_entropy=grad and config.entropy, suppress=suppress)
                    if grad:
                        (logp.sum() + (entropy.sum() if entropy is not None else 0.0)).backward()

        extras["logprob_math"] = logprob_math
        return extras

    def describe(self) -> dict[str, Any]:
        calls = [(int(c["select"].shape[0]), int(c["prefix"]["input_ids"].shape[0]), c["steps"]) for c in self.calls]
        units = [tuple(u.inputs["teacher"]["input_ids"].shape) for m in self.schedule for u in m]
        shared = [u.inputs["shared"] is not None for m in self.schedule for u in m]
        return {"generation": f"rollout calls (samples, distinct prompts, generated tokens): {calls}",
                "forward_backward": f"{self.backward_passes()} teacher-forced passes of [n, P + C] = {units}, "
                                    f"prompt forward shared per distinct prompt: {shared}"}
