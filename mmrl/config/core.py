"""The training config: one dataclass per section, each field with help text and its paper reference.

A YAML recipe looks like::

    plugin: {name: toy, ...}           # the modality plugin and its own section
    run: {output_dir: runs/toy, max_steps: 60, seed: 0}
    rollout: {prompts_per_step: 16, group_size: 8}
    algorithm: {advantage: grpo, policy_loss: {name: grpo, clip_high: 0.28}, aggregation: token_mean}
    optim: {lr: 3.0e-3}
    rewards: {functions: [{name: token_accuracy}]}

``mmrl explain`` prints every field with its help text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mmrl.config.schema import (
    ConfigError,
    RegistryChoice,
    bind_options,
    config_field,
    from_dict,
    registry_choice_field,
)
from mmrl.registry import RegistryError

LAYOUTS = ("spread", "contiguous")


@dataclass
class RunConfig:
    """Where the run writes, how long it lasts, and how it is logged and checkpointed."""

    output_dir: str = config_field(
        "runs/default", help="Run folder: config.yaml, metrics.jsonl, samples/, checkpoints/."
    )
    seed: int = config_field(0, help="Base seed. Prompt order, sampling noise and mask draws all derive from it.")
    max_steps: int = config_field(100, minimum=1, help="Training steps (one rollout batch each).")
    log_every: int = config_field(1, minimum=1, help="Write metrics every this many steps.")
    save_every: int = config_field(0, minimum=0, help="Checkpoint every this many steps (0: only at the end).")
    keep_last: int = config_field(2, minimum=1, help="How many checkpoints to keep; older ones are deleted.")
    resume: str | None = config_field(
        None, help="'latest' to continue from the newest checkpoint in output_dir, a checkpoint folder, or null."
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = config_field(
        "no", help="Autocast precision for model forwards. Log-prob math always runs in float32."
    )
    cpu: bool = config_field(False, help="Force CPU even when an accelerator is present.")
    trackers: list[str] = config_field(
        default_factory=list,
        help="Accelerate trackers to log to besides metrics.jsonl, e.g. ['tensorboard'] or ['wandb'].",
    )
    project_name: str = config_field("mmrl", help="Project name given to the trackers.")
    progress: bool = config_field(True, help="Show a tqdm progress bar on the main process.")

    def validate(self, path: str) -> None:
        allowed = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive")
        for tracker in self.trackers:
            if tracker not in allowed:
                raise ConfigError(f"{path}.trackers", tracker, f"one of {', '.join(allowed)}")


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2)."""

    enabled: bool = config_field(
        False, help="Drop groups whose rewards have no spread and sample more until the batch is full.",
        ref="DAPO, arXiv:2503.14476, §3.2",
    )
    max_rounds: int = config_field(
        4, minimum=1, help="Sampling rounds per step, the first included; afterwards short processes pad with "
        "zero-weight samples (verl's max_num_gen_batches).",
    )
    tolerance: float = config_field(0.0, minimum=0.0, help="A group whose max − min reward is <= this has no spread.")


