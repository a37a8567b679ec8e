"""Floor of the dLLM plugin with a canvas model (DiffusionGemma): its own sampler, scored by ``uniform_one_step``.

- generation: per rollout call, the encoder on the prompts, then per canvas the sampler decoded its share of the
  call's batched decoder forwards (``rollout/decoder_calls``; a canvas runs until its last row stops, so the calls
  are spread evenly over the canvases, which changes nothing of their cost) on a canvas of random tokens, each after
  the first reading the previous call's logits as self-conditioning, and the encoder on each decoded canvas but the
  last;
- forward and backward: per backward pass, the estimator's passes of the pass's samples under the inner epoch's
  noise plan: the encoder on the prompts (once per draw), per canvas holding completion tokens the self-conditioning
  pass without gradients (when a draw's coin asks for it) and the decoder pass, and the encoder on each clean canvas
  but the last, reduced to a scalar, then one backward;
- extras: ``old_logp`` (the core's no-grad scoring of the sampling policy, as for masked models), ``reference`` (the
  reference model on every plan, when ``kl_coef > 0``) and ``logprob_math`` (the float32 log-softmax and gather of
  the scored positions and the draw average, on precomputed logits of the same shapes, for every scoring pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mmrl.plugins.dllm.adapters import padding_inputs
from mmrl.plugins.dllm.canvas import canvas_window, new_cache, text_config

from . import scalar
from .dllm import DLLMFloor


class CanvasFloor(DLLMFloor):
    """Floor of the ``dllm`` plugin with a canvas model (module docstring)."""

    def __init__(self, trainer: Any, capture: Any):
        super().__init__(trainer, capture)
        self.canvas_length = int(self.adapter.canvas_length)
        self.vocab = int(text_config(self.module).vocab_size)
        # Per rollout call: prompt ids, their mask, completion ids, canvases decoded, batched decoder forwards.
        self.calls = []
        for call in capture.rollouts:
            prompt, completion = call.replay["prompt_ids"], call.replay["completion_ids"]
            real = call.replay["completion_mask"].bool()
            every_row_stopped = bool(torch.isin(completion, torch.tensor(self.adapter.stop_ids,
                                                                            device=completion.device)).any(1).all())
            canvases = (int(canvas_window(real, self.canvas_length).sum(1).max()) // self.canvas_length
                        if every_row_stopped else completion.shape[1] // self.canvas_length)
            self.calls.append((prompt, padding_inputs(prompt, self.adapter.pad_id)[0].bool(), completion,
                               canvases, int(call.metrics["decoder_calls"])))

    # ------------------------------------------------------------------ model calls
    def generation(self) -> None:
        module, length = self.module, self.canvas_length
        for prompt, mask, completion, canvases, calls in self.calls:
            cache, width = new_cache(self.module), prompt.shape[1]
            attention = mask
            module.model.encoder(input_ids=prompt, attention_mask=attention, cache=cache,
                                 position_ids=torch.arange(width, device=prompt.device).unsqueeze(0))
            shares = [calls // canvases + (k < calls % canvases) for k in range(canvases)]
            for k, share in enumerate(shares):
                start = width + k * length
                decoder = {"decoder_attention_mask": F.pad(attention, (0, length), value=True), "cache": cache,
                           "decoder_position_ids": torch.arange(start, start + length,
                                                                device=prompt.device).unsqueeze(0)}
                canvas = torch.randint(0, self.vocab, (prompt.shape[0], length), device=prompt.device)
                logits = None
                for _ in range(share):
                    logits = module(decoder_input_ids=canvas, self_conditioning_logits=logits, **decoder).logits
                if k + 1 < canvases:
                    attention = F.pad(attention, (0, length), value=True)
                    module.model.encoder(input_ids=completion[:, k * length:(k + 1) * length],
                                         attention_mask=attention, cache=cache,
                                         position_ids=torch.arange(start, start + length,
                                                                   device=prompt.device).unsqueeze(0))

    def plan_inputs(self, indices: list[int], plan: int) -> dict[str, Any]:
        """The scoring inputs of samples ``indices`` under plan ``plan``, rows draw-major within each sample as the
        plugin forwards them (``[n·D, ...]``)."""
        replay = self.rollout.replay
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        width = int(replay["prompt_width"][0])
        prompt = replay["prompt_ids"].index_select(0, index)[:, :width]
        completion = replay["completion_ids"].index_select(0, index)
        real = replay["completion_mask"].index_select(0, index).bool()

        def stored(name: str) -> torch.Tensor:  # [n, D, ...]
            return replay[name].index_select(0, index)[:, plan]

        draws = stored("plan_masked").shape[1]
        clean = torch.where(real, completion, torch.full_like(completion, self.adapter.eos_id))
        noisy = torch.where(stored("plan_masked").bool(), stored("plan_tokens").long(), clean.unsqueeze(1))
        return {"prompt": prompt.repeat_interleave(draws, dim=0),
                "mask": padding_inputs(prompt, self.adapter.pad_id)[0].bool().repeat_interleave(draws, dim=0),
                "clean": clean.repeat_interleave(draws, dim=0), "noisy": noisy.flatten(0, 1),
                "coins": stored("plan_self_conditioning").bool().flatten(0, 1),
                "scored": stored("plan_weights").flatten(0, 1) != 0,
                "canvases": int(canvas_window(real, self.canvas_length).sum(1).max()) // self.canvas_length}

    def passes(self, module: torch.nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
        """The scoring pass's model calls: the logits of each scored canvas (``[n·D, C, V]`` each)."""
        prompt, length = inputs["prompt"], self.canvas_length
        width, cache, attention = prompt.shape[1], new_cache(self.module), inputs["mask"]
        encoder = self.plugin.runtime.unwrap(module).model.encoder
        encoder(input_ids=prompt, attention_mask=attention, cache=cache,
                position_ids=torch.arange(width, device=prompt.device).unsqueeze(0))
        outputs = []
        for k in range(inputs["canvases"]):
            start, columns = width + k * length, slice(k * length, (k + 1) * length)
            decoder = {"decoder_input_ids": inputs["noisy"][:, columns], "cache": cache,
                       "decoder_attention_mask": F.pad(attention, (0, length), value=True),
                       "decoder_position_ids": torch.arange(start, start + length, device=prompt.device).unsqueeze(0)}
            first = None
            if bool(inputs["coins"].any()):
                with torch.no_grad():
                    first = module(**decoder).logits
            outputs.append(module(**decoder, self_conditioning_logits=first,
                                  self_conditioning_mask=inputs["coins"] if first is not None else None).logits)
            if k + 1 < inputs["canvases"]:
                attention = F.pad(attention, (0, length), value=True)
                encoder(input_ids=inputs["clean"][:, columns], attention_mask=attention, cache=cache,
                        position_ids=torch.arange(start, start + length, device=prompt.device).unsqueeze(0))
        return outputs

    def unit_inputs(self, epoch: int, indices: list[int], columns: torch.Tensor | None) -> Any:
        return self.plan_inputs(indices, epoch if self.num_plans > 1 else 0)

    def loss(self, inputs: Any) -> torch.Tensor:
        return sum((scalar(logits) for logits in self.passes(self.policy, inputs)), torch.zeros((), device=self.device))

    # ------------------------------------------------------------------ extras (DLLMFloor.extras)
    def scoring_inputs(self, indices: list[int], plan: int) -> Any:
        return self.plan_inputs(indices, plan)

    def score(self, module: torch.nn.Module, inputs: Any) -> None:
        self.passes(module, inputs)

    def _logprob_math(self, extras: dict[str, Any]) -> Callable[[], None]:
        """The float32 log-softmax and gather of every scored position and the draw average, on random logits of
        each pass's shapes: every no-grad scoring pass, then every training pass with its backward."""
        everything = list(range(len(self.rollout)))
        scorings = [] if "reference" not in extras else [(plan, everything) for plan in range(self.num_plans)]
        if "old_logp" in extras:
            scorings += [(plan, indices) for plan, indices in enumerate(self.old_policy_samples()) if indices]
        prepared = [(False, self.plan_inputs(indices, plan)) for plan, indices in scorings]
        prepared += [(True, unit.inputs) for minibatch in self.schedule for unit in minibatch]
        length = self.canvas_length
        tables = [(grad, inputs, torch.randn(inputs["noisy"].shape[0], length, self.vocab, device=self.device))
                  for grad, inputs in prepared]

        def logprob_math() -> None:
            for grad, inputs, table in tables:
                with torch.set_grad_enabled(grad):
                    leaf = table.detach().requires_grad_(grad)
                    total = torch.zeros((), device=self.device)
                    for k in range(inputs["canvases"]):
                        columns = slice(k * length, (k + 1) * length)
                        where = inputs["scored"][:, columns]
                        picked = leaf[where].float().log_softmax(dim=-1)
                        total = total + picked.gather(-1, inputs["clean"][:, columns][where].unsqueeze(-1)).sum()
                    if grad:
                        total.backward()

        return logprob_math

    def describe(self) -> dict[str, Any]:
        return {"generation": [f"{prompt.shape[0]} prompts x {canvases} canvas(es), {calls} decoder calls"
                               for prompt, _, _, canvases, calls in self.calls],
                "forward_backward": f"{self.backward_passes()} backward passes"}
