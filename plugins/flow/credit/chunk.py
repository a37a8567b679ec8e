r"""``credit.strategy: chunk`` — Chunk-GRPO: sample by step, optimise by chunk.

Luo et al. 2025, "Sample By Step, Optimize By Chunk: Chunk-Level GRPO for Text-to-Image Generation",
arXiv:2510.21583. Consecutive trained steps are grouped into chunks and the importance ratio is taken per chunk, as
the geometric mean of the step ratios (GSPO-style):

    r_c = exp( (1/|c|) Σ_{t ∈ c} (log π_θ(x_{t+1}|x_t) − log π_old(x_{t+1}|x_t)) ),

clipped per chunk, and every step of the chunk carries r_c with the sample's advantage. That is the core's
``ratio_level: chunk`` (:mod:`mmrl.algos.ratios`): this strategy provides ``rollout.chunk_ids`` and the recipe sets
``algorithm.policy_loss.ratio_level: chunk`` (and ``action_chunk_size: null``, since a chunk ratio needs all its
steps in one forward; :meth:`ChunkCredit.forward_check` refuses the per-column forward that action_chunk_size asks
for).

Chunk boundaries (``credit.chunk``):

- ``sizes: [n_1, n_2, ...]``: fixed chunks over the trained steps, high noise first (the paper's setting, chosen
  offline from the latents' temporal dynamics, which it finds prompt-invariant);
- ``sizes: null``: from the sample's own dynamics, the relative L1 change of the latents at each trained step,
  d_t = mean|x_{t+1} − x_t| / mean|x_t|. With D_t = Σ_{s ≤ t} d_s and D = D_last, step t goes to chunk
  ⌊K·(D_t − d_t/2)/D⌋ (its midpoint's share of the total change), K = ``num_chunks``: chunks of about equal change.

Weighted chunk sampling (``sample: weighted``, the paper's optional strategy): each sample trains
max(1, ⌊C·sample_fraction⌋) of its C chunks, drawn without replacement with probabilities ∝ the chunk's mean d_t
(``weights: l1``) or softmax(mean d_t) (``weights: softmax``); the other chunks get mask 0 (and are not recomputed).
As in the released code (xingzhejun/GCPO, whose README names the method GCPO and links the same paper,
arXiv:2510.21583), there is no importance correction for the sampling: chunks of high dynamics are trained more
often on purpose.

How the chunks enter the loss (``weighting``):

- ``step`` (the default): every trained step is one action of the core's aggregation, each carrying its chunk's
  clipped ratio, so a chunk counts in proportion to its size; under ``token_mean`` step t of sample n weighs 1/T
  (T the trained steps of the batch's samples). On policy (ratio 1) this is Flow-GRPO's gradient exactly: each step
  of a chunk carries ∂r_c/∂ℓ_t = 1/|c| times |c| actions;
- ``chunk_mean``: each chunk's loss counts once, divided by the number of trained chunks C_n of its sample, as the
  released code does (xingzhejun/GCPO ea6cc4d, ``fastvideo/train_grpo_flux_clip.py``: the chunk log-prob is the
  mean of its steps' log-probs, lines 475 and 638; line 777: ``loss = policy_loss / (gradient_accumulation_steps *
  train_chunks)``).
  A step of chunk c then weighs 1/(C_n·|c|) in its sample: for sizes [2, 3, 4, 7], 0.125, 0.083, 0.0625 and 0.036
  against a flat 0.0625, so short (high-noise) chunks weigh more per step. Implemented as action weights
  T_n/(C_n·|c|) (T_n the sample's trained steps, so a sample's weights average 1 over its steps): the loss is GCPO's
  exactly under ``aggregation: seq_mean_token_mean``, and under ``token_mean`` whenever every sample trains the same
  number of steps (``sample: all``), up to the core's constant normalisation. GCPO's optional per-chunk factor
  √((S − mid)/mid) (``use_reweight``) is not implemented.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError
from mmrl.plugins.flow.credit.base import CreditStrategy
from mmrl.plugins.flow.credit.step import step_plan
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed

if TYPE_CHECKING:
    from mmrl.plugin import PromptBatch
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sampler import FlowSampler

_CHUNK_SAMPLING_TAG = 0xC4C2


def relative_l1(before: Tensor, after: Tensor) -> Tensor:
    """d = mean|after − before| / mean|before| over the latent elements: ``[N, A, *latent]`` → ``[N, A]``."""
    change = (after.float() - before.float()).abs().flatten(2).mean(dim=2)
    scale = before.float().abs().flatten(2).mean(dim=2)
    return change / scale.clamp(min=1e-12)


def chunks_from_sizes(sizes: list[int], num_actions: int) -> Tensor:
    """``[A]`` chunk id of every column for fixed ``sizes`` (they must add up to A)."""
    if sum(sizes) != num_actions:
        raise ValueError(f"chunk sizes {sizes} add up to {sum(sizes)}, not to the {num_actions} trained steps")
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def chunks_from_dynamics(dynamics: Tensor, num_chunks: int) -> Tensor:
    """``[N, A]`` chunk ids from the relative L1 change ``[N, A]``: step t goes to ⌊K·(D_t − d_t/2)/D⌋, then the ids
    are renumbered 0, 1, ... so that no chunk is empty. Rows without change are cut into equal parts."""
    dynamics = dynamics.double().clamp(min=0)
    num_actions = dynamics.shape[1]
    cumulative = dynamics.cumsum(dim=1)
    total = cumulative[:, -1:]
    share = (cumulative - dynamics / 2) / total.clamp(min=1e-300)
    uniform = ((torch.arange(num_actions, dtype=torch.float64) + 0.5) / num_actions).expand_as(share)
    share = torch.where(total > 0, share, uniform)
    raw = (share * num_chunks).floor().clamp(0, num_chunks - 1).long()
    steps = torch.cat([torch.zeros_like(raw[:, :1]), (raw[:, 1:] != raw[:, :-1]).long()], dim=1)
    return steps.cumsum(dim=1)


def chunk_probabilities(dynamics: Tensor, chunk_ids: Tensor, how: str) -> Tensor:
    """``[N, C]`` sampling probabilities of each row's chunks from the mean relative L1 change of the chunk
    (``how``: ``"l1"`` divides by the sum, ``"softmax"`` takes a softmax, ``"uniform"`` is equal); chunks a row does not
    have get probability 0."""
    num_chunks = int(chunk_ids.max()) + 1
    sums = torch.zeros(dynamics.shape[0], num_chunks, dtype=torch.float64).scatter_add(1, chunk_ids, dynamics.double())
    counts = torch.zeros_like(sums).scatter_add(1, chunk_ids, torch.ones_like(dynamics, dtype=torch.float64))
    present = counts > 0
    means = sums / counts.clamp(min=1)
    if how == "uniform":
        scores = present.double()
    elif how == "softmax":
        scores = torch.where(present, (means - means.max(dim=1, keepdim=True).values).exp(), torch.zeros_like(means))
    elif how == "l1":
        scores = torch.where(present, means + 1e-8, torch.zeros_like(means))
    else:
        raise ValueError(f"unknown chunk weighting {how!r}")
    return scores / scores.sum(dim=1, keepdim=True)


def chunk_mean_weights(chunk_ids: Tensor, mask: Tensor) -> Tensor:
    """GCPO's chunk-mean weighting as action weights ``[N, A]``: T_n/(C_n·|c|) on the trained steps of chunk c of
    sample n (T_n trained steps and C_n trained chunks of the sample), 1 on the others (they do not enter the loss).

    Args:
        chunk_ids: ``[N, A]`` chunk id of every step (consecutive ids from 0 per row).
        mask: ``[N, A]`` 1 on the trained steps (whole chunks).
    """
    active = (mask > 0).to(torch.float64)  # [N, A]
    num_chunks = int(chunk_ids.max()) + 1
    ids = chunk_ids.long().cpu()
    sizes = torch.zeros(ids.shape[0], num_chunks, dtype=torch.float64).scatter_add(1, ids, active.cpu())  # [N, C]
    trained_steps = sizes.sum(dim=1, keepdim=True)  # [N, 1] T_n
    trained_chunks = (sizes > 0).sum(dim=1, keepdim=True).to(torch.float64)  # [N, 1] C_n
    size = sizes.gather(1, ids)  # [N, A] |c| of every step's chunk
    weights = trained_steps / (trained_chunks * size).clamp(min=1.0)
    return torch.where(active.cpu() > 0, weights, torch.ones_like(weights)).to(torch.float32)


def sample_chunk_mask(chunk_ids: Tensor, probabilities: Tensor, fraction: float, seeds: Tensor) -> Tensor:
    """``[N, A]`` float mask: per row, max(1, ⌊C·fraction⌋) of its C chunks drawn without replacement from
    ``probabilities [N, C]`` with the row's seed."""
    mask = torch.zeros(chunk_ids.shape, dtype=torch.float32)
    for row in range(chunk_ids.shape[0]):
        present = int((probabilities[row] > 0).sum())
        count = max(1, int(present * fraction))
        generator = torch.Generator().manual_seed(derive_seed(int(seeds[row]), _CHUNK_SAMPLING_TAG))
        chosen = torch.multinomial(probabilities[row].float(), count, replacement=False, generator=generator)
        mask[row] = torch.isin(chunk_ids[row], chosen).float()
    return mask