@dataclass
class RolloutConfig:
    """How many prompts and samples one step draws, and how groups are laid out over processes."""

    prompts_per_step: int = config_field(
        16, minimum=1, help="Prompts (groups) per step over all processes.", ref="Flow-GRPO: 48; DAPO: 512"
    )
    group_size: int = config_field(
        8, minimum=2, help="G, samples per prompt. Group-relative advantages need at least 2.",
        ref="GRPO: 64 (DeepSeekMath); Flow-GRPO: 24; TRL default 8",
    )
    layout: Literal["spread", "contiguous"] = config_field(
        "spread",
        help="'spread': the G copies of a prompt are dealt round-robin over processes and group statistics are "
        "computed on gathered rewards. 'contiguous': all G copies stay on one process (DanceGRPO; lets a plugin "
        "share initial noise within a group); needs prompts_per_step divisible by the number of processes.",
    )
    batch_size: int | None = config_field(
        None, minimum=1, help="Samples per plugin.rollout call on one process (null: the whole local batch).",
    )
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class AlgorithmConfig:
    """The group-relative objective: advantages, ratio and clip, KL, aggregation, inner epochs."""

    advantage: RegistryChoice = registry_choice_field(
        "mmrl.algos:advantage_estimators", "grpo",
        help="Advantage estimator and its options (grpo, dr_grpo, rloo, batch_std, grpo_passk, reinforce_pp_baseline, "
             "gpg; plugins add more, e.g. wd1; see `mmrl list --options`).",
        ref="GRPO: arXiv:2402.03300 eq. 3",
    )
    advantage_clip: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True,
        help="Clip advantages to ±this value (Flow-GRPO and DanceGRPO: 5.0); null disables.",
        ref="Flow-GRPO, arXiv:2505.05470",
    )
    policy_loss: RegistryChoice = registry_choice_field(
        "mmrl.algos:policy_losses", "grpo",
        help="Policy loss and its options, e.g. {name: grpo, clip_low: 0.2, clip_high: 0.28, ratio_level: token}.",
        ref="PPO clip arXiv:1707.06347; clip-higher DAPO arXiv:2503.14476; GSPO arXiv:2507.18071",
    )
    aggregation: str = config_field(
        "token_mean",
        help="How per-action losses become one scalar: token_mean, seq_mean_token_mean, seq_mean_token_sum, "
        "seq_mean_token_sum_norm (Dr.GRPO). Denominators span the whole optimizer step (docs/algorithms.md).",
        ref="DAPO §3.3 (token_mean); Dr.GRPO arXiv:2503.20783 (seq_mean_token_sum_norm)",
    )
    max_actions: int | None = config_field(
        None, minimum=1,
        help="Dr.GRPO's constant for seq_mean_token_sum_norm (the generation budget). Null: the plugin's budget, "
        "else the widest action axis of the step.",
    )
    kl_coef: float = config_field(
        0.0, minimum=0.0,
        help="β, weight of the KL-to-reference term in the loss (0 skips the reference forward).",
        ref="GRPO: 0.04; Flow-GRPO: 0.04 GenEval, 0.01 PickScore; DAPO: 0",
    )
    kl_estimator: str = config_field(
        "k3", help="KL estimator when the plugin returns log-probs: k1, k2 or k3 per action, or k2_seq, k2 of the "
        "sequence log-ratio (ESPO; the plugin's columns must sum to the sequence's log-prob).",
    )
    kl_importance_weighted: bool = config_field(
        False,
        help="Multiply each action's KL estimate by its token importance ratio pi/pi_old, with its gradient: samples "
        "of the old policy then estimate each state's KL(pi || pi_ref) without bias off-policy, and the gradient is "
        "the exact one on-policy (whatever the policy loss's ratio level; TRL uses a sequence-level loss's geometric "
        "mean there, which is no importance weight). Needs kl_coef > 0 and a KL estimated from the reference's "
        "log-probs (k1, k2 or k3; not a plugin's own KL).",
        ref="DeepSeek-V3.2 arXiv:2512.02556 ('Unbiased KL Estimate'); TRL use_bias_correction_kl",
    )
    ref_sync_every: int = config_field(
        0, minimum=0,
        help="Move the KL reference toward the policy every this many optimizer steps, ref <- mix*policy + "
        "(1 - mix)*ref (0: the reference stays the initial policy). Needs kl_coef > 0 and a plugin that keeps a "
        "separate reference model (full fine-tuning; with LoRA the reference is the base weights).",
        ref="TR-DPO arXiv:2404.09656 (tau); TRL sync_ref_model / ref_model_sync_steps: 512; DiffuCoder: 64",
    )
    ref_sync_mix: float = config_field(
        0.6, minimum=0.0, maximum=1.0, exclusive_minimum=True,
        help="The policy's share in each reference update (1: the reference becomes a copy of the policy).",
        ref="TR-DPO alpha; TRL ref_model_mixup_alpha: 0.6",
    )
    mask_truncated: bool = config_field(
        False, help="Leave the samples that ran out of the generation budget (rollout.truncated: no end-of-sequence "
        "token) out of the loss; their rewards still enter their group's advantages.",
        ref="DAPO arXiv:2503.14476 sec. 3.4 overlong filtering; TRL mask_truncated_completions",
    )
    top_entropy_quantile: float = config_field(
        1.0, minimum=0.0, maximum=1.0,
        help="rho: the policy term trains only the actions whose entropy is in the top rho of each micro-batch's "
        "active actions (over all processes); the KL term keeps every action, the entropy bonus the same ones. 1: "
        "every action. Needs a plugin that reports per-action entropy; not with action_chunk_size.",
        ref="Beyond the 80/20 Rule arXiv:2506.01939: 0.2; TRL top_entropy_quantile",
    )
    off_policy_mask_threshold: float | None = config_field(
        None, minimum=0.0,
        help="delta: leave out of the policy term the samples whose advantage is negative and whose mean "
        "log(pi_old/pi) over their actions exceeds delta (off-policy sequence masking); the KL term and the entropy "
        "bonus keep them, the denominators still count them. Null: off. Not with action_chunk_size.",
        ref="DeepSeek-V3.2 arXiv:2512.02556 eq. 9; TRL off_policy_mask_threshold (e.g. 0.5)",
    )
    entropy_coef: float = config_field(
        0.0, minimum=0.0,
        help="Weight of an entropy bonus (subtracted from the loss); needs a plugin that reports entropy. With "
        "entropy_target set: the initial coefficient of adaptive entropy control.",
    )
    entropy_target: float | None = config_field(
        None,
        help="Adaptive entropy control: after each optimizer step the coefficient moves by entropy_coef_delta, up when "
        "that step's mean entropy over the trained actions (all processes) is <= this target, down otherwise, within "
        "[entropy_coef_min, entropy_coef_max]; the bonus applies only while the previous step's entropy is <= the "
        "target (none on the first step). Nats per action (any finite value: a continuous policy's entropy can be "
        "negative); needs a plugin that reports entropy. Null: entropy_coef is a fixed weight.",
        ref="Skywork-OR1 arXiv:2505.22312 (adaptive entropy control: target 0.2); TRL entropy_target, "
        "use_adaptive_entropy (trl f2cd577 grpo_trainer.py L3174-3210)",
    )
    entropy_coef_delta: float = config_field(
        0.005, minimum=0.0, exclusive_minimum=True,
        help="Step of the adaptive entropy coefficient per optimizer step (needs entropy_target).",
        ref="TRL entropy_coef_delta: 0.005; Skywork-OR1 7B/32B scripts: 0.0001",
    )
    entropy_coef_min: float = config_field(
        0.0, minimum=0.0, help="Lower bound of the adaptive entropy coefficient (needs entropy_target).",
        ref="TRL entropy_coef_min: 0.0; Skywork-OR1: 0",
    )
    entropy_coef_max: float = config_field(
        1.0, minimum=0.0, help="Upper bound of the adaptive entropy coefficient (needs entropy_target).",
        ref="TRL entropy_coef_max: 1.0; Skywork-OR1 scripts: 0.005",
    )
    inner_epochs: int = config_field(
        1, minimum=1,
        help="μ, passes over each rollout batch. After the first the data is off-policy and clipping acts.",
        ref="GRPO μ; TRL num_iterations",
    )
    minibatches: int = config_field(
        1, minimum=1, help="Optimizer steps per inner epoch; each process splits its samples into this many parts."
    )
    micro_batch_size: int = config_field(
        8, minimum=1, help="Samples per forward/backward on one process (gradient accumulation fills the mini-batch)."
    )
    action_chunk_size: int | None = config_field(
        None, minimum=1,
        help="Back-propagate this many action columns at a time (Flow-GRPO: 1 denoising step) to bound activation "
        "memory; needs a plugin that supports action chunks and the token ratio level. Null: all actions at once.",
        ref="Flow-GRPO, arXiv:2505.05470 (one backward per timestep)",
    )
    recompute_old_logp: bool = config_field(
        False,
        help="Recompute old log-probs with the training forward before the first inner epoch, for plugins whose "
        "sampling path computes log-probs differently. With one inner epoch and one mini-batch nothing is recomputed: "
        "the training forward itself is then the old policy (ratio exactly 1).",
    )

    def validate(self, path: str) -> None:
        from mmrl.algos import aggregation_modes, kl_estimators

        for key, registry in (("aggregation", aggregation_modes), ("kl_estimator", kl_estimators)):
            value = getattr(self, key)
            if value not in registry:
                raise ConfigError(f"{path}.{key}", value, f"one of {', '.join(registry.names())}")
        if self.top_entropy_quantile < 1 and self.action_chunk_size is not None:
            raise ConfigError(f"{path}.top_entropy_quantile", self.top_entropy_quantile,
                              f"1 with {path}.action_chunk_size set (the entropy threshold spans a whole micro-batch; "
                              "chunks see a few of its actions at a time), or action_chunk_size: null")
        if self.off_policy_mask_threshold is not None and self.action_chunk_size is not None:
            raise ConfigError(f"{path}.off_policy_mask_threshold", self.off_policy_mask_threshold,
                              f"null with {path}.action_chunk_size set (the mask needs a whole sequence's mean "
                              "log-ratio; chunks see a few of its actions at a time), or action_chunk_size: null")
        if self.kl_estimator == "k2_seq" and self.action_chunk_size is not None:
            raise ConfigError(f"{path}.kl_estimator", self.kl_estimator,
                              f"k1, k2 or k3 with {path}.action_chunk_size set (k2_seq squares the sum of a whole "
                              "sequence's columns; chunks see a few of them at a time), or action_chunk_size: null")
        if self.kl_importance_weighted and self.kl_coef == 0:
            raise ConfigError(f"{path}.kl_importance_weighted", self.kl_importance_weighted,
                              f"false while {path}.kl_coef is 0 (there is no KL term to weight; set kl_coef > 0)")
        if self.kl_importance_weighted and self.kl_estimator == "k2_seq":
            raise ConfigError(f"{path}.kl_importance_weighted", self.kl_importance_weighted,
                              f"false with {path}.kl_estimator k2_seq (a sequence's KL spread over its columns has "
                              "no per-action ratio to weight it by), or kl_estimator k1, k2 or k3")
        self._validate_entropy_control(path)
        if self.ref_sync_every and self.kl_coef == 0:
            raise ConfigError(f"{path}.ref_sync_every", self.ref_sync_every,
                              f"0 while {path}.kl_coef is 0 (the reference is used by the KL term only; set kl_coef "
                              "> 0 to sync it)")

    def _validate_entropy_control(self, path: str) -> None:
        """The adaptive entropy options: bounds in order, the initial coefficient inside them, and no bound or step set
        without a target (they would do nothing)."""
        names = ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
        if self.entropy_target is None:
            for name in names:
                value, default = getattr(self, name), AlgorithmConfig.__dataclass_fields__[name].default
                if value != default:
                    raise ConfigError(f"{path}.{name}", value,
                                      f"{default} while {path}.entropy_target is null (the coefficient is fixed), or "
                                      "set entropy_target for adaptive entropy control")
            return
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ConfigError(f"{path}.entropy_coef_min", self.entropy_coef_min,
                              f"a number <= {path}.entropy_coef_max ({self.entropy_coef_max})")
        if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ConfigError(f"{path}.entropy_coef", self.entropy_coef,
                              f"a number in [{path}.entropy_coef_min, {path}.entropy_coef_max] = "
                              f"[{self.entropy_coef_min}, {self.entropy_coef_max}] with entropy_target set (the "
                              "initial adaptive coefficient)")

    def refuse_entropy_readers(self, without: str) -> None:
        """For a plugin (or a plugin setting) that reports no per-action entropy: refuse, in one line, each option that
        reads it (``top_entropy_quantile`` < 1 selects by it, ``entropy_target`` steers by it, ``entropy_coef`` > 0
        rewards it), which would otherwise fail only at the first training forward or, for a fixed bonus, do nothing.
        ``without`` completes "<the option's off value> with ...", e.g. ``"plugin flow (it reports no per-step
        entropy)"``."""
        for key, off, reads in (("top_entropy_quantile", "1", self.top_entropy_quantile < 1),
                                ("entropy_target", "null", self.entropy_target is not None),
                                ("entropy_coef", "0", self.entropy_coef > 0)):
            if reads:
                raise ConfigError(f"algorithm.{key}", getattr(self, key), f"{off} with {without}")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = config_field(1e-5, minimum=0.0, exclusive_minimum=True, help="Peak learning rate.",
                             ref="Flow-GRPO LoRA: 3e-4; TRL: 1e-6")
    betas: list[float] = config_field(default_factory=lambda: [0.9, 0.999], help="AdamW betas.")
    weight_decay: float = config_field(0.0, minimum=0.0, help="AdamW decoupled weight decay.")
    eps: float = config_field(1e-8, minimum=0.0, exclusive_minimum=True, help="AdamW epsilon.")
    max_grad_norm: float | None = config_field(
        1.0, minimum=0.0, exclusive_minimum=True, help="Clip the global gradient norm to this value; null disables."
    )
    scheduler: Literal["constant", "linear", "cosine"] = config_field(
        "constant", help="Learning-rate decay after warmup, over all optimizer steps of the run."
    )
    warmup_steps: int = config_field(0, minimum=0, help="Linear warmup, in optimizer steps.")

    def validate(self, path: str) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"{path}.betas", self.betas, "two numbers in [0, 1)")


