"""The plugin contract: how a modality plugs into the shared optimizer.

A plugin is a class registered by name in :data:`plugin_registry`. The trainer drives it; the plugin never sees
the trainer. Data flows one way::

    dataset rows ──► Plugin.rollout(policy, PromptBatch) ──► Rollout ──► rewards ──► advantages
                                                                                        │
    optimizer step ◄── aggregate(policy loss + β·KL) ◄── Plugin.forward(policy, Rollout) ◄┘

A plugin class is registered through the entry-point group ``mmrl.plugins``, the built-in ones in mmrl's own
pyproject.toml exactly as a third-party package registers its own; ``pip install`` is then enough for configs and
``mmrl list``::

    [project.entry-points."mmrl.plugins"]
    my_modality = "my_package.plugin:MyPlugin"

What the core owns, so that a plugin does not: the old-policy log-probs (a rollout may leave ``old_logp`` None; the
learner computes them with :meth:`Plugin.forward` under ``no_grad`` when the run needs them), group statistics and
advantages (a plugin only says how a sample's reward is credited to its actions, :meth:`Plugin.action_rewards`),
seeds (:mod:`mmrl.seeding`) and cross-section config checks (:meth:`Plugin.check_config`).

docs/plugins.md walks through writing one, using the reference plugin :mod:`mmrl.plugins.toy` as the example.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

# Re-exported: these names lived here before the policy module, for plugins that override save_trainable.
from mmrl.policy import (  # noqa: F401
    PEFT_ADAPTER_WEIGHTS,
    LoraConfig,
    clean_parameter_name,
    has_lora,
    load_adapter_state,
    load_policy,
    save_peft_adapter,
    save_policy,
)
from mmrl.registry import Registry
from mmrl.rollout import Rollout


@dataclass
class Runtime:
    """What a plugin may know about the process it runs in (built by the trainer from Accelerate).

    Attributes:
        device: Device of this process.
        process_index: Rank of this process, 0..num_processes-1.
        num_processes: World size.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; log-prob math stays in float32 regardless.
        unwrap: Returns the bare module inside a DDP/FSDP/DeepSpeed wrapper (for ``generate``).
        full_state_dict: Returns the module's complete, unsharded state dict. A collective under FSDP and
            ZeRO-3: every process must call it; the main process receives full tensors (Accelerate's
            ``get_state_dict``). Saving reads weights through it, never from local (possibly sharded) parameters.
        autocast: Returns the mixed-precision autocast context for forward passes.
        seed: The run's base seed.
        needs_reference: Whether :meth:`Plugin.forward` will be asked for the reference policy (``kl_coef > 0``,
            or a policy loss that reads ``ref_logp`` such as ``dgpo``), so that a plugin keeps a frozen copy only
            when the run needs one.
        ratio_level: The importance-ratio level the policy loss uses (``"token"``, ``"chunk"``, ``"sequence"``;
            None when unknown, e.g. outside a trainer), so that a plugin providing chunk ids can insist on it.
        inner_epochs: ``algorithm.inner_epochs`` (μ), the number of passes the learner makes over each training
            rollout: how many noise draws a plugin that redraws its noise per inner epoch prepares at rollout time
            (:attr:`Plugin.redraws_per_epoch`; the dLLM plugin's mask plans, as d1 draws a mask seed per inner
            iteration). 1 outside a trainer.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_index: int = 0
    num_processes: int = 1
    mixed_precision: str = "no"
    unwrap: Callable[[nn.Module], nn.Module] = lambda module: getattr(module, "module", module)
    full_state_dict: Callable[[nn.Module], dict[str, Tensor]] = lambda module: getattr(
        module, "module", module
    ).state_dict()
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext
    seed: int = 0
    needs_reference: bool = False
    ratio_level: str | None = None
    inner_epochs: int = 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.mixed_precision, torch.float32)


