"""The ``plugin.credit`` section of the flow plugin: which credit-assignment strategy a rollout follows.

Each strategy has its own sub-section (read only when that strategy is selected); the options that apply to every
strategy sit at the top level. Cross-checks against the rest of the plugin config (the number of steps, the SDE)
happen in :meth:`FlowPluginConfig.validate`, which asks the strategy (:meth:`CreditStrategy.validate`). docs/credit.md
has the formulas and the papers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mmrl.config import ConfigError, config_field


@dataclass
class ChunkCreditConfig:
    """``credit.chunk``: Chunk-GRPO (Luo et al. 2025, arXiv:2510.21583)."""

    sizes: list[int] | None = config_field(
        None, help="Fixed chunk sizes over the trained steps, high noise first; they must add up to the number of "
        "trained steps. Null: boundaries from the relative L1 change of the latents (num_chunks chunks of equal "
        "change).", ref="GCPO code (xingzhejun/GCPO, released for arXiv:2510.21583): [2, 3, 4, 7] for 17 steps",
    )
    num_chunks: int = config_field(
        4, minimum=1, help="Chunks per sample when sizes is null (at most this many; empty chunks are dropped).",
    )
    sample: Literal["all", "weighted", "uniform"] = config_field(
        "all", help="Train every chunk ('all'), or a subset per sample drawn without replacement with probabilities "
        "proportional to the chunk's mean relative L1 change ('weighted', Chunk-GRPO's optional weighted sampling) "
        "or uniformly ('uniform').", ref="Chunk-GRPO §weighted sampling",
    )
    sample_fraction: float = config_field(
        0.5, minimum=0.0, exclusive_minimum=True, maximum=1.0,
        help="Fraction of a sample's chunks that are trained when sample is not 'all' (at least one).",
        ref="GCPO code: timestep_fraction 0.5",
    )
    weights: Literal["l1", "softmax"] = config_field(
        "l1", help="How chunk dynamics become sampling probabilities: divided by their sum ('l1') or a softmax.",
        ref="GCPO code: sample_weight_method normalized",
    )
    weighting: Literal["step", "chunk_mean"] = config_field(
        "step", help="How chunks enter the loss: 'step', every trained step counts once (a chunk in proportion to "
        "its size; on policy the gradient is Flow-GRPO's); 'chunk_mean', each chunk's loss counts once, divided by "
        "the sample's number of trained chunks (a step of chunk c weighs 1/(C·|c|): short chunks weigh more).",
        ref="GCPO code (xingzhejun/GCPO, the code released for arXiv:2510.21583): loss = policy_loss / "
        "(gradient_accumulation_steps * train_chunks), train_grpo_flux_clip.py:775-777",
    )

    def validate(self, path: str) -> None:
        if self.sizes is not None and (not self.sizes or any(size < 1 for size in self.sizes)):
            raise ConfigError(f"{path}.sizes", self.sizes, "null or a non-empty list of positive integers")


@dataclass
class BranchCreditConfig:
    """``credit.branch``: TempFlow-GRPO's trajectory branching (He et al. 2025, arXiv:2508.04324)."""

    points: list[int] | None = config_field(
        None, help="Branch steps. Null (the default): every step 0..num_steps-2, TempFlow-GRPO's released method: "
        "the group follows one ODE trunk, at every step K = G/(num_steps-1) samples leave it with one SDE step and "
        "finish by the ODE, each trains its own branch step with the advantage of its step's samples. A list: only "
        "these steps branch (designated branch points, G/len(points) samples each); cheaper per group, and the "
        "credit goes only where the list says.",
        ref="TempFlow-GRPO code (Shredded-Pork/TempFlow-GRPO e66824e, sd3_pipeline_with_logprob_perstep.py): a "
        "branch at every step but the last, 6 per step (sd3_sde_with_logprob_perstep.py num_samples = 6)",
    )

    def validate(self, path: str) -> None:
        points = self.points
        if points is not None and (not points or sorted(set(points)) != list(points) or min(points) < 0):
            raise ConfigError(f"{path}.points", points, "null or a non-empty, increasing list of distinct steps >= 0")