@dataclass
class EMAConfig:
    """Exponential moving average of the trainable weights (Flow-GRPO keeps one for eval and saving)."""

    enabled: bool = config_field(False, help="Keep an EMA of the trainable weights.")
    decay: float = config_field(0.9, minimum=0.0, maximum=1.0, help="EMA decay.", ref="Flow-GRPO: 0.9")
    update_every: int = config_field(8, minimum=1, help="Update the EMA every this many optimizer steps.",
                                     ref="Flow-GRPO: 8")
    use_for_eval: bool = config_field(True, eval_only=True, help="Evaluate with the EMA weights swapped in.")


@dataclass
class EvalConfig:
    """Periodic evaluation on the plugin's held-out split."""

    every: int = config_field(0, minimum=0, help="Evaluate every this many steps (0: only at the start and the end).")
    at_start: bool = config_field(True, help="Evaluate before the first step, to measure improvement.")
    num_prompts: int | None = config_field(None, minimum=1, help="Held-out prompts to use (null: all).")
    samples_per_prompt: int = config_field(1, minimum=1, help="Samples per held-out prompt.")
    save_samples: bool = config_field(True, help="Write the evaluation samples to the run folder.")
    rewards: list[RewardSpec] | None = config_field(
        None, help="The rewards that score the held-out evaluation, as rewards.functions (null: the training "
        "rewards). Lets a run train on a shaped reward and report the metric it is judged by; rewards.on_nonfinite "
        "and the scoring workers apply to both.",
    )

    def validate(self, path: str) -> None:
        if self.rewards is not None and not self.rewards:
            raise ConfigError(f"{path}.rewards", [], "null (the training rewards) or at least one reward")