@dataclass
class PromptBatch:
    """The prompts one process turns into a rollout.

    Attributes:
        rows: N dataset rows; each prompt appears once per sample of its group on this process.
        group_ids: ``[N]`` group id of each row (equal ids = copies of one prompt).
        group_size: G, the number of samples per prompt over all processes.
        seeds: ``[N]`` int64 seed of each sample, a function of (run seed, step, round, global sample index) only.
            Drawing each sample's randomness from its own seed makes a rollout independent of how samples are
            laid out over processes and micro-batches (one process and two processes sample the same thing).
        generator: A per-process ``torch.Generator`` on the process's device, for plugins that draw batched noise.
        training: False for evaluation (plugins sample greedily or with their deterministic sampler).
        step: The training step this batch belongs to (0-based; the step being evaluated for evaluation batches),
            for schedules that move with training, such as MixGRPO's sliding SDE window.
        max_steps: The run's ``run.max_steps``, so that such schedules can be expressed as training progress.
    """

    rows: list[dict[str, Any]]
    group_ids: Tensor
    group_size: int
    seeds: Tensor
    generator: torch.Generator
    training: bool = True
    step: int = 0
    max_steps: int = 1

    def __len__(self) -> int:
        return len(self.rows)

    def sample_generators(self, device: torch.device | str = "cpu") -> list[torch.Generator]:
        """One ``torch.Generator`` per sample, seeded from :attr:`seeds`."""
        return [torch.Generator(device=device).manual_seed(int(seed)) for seed in self.seeds.tolist()]


@dataclass
class PolicyOutput:
    """What :meth:`Plugin.forward` returns for a (micro-)batch of a rollout.

    Attributes:
        logp: ``[N, A]`` float32 log-probs of the stored actions under the current policy, with gradients.
        ref_logp: ``[N, A]`` log-probs under the reference policy (no gradients), when asked for.
        kl: ``[N, A]`` the plugin's own per-action KL to the reference, with gradients. When set it replaces the
            core's estimator applied to ``logp`` and ``ref_logp`` (flow models use a KL between Gaussian means).
        entropy: ``[N, A]`` per-action policy entropy, when the plugin can compute it.
        replay: Per-sample ``rollout.replay`` entries (tensors ``[N, ...]``) that describe the old policy along with
            the log-probs, e.g. the flow plugin's transition means for GRPO-Guard's RatioNorm. The learner's old-policy
            pass (the ``no_grad`` forward that computes ``old_logp``, see :meth:`Plugin.forward`) stores them in the
            rollout of that inner epoch together with the log-probs; training forwards' are ignored.
        aux_loss: A 0-dim regulariser of the plugin's model from this forward, with gradients and already weighted
            by the plugin's own coefficient (the VLM plugin's MoE router load-balancing loss, TRL's
            ``router_aux_loss_coef``). The learner adds it to the loss of the backward pass it came from, divided by
            the backward passes of an optimizer step on all processes, so each optimizer step's gradient carries its
            mean over the step's forwards (TRL: ``coef · aux / gradient_accumulation_steps`` per micro-batch, then
            DDP's mean over processes). Logged as ``loss/aux``. None: no such term.
    """

    logp: Tensor
    ref_logp: Tensor | None = None
    kl: Tensor | None = None
    entropy: Tensor | None = None
    replay: dict[str, Tensor] | None = None
    aux_loss: Tensor | None = None