@dataclass
class SlidingWindowCreditConfig:
    """``credit.sliding_window``: MixGRPO's moving SDE window (Li et al. 2025, arXiv:2507.21802)."""

    size: int = config_field(4, minimum=1, help="SDE (and trained) steps in the window.", ref="MixGRPO: 4")
    shift_every: int | None = config_field(
        25, minimum=1, help="Training steps before the window moves on by stride. Null: spread the sweep over "
        "run.max_steps, so the window crosses window_range once.", ref="MixGRPO iters_per_group: 25 (Flash: 20)",
    )
    stride: int = config_field(1, minimum=1, help="Steps the window moves each time.",
                               ref="MixGRPO prog_overlap_step: 1")
    window_range: list[int] | None = config_field(
        None, help="[lo, hi): the window lies within steps lo..hi-1, hi <= num_steps-1 (the last step is never "
        "trained). Null: [0, num_steps-2), MixGRPO's range.",
        ref="MixGRPO train_grpo_flux.py: max_timesteps = sampling_steps - 2",
    )
    schedule: Literal["progressive", "random"] = config_field(
        "progressive", help="'progressive': start at lo and move on every shift_every steps; 'random': a start drawn "
        "per training step from (run seed, step).", ref="MixGRPO sample_strategy",
    )
    roll_back: bool = config_field(
        True, help="Start again at lo after the last window position (false: stay at the last position).",
        ref="MixGRPO roll_back",
    )
    solver: Literal["euler", "dpm2m"] = config_field(
        "euler", help="ODE solver after the window: Euler, or DPM-Solver++(2M) (MixGRPO-Flash's higher-order solver).",
        ref="MixGRPO-Flash",
    )
    solver_steps: float = config_field(
        1.0, minimum=0.0, exclusive_minimum=True, maximum=1.0,
        help="Fraction of the steps after the window that the solver takes (on a subset of the sigma grid).",
        ref="MixGRPO-Flash: 0.4",
    )

    def validate(self, path: str) -> None:
        if self.window_range is not None and len(self.window_range) != 2:
            raise ConfigError(f"{path}.window_range", self.window_range, "null or two integers [lo, hi]")


@dataclass
class TreeCreditConfig:
    """``credit.tree``: BranchGRPO's branching tree (Li et al. 2025, arXiv:2509.06040)."""

    split_points: list[int] = config_field(
        default_factory=lambda: [0, 3, 6, 9],
        help="Steps at which every node splits into `branching` children; G = branching^len(split_points) leaves "
        "per group, one sample each.", ref="BranchGRPO: (0, 3, 6, 9) over 20 steps, 16 leaves",
    )
    branching: int = config_field(2, minimum=2, help="Children per split (k).", ref="BranchGRPO: 2")
    sde_steps: Literal["all", "splits"] = config_field(
        "all", help="'all': every step is an SDE step and every edge from the first split on is trained "
        "(BranchGRPO); 'splits': SDE only at the split steps, ODE elsewhere, only split edges trained.",
    )
    width_pruning: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True, maximum=1.0,
        help="Keep this fraction of the edges after the last split for the backward: the leaves with the best and "
        "the worst rewards, half each (at least 2). Advantages are still computed on all nodes. Null: no pruning.",
        ref="BranchGRPO width pruning (mode 2)",
    )

    def validate(self, path: str) -> None:
        points = self.split_points
        if not points or sorted(set(points)) != list(points) or min(points) < 0:
            raise ConfigError(f"{path}.split_points", points, "a non-empty, increasing list of distinct steps >= 0")


@dataclass
class CreditConfig:
    """``plugin.credit``: how the reward is credited to denoising steps (docs/credit.md)."""

    strategy: str = config_field(
        "step", help="'step' (Flow-GRPO: every trained step gets the sample's advantage; plugin.train_steps picks "
        "the steps), 'chunk' (Chunk-GRPO), 'branch' (TempFlow-GRPO), 'sliding_window' (MixGRPO) or 'tree' "
        "(BranchGRPO), or another registered strategy.",
        ref="Flow-GRPO arXiv:2505.05470; Chunk-GRPO arXiv:2510.21583; TempFlow-GRPO arXiv:2508.04324; MixGRPO "
        "arXiv:2507.21802; BranchGRPO arXiv:2509.06040",
    )
    noise_weighting: bool = config_field(
        False, help="Weight each trained step's policy loss (not the KL) by its transition std, normalised to mean 1 "
        "over the steps 0..S-2 (TempFlow-GRPO's noise-aware weighting).", ref="TempFlow-GRPO arXiv:2508.04324",
    )
    ratio_norm: bool = config_field(
        False, help="GRPO-Guard's RatioNorm: log r' = s·(log r + mean((mu_new - mu_old)^2)/(2 s^2)) with s the "
        "transition std, which removes the ratio's negative bias (exactly 1 on policy).",
        ref="GRPO-Guard arXiv:2510.22319",
    )
    ratio_norm_reweight: bool = config_field(
        False, help="GRPO-Guard's gradient reweighting: multiply each step's policy loss (not the KL) by 1/Δσ "
        "(normalised to mean 1 over the steps 0..S-2).", ref="GRPO-Guard arXiv:2510.22319",
    )
    chunk: ChunkCreditConfig = field(default_factory=ChunkCreditConfig)
    branch: BranchCreditConfig = field(default_factory=BranchCreditConfig)
    sliding_window: SlidingWindowCreditConfig = field(default_factory=SlidingWindowCreditConfig)
    tree: TreeCreditConfig = field(default_factory=TreeCreditConfig)

    def validate(self, path: str) -> None:
        from mmrl.plugins.flow.credit import credit_strategies

        if self.strategy not in credit_strategies:
            raise ConfigError(f"{path}.strategy", self.strategy, f"one of {', '.join(credit_strategies.names())}")