@dataclass
class RewardSpec:
    """One reward function, its weight and its options."""

    name: str = config_field(help="A reward registered in mmrl.rewards.reward_functions (`mmrl list`).")
    weight: float = config_field(1.0, help="Weight of this reward in the combined reward.")
    args: dict[str, Any] = config_field(default_factory=dict, help="Options passed to the reward's constructor.")

    def validate(self, path: str) -> None:
        from mmrl.rewards import reward_functions

        try:
            entry = reward_functions.get(self.name)
        except RegistryError:
            raise ConfigError(f"{path}.name", self.name, f"one of {', '.join(reward_functions.names())}") from None
        self.args = bind_options(entry, self.args, f"{path}.args", f"reward {self.name!r}")


@dataclass
class RewardsConfig:
    """Which rewards score the samples and how they combine."""

    functions: list[RewardSpec] = config_field(default_factory=list, help="The reward functions (at least one).")
    multi_reward: Literal["sum_then_normalize", "normalize_then_sum"] = config_field(
        "sum_then_normalize",
        help="With several rewards: weight-then-normalise, or normalise each reward then weight and whiten (GDPO).",
        ref="GDPO, arXiv:2601.05242",
    )
    on_nonfinite: Literal["error", "skip"] = config_field(
        "error", help="A NaN or infinite score stops the run naming the reward ('error'), or drops the sample ('skip')."
    )
    async_scoring: bool = config_field(
        False, help="Score each rollout chunk in a worker pool while the next chunk is sampled; the scores are "
        "identical to synchronous scoring.", ref="Flow-GRPO (ThreadPoolExecutor for reward calls)",
    )
    num_workers: int = config_field(
        2, minimum=1, help="Worker threads for asynchronous scoring (rewards must be thread-safe when > 1)."
    )

    def validate(self, path: str) -> None:
        if not self.functions:
            raise ConfigError(f"{path}.functions", [], "at least one reward, e.g. [{name: token_accuracy}]")