class Plugin(ABC):
    """Base class of modality plugins.

    Subclasses set :attr:`name` and :attr:`config_class` (a dataclass validated from the config's ``plugin:``
    section) and implement the abstract methods. The constructor builds the models; nothing is prepared for
    distribution until the trainer calls :meth:`policy`.

    Args:
        config: An instance of :attr:`config_class`.
        runtime: Process facts (device, rank, precision).
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    #: Whether :meth:`forward` can recompute a subset of the action columns (``actions=``). Plugins whose actions
    #: are separate model calls (denoising steps) set it, so that ``algorithm.action_chunk_size`` can bound memory
    #: by back-propagating a few actions at a time, as Flow-GRPO does one timestep at a time.
    supports_action_chunks: ClassVar[bool] = False

    @classmethod
    def check_config(cls, train_config: Any) -> None:
        """Refuse a config whose other sections contradict this plugin's section; the default accepts everything.

        Called when a config is loaded (:class:`mmrl.config.TrainConfig` validates every section first, then asks the
        plugin), before any model is built, with the whole validated config. Raise
        :class:`mmrl.config.ConfigError` naming the key that is wrong and what is allowed with the plugin's choice,
        e.g. the dLLM plugin refuses ``plugin.objective: spg`` unless ``algorithm.policy_loss`` is ``spg``. Checks
        within the plugin's own section belong in its config class's ``validate``.

        Args:
            train_config: The :class:`mmrl.config.TrainConfig` being loaded (``train_config.plugin.config`` is this
                plugin's validated section).
        """
        return None

    def __init__(self, config: Any, runtime: Runtime):
        self.config = config
        self.runtime = runtime

    # ------------------------------------------------------------------ required
    @abstractmethod
    def policy(self) -> nn.Module:
        """The trainable module. The trainer wraps it (DDP, FSDP, DeepSpeed) and passes the wrapped module back
        to :meth:`rollout` and :meth:`forward`; gradients must flow through a call of that module."""

    @abstractmethod
    def dataset(self, split: str) -> Sequence[dict[str, Any]]:
        """The prompt rows of ``split`` (``"train"`` or ``"eval"``), each a dict with at least ``"prompt"``."""

    @abstractmethod
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """Sample one trajectory per row of ``batch`` (under ``torch.no_grad``) and return them as a rollout whose
        ``group_ids`` equal ``batch.group_ids``.

        ``old_logp`` may be None: the core then computes the old policy's log-probs itself when the run needs them
        (several optimizer steps per rollout), with :meth:`forward` under ``no_grad`` before the first update, so a
        plugin never needs to know whether they are needed. Return them only when sampling produces them anyway (the
        flow plugin's SDE step log-densities); they must then come from the same computation as :meth:`forward`, so
        that the ratio is 1 on the first inner step."""

    @abstractmethod
    def forward(
        self, policy: nn.Module, rollout: Rollout, *, need_reference: bool, actions: Tensor | None = None
    ) -> PolicyOutput:
        """Recompute, with gradients, the log-probs of the actions stored in ``rollout`` (any subset of the
        sampled rollout's samples). With ``need_reference`` also return ``ref_logp`` (or ``kl``) under the
        reference policy.

        ``actions`` (only passed when :attr:`supports_action_chunks` is set) holds the indices of the action columns
        to recompute; the outputs are then ``[N, len(actions)]`` and ``rollout``'s action fields are already sliced
        to those columns (``replay`` is not: it still describes whole trajectories).

        The learner also calls it under ``torch.no_grad`` with the policy in eval mode (as when sampling), on the
        unchanged weights before the step's first update, to compute the old log-probs that the rollout left out
        (or all of them with ``algorithm.recompute_old_logp``): the ratio is then 1 on the first inner step by
        construction."""

    # ------------------------------------------------------------------ optional
    @property
    def redraws_per_epoch(self) -> bool:
        """Whether :meth:`forward`'s log-probs depend on the inner epoch: Monte Carlo estimates whose noise is drawn
        anew for every epoch (:attr:`Runtime.inner_epochs` draws prepared at rollout time, selected by
        :meth:`start_inner_epoch`). The learner then computes the old log-probs once per epoch, each on that epoch's
        draw, so that every epoch's ratio compares the two policies on one draw. Default False: one old-policy pass
        serves every epoch."""
        return False

    def start_inner_epoch(self, epoch: int) -> None:
        """Select the noise draw of inner epoch ``epoch`` (0-based, ``< Runtime.inner_epochs``) for the following
        :meth:`forward` calls. The learner calls it before the old-policy pass of that epoch's draw and before the
        training forwards of that epoch; only plugins with :attr:`redraws_per_epoch` need it. Default: nothing."""
        return None

    def max_actions(self) -> int | None:
        """The action budget (e.g. ``max_new_tokens``); Dr.GRPO's constant in ``seq_mean_token_sum_norm``."""
        return None

    def row_buckets(self, split: str) -> list[str] | None:
        """The bucket of each row of ``self.dataset(split)``, in order: rows of different buckets never share a batch.

        A bucket is an opaque key to the core, a short string usable in a file name (the flow plugin's are output
        sizes such as ``"512x384"``: images of different sizes cannot be stacked in one tensor). Every training step
        draws its prompts, on all processes and in every rollout call, from one bucket (the stream deals each
        bucket's rows into chunks of a step's prompts; see :class:`mmrl.trainer.sampler.PromptStream`), and the
        evaluation samples each bucket apart (``save_samples`` is called once per bucket, with ``tag`` ending in
        ``_{key}``). With several training buckets the trainer refuses ``rollout.dynamic_sampling.enabled``: a
        step's sampling rounds would draw different buckets.

        Args:
            split: ``"train"`` or ``"eval"``.

        Returns:
            One key per row of ``self.dataset(split)`` (same length, same order), or None (the default): any rows can
            share a batch. A list with one distinct key behaves as None.
        """
        return None

    def reward_context(self) -> dict[str, Any]:
        """Facts about the model being trained that rewards may read, as a JSON-serialisable dict (default ``{}``).

        The trainer hands it to every reward when it builds them at start-up (:func:`mmrl.reward.build_reward`), so
        that a reward can default to what the model does and refuse options that contradict it before training
        starts; rewards that do not care ignore it. Keys in use: ``box_convention``, the coordinate convention of the
        boxes the model writes (a :data:`mmrl.rewards.boxes.CONVENTIONS` name; declared by the vlm plugin, read by
        the ``iou``, ``giou`` and ``detection`` rewards).
        """
        return {}

    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor | None:
        """The one credit hook: how a sample's reward is credited to its actions, for plugins whose credit is not
        uniform over time.

        Called after scoring with this process's rollout and rewards ``[N]`` (the combined reward; with
        ``rewards.multi_reward: normalize_then_sum`` once more per reward column, on a shallow copy of the rollout);
        return ``[N, A]`` per-action rewards (e.g. a tree node's reward = the mean of its leaves, a branch point's
        reward spread), or None (the default) for one group-relative advantage per sample broadcast over its actions.
        The core computes every advantage: per-action rewards are normalised per (group, action position), see
        :func:`mmrl.trainer.credit.action_advantages`. A plugin returns rewards, never advantages, so that the
        configured estimator, clipping and multi-reward order apply to every plugin alike.
        """
        return None

    def trainable_parameters(self, policy: nn.Module) -> Iterator[nn.Parameter]:
        """Parameters the optimizer updates (default: those with ``requires_grad``)."""
        return (p for p in policy.parameters() if p.requires_grad)

    def reference_module(self) -> nn.Module | None:
        """The separate module the KL reference runs on, which ``algorithm.ref_sync_every`` moves toward the policy
        (:mod:`mmrl.trainer.reference`); None (the default) where there is none, e.g. with LoRA, whose reference is
        the policy with its adapter switched off: the trainer then refuses ``ref_sync_every`` at start-up.

        Called once at start-up, only when ``ref_sync_every`` is set (``Runtime.needs_reference`` is then true). The
        module's parameters must carry the names of the policy's (unwrapped) ones; the core updates in place those
        whose policy counterparts are trainable, so the reference that :meth:`forward` uses must be this module.
        """
        return None

    def gathered_trainable_state(self, policy: nn.Module) -> dict[str, Tensor] | None:
        """The full weights of every trainable parameter, keyed by :func:`clean_parameter_name`, on the main process
        (None on the others).

        Call it on every process: the weights are read through :attr:`Runtime.full_state_dict`, a collective under
        FSDP and ZeRO-3, never from local (possibly sharded) parameters. A trainable tensor missing from the
        gathered state, or empty, raises instead of returning an incomplete state (peers save empty LoRA adapters
        under FSDP by reading local shards). Plugins that override :meth:`save_trainable` build on this.
        """
        gathered = self.runtime.full_state_dict(policy)
        if not self.runtime.is_main_process:
            return None
        module = self.runtime.unwrap(policy)
        names = [clean_parameter_name(name) for name, p in module.named_parameters() if p.requires_grad]
        state = {clean_parameter_name(name): tensor for name, tensor in gathered.items()}
        incomplete = [name for name in names if name not in state or state[name].numel() == 0]
        if incomplete:
            raise RuntimeError(
                f"refusing to save trainable weights: {len(incomplete)} tensors are missing or empty in the gathered "
                f"state dict (first: {incomplete[:3]}); the state was not gathered from all shards"
            )
        return {name: state[name].detach().cpu().contiguous() for name in names}

    #: The format of a LoRA adapter in checkpoints and exports (:data:`mmrl.policy.POLICY_FORMATS`): peft's adapter
    #: folder, or ``"diffusers_lora"`` for diffusers models (``pipeline.load_lora_weights``).
    lora_format: ClassVar[str] = "peft_lora"

    def policy_format(self, policy: nn.Module, *, export: bool) -> str:
        """The :func:`mmrl.policy.save_policy` format of this policy's checkpoints (``export`` False) and exports.

        Default: :attr:`lora_format` when the policy carries a LoRA adapter; otherwise ``"trainable"`` in checkpoints
        (the trainable weights only: frozen parts are rebuilt from the config) and ``"pretrained"`` in exports when
        the model has ``save_pretrained`` (transformers, diffusers), else ``"trainable"``.
        """
        module = self.runtime.unwrap(policy)
        if has_lora(module):
            return self.lora_format
        if export and hasattr(module, "save_pretrained"):
            return "pretrained"
        return "trainable"

    def save_trainable(self, policy: nn.Module, directory: str | Path) -> None:
        """Write the trainable weights to ``directory`` for a checkpoint, in :meth:`policy_format`: a LoRA adapter in
        the library's own format, else ``trainable.safetensors`` with every parameter that requires gradients.

        Called on every process (see :meth:`gathered_trainable_state`); only the main process writes.
        """
        state = self.gathered_trainable_state(policy)
        if state is None:
            return
        save_policy(self.runtime.unwrap(policy), directory, self.policy_format(policy, export=False), state=state)

    def load_trainable(self, policy: nn.Module, directory: str | Path) -> None:
        """Load what :meth:`save_trainable` wrote; every trainable tensor must be present. A LoRA adapter of another
        rank or alpha than the config's is refused in one line."""
        lora = getattr(self.config, "lora", None)
        load_policy(self.runtime.unwrap(policy), directory, self.policy_format(policy, export=False),
                    lora=lora if isinstance(lora, LoraConfig) else None)

    def export(self, policy: nn.Module, directory: str | Path) -> str:
        """Write the policy to ``directory`` as a folder its model library loads (``mmrl export``); return the format.

        Default: :func:`mmrl.policy.save_policy` in :meth:`policy_format` (``export=True``): a LoRA adapter
        (``PeftModel.from_pretrained(base, directory)`` or ``pipeline.load_lora_weights(directory)``), or the whole
        model through ``save_pretrained``. Plugins add what their library needs next to it (a VLM's processor, a
        language model's tokenizer). Called on one process, outside any distributed wrapper. A plugin whose policy
        cannot be exported raises ``NotImplementedError`` saying why (:func:`mmrl.testing.check_plugin` then skips
        its export check with that reason).
        """
        fmt = self.policy_format(policy, export=True)
        save_policy(self.runtime.unwrap(policy), directory, fmt)
        return fmt

    def save_samples(
        self, rollout: Rollout, rewards: Tensor, directory: str | Path, *, tag: str
    ) -> list[Path]:
        """Write evaluation samples to ``directory`` for people to look at; return the files written.

        The default writes ``{tag}.jsonl`` with each prompt, its text outputs (``payload["completions"]`` or
        ``payload["texts"]``) and its reward. Image plugins override this to write grids.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        texts = rollout.payload.get("completions", rollout.payload.get("texts"))
        path = directory / f"{tag}.jsonl"
        with path.open("w") as handle:
            for i, row in enumerate(rollout.rows):
                record = {"prompt": row.get("prompt"), "reward": float(rewards[i])}
                if texts is not None:
                    record["output"] = texts[i]
                handle.write(json.dumps(record) + "\n")
        return [path]


# The built-in plugins are entry points of mmrl's own pyproject.toml, declared as a third-party package declares its
# own.
plugin_registry: Registry[type[Plugin]] = Registry("plugin", entry_point_group="mmrl.plugins")
