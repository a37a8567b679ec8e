"""Moving the KL reference toward the policy during training (``algorithm.ref_sync_every``).

TR-DPO (Gorbatovski et al. 2024, arXiv:2404.09656) updates the reference policy every τ optimizer steps with a soft
update, π_ref ← α·π_θ + (1 − α)·π_ref, so that the KL term keeps the policy near a recent version of itself instead
of the initial one. TRL's GRPO trainer offers it as ``sync_ref_model`` with ``ref_model_sync_steps`` τ (512) and
``ref_model_mixup_alpha`` α (0.6) (huggingface/trl@f2cd577 ``trl/trainer/callbacks.py:104-138``
``SyncRefModelCallback``: ``target.mul_(1 − α).add_(θ, alpha=α)`` over every parameter when ``global_step % τ == 0``;
``trl/trainer/grpo_trainer.py:1145-1161`` refuses it with β = 0 and with PEFT), and DiffuCoder's coupled-GRPO recipe
uses it every 64 steps (apple/ml-diffucoder@f735e01 ``recipes/config_coupled_code.yaml:11-12``, α at TRL's default).

mmrl does the same after optimizer step k·τ (``Learner.optimizer_steps``, TRL's ``global_step``). Differences from
TRL: only the parameters that the policy trains are blended (the others are equal in both and stay so), in float32
and rounded once to the reference's dtype; the synced weights are part of the checkpoint, so a resumed run continues
from the reference it had (TRL rebuilds the initial reference on resume). The reference is the plugin's
(:meth:`mmrl.plugin.Plugin.reference_module`); like TRL, LoRA runs are refused (their reference is the base weights
under the adapter), and so are sharded policies (FSDP, ZeRO-3), whose local parameters are not whole tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmrl.config import ConfigError
from mmrl.plugin import Plugin, clean_parameter_name


class ReferenceSync:
    """The soft update of the reference's parameters toward the policy's trainable ones.

    Args:
        pairs: ``(name, policy parameter, reference parameter)`` of every trainable parameter, equal shapes.
        every: τ, optimizer steps between updates.
        mix: α, the policy's share in an update.
    """

    def __init__(self, pairs: list[tuple[str, nn.Parameter, torch.Tensor]], every: int, mix: float):
        self.pairs = pairs
        self.every = every
        self.mix = mix
        self.syncs = 0

    @classmethod
    def build(cls, plugin: Plugin, policy: nn.Module, every: int, mix: float) -> ReferenceSync:
        """Pair the policy's trainable parameters with the reference's by name, refusing what cannot be synced.

        Args:
            plugin: The run's plugin; its :meth:`~mmrl.plugin.Plugin.reference_module` is the reference.
            policy: The prepared (possibly wrapped) policy.
            every: ``algorithm.ref_sync_every``.
            mix: ``algorithm.ref_sync_mix``.
        """
        reference = plugin.reference_module()
        if reference is None:
            raise ConfigError("algorithm.ref_sync_every", every,
                              f"0 with plugin {plugin.name!r} here: it keeps no separate reference model to sync "
                              "(with LoRA the reference is the base weights under the adapter; full fine-tuning "
                              "keeps a frozen copy)")
        references = {clean_parameter_name(name): p for name, p in reference.named_parameters()}
        pairs = []
        for name, parameter in plugin.runtime.unwrap(policy).named_parameters():
            if not parameter.requires_grad:
                continue
            key = clean_parameter_name(name)
            target = references.get(key)
            if target is None:
                raise ConfigError("algorithm.ref_sync_every", every,
                                  f"0: the reference model of plugin {plugin.name!r} has no parameter {key!r}, which "
                                  "the policy trains")
            if target.shape != parameter.shape:
                raise ConfigError("algorithm.ref_sync_every", every,
                                  f"0: the policy's {key!r} is {tuple(parameter.shape)} on this process, the "
                                  f"reference's {tuple(target.shape)} (a sharded policy, FSDP or ZeRO-3, cannot be "
                                  "synced)")
            pairs.append((key, parameter, target))
        return cls(pairs, every, mix)

    def after_optimizer_step(self, optimizer_steps: int) -> bool:
        """Update the reference when ``optimizer_steps`` (the count after the step) is a multiple of τ."""
        if optimizer_steps % self.every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """π_ref ← α·π_θ + (1 − α)·π_ref on every paired parameter."""
        for _, parameter, target in self.pairs:
            blended = torch.lerp(target.float(), parameter.detach().float(), self.mix)  # ref + α·(θ − ref)
            target.copy_(blended.to(target.dtype))
        self.syncs += 1

    # Checkpointing (Accelerate's register_for_checkpointing): the synced weights, once they differ from the initial
    # ones the plugin loads again at start-up.
    def state_dict(self) -> dict[str, Any]:
        weights = {name: target.detach().cpu().clone() for name, _, target in self.pairs} if self.syncs else {}
        return {"syncs": self.syncs, "weights": weights}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.syncs = int(state["syncs"])
        weights = state["weights"]
        if self.syncs and set(weights) != {name for name, _, _ in self.pairs}:
            raise RuntimeError("the checkpoint's synced reference does not hold the parameters this run trains")
        for name, _, target in self.pairs:
            if name in weights:
                target.copy_(weights[name].to(device=target.device, dtype=target.dtype))