@dataclass
class PluginSpec:
    """The plugin section: ``name`` plus the plugin's own options, validated by its ``config_class``."""

    name: str
    config: Any

    @classmethod
    def from_config_value(cls, value: Any, key: str) -> PluginSpec:
        from mmrl.plugin import plugin_registry

        if isinstance(value, PluginSpec):
            return value
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict) or "name" not in value:
            raise ConfigError(key, value, f"a mapping with 'name' (one of {', '.join(plugin_registry.names())})")
        try:
            plugin_class = plugin_registry.get(value["name"])
        except RegistryError:
            raise ConfigError(f"{key}.name", value["name"], f"one of {', '.join(plugin_registry.names())}") from None
        options = {k: v for k, v in value.items() if k != "name"}
        return cls(value["name"], from_dict(plugin_class.config_class, options, key))

    def to_dict(self) -> dict[str, Any]:
        from mmrl.config.schema import to_dict

        return {"name": self.name, **to_dict(self.config)}

    def eval_only_keys(self, prefix: str) -> list[str]:
        """The plugin's evaluation-only keys, under this section's flat layout (``plugin.eval_dataset``)."""
        from mmrl.config.schema import eval_only_keys

        return eval_only_keys(self.config, prefix)


@dataclass
class TrainConfig:
    """A whole training run."""

    plugin: PluginSpec = config_field(help="The modality plugin: {name: ..., <the plugin's options>}.")
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self, path: str) -> None:
        """Cross-section checks, after every section validated on its own: what the plugin refuses
        (:meth:`mmrl.plugin.Plugin.check_config`), in the one-line form of every config error."""
        from mmrl.plugin import plugin_registry

        plugin_registry.get(self.plugin.name).check_config(self)