class ChunkCredit(CreditStrategy):
    """Chunk-GRPO: chunk ids for the core's chunk ratio level, optional weighted chunk sampling."""

    name = "chunk"
    uses_step_selection = True

    def validate(self, config: FlowPluginConfig, path: str) -> None:
        if config.train_steps == "random":
            raise ConfigError(f"{path}.strategy", "chunk", "a contiguous step selection: plugin.train_steps "
                              "'fraction' or 'window' (chunks are runs of consecutive steps)")
        sizes = config.credit.chunk.sizes
        count = config.step_selection_count()
        if sizes is not None and sum(sizes) != count:
            raise ConfigError(f"{path}.chunk.sizes", sizes, f"sizes adding up to the {count} trained steps")

    def num_actions(self, config: FlowPluginConfig) -> int:
        return config.step_selection_count()

    def sample(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        level = sampler.runtime.ratio_level
        if level is not None and level != "chunk":
            raise ConfigError("algorithm.policy_loss.ratio_level", level,
                              "'chunk' with plugin.credit.strategy 'chunk' (one importance ratio per chunk)")
        options = self.credit.chunk
        rollout = sampler.chain_rollout(policy, batch, step_plan(self.config, batch, sampler.runtime.seed))
        dynamics = relative_l1(rollout.replay["latents"], rollout.replay["next_latents"]).cpu()  # [N, A]
        if options.sizes is not None:
            chunk_ids = chunks_from_sizes(list(options.sizes), rollout.num_actions).expand_as(dynamics).clone()
        else:
            chunk_ids = chunks_from_dynamics(dynamics, options.num_chunks)
        device = rollout.old_logp.device
        rollout.chunk_ids = chunk_ids.to(device)
        if options.sample != "all":
            how = "uniform" if options.sample == "uniform" else options.weights
            probabilities = chunk_probabilities(dynamics, chunk_ids, how)
            rollout.mask = sample_chunk_mask(chunk_ids, probabilities, options.sample_fraction, batch.seeds).to(
                rollout.mask)
        if options.weighting == "chunk_mean":
            weights = chunk_mean_weights(chunk_ids, rollout.mask.cpu()).to(rollout.mask)
            rollout.action_weights = weights if rollout.action_weights is None else rollout.action_weights * weights
        rollout.metrics["chunks_per_sample"] = float((chunk_ids.max(dim=1).values + 1).float().mean())
        return rollout

    def forward_check(self, actions: Tensor | None) -> None:
        if actions is not None:
            raise RolloutError(
                "flow credit strategy 'chunk' takes one importance ratio per chunk "
                "(algorithm.policy_loss.ratio_level: chunk), which needs every step of a sample in one forward: set "
                "algorithm.action_chunk_size: null"
            )
