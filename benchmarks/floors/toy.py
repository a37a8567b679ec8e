"""Floor of the reference plugin (``toy``): a GRU policy over digit tokens.

- generation: per rollout call, the prompt encoder and one decoder step per generated token on the whole batch,
  fed the sampled tokens (the rollout feeds each step its sampled token; the floor leaves out the sampling itself);
- forward and backward: the teacher-forced decoder (:meth:`TinySequencePolicy.forward`) on each backward pass's
  samples, reduced to a scalar;
- extras: ``reference``, the frozen copy's teacher-forced pass per backward pass when ``kl_coef > 0``;
  ``logprob_math``, the tempered log-softmax, gather and entropy on logits of the same shapes (the rollout's scoring
  of its own sampling logits without gradients, the training passes with them and their backward). The plugin runs
  no separate old-policy pass: its rollout scores the sampled tokens with the logits it sampled them from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import Floor, scalar


class ToyFloor(Floor):
    """Floor of the ``toy`` plugin (module docstring)."""

    def __init__(self, trainer: Any, capture: Any):
        super().__init__(trainer, capture)
        self.model = self.plugin.runtime.unwrap(self.policy)
        # Per rollout call: (prompt ids [n, P], sampled tokens [n, T]).
        self.calls = [(call.replay["prompt_ids"], call.replay["tokens"]) for call in capture.rollouts]

    def generation(self) -> None:
        for prompt_ids, tokens in self.calls:
            state, *memory = self.model.encode(prompt_ids)
            previous = torch.full((tokens.shape[0],), self.model.config.bos_id, dtype=torch.long,
                                  device=tokens.device)
            for t in range(tokens.shape[1]):
                _, state = self.model.step(state, previous, memory)  # logits [n, V_out]
                previous = tokens[:, t]

    def unit_inputs(self, epoch: int, indices: list[int], columns: torch.Tensor | None) -> Any:
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        replay = self.rollout.replay
        return replay["prompt_ids"].index_select(0, index), replay["tokens"].index_select(0, index)

    def loss(self, inputs: Any) -> torch.Tensor:
        prompt_ids, tokens = inputs
        return scalar(self.policy(prompt_ids, tokens))  # logits [n, T, V_out]

    def extras(self) -> dict[str, Callable[[], None]]:
        runtime = self.plugin.runtime
        extras: dict[str, Callable[[], None]] = {}
        units = [unit.inputs for minibatch in self.schedule for unit in minibatch]
        if self.plugin.reference is not None and self.trainer.config.algorithm.kl_coef > 0:
            def reference() -> None:
                with torch.no_grad(), runtime.autocast():
                    for prompt_ids, tokens in units:
                        self.plugin.reference(prompt_ids, tokens)

            extras["reference"] = reference
        temperature = self.plugin.config.temperature
        outputs = self.model.config.num_outputs
        # Logits of the shapes the step scores: each rollout call's sampling logits, every training pass.
        scored = [(tokens, False) for _, tokens in self.calls]
        scored += [(tokens, True) for _, tokens in units]
        logits = [(torch.randn(*tokens.shape, outputs, device=self.device), tokens, grad) for tokens, grad in scored]

        def logprob_math() -> None:
            for values, tokens, grad in logits:
                with torch.set_grad_enabled(grad):
                    values = values.detach().requires_grad_(grad)
                    log_probs = F.log_softmax(values.float() / temperature, dim=-1)  # [n, T, V_out]
                    token_logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n, T]
                    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [n, T]
                    if grad:
                        (token_logp.sum() + entropy.sum()).backward()

        extras["logprob_math"] = logprob_math
        return extras

    def describe(self) -> dict[str, Any]:
        return {"generation": f"{len(self.calls)} rollout call(s): encoder + {self.calls[0][1].shape[1]} decoder "
                              f"steps on {self.calls[0][1].shape[0]} samples",
                "forward_backward": f"{self.backward_passes()} teacher-forced passes"}
