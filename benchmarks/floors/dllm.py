"""Floor of the dLLM plugin: a masked diffusion LM scored by Monte Carlo ELBO estimators.

- generation: per rollout call and ``generation_batch_size`` piece, one forward of the whole sequence (prompt and
  completion) per decoding step (two with ``cfg_scale > 0``), without the sampler's token choice;
- forward and backward: per backward pass, the estimator's masked forwards of the pass's samples under the inner
  epoch's mask plan (the rows whose plan scores a position, in ``score_micro_batch`` pieces, two forwards each with
  ``cfg_scale > 0``), reduced to a scalar over the completion positions, then one backward;
- extras: ``old_logp``, the core's no-grad scoring of the sampling policy under every epoch's plan, when the run
  needs old log-probs, without the samples of the first mini-batch where the learner takes their old log-probs
  from the training forward (:meth:`mmrl.trainer.learn.Learner.old_policy_rollouts`); ``reference``, the scoring
  of every sample under every plan with the reference model, when ``kl_coef > 0``;
  ``logprob_math``, the plugin's scoring function (``DLLMPlugin.score``: the masked inputs, the float32 log-softmax
  of the scored positions, the plan's reduction and the token columns) with the model replaced by a precomputed
  output, for every scoring pass of the step (with gradients and their backward for the training passes).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from mmrl.trainer.learn import needs_old_logp, same_in_train_and_eval

from . import Floor, scalar


class DLLMFloor(Floor):
    """Floor of the ``dllm`` plugin (module docstring)."""

    def __init__(self, trainer: Any, capture: Any):
        super().__init__(trainer, capture)
        plugin = self.plugin
        self.config = plugin.config
        self.adapter = plugin.adapter
        self.module = plugin.runtime.unwrap(self.policy)
        self.mask_id = self.adapter.mask_id
        self.num_plans = int(self.rollout.replay["plan_masked"].shape[1])
        size = self.config.generation_batch_size
        # Per decoding batch: the prompt and completion ids, [n, w + L].
        self.decoded = []
        for call in capture.rollouts:
            ids = torch.cat([call.replay["prompt_ids"], call.replay["completion_ids"]], dim=1)
            self.decoded += list(ids.split(size or ids.shape[0]))

    # ------------------------------------------------------------------ model calls
    def logits(self, module: torch.nn.Module, input_ids: torch.Tensor, width: int) -> torch.Tensor:
        """The model's logits of ``input_ids``, and of the unconditional copy (prompt masked) with CFG."""
        logits = self.adapter.model_logits(module, input_ids)  # [R, T, V]
        if self.config.cfg_scale > 0:
            unconditional = input_ids.clone()
            unconditional[:, :width] = self.mask_id
            return torch.cat([logits, self.adapter.model_logits(module, unconditional)])
        return logits

    def generation(self) -> None:
        width = self.rollout.replay["prompt_ids"].shape[1]
        for ids in self.decoded:
            for _ in range(self.config.steps):
                self.logits(self.module, ids, width)

    def masked_rows(self, indices: list[int], plan: int) -> tuple[list[torch.Tensor], int]:
        """The masked copies the estimator forwards for samples ``indices`` under plan ``plan``: the rows that
        score a position, in ``score_micro_batch`` pieces (``[R, w + L]`` each), and the prompt width w."""
        replay = self.rollout.replay
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        width = int(replay["prompt_width"][0])
        prompt = replay["prompt_ids"].index_select(0, index)[:, :width]  # [n, w]
        completion = replay["completion_ids"].index_select(0, index)  # [n, L]
        masked = replay["plan_masked"].index_select(0, index)[:, plan].transpose(0, 1).bool()  # [D, n, L]
        scored = replay["plan_weights"].index_select(0, index)[:, plan].transpose(0, 1) != 0  # [D, n, L]
        prompts = prompt.unsqueeze(0).expand(masked.shape[0], -1, -1)  # [D, n, w]
        if "plan_prompt_masked" in replay:
            prompt_masked = replay["plan_prompt_masked"].index_select(0, index)[:, plan, :, :width]
            prompts = torch.where(prompt_masked.transpose(0, 1).bool(), self.mask_id, prompts)
        rows = torch.cat([prompts, torch.where(masked, self.mask_id, completion.unsqueeze(0))], dim=-1)
        rows = rows.reshape(-1, rows.shape[-1])[scored.reshape(-1, scored.shape[-1]).any(dim=-1)]  # [R, w + L]
        return list(rows.split(self.config.score_micro_batch or max(rows.shape[0], 1))), width

    def unit_inputs(self, epoch: int, indices: list[int], columns: torch.Tensor | None) -> Any:
        return self.masked_rows(indices, epoch if self.num_plans > 1 else 0)

    def loss(self, inputs: Any) -> torch.Tensor:
        pieces, width = inputs
        total = torch.zeros((), device=self.device)
        for rows in pieces:
            total = total + scalar(self.logits(self.policy, rows, width)[:, width:])
        return total

    # ------------------------------------------------------------------ extras
    def old_policy_samples(self) -> list[list[int]]:
        """Per plan, the samples the learner's old-policy pass scores (empty when the run needs no old log-probs): all
        of them, but for plan 0 not the first mini-batch's when the learner reuses its training forward (one pass per
        epoch, or a single epoch, and a policy that computes the same in training and eval mode)."""
        if not needs_old_logp(self.trainer.config):
            return [[] for _ in range(self.num_plans)]
        everything = list(range(len(self.rollout)))
        epochs = self.trainer.geometry.inner_epochs
        reused = set()
        if (self.num_plans > 1 or epochs == 1) and same_in_train_and_eval(self.policy):
            reused = {i for unit in self.schedule[0] for i in unit.indices}  # epoch 0's first mini-batch
        return [[i for i in everything if plan > 0 or i not in reused] for plan in range(self.num_plans)]

    def scoring_inputs(self, indices: list[int], plan: int) -> Any:
        """Inputs of one no-grad scoring pass over samples ``indices`` under plan ``plan``."""
        return self.masked_rows(indices, plan)

    def score(self, module: torch.nn.Module, inputs: Any) -> None:
        """The model calls of one no-grad scoring pass (``inputs`` from :meth:`scoring_inputs`)."""
        pieces, width = inputs
        for rows in pieces:
            self.logits(module, rows, width)

    def extras(self) -> dict[str, Callable[[], None]]:
        plugin, runtime = self.plugin, self.plugin.runtime
        everything = list(range(len(self.rollout)))

        def scoring(module_of: Callable[[], Any], samples: list[list[int]]) -> Callable[[], None]:
            passes = [self.scoring_inputs(indices, plan) for plan, indices in enumerate(samples) if indices]

            def run() -> None:
                with torch.no_grad(), module_of() as module, runtime.autocast():
                    for inputs in passes:
                        self.score(module, inputs)
            return run

        extras: dict[str, Callable[[], None]] = {}
        old = self.old_policy_samples()
        if any(old):  # the core's old-policy pass, one per redrawn plan
            extras["old_logp"] = scoring(lambda: nullcontext(self.module), old)
        if runtime.needs_reference:
            extras["reference"] = scoring(lambda: plugin._reference_module(self.policy),
                                          [everything] * self.num_plans)
        extras["logprob_math"] = self._logprob_math(extras)
        return extras

    def _logprob_math(self, extras: dict[str, Any]) -> Callable[[], None]:
        """``DLLMPlugin.score`` with a model that returns a precomputed output: every no-grad scoring pass the
        step runs (old-policy and reference, per plan), then every training pass with its backward."""
        plugin, replay = self.plugin, self.rollout.replay
        vocab = int(self.adapter.model_logits(self.module, self.decoded[0][:1]).shape[-1])
        longest = max(rows.shape[0] for pieces, _ in
                      [self.masked_rows(list(range(len(self.rollout))), plan) for plan in range(self.num_plans)]
                      for rows in pieces)
        table = torch.randn(longest, self.decoded[0].shape[1], vocab, device=self.device)
        everything = list(range(len(self.rollout)))
        scorings = [] if "reference" not in extras else [(plan, everything) for plan in range(self.num_plans)]
        if "old_logp" in extras:
            scorings += [(plan, indices) for plan, indices in enumerate(self.old_policy_samples()) if indices]
        scorings = [(plan, {key: _rows(value, torch.tensor(indices, device=self.device))
                            for key, value in replay.items()}) for plan, indices in scorings]
        units = [(unit.epoch, torch.tensor(unit.indices, device=self.device)) for minibatch in self.schedule
                 for unit in minibatch]

        def logprob_math() -> None:
            with torch.no_grad():
                for plan, part in scorings:
                    plugin.score(lambda ids: table[:ids.shape[0]], part, plan=plan)
            for (epoch, indices) in units:
                leaf = table.detach().requires_grad_(True)
                part = {key: _rows(value, indices) for key, value in replay.items()}
                plugin.score(lambda ids, leaf=leaf: leaf[:ids.shape[0]], part,
                             plan=epoch if self.num_plans > 1 else 0).sum().backward()

        return logprob_math

    def describe(self) -> dict[str, Any]:
        rows = [piece.shape for pieces, _ in (unit.inputs for m in self.schedule for unit in m) for piece in pieces]
        return {"generation": f"{len(self.decoded)} decoding batch(es) of {self.decoded[0].shape[0]} x "
                              f"{self.config.steps} steps, sequences of {self.decoded[0].shape[1]} tokens",
                "forward_backward": f"{self.backward_passes()} backward passes over masked inputs "
                                    f"{[tuple(shape) for shape in rows]}"}


def _rows(value: Any, indices: torch.Tensor) -> Any:
    return value.index_select(0, indices.to(value.device)) if isinstance(value, torch.Tensor) else value
