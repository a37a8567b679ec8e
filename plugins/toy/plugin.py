"""The reference plugin: a categorical sequence policy on a digit task with a verifiable reward.

It is the template for new modalities (docs/plugins.md walks through it) and learns on a CPU in seconds. How it
maps onto the rollout contract:

- an action is one generated token, A = ``max_new_tokens``; the mask covers tokens up to and including EOS;
- ``payload["completions"]`` holds the decoded text, scored by ``token_accuracy`` or ``exact_match`` against
  the row's ``"solution"``;
- ``replay`` holds the prompt ids and sampled tokens, enough to recompute every log-prob;
- ``old_logp`` comes from the sampling pass's own logits, scored by :meth:`ToyPlugin.forward`'s log-prob math: the
  decoder computes them anyway, and the core then needs no old-policy pass (a plugin that cannot get them for free
  returns None and the core computes them with ``forward`` when the run needs them);
- each sample draws its Gumbel noise from its own seed, so a rollout does not depend on how samples are laid out
  over processes;
- the reference policy is :mod:`mmrl.policy`'s: a frozen copy of the initial weights (full fine-tuning;
  :func:`~mmrl.policy.reference_policy` disables the adapter instead for a LoRA policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.config import ConfigError, config_field
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime
from mmrl.plugins.toy.model import TinyPolicyConfig, TinySequencePolicy
from mmrl.plugins.toy.task import make_splits
from mmrl.policy import frozen_copy, has_lora, reference_policy
from mmrl.rollout import Rollout


@dataclass
class ToyPluginConfig:
    """The ``plugin:`` section of the reference plugin."""

    task: Literal["reverse", "sort", "copy"] = config_field("reverse", help="What the answer is.")
    num_digits: int = config_field(6, minimum=2, help="Vocabulary of the prompts: digits 0..num_digits-1.")
    min_length: int = config_field(3, minimum=1, help="Shortest prompt.")
    max_length: int = config_field(5, minimum=1, help="Longest prompt.")
    train_size: int = config_field(1024, minimum=1, help="Distinct training prompts.")
    eval_size: int = config_field(128, minimum=1, eval_only=True,
                                  help="Distinct held-out prompts (drawn after the training prompts, which stay "
                                       "the same whatever this is).")
    data_seed: int = config_field(1234, help="Seed of the prompt draw (independent of the run seed).")
    model_path: str | None = config_field(
        None, help="Folder with config.json and model.safetensors to start from; null builds a random policy."
    )
    init_seed: int = config_field(0, help="Seed of the random initialisation when model_path is null.")
    embed_size: int = config_field(16, minimum=1, help="Token embedding width of a new policy.")
    hidden_size: int = config_field(64, minimum=1, help="GRU width of a new policy.")
    max_new_tokens: int | None = config_field(
        None, minimum=1, help="Generation budget (the action axis A). Null: max_length + 1, room for EOS."
    )
    temperature: float = config_field(1.0, minimum=0.0, exclusive_minimum=True, help="Sampling temperature.")

    def validate(self, path: str) -> None:
        if self.max_length < self.min_length:
            raise ConfigError(f"{path}.max_length", self.max_length, f"an integer >= min_length ({self.min_length})")


class ToyPlugin(Plugin):
    """Reference plugin: GRPO on a tiny GRU policy that must reverse (sort, copy) a digit sequence."""

    name = "toy"
    config_class = ToyPluginConfig
    # An autoregressive pass computes every token anyway; the toy slices the requested columns so that the
    # trainer's action chunking (meant for flow models, one denoising step per forward) is exercised in tests.
    supports_action_chunks = True

    def __init__(self, config: ToyPluginConfig, runtime: Runtime):
        super().__init__(config, runtime)
        if config.model_path:
            self.model = TinySequencePolicy.from_pretrained(config.model_path)
            if self.model.config.num_digits != config.num_digits:
                raise ConfigError("plugin.num_digits", config.num_digits,
                                  f"{self.model.config.num_digits}, the vocabulary of {config.model_path}")
            if self.model.config.max_prompt_length < config.max_length:
                raise ConfigError("plugin.max_length", config.max_length,
                                  f"at most {self.model.config.max_prompt_length}, the prompt width of the model")
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.init_seed)
                self.model = TinySequencePolicy(TinyPolicyConfig(
                    num_digits=config.num_digits, max_prompt_length=config.max_length,
                    embed_size=config.embed_size, hidden_size=config.hidden_size,
                ))
        self.model.to(runtime.device)
        # The KL reference: a frozen copy of the initial weights, kept only when the KL term needs it.
        self.reference = frozen_copy(self.model) if runtime.needs_reference else None
        self.splits = make_splits(
            config.task, num_digits=config.num_digits, min_length=config.min_length, max_length=config.max_length,
            train_size=config.train_size, eval_size=config.eval_size, seed=config.data_seed,
        )
        self.tiny = self.model.config

    # ------------------------------------------------------------------ contract
    def policy(self) -> nn.Module:
        return self.model

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise KeyError(f"toy plugin has splits {sorted(self.splits)}, not {split!r}")
        return self.splits[split]

    def max_actions(self) -> int:
        return self.config.max_new_tokens or self.config.max_length + 1

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        model = self.runtime.unwrap(policy)
        device = self.runtime.device
        prompt_ids = self._encode([row["digits"] for row in batch.rows])  # [N, P]
        steps = self.max_actions()
        if batch.training:
            # Gumbel-max sampling with per-sample noise: the same sample seed gives the same tokens whatever the
            # batch it is in. noise [N, T, V_out].
            noise = torch.stack([
                torch.rand(steps, self.tiny.num_outputs, generator=g) for g in batch.sample_generators()
            ]).to(device)
            gumbel = -torch.log(-torch.log(noise.clamp(1e-10, 1.0 - 1e-7)))
        tokens, mask, step_logits = [], [], []
        with self.runtime.autocast():  # as the teacher-forced forward runs: the logits below are the ones it computes
            state, *memory = model.encode(prompt_ids)
            previous = torch.full((len(batch),), self.tiny.bos_id, dtype=torch.long, device=device)
            finished = torch.zeros(len(batch), dtype=torch.bool, device=device)
            for t in range(steps):
                logits, state = model.step(state, previous, memory)  # [N, V_out]
                step_logits.append(logits)
                if batch.training:
                    choice = torch.argmax(logits.float() / self.config.temperature + gumbel[:, t], dim=-1)
                else:
                    choice = torch.argmax(logits, dim=-1)  # greedy evaluation
                choice = torch.where(finished, torch.full_like(choice, self.tiny.eos_id), choice)
                mask.append((~finished).float())
                tokens.append(choice)
                finished = finished | (choice == self.tiny.eos_id)
                previous = choice
        tokens_t = torch.stack(tokens, dim=1)  # [N, T]
        mask_t = torch.stack(mask, dim=1)  # [N, T]: up to and including EOS
        # old_logp from the sampling pass's own logits: forward() feeds the decoder's step() the same prompt and the
        # same tokens (each step's input is the token sampled before it, EOS after the end), so a second
        # teacher-forced pass would compute these logits again; the log-prob math is forward()'s own.
        old_logp, _ = self._log_probs(torch.stack(step_logits, dim=1), tokens_t)  # [N, T]
        return Rollout(
            group_ids=batch.group_ids,
            old_logp=old_logp,
            mask=mask_t,
            payload={"completions": self._decode(tokens_t, mask_t),
                     "completion_tokens": mask_t.sum(dim=1).long()},  # tokens up to and including the EOS
            replay={"prompt_ids": prompt_ids, "tokens": tokens_t},
            truncated=~finished,  # no EOS within max_new_tokens
            metrics={"completion_length": float(mask_t.sum(dim=1).mean())},
        )

    def forward(
        self, policy: nn.Module, rollout: Rollout, *, need_reference: bool, actions: Tensor | None = None
    ) -> PolicyOutput:
        prompt_ids, tokens = rollout.replay["prompt_ids"], rollout.replay["tokens"]
        logp, entropy = self._token_logp(policy, prompt_ids, tokens)  # [N, T] each
        ref_logp = None
        if need_reference:
            with torch.no_grad(), reference_policy(self.runtime.unwrap(policy), self.reference) as reference:
                ref_logp, _ = self._token_logp(reference, prompt_ids, tokens)
        if actions is not None:
            columns = actions.to(logp.device)
            logp, entropy = logp.index_select(1, columns), entropy.index_select(1, columns)
            ref_logp = None if ref_logp is None else ref_logp.index_select(1, columns)
        return PolicyOutput(logp=logp, ref_logp=ref_logp, entropy=entropy)

    # ------------------------------------------------------------------ helpers
    def reference_module(self) -> nn.Module | None:
        """The frozen copy of the initial weights that :meth:`forward` scores the reference with (None under a LoRA
        adapter, whose reference is the base weights)."""
        return None if has_lora(self.model) else self.reference

    def _token_logp(self, model: nn.Module, prompt_ids: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Log-prob and entropy of each token, in float32: ``[N, T]`` each."""
        with self.runtime.autocast():
            logits = model(prompt_ids, tokens)  # [N, T, V_out]
        return self._log_probs(logits, tokens)

    def _log_probs(self, logits: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Log-prob and entropy of ``tokens [N, T]`` under ``logits [N, T, V_out]``, in float32: ``[N, T]`` each."""
        log_probs = F.log_softmax(logits.float() / self.config.temperature, dim=-1)  # [N, T, V_out]
        token_logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, T]
        entropy = -(log_probs.exp() * log_probs).sum(-1)  # [N, T]
        return token_logp, entropy

    def _encode(self, sequences: list[list[int]]) -> Tensor:
        """PAD-padded prompt ids ``[N, P]``, built in one ``torch.tensor`` call (one per row cost 1.5 ms a step)."""
        width, pad = self.tiny.max_prompt_length, self.tiny.pad_id
        for digits in sequences:
            if len(digits) > width:
                raise ValueError(f"toy prompt of length {len(digits)} exceeds the model's width {width}")
        rows = [[*digits, *[pad] * (width - len(digits))] for digits in sequences]
        return torch.tensor(rows, dtype=torch.long).reshape(len(sequences), width).to(self.runtime.device)

    def _decode(self, tokens: Tensor, mask: Tensor) -> list[str]:
        texts = []
        for row, row_mask in zip(tokens.tolist(), mask.tolist(), strict=True):
            digits = [str(tok) for tok, keep in zip(row, row_mask, strict=True) if keep and tok != self.tiny.eos_id]
            texts.append(" ".join(digits))
        return texts
