"""The dLLM plugin: group-relative RL for diffusion language models: masked ones (LLaDA, Dream, tiny masked LMs) and
canvas models (DiffusionGemma, :mod:`mmrl.plugins.dllm.canvas`).

How it maps onto the rollout contract (docs/dllm.md has the long version):

- **Actions.** ``objective: grpo``: one action per completion position (``A = G``, mask = the real tokens, up to and
  including the first EOS). With ``one_step`` each column holds the token's own log-prob under the one-step forward
  (with ``trace``, under its step group's row of the decoding trajectory, TraceRL),
  so the core's clipped ratio, clipping and KL act per token as in d1 (``diffu_grpo_trainer.py`` L114-121 at
  dllm-reasoning/d1@837888f); with the ELBO estimators (and ``spg_upper``) every real column holds ``ELBO / L``, so
  each token's ratio is the sequence ratio ``exp((ELBO_θ − ELBO_old) / L)`` whatever ``ratio_level`` says. In both
  cases the columns sum to the sequence estimate and ``algorithm.aggregation`` sets the length weighting
  (``token_mean``: each sequence's gradient is ``A·∇ELBO / T``, T the step's tokens, as d1; ``seq_mean_token_mean``:
  ``A·∇ELBO / (S·L)``; ``seq_mean_token_sum_norm``: Dr. GRPO's ``A·∇ELBO / (S·G)``). ``objective: wd1``: ``A = 1``,
  the sequence estimate; ``objective: spg``: ``A = 2`` (column 0 the ELBO, column 1 the EUBO); divided by the
  length with ``normalize_by_length``. The rollout's ``old_logp`` is None: when the run needs the sampling policy's
  estimates (μ > 1 or several mini-batches) the core scores them with :meth:`DLLMPlugin.forward` before the first
  update, on every epoch's plan (:attr:`DLLMPlugin.redraws_per_epoch`), but for the first mini-batch of epoch 0,
  which trains on the sampling weights; otherwise (and for that mini-batch) it uses the detached training estimate,
  the same loss and gradient.
- **The mask plans travel with the sample.** At rollout time each sample draws its masks, timesteps and weights
  (a :class:`~mmrl.plugins.dllm.masking.MaskPlan`) from a generator seeded by its own sample seed: one plan per
  inner epoch (``redraw_masks``, the default, when μ > 1 and the plan is random), as d1, wd1 and SPG draw a new mask
  seed for every inner iteration (``mask_seeds = torch.randint(0, 2**12, (num_iterations,))``,
  ``diffu_grpo_trainer.py`` L449-451 at dllm-reasoning/d1@837888f); d1 credits the fresh prompt masks with a
  regularising effect. The plans' tensors are stored per sample in ``replay`` (``[N, E, draws, L]``), so that the
  trainer can split them by sample. The reference is scored on every plan at rollout time
  (``replay["epoch_ref_logp"]``, ``[N, E, A]``; d1 does the same). The learner calls
  :meth:`DLLMPlugin.start_inner_epoch` before each epoch, and before its old-policy pass on that epoch's plan;
  :meth:`DLLMPlugin.forward` rebuilds plan ``e`` of whatever samples a micro-batch holds, scores the current policy
  with it and returns π_ref on that plan (``PolicyOutput.ref_logp``), and the core's old-policy pass scored π_old on
  the same plan: within an epoch the ratio and the KL compare the policies on one draw
  (the ratio is exactly 1 on the first inner step, and ``est_θ − est_ref`` has the variance of a difference of
  antithetic estimates, VRPO, arXiv:2505.19223), while the gradient averages over E draws in the step. With
  ``redraw_masks: false`` one plan serves every epoch (one scoring pass). A new step draws new plans (new seeds).
- **The reference** is the policy with its LoRA adapter disabled, or a frozen copy of the initial weights for full
  fine-tuning, kept only when ``Runtime.needs_reference``. Its estimates use the same plans and are computed at
  rollout time (``Rollout.ref_logp`` for plan 0, ``replay["epoch_ref_logp"]`` for every plan).
- **Canvas models** (adapter ``noise = "uniform"``: DiffusionGemma) replace the two model-specific pieces and keep
  the rest: rollouts run the model's own canvas sampler (:func:`~mmrl.plugins.dllm.canvas.canvas_generate`), and the
  plans are uniform-noise plans (``plan_masked`` the corrupted positions, ``plan_tokens`` their random tokens,
  ``plan_self_conditioning`` the self-conditioning coins) scored by ``uniform_one_step``
  (:meth:`DLLMPlugin.score_canvas`), one per inner epoch, shared by π_θ, π_old and π_ref as above.
- **The trace estimator** (TraceRL, arXiv:2509.06949) draws nothing: :meth:`DLLMPlugin.score` rebuilds its rows from
  ``replay["step_map"]`` (:func:`~mmrl.plugins.dllm.masking.trace_plan`) on every pass, so π_θ, π_old and π_ref see
  the same rows, one plan serves every inner epoch and no plan tensors are stored.
- ``payload["completions"]`` holds the decoded text (up to, not including, the first EOS). ``replay`` also holds
  the completion ids as sampled, the completion mask (tokens up to and including the first EOS; the tail after it is
  masked in every scoring forward, as d1 and SPG do), ``prompt_width`` and the ``step_map`` of the decoder.
- **UniGRPO's random masking** (``estimator: random_masking``, dLLM-RL's ``random_masking``/``coupled`` methods) is
  per token as ``one_step``: each column is the token's log-prob averaged over the draws that mask it, and the
  rollout's action mask keeps only the real tokens that some draw of the sample's plans masks (dLLM-RL averages
  each row's surrogate over its masked tokens).
- **ESPO** (Ou et al. 2025, arXiv:2512.03759; ML-GSAI/ESPO@b5f2dac ``espo/espo_trainer.py``) scores all
  ``gen_length`` positions (its loss has no completion mask): ``score_tail`` hands the estimator every position as
  real (:meth:`DLLMPlugin.scored_positions`), so the tail is masked, visible and scored like the other tokens and
  every token column holds ``ELBO / gen_length``, ESPO's per-token normalised sequence ratio; with ``estimator: espo``
  and the core's ``kl_estimator: k2_seq`` the loss is ESPO's (docs/dllm.md section 2.1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError, config_field
from mmrl.config.schema import bind_options
from mmrl.extras import require_extra
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime
from mmrl.plugins.dllm import toy
from mmrl.plugins.dllm.adapters import DTYPES, DLLMAdapter, adapter_for, dllm_adapters, padding_inputs
from mmrl.plugins.dllm.canvas import (
    CanvasSamplerConfig,
    UniformPlan,
    canvas_generate,
    canvas_token_logprobs,
    draw_uniform_plan,
    uniform_one_step_scores,
)
from mmrl.plugins.dllm.dream_sampler import DreamSamplerConfig, dream_generate
from mmrl.plugins.dllm.estimators import MaskPlan, draw_plan, likelihood_estimators, plan_token_logprobs
from mmrl.plugins.dllm.generation import check_schedule, completion_mask, generate, guided
from mmrl.plugins.dllm.masking import SampleStreams, sdmc_quadrature, trace_plan
from mmrl.policy import attach_lora, check_reference_sync, frozen_copy, lora_config_class, reference_policy
from mmrl.prompts import check_chat_template_kwargs, read_jsonl_prompts
from mmrl.rollout import Rollout

OBJECTIVES = ("grpo", "wd1", "spg")
DEFAULT_ESTIMATORS = {"grpo": "elbo_l", "wd1": "one_step", "spg": "spg_lower"}
CANVAS_ESTIMATOR = "uniform_one_step"  # the only estimator of canvas models (adapter noise "uniform")
TRACE_ESTIMATOR = "trace"  # TraceRL: the plan is built from the rollout's step_map, not drawn
RANDOM_MASKING = "random_masking"  # UniGRPO / dLLM-RL: the action mask keeps the tokens its draws mask
# each column holds the token's own log-prob
PER_TOKEN_ESTIMATORS = ("one_step", TRACE_ESTIMATOR, CANVAS_ESTIMATOR, RANDOM_MASKING)
BUILTIN_DATASETS = ("toy_addition",)
PLAN_SEED_TAG = 0x91A4  # separates a sample's mask-plan stream from its decoding noise
# Estimator parameters the plugin sets itself (everything else is an estimator option).
_ESTIMATOR_DATA = frozenset({"model", "prompt_ids", "completion_ids", "completion_mask", "mask_id", "num_samples",
                             "generator", "micro_batch", "step_map"})


DLLMLoraConfig = lora_config_class(
    "DLLMLoraConfig", __name__, rank=128, alpha=64.0,
    doc="LoRA on the masked diffusion LM (:class:`mmrl.policy.LoraConfig` with d1's defaults). ``plugin.lora: null`` "
    "(the default) trains every weight instead.",
    refs={"rank": "d1 / wd1 / SPG: 128", "alpha": "d1 / wd1 / SPG: 64", "dropout": "d1: 0.05"},
    targets_help="Module-name suffixes to adapt. Null: the adapter's defaults (LLaDA: q_proj, k_proj, v_proj, "
    "attn_out, ff_proj, up_proj, ff_out).",
)


@dataclass
class DLLMPluginConfig:
    """The ``plugin:`` section of the dLLM plugin. The defaults run the toy world on the bundled checkpoint."""

    # ---------------------------------------------------------------- model
    model: str | None = config_field(
        None, help="Local folder or hub id of the model (config.json, weights, tokenizer). Null: the bundled toy "
        "checkpoint (mmrl/plugins/dllm/assets, made by `python -m mmrl.plugins.dllm.pretrain`; with adapter "
        "diffusion_gemma, the toy canvas model in assets/canvas, made by `python -m mmrl.plugins.dllm."
        "canvas_pretrain`).",
    )
    adapter: str = config_field(
        "auto", help="Model family: masked_lm, llada, dream, diffusion_gemma (or a third-party adapter). 'auto' reads "
        "config.json's model_type.",
    )
    trust_remote_code: bool = config_field(False, help="Run modelling code shipped with the checkpoint (LLaDA, Dream).")
    dtype: Literal["float32", "bfloat16", "float16"] = config_field(
        "float32", help="Weight dtype of the loaded model (LoRA adapters are float32 either way)."
    )
    mask_token_id: int | None = config_field(None, help="Override of the mask token id (null: from the model).")
    eos_token_ids: list[int] | None = config_field(
        None, help="Override of the ids that end a completion; the first also fills the completion after its end."
    )
    pad_token_id: int | None = config_field(None, help="Override of the prompt left-padding id.")
    attn_implementation: str | None = config_field(
        None, help="transformers attention implementation (eager, sdpa, flash_attention_2); null: the library's "
        "default. The toy model runs faster with eager on CPU.",
    )
    lora: DLLMLoraConfig | None = config_field(None, help="LoRA options; null for full fine-tuning.")
    gradient_checkpointing: bool = config_field(False, help="Enable the model's gradient checkpointing.")
    # ---------------------------------------------------------------- data
    dataset: str = config_field(
        "toy_addition", help="'toy_addition' (the synthetic task of mmrl.plugins.dllm.toy), or a JSONL file of rows "
        "with a 'prompt' (and the fields rewards read, e.g. 'solution'), or a folder with train.jsonl and test.jsonl.",
    )
    eval_dataset: str | None = config_field(
        None, eval_only=True, help="JSONL of held-out rows (default: the folder's test.jsonl).")
    train_size: int | None = config_field(None, minimum=1, help="toy_addition: training problems (null: all but "
                                          "the held-out ones); files: keep the first this many rows.")
    eval_size: int = config_field(500, minimum=1, help="toy_addition: held-out problems; files: at most this many.")
    data_seed: int = config_field(1234, help="toy_addition: seed of the train/held-out split (the pretraining split).")
    prompt_template: str = config_field(
        "{prompt}", help="Python format string applied to each row to make the model's prompt text, e.g. "
        "'{prompt}\\nAnswer:'. Fields are the row's keys.",
    )
    system_prompt: str | None = config_field(None, help="System message when chat_template is on (d1's format "
                                             "instructions go here or in prompt_template).")
    chat_template: bool = config_field(False, help="Wrap the prompt in the tokenizer's chat template (instruct "
                                       "models) with the generation prompt appended.")
    chat_template_kwargs: dict[str, Any] = config_field(
        default_factory=dict, help="Extra variables for the chat template (needs chat_template: true), passed to "
        "apply_chat_template with every prompt.", ref="TRL GRPOConfig.chat_template_kwargs",
    )
    add_special_tokens: bool = config_field(False, help="Let the tokenizer add its special tokens (BOS) to prompts.")
    max_prompt_length: int = config_field(256, minimum=1, help="Longer prompts keep their last tokens.",
                                          ref="d1: 200")
    # ---------------------------------------------------------------- generation
    gen_length: int = config_field(toy.GEN_LENGTH, minimum=1, help="Completion length G (mask tokens decoded).",
                                   ref="d1 / wd1 / SPG: 256")
    block_length: int = config_field(toy.GEN_LENGTH, minimum=1, help="Semi-autoregressive block length; G must be a "
                                     "multiple. Canvas models (DiffusionGemma): the model's canvas_length.",
                                     ref="LLaDA, d1: 32; DiffusionGemma: 256")
    steps: int = config_field(toy.GEN_LENGTH, minimum=1, help="Decoding steps over the whole completion; a multiple "
                              "of G / block_length.", ref="d1 rollouts: 128 for G = 256")
    temperature: float = config_field(1.0, minimum=0.0, help="Sampling temperature of training rollouts (LLaDA: "
                                      "Gumbel-max; Dream: softmax).",
                                      ref="d1 / wd1 / SPG: 0.9")
    remasking: Literal["low_confidence", "random"] = config_field(
        "low_confidence", help="Which masked positions of the block are committed each step.", ref="LLaDA")
    eval_temperature: float = config_field(0.0, minimum=0.0, eval_only=True,
                                           help="Temperature of evaluation (0: greedy).")
    eval_remasking: Literal["low_confidence", "random"] = config_field(
        "low_confidence", eval_only=True, help="Remasking of evaluation.")
    cfg_scale: float = config_field(
        0.0, minimum=0.0, help="Classifier-free guidance scale s (0: off) of decoding and of every scoring pass "
        "(policy, old and reference: the scored policy is the sampled one), logits = un + (s+1)(cond - un) with the "
        "real prompt tokens masked in the unconditional pass. Doubles the forwards.",
        ref="LLaDA generate.py; d1 get_logits (diffu_grpo_trainer.py L269-283)",
    )
    logits_eos_inf: bool = config_field(
        False, help="LLaDA sampler: the EOS logit (the first stop id; LLaDA 126081) is set to -inf after guidance, "
        "so EOS is never proposed; rollouts and evaluation alike.",
        ref="LLaDA generate.py L91-92 (ML-GSAI/LLaDA@b7e6c35); its EVAL.md: HumanEval of LLaDA-8B-Instruct",
    )
    confidence_eos_eot_inf: bool = config_field(
        False, help="LLaDA sampler, low_confidence remasking: LLaDA's confidence change as its code runs it: the "
        "end-of-turn id (the second stop id; LLaDA 126348) is dropped from the confidence softmax, and EOS (the "
        "first; 126081) too at temperature 0, so their candidates get confidence 0 and are committed last in the "
        "block (docs/dllm.md section 4); rollouts and evaluation alike.",
        ref="LLaDA generate.py L97-98 (ML-GSAI/LLaDA@b7e6c35); its EVAL.md: GSM8K, Math, GPQA, MBPP",
    )
    generation_batch_size: int | None = config_field(None, minimum=1, help="Samples decoded per batch (null: all).")
    sampler: Literal["llada", "dream"] | None = config_field(
        None, help="Rollout sampler of masked models: 'llada' (LLaDA's semi-autoregressive blocks with remasking: "
        "d1, wd1, SPG) or 'dream' (Dream's diffusion_generate over the whole completion, set by dream_sampler: "
        "DiffuCoder's coupled-GRPO rollouts; block_length must be gen_length, no remasking or cfg_scale). Null: "
        "dream for the dream adapter, llada otherwise. Canvas models run their own.",
        ref="Dream generation_utils.py _sample; apple/ml-diffucoder coupled_grpo.py L419-431")
    dream_sampler: DreamSamplerConfig = config_field(
        default_factory=DreamSamplerConfig, help="Dream's sampler (sampler: dream): alg, alg_temp, top_p, top_k, "
        "eps; its temperatures are temperature and eval_temperature.", ref="DiffuCoder: entropy, 0.0, top_p 0.95")
    canvas_sampler: CanvasSamplerConfig = config_field(
        default_factory=CanvasSamplerConfig, help="Canvas models (DiffusionGemma) only: temperatures, entropy bound "
        "and adaptive stopping of their sampler (null values: the checkpoint's generation_config.json, else "
        "transformers' defaults). Their denoising steps per canvas are steps / (gen_length / block_length); "
        "temperature, remasking and cfg_scale are masked-model options they refuse.",
        ref="transformers generation_diffusion_gemma.py")
    # ---------------------------------------------------------------- likelihood and objective
    objective: Literal["grpo", "wd1", "spg"] = config_field(
        "grpo", help="What the action log-probs are: 'grpo' (one action per completion token: one_step's per-token "
        "log-probs, d1's per-token ratio; the ELBO estimators' ELBO/L in every token, a sequence ratio; for the "
        "ratio objectives grpo/gspo, weighted by algorithm.aggregation), 'wd1' (sequence estimate, pair with "
        "policy_loss wd1 and advantage wd1), 'spg' (ELBO and EUBO columns, pair with policy_loss spg and advantage "
        "dr_grpo).",
        ref="d1 diffu_grpo_trainer.py L114-121; wd1 arXiv:2507.08838; SPG arXiv:2510.09541",
    )
    estimator: str | None = config_field(
        None, help="Likelihood estimator: one_step, elbo_t, elbo_l, coupled, coupled_cv, espo, spg_lower, spg_upper, "
        "trace, random_masking, sdmc "
        "(masked models; trace: TraceRL's per-token log-probs in the decoding trajectory's own context, from the "
        "rollout's step map; random_masking: UniGRPO's per-token log-probs at a random masking rate; sdmc: GDPO's "
        "quadrature ELBO), uniform_one_step (canvas models: DiffusionGemma). Null: elbo_l for grpo, one_step for "
        "wd1, spg_lower for spg; uniform_one_step for a canvas model.",
    )
    num_mc_samples: int = config_field(
        4, minimum=1, help="Masked forwards per completion (coupled, and espo or random_masking with coupled: an even "
        "number; coupled_cv: at least 2; sdmc: a multiple of its quadrature nodes; random_masking: dLLM-RL's "
        "mask_times_per_sample; "
        "one_step without prompt masking uses one; trace ignores it: one forward per step group).",
        ref="LLaDA likelihood: 128; SPG num_t: 2",
    )
    estimator_options: dict[str, Any] = config_field(
        default_factory=dict, help="Options of the estimator, e.g. {p_mask_prompt: 0.15} for one_step, "
        "{stratified: false} for elbo_l, {masking: block, block_length: 32} for spg_lower, {shrink: 8, tail: "
        "trajectory} for trace.",
    )
    normalize_by_length: bool | None = config_field(
        None, help="wd1 and spg: divide each sequence estimate by the number of real completion tokens (null: no; "
        "their losses weight sequence log-likelihoods). Must be null for grpo, whose token columns already hold "
        "per-token values and whose length weighting is algorithm.aggregation's.",
    )
    score_tail: bool = config_field(
        False, help="Score the whole generated length as the completion (ESPO): the tail after the first stop token "
        "is masked, unmasked and scored by the estimator like any other position, and every token column is an "
        "action (L = gen_length, the ratio exp(dELBO / gen_length)). False: the tail is masked in every forward and "
        "never scored (d1, SPG). Not with estimator trace (its own tail option) or canvas models.",
        ref="ESPO espo_trainer.py L191 and L376-438 (ML-GSAI/ESPO@b5f2dac): no completion mask in the loss",
    )
    redraw_masks: bool = config_field(
        True, help="Draw a new mask plan for every inner epoch: the sampling policy and the reference are scored on "
        "each epoch's plan at rollout time (μ scoring passes each), and epoch k's training forward uses plan k, so "
        "the ratio and the KL of an epoch compare the policies on one draw. False: one plan serves all inner epochs "
        "(one scoring pass). No effect on deterministic plans (one_step without prompt masking; trace, whose plan "
        "is the decoding trajectory).",
        ref="d1 / wd1 / SPG: mask_seeds = torch.randint(0, 2**12, (num_iterations,)), random_masking: True",
    )
    spg_beta: float = config_field(1.5, minimum=1.0, help="Rényi order β of SPG's upper bound.",
                                   ref="SPG: 1.5 GSM8K/MATH, 2.0 Countdown, 1.0 Sudoku")
    score_micro_batch: int | None = config_field(None, minimum=1, help="Masked rows per forward when scoring "
                                                 "(null: all at once).")

    def validate(self, path: str) -> None:
        try:
            check_schedule(self.gen_length, self.block_length, self.steps)
        except ValueError as error:
            key = "block_length" if self.gen_length % self.block_length else "steps"
            raise ConfigError(f"{path}.{key}", getattr(self, key), str(error)) from None
        check_chat_template_kwargs(self.chat_template_kwargs, f"{path}.chat_template_kwargs")
        if self.chat_template_kwargs and not self.chat_template:
            raise ConfigError(f"{path}.chat_template_kwargs", self.chat_template_kwargs,
                              "empty unless chat_template is true (the variables are the chat template's)")
        if self.adapter != "auto" and self.adapter not in dllm_adapters:
            raise ConfigError(f"{path}.adapter", self.adapter, f"auto or one of {', '.join(dllm_adapters.names())}")
        name = self.resolved_estimator
        if name not in likelihood_estimators:
            raise ConfigError(f"{path}.estimator", name, f"one of {', '.join(likelihood_estimators.names())}")
        self.estimator_options = bind_options(likelihood_estimators.get(name), self.estimator_options,
                                              f"{path}.estimator_options", f"estimator {name!r}",
                                              supplied=_ESTIMATOR_DATA)
        if name == "espo" and self.estimator_options.get("coupled", True) and self.num_mc_samples % 2:
            raise ConfigError(f"{path}.num_mc_samples", self.num_mc_samples,
                              "an even number for the espo estimator with coupled: true (each draw is a pair of "
                              "complementary masks: ESPO's num_mc 2 is 4 forwards)")
        if self.score_tail and name == TRACE_ESTIMATOR:
            raise ConfigError(f"{path}.score_tail", True, "false with estimator trace (it scores the real tokens of "
                              "the decoding trajectory; estimator_options.tail sets what it sees of the tail)")
        if name == "coupled" and self.num_mc_samples % 2:
            raise ConfigError(f"{path}.num_mc_samples", self.num_mc_samples,
                              "an even number for the coupled estimator (pairs of complementary masks)")
        if name == RANDOM_MASKING:
            options = self.estimator_options
            if options.get("t_low", 0.1) > options.get("t_high", 0.9):
                raise ConfigError(f"{path}.estimator_options.t_low", options.get("t_low", 0.1),
                                  f"a number <= t_high ({options.get('t_high', 0.9)}): t ~ U(t_low, t_high)")
            if options.get("coupled", False) and self.num_mc_samples % 2:
                raise ConfigError(f"{path}.num_mc_samples", self.num_mc_samples, "an even number for the "
                                  "random_masking estimator with coupled: true (each draw is a pair of complementary "
                                  "rows)")
            if self.objective == "spg":
                raise ConfigError(f"{path}.objective", self.objective, "grpo or wd1 with estimator random_masking "
                                  "(its per-token log-probs are no ELBO: there is no ELBO/EUBO pair for spg)")
        if name == "sdmc":
            nodes = sdmc_quadrature(self.estimator_options.get("quadrature", "gauss-2"))[0].numel()
            if self.num_mc_samples % nodes:
                raise ConfigError(f"{path}.num_mc_samples", self.num_mc_samples, f"a multiple of {nodes}, the nodes "
                                  f"of the sdmc quadrature {self.estimator_options.get('quadrature', 'gauss-2')} "
                                  "(the same number of mask draws at every node)")
        if name == "coupled_cv" and self.num_mc_samples < 2:
            raise ConfigError(f"{path}.num_mc_samples", self.num_mc_samples,
                              "at least 2 for coupled_cv (a fully masked row and a partly masked one)")
        if name == TRACE_ESTIMATOR and self.objective == "spg":
            raise ConfigError(f"{path}.objective", self.objective, "grpo or wd1 with estimator trace (each token is "
                              "scored once, in its decoding context: there is no ELBO/EUBO pair for spg)")
        if name == "coupled_cv" and self.objective == "spg" and self.estimator_options.get("control", 1.0) != 0:
            raise ConfigError(f"{path}.estimator", name, "an estimator with nonnegative weights for objective spg "
                              "(SPG's EUBO); coupled_cv's control variate gives negative ones (or set control: 0)")
        if "{" not in self.prompt_template:
            raise ConfigError(f"{path}.prompt_template", self.prompt_template, "a format string using a row field, "
                              "e.g. '{prompt}'")
        toy_families = ("auto", "masked_lm", "diffusion_gemma")  # the families with a toy checkpoint
        if self.dataset in BUILTIN_DATASETS and self.model is not None and self.adapter not in toy_families:
            raise ConfigError(f"{path}.dataset", self.dataset, "a JSONL file or folder for a non-toy model")
        if self.confidence_eos_eot_inf and self.remasking == self.eval_remasking == "random":
            raise ConfigError(f"{path}.confidence_eos_eot_inf", True, "false with remasking and eval_remasking "
                              "random (it changes low_confidence confidences only)")
        if self.objective == "grpo" and self.normalize_by_length is not None:
            raise ConfigError(f"{path}.normalize_by_length", self.normalize_by_length,
                              "null with objective grpo (each token column holds a per-token value; "
                              "algorithm.aggregation sets the length weighting)")

    @property
    def resolved_estimator(self) -> str:
        return self.estimator or DEFAULT_ESTIMATORS[self.objective]

    @property
    def normalized(self) -> bool:
        """wd1/spg: whether the sequence estimates are divided by the completion length."""
        return bool(self.normalize_by_length)

    @property
    def token_columns(self) -> bool:
        """Whether the actions are the completion's token positions (objective grpo) rather than the completion."""
        return self.objective == "grpo"

    @property
    def per_token(self) -> bool:
        """Whether each token column holds the token's own log-prob (one_step, d1; uniform_one_step) rather than
        ELBO/L."""
        return self.token_columns and self.resolved_estimator in PER_TOKEN_ESTIMATORS

    @property
    def num_actions(self) -> int:
        if self.token_columns:
            return self.gen_length
        return 2 if self.objective == "spg" else 1


class DLLMPlugin(Plugin):
    """GRPO (and wd1, SPG) for diffusion LMs: block-decoded rollouts scored by ELBO estimators (canvas models: their
    own sampler and the uniform_one_step surrogate)."""

    name = "dllm"
    config_class = DLLMPluginConfig

    def __init__(self, config: DLLMPluginConfig, runtime: Runtime):
        require_extra("dllm", "plugin 'dllm'")  # one line naming mmrl[dllm] instead of an import traceback
        super().__init__(config, runtime)
        if config.model is not None:
            model_path = config.model
        else:  # the bundled toy checkpoint of the family
            model_path = str(toy.CANVAS_ASSETS if config.adapter == "diffusion_gemma" else toy.ASSETS)
        adapter_class = adapter_for(model_path) if config.adapter == "auto" else dllm_adapters.get(config.adapter)
        try:
            self.adapter: DLLMAdapter = adapter_class(
                model_path, trust_remote_code=config.trust_remote_code, mask_id=config.mask_token_id,
                stop_ids=config.eos_token_ids, pad_id=config.pad_token_id,
            )
        except ValueError as error:
            raise ConfigError("plugin.model", model_path, str(error)) from None
        self.canvas = self.adapter.noise == "uniform"  # a canvas model (DiffusionGemma): its own sampler/likelihood
        self.canvas_sampling = self._check_canvas_options() if self.canvas else None
        #: The masked models' rollout sampler, 'llada' or 'dream' (None for canvas models).
        self.sampler = None if self.canvas else (config.sampler or self.adapter.default_sampler)
        if self.sampler == "dream":
            self._check_dream_options()
        elif self.sampler == "llada" and config.confidence_eos_eot_inf and len(self.adapter.stop_ids) < 2:
            raise ConfigError("plugin.confidence_eos_eot_inf", True, f"false for {model_path}: it acts on an EOS and "
                              f"an end-of-turn id (the first two stop ids; LLaDA: 126081, 126348) and the "
                              f"{self.adapter.name} adapter has {list(self.adapter.stop_ids)}: name both in "
                              "plugin.eos_token_ids")
        if not self.canvas and config.resolved_estimator == CANVAS_ESTIMATOR:
            raise ConfigError("plugin.estimator", CANVAS_ESTIMATOR, f"a masked-model estimator for {model_path} "
                              f"({self.adapter.name} adapter); {CANVAS_ESTIMATOR} scores canvas models only")
        model = self.adapter.load_model(dtype=DTYPES[config.dtype], attn_implementation=config.attn_implementation)
        model.to(runtime.device)
        self.reference: nn.Module | None = None
        if config.lora is None:
            model.to(torch.float32).requires_grad_(True)  # float32 master weights; autocast runs mixed precision
            self.adapter.prepare_trainable(model, lora=False)
            if runtime.needs_reference:  # the KL needs the initial weights; LoRA disables the adapter instead
                self.reference = frozen_copy(model)
        else:
            # peft injects the LoRA layers in place (no wrapper: parameter names and the adapter's scorer stay).
            attach_lora(model, config.lora, default_targets=self.adapter.lora_target_modules,
                        what=str(self.adapter.model_path), base_model=config.model,
                        exclude_modules=self.adapter.lora_exclude_modules)
            self.adapter.prepare_trainable(model, lora=True)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = model
        self.estimator = config.resolved_estimator
        self._inner_epoch = 0  # set by start_inner_epoch; selects the mask plan of the epoch
        self._rows = {split: self._load_rows(split) for split in ("train", "eval")}

    def _check_dream_options(self) -> None:
        """Dream's sampler decodes the whole completion at once and commits by its own ``alg``: refuse LLaDA's block
        length, remasking and guidance, which it has no place for."""
        config = self.config
        why = "with Dream's sampler (plugin.sampler dream"
        why += ", the dream adapter's default)" if config.sampler is None else ")"
        if config.block_length != config.gen_length:
            raise ConfigError("plugin.block_length", config.block_length, f"gen_length ({config.gen_length}) {why}: "
                              "it decodes the whole completion as one block; plugin.sampler llada decodes blocks")
        for key, default in {"remasking": "low_confidence", "eval_remasking": "low_confidence",
                             "cfg_scale": 0.0}.items():
            if getattr(config, key) != default:
                raise ConfigError(f"plugin.{key}", getattr(config, key), f"{default!r} (its default) {why}: "
                                  "plugin.dream_sampler.alg chooses what is committed, and it has no guidance")
        for key in ("logits_eos_inf", "confidence_eos_eot_inf"):
            if getattr(config, key):
                raise ConfigError(f"plugin.{key}", True, f"false (its default) {why}: it is an option of LLaDA's "
                                  "generate.py, a step Dream's diffusion_generate does not have")

    def _check_canvas_options(self) -> Any:
        """Canvas models: settle the estimator (``uniform_one_step``, the only one that fits them) and refuse the
        masked-model options that mean nothing to them; return the resolved sampler settings."""
        config, adapter = self.config, self.adapter
        if config.estimator not in (None, CANVAS_ESTIMATOR):
            raise ConfigError("plugin.estimator", config.estimator, f"{CANVAS_ESTIMATOR} (or null) for the "
                              f"{adapter.name} canvas model: it has no mask token for the masked-model estimators")
        if config.estimator is None:  # options were bound to the masked default at load time: bind them again
            config.estimator = CANVAS_ESTIMATOR
            config.estimator_options = bind_options(likelihood_estimators.get(CANVAS_ESTIMATOR),
                                                    config.estimator_options, "plugin.estimator_options",
                                                    f"estimator {CANVAS_ESTIMATOR!r}", supplied=_ESTIMATOR_DATA)
        if config.objective == "spg":
            raise ConfigError("plugin.objective", "spg", f"grpo or wd1 for the {adapter.name} canvas model (SPG's "
                              "bounds are masked-diffusion ELBO/EUBO)")
        if config.block_length != adapter.canvas_length:
            raise ConfigError("plugin.block_length", config.block_length,
                              f"{adapter.canvas_length}, the canvas_length of {adapter.model_path}")
        refused = {"temperature": 1.0, "eval_temperature": 0.0, "remasking": "low_confidence",
                   "eval_remasking": "low_confidence", "cfg_scale": 0.0, "sampler": None, "logits_eos_inf": False,
                   "confidence_eos_eot_inf": False, "score_tail": False}
        for key, default in refused.items():
            if getattr(config, key) != default:
                raise ConfigError(f"plugin.{key}", getattr(config, key), f"{default!r} (its default) for the "
                                  f"{adapter.name} canvas model; its sampler is set by plugin.canvas_sampler")
        steps_per_canvas = config.steps // (config.gen_length // config.block_length)
        return config.canvas_sampler.resolve(adapter.generation_config, steps_per_canvas)

    # ------------------------------------------------------------------ contract
    def policy(self) -> nn.Module:
        return self.model

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            raise KeyError(f"dllm plugin has splits {sorted(self._rows)}, not {split!r}")
        return self._rows[split]

    def max_actions(self) -> int:
        return self.config.num_actions

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        config, device = self.config, self.runtime.device
        module = self.runtime.unwrap(policy)
        prompt_ids, lengths = self.encode_prompts(batch.rows)  # [N, w], [N]
        completion_ids, step_map, decoding = self._decode(module, prompt_ids, batch)
        # Kept as sampled: the tail after the first EOS is masked in every scoring forward (d1, SPG), so what it
        # holds never matters.
        real = completion_mask(completion_ids, self.adapter.stop_ids)  # [N, G]
        texts = self.decode_texts(completion_ids, real)
        payload = {"completions": texts, "completion_tokens": real.sum(dim=1)}  # tokens up to and including the EOS
        n, width = prompt_ids.shape
        stops = torch.tensor(self.adapter.stop_ids, device=completion_ids.device)
        finished = torch.isin(completion_ids, stops).any(dim=1)
        metrics = {"completion_length": float(real.sum(dim=1).float().mean()),
                   "finished_fraction": float(finished.float().mean()), **decoding}
        replay: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "prompt_width": torch.full((n,), width, dtype=torch.long, device=device),
            "completion_ids": completion_ids,
            "completion_mask": real,
            "step_map": step_map,
        }
        actions = config.num_actions
        if not batch.training:  # evaluation: rewards only, nothing is trained
            zeros = torch.zeros(n, actions, device=device)
            return Rollout(group_ids=batch.group_ids, old_logp=zeros, mask=zeros.clone(),
                           payload=payload, replay=replay, metrics=metrics)
        self._inner_epoch = 0  # the learner selects each epoch's plan (start_inner_epoch) before scoring with it
        num_plans = self.num_plans()
        scored = self.scored_positions(real)  # [N, G]: the real tokens, or every position with score_tail
        replay.update(self.draw_plans(prompt_ids, lengths, completion_ids, scored, batch.seeds, num_plans=num_plans))
        refs = []  # per plan, [N, A] each
        with self.runtime.autocast():
            if self.runtime.needs_reference:
                with self._reference_module(policy) as reference:
                    refs = [self.score_module(reference, replay, plan=e).float() for e in range(num_plans)]
        # Plan 0's reference scores are the rollout's; later epochs' are handed to the learner by forward().
        ref_logp = refs[0] if refs else None  # [N, A]
        if num_plans > 1 and refs:
            replay["epoch_ref_logp"] = torch.stack(refs, dim=1)  # [N, E, A]
        # old_logp None: when the run needs them, the core scores the sampling policy with forward() on each epoch's
        # plan before the first update (redraws_per_epoch).
        mask = self.action_mask(scored)  # [N, A]
        if self.estimator == RANDOM_MASKING and config.token_columns:
            # UniGRPO (dLLM-RL) averages each row's surrogate over the tokens it masks: a token masked in none of
            # the sample's draws has no log-prob (its column is 0 under every policy) and is no action.
            mask = mask * replay["plan_weights"].ne(0).flatten(1, 2).any(dim=1).to(mask.dtype)  # [N, G]
        return Rollout(
            group_ids=batch.group_ids, old_logp=None, mask=mask, payload=payload,
            replay=replay, ref_logp=ref_logp, metrics=metrics,
            truncated=~finished if self.adapter.stop_ids else None,  # no stop token in the generated length
        )

    @property
    def redraws_per_epoch(self) -> bool:
        """True when each inner epoch has its own mask plan (:meth:`num_plans` > 1): the core then scores the
        sampling policy on every epoch's plan."""
        return self.num_plans() > 1

    @classmethod
    def check_config(cls, train_config: Any) -> None:
        """Refuse an objective paired with another family's loss or advantage, ``algorithm.kl_estimator: k2_seq``
        with ``objective: spg`` (it sums a row's columns, and spg's ELBO and EUBO columns do not add up to the
        sequence log-ratio), ``algorithm.ref_sync_every`` with LoRA (:func:`mmrl.policy.check_reference_sync`) and
        ``algorithm.top_entropy_quantile``, ``algorithm.entropy_target`` and ``algorithm.entropy_coef`` (no entropy).

        ``objective: spg`` returns ELBO and EUBO columns that only ``policy_loss: spg`` reads, and ``spg`` reads
        nothing else; ``objective: wd1`` returns one sequence estimate for ``policy_loss: wd1``, which weights it
        with ``advantage: wd1``'s group-softmax weights (weights that mean nothing to another loss); the ratio
        losses (grpo, gspo, ...) need ``objective: grpo``'s token columns.
        """
        objective = train_config.plugin.config.objective
        loss = train_config.algorithm.policy_loss.name
        advantage = train_config.algorithm.advantage.name
        paired = {"spg": "spg", "wd1": "wd1"}  # objective -> the loss that reads its columns (and the reverse)
        if objective in paired and loss != paired[objective]:
            raise ConfigError("algorithm.policy_loss.name", loss, f"{paired[objective]} with plugin.objective "
                              f"{objective} (or set plugin.objective to match the loss)")
        if objective not in paired and loss in paired:
            raise ConfigError("algorithm.policy_loss.name", loss, "a ratio loss (grpo, gspo, ...) with "
                              f"plugin.objective {objective}; {loss} needs plugin.objective {loss}")
        if (loss == "wd1") != (advantage == "wd1"):
            allowed = ("wd1 with policy_loss wd1 (its group-softmax weights)" if loss == "wd1"
                       else f"an estimator other than wd1 with policy_loss {loss} (wd1's weights are not advantages)")
            raise ConfigError("algorithm.advantage.name", advantage, allowed)
        if objective == "spg" and train_config.algorithm.kl_estimator == "k2_seq":
            # k2_seq sums a row's columns into the sequence log-ratio; spg's two columns are two estimates of it
            raise ConfigError("algorithm.kl_estimator", "k2_seq", "k1, k2 or k3 with plugin.objective spg (its ELBO "
                              "and EUBO columns are two estimates of one sequence, not parts that add up to it)")
        check_reference_sync(train_config)  # a LoRA run's reference is the adapter-off model: nothing to sync
        train_config.algorithm.refuse_entropy_readers(
            "plugin dllm (its likelihood estimates come with no per-token entropy)")

    def start_inner_epoch(self, epoch: int) -> None:
        """Select plan ``epoch`` for the forwards of this inner epoch (plans redrawn per epoch, ``redraw_masks``)."""
        self._inner_epoch = int(epoch)

    def forward(
        self, policy: nn.Module, rollout: Rollout, *, need_reference: bool, actions: Tensor | None = None
    ) -> PolicyOutput:
        replay = rollout.replay
        plan = self.plan_index(replay)
        with self.runtime.autocast():
            logp = self.score_module(policy, replay, plan=plan)
            ref_logp = None
            if need_reference:
                with torch.no_grad(), self._reference_module(policy) as reference:
                    ref_logp = self.score_module(reference, replay, plan=plan)
        if plan > 0 and ref_logp is None and "epoch_ref_logp" in replay:  # π_ref on this epoch's plan (rollout time)
            ref_logp = replay["epoch_ref_logp"][:, plan]
        return PolicyOutput(logp=logp.float(), ref_logp=None if ref_logp is None else ref_logp.float())

    # ------------------------------------------------------------------ building blocks
    def num_plans(self) -> int:
        """Mask plans drawn per training sample: one per inner epoch with ``redraw_masks`` (when μ > 1 and the plan
        is random), else one."""
        config = self.config
        deterministic = self.estimator == TRACE_ESTIMATOR or (
            self.estimator == "one_step" and not config.estimator_options.get("p_mask_prompt", 0.0))
        if config.redraw_masks and not deterministic:
            return max(int(self.runtime.inner_epochs), 1)
        return 1

    def plan_index(self, replay: dict[str, Any]) -> int:
        """The plan of the current inner epoch (0 when a single plan serves every epoch)."""
        if self.estimator == TRACE_ESTIMATOR:  # one plan, rebuilt from the step map: nothing stored
            return 0
        drawn = replay["plan_masked"].shape[1]
        if drawn == 1:
            return 0
        if not 0 <= self._inner_epoch < drawn:
            raise RuntimeError(f"dllm plugin: inner epoch {self._inner_epoch} but {drawn} mask plans were drawn per "
                               "sample (Runtime.inner_epochs and the learner disagree)")
        return self._inner_epoch

    def scored_positions(self, real: Tensor) -> Tensor:
        """The completion positions the estimators score: the real tokens (the completion mask), or every generated
        position with ``score_tail`` (ESPO scores the whole generated length, its tail included).

        Shapes:
            real ``[N, G]`` → ``[N, G]`` (same dtype).
        """
        return torch.ones_like(real) if self.config.score_tail else real

    def action_mask(self, real: Tensor) -> Tensor:
        """The rollout's action mask: the completion mask over the token columns (grpo), else one per column.
        (:meth:`rollout` also drops, for ``random_masking``, the tokens that no draw of the sample's plans masks.)

        Shapes:
            real ``[N, G]`` → ``[N, A]`` float32.
        """
        if self.config.token_columns:
            return real.float()
        return torch.ones(real.shape[0], self.config.num_actions, device=real.device)

    def sequence_estimates(self, scores: Tensor) -> Tensor:
        """The sequence estimate (nats per completion, or per token with ``normalize_by_length``) of action scores:
        the sum of the token columns for grpo, column 0 (the ELBO) otherwise.

        Shapes:
            scores ``[N, A]`` → ``[N]``.
        """
        return scores.sum(dim=1) if self.config.token_columns else scores[:, 0]

    def encode_prompts(self, rows: list[dict[str, Any]]) -> tuple[Tensor, Tensor]:
        """Prompt ids left-padded to the longest prompt of ``rows`` (after truncation to ``max_prompt_length``),
        and the number of real tokens of each.

        Shapes:
            → ``[N, w]`` long, ``[N]`` long, on the runtime device.
        """
        config, tokenizer = self.config, self.adapter.tokenizer
        texts, made = [], {}  # made: id(row) -> its text (a group's G samples share their row object)
        for row in rows:
            text = made.get(id(row))
            if text is None:
                try:
                    text = config.prompt_template.format_map(row)
                except (KeyError, IndexError, ValueError) as error:
                    raise ValueError(f"plugin.prompt_template {config.prompt_template!r} does not fit the row "
                                     f"{sorted(row)}: {error}") from None
                if config.chat_template:
                    messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
                    messages.append({"role": "user", "content": text})
                    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                         **config.chat_template_kwargs)
                made[id(row)] = text
            texts.append(text)
        distinct = list(dict.fromkeys(texts))  # each text is tokenized on its own: tokenize every distinct one once
        ids_of = dict(zip(distinct, tokenizer(distinct, add_special_tokens=config.add_special_tokens)["input_ids"],
                          strict=True))
        encoded = [list(ids_of[text])[-config.max_prompt_length:] for text in texts]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt encodes to no tokens; check plugin.prompt_template")
        width = max(len(ids) for ids in encoded)
        pad = self.adapter.pad_id
        starts = [i for i, ids in enumerate(encoded) if ids[0] == pad]
        if starts:  # left padding is the leading run of the pad id (adapters.padding_inputs): it would swallow it
            raise ValueError(f"prompt {starts[0]} starts with the padding token id {pad}, which would be read as left "
                             "padding; set plugin.pad_token_id to an id prompts do not start with")
        ids = torch.tensor([[pad] * (width - len(row)) + row for row in encoded], dtype=torch.long)
        lengths = torch.tensor([len(row) for row in encoded], dtype=torch.long)
        return ids.to(self.runtime.device), lengths.to(self.runtime.device)

    def decode_texts(self, completion_ids: Tensor, real: Tensor) -> list[str]:
        """The text of each completion up to, not including, its first EOS."""
        stops = set(self.adapter.stop_ids)
        texts = []
        for ids, keep in zip(completion_ids.tolist(), real.tolist(), strict=True):
            tokens = [token for token, k in zip(ids, keep, strict=True) if k and token not in stops]
            texts.append(self.adapter.tokenizer.decode(tokens, skip_special_tokens=True))
        return texts

    def _decode(self, module: nn.Module, prompt_ids: Tensor,
                batch: PromptBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Completion ids ``[N, G]``, their step map ``[N, G]`` and the decoder's own metrics (canvas models')."""
        config = self.config
        generators = batch.sample_generators(self.runtime.device)
        if self.canvas:
            return self._decode_canvases(module, prompt_ids, generators)
        temperature = config.temperature if batch.training else config.eval_temperature
        remasking = config.remasking if batch.training else config.eval_remasking
        dream = config.dream_sampler
        top_p = dream.top_p if batch.training or dream.eval_top_p is None else dream.eval_top_p
        size = config.generation_batch_size or len(batch) or 1
        scorer = self.adapter.scorer(module)
        stops = self.adapter.stop_ids  # LLaDA: |EOS| 126081, <|eot_id|> 126348 (the ids its generate.py hard-codes)
        eos_eot = {"eos_id": stops[0], "eot_id": stops[1] if len(stops) > 1 else None}
        completions, step_maps = [], []
        with self.runtime.autocast():
            for start in range(0, prompt_ids.shape[0], size):
                part = slice(start, start + size)
                if self.sampler == "dream":
                    out = dream_generate(
                        scorer, prompt_ids[part], mask_id=self.adapter.mask_id, gen_length=config.gen_length,
                        steps=config.steps, temperature=temperature, alg=dream.alg, alg_temp=dream.alg_temp,
                        top_p=top_p, top_k=dream.top_k, eps=dream.eps, generators=generators[part],
                    )
                else:
                    out = generate(
                        scorer, prompt_ids[part], mask_id=self.adapter.mask_id, gen_length=config.gen_length,
                        block_length=config.block_length, steps=config.steps, temperature=temperature,
                        remasking=remasking, generators=generators[part], cfg_scale=config.cfg_scale,
                        prompt_mask=padding_inputs(prompt_ids[part], self.adapter.pad_id)[0].bool(),  # real prompt
                        logits_eos_inf=config.logits_eos_inf, confidence_eos_eot_inf=config.confidence_eos_eot_inf,
                        **eos_eot,
                    )
                completions.append(out.completion_ids)
                step_maps.append(out.step_map)
        return torch.cat(completions), torch.cat(step_maps), {}

    def _decode_canvases(self, module: nn.Module, prompt_ids: Tensor,
                         generators: list[torch.Generator]) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Canvas models: :func:`~mmrl.plugins.dllm.canvas.canvas_generate`, one generator per sample (training
        and evaluation alike: the sampler's temperatures are ``canvas_sampler``'s). Logs ``denoising_steps``, the
        mean decoder passes per sample, and ``decoder_calls``, the batched decoder forwards of the rollout call
        (what the step-floor benchmark replays)."""
        size = self.config.generation_batch_size or prompt_ids.shape[0] or 1
        completions, step_maps, passes, calls = [], [], [], 0
        with self.runtime.autocast():
            for start in range(0, prompt_ids.shape[0], size):
                part = slice(start, start + size)
                out = canvas_generate(
                    module, prompt_ids[part], padding_inputs(prompt_ids[part], self.adapter.pad_id)[0],
                    gen_length=self.config.gen_length, sampling=self.canvas_sampling, stop_ids=self.adapter.stop_ids,
                    pad_id=self.adapter.pad_id, generators=generators[part],
                )
                completions.append(out.completion_ids)
                step_maps.append(out.step_map)
                passes.append(out.decoder_passes)
                calls += out.decoder_calls
        metrics = {"denoising_steps": float(torch.cat(passes).float().mean()), "decoder_calls": float(calls)}
        return torch.cat(completions), torch.cat(step_maps), metrics

    def draw_plans(self, prompt_ids: Tensor, lengths: Tensor, completion_ids: Tensor, real: Tensor,
                   seeds: Tensor, *, num_plans: int = 1) -> dict[str, Tensor]:
        """Each sample's mask plans (``num_plans``, one per inner epoch), drawn from its own seed on the CPU, stored
        per sample.

        A sample's plans depend on its seed, its completion mask and its prompt length only (prompt masking covers
        the real prompt tokens, never the left padding), not on the batch it was sampled in. Plan ``e`` is the
        ``e``-th draw of one generator, so plan 0 is the same whatever ``num_plans``. The plans are drawn for the
        whole batch at once, each sample reading its own generator's stream (:class:`~mmrl.plugins.dllm.masking.
        SampleStreams`): the same plans as drawing every sample alone, without a Python loop of ``N × num_plans``
        plan draws. With prompt masking the samples are drawn in groups of one prompt length (a sample's prompt
        mask covers its own prompt only).

        Shapes:
            → ``plan_masked`` bool ``[N, E, D, L]``, ``plan_weights`` float32 ``[N, E, D, L]`` and, with prompt
            masking, ``plan_prompt_masked`` bool ``[N, E, D, w]`` (``E`` plans of ``D`` draws).
        """
        from mmrl.seeding import derive_seed

        n, width = prompt_ids.shape
        device = completion_ids.device
        if self.estimator == TRACE_ESTIMATOR:  # the plan is the trajectory's (replay["step_map"]): :meth:`score`
            return {}
        generators = [torch.Generator().manual_seed(derive_seed(int(seed), PLAN_SEED_TAG)) for seed in seeds.tolist()]
        if self.canvas:
            return self._draw_uniform_plans(real, generators, num_plans)
        prompt_ids, completion_ids, real = prompt_ids.cpu(), completion_ids.cpu(), real.cpu()
        lengths = [int(length) for length in lengths.tolist()]
        masks_prompt = float(self.config.estimator_options.get("p_mask_prompt", 0.0)) > 0
        if masks_prompt:  # one group per prompt length, each with its real prompt tokens
            groups = {length: [i for i in range(n) if lengths[i] == length] for length in sorted(set(lengths))}
        else:  # the prompt is not read: one group
            groups = {width: list(range(n))}
        masked = weights = prompt_masked = None
        for length, members in groups.items():
            index = torch.tensor(members, dtype=torch.long)
            streams = SampleStreams([generators[i] for i in members])
            prompt, completion, mask = (prompt_ids.index_select(0, index)[:, width - length:],
                                        completion_ids.index_select(0, index), real.index_select(0, index))
            plans = [draw_plan(self.estimator, prompt, completion, mask, num_samples=self.config.num_mc_samples,
                               generator=streams, **self.config.estimator_options) for _ in range(num_plans)]
            group_masked = torch.stack([plan.completion_masked.transpose(0, 1) for plan in plans], dim=1)  # [g,E,D,L]
            group_weights = torch.stack([plan.weights.transpose(0, 1) for plan in plans], dim=1)  # [g, E, D, L]
            if masked is None:
                masked = group_masked.new_zeros((n, *group_masked.shape[1:]))
                weights = group_weights.new_zeros((n, *group_weights.shape[1:]))
            masked[index], weights[index] = group_masked, group_weights
            if plans[0].prompt_masked is not None:
                if not masks_prompt:
                    raise RuntimeError(f"estimator {self.estimator!r} masked the prompt without a p_mask_prompt option")
                group_prompt = torch.stack([torch.nn.functional.pad(plan.prompt_masked, (width - length, 0))
                                            .transpose(0, 1) for plan in plans], dim=1)  # [g, E, D, w]
                if prompt_masked is None:
                    prompt_masked = group_prompt.new_zeros((n, *group_prompt.shape[1:]))
                prompt_masked[index] = group_prompt
        out = {"plan_masked": masked.to(device), "plan_weights": weights.to(device)}
        if prompt_masked is not None:
            out["plan_prompt_masked"] = prompt_masked.to(device)
        return out

    def _draw_uniform_plans(self, real: Tensor, generators: list[torch.Generator], num_plans: int) -> dict[str, Tensor]:
        """Canvas models: each sample's ``num_plans`` uniform-noise plans (:func:`~mmrl.plugins.dllm.canvas.
        draw_uniform_plan`), plan ``e`` the ``e``-th draw of the sample's own generator.

        Shapes:
            → ``plan_masked`` bool, ``plan_tokens`` long and ``plan_weights`` float32 ``[N, E, D, G]``,
            ``plan_self_conditioning`` bool ``[N, E, D]``.
        """
        plans = [draw_uniform_plan(real.cpu(), canvas_length=self.adapter.canvas_length,
                                   vocab_size=self.adapter.vocab_size, num_samples=self.config.num_mc_samples,
                                   generators=generators, **self.config.estimator_options) for _ in range(num_plans)]
        device = real.device

        def stacked(name: str) -> Tensor:  # [D, N, ...] per plan -> [N, E, D, ...]
            return torch.stack([getattr(plan, name).transpose(0, 1) for plan in plans], dim=1).to(device)

        return {"plan_masked": stacked("corrupted"), "plan_tokens": stacked("tokens"),
                "plan_weights": stacked("weights"), "plan_self_conditioning": stacked("self_conditioning")}

    def score_module(self, module: nn.Module, replay: dict[str, Any], *, plan: int = 0) -> Tensor:
        """:meth:`score` with ``module``'s scorer, or for a canvas model :meth:`score_canvas` (``module`` may be
        wrapped for data parallelism)."""
        if self.canvas:
            return self.score_canvas(module, replay, plan=plan)
        return self.score(self.adapter.scorer(module), replay, plan=plan)

    def score_canvas(self, module: nn.Module, replay: dict[str, Any], *, plan: int = 0) -> Tensor:
        """Canvas models: the action log-probs of the samples in ``replay`` on their stored uniform-noise plan
        ``plan`` (:func:`~mmrl.plugins.dllm.canvas.canvas_token_logprobs`), grouped by prompt width as
        :meth:`score`.

        Shapes:
            → ``[n, A]`` float32: grpo, each real token's log-prob averaged over the draws (zero after the first
            EOS); wd1, their sum (divided by the real tokens with ``normalize_by_length``).
        """
        config, widths = self.config, replay["prompt_width"]
        encoder = self.runtime.unwrap(module).model.encoder
        parts, order = [], []
        for width in torch.unique(widths).tolist():
            rows = (widths == width).nonzero().squeeze(-1)
            prompt = replay["prompt_ids"].index_select(0, rows)[:, :width]
            completion = replay["completion_ids"].index_select(0, rows)
            real = replay["completion_mask"].index_select(0, rows)

            stored = {name: replay[name].index_select(0, rows)[:, plan].transpose(0, 1)  # [D, n, ...]
                      for name in ("plan_masked", "plan_tokens", "plan_self_conditioning", "plan_weights")}
            noise = UniformPlan(corrupted=stored["plan_masked"].bool(), tokens=stored["plan_tokens"].long(),
                                self_conditioning=stored["plan_self_conditioning"].bool(),
                                weights=stored["plan_weights"].float())
            token_logp = canvas_token_logprobs(
                module, prompt, padding_inputs(prompt, self.adapter.pad_id)[0], completion, real, noise,
                canvas_length=self.adapter.canvas_length, eos_id=self.adapter.eos_id,
                micro_batch=config.score_micro_batch, encoder=encoder)  # [D, n, G]
            scores = uniform_one_step_scores(token_logp, noise)  # [n, G]
            if not config.token_columns:  # wd1: the sequence estimate
                scores = scores.sum(dim=1, keepdim=True)
                if config.normalized:
                    scores = scores / real.sum(dim=1, keepdim=True).float().clamp(min=1.0)
            parts.append(scores)
            order.append(rows)
        scores = torch.cat(parts)
        index = torch.cat(order)
        return scores.index_select(0, torch.argsort(index.to(scores.device)))

    def score(self, scorer: Callable[[Tensor], Tensor], replay: dict[str, Any], *, plan: int = 0) -> Tensor:
        """The action log-probs of the samples in ``replay`` under ``scorer`` with their stored plan number ``plan``.

        Samples are grouped by prompt width (rollouts of different widths may have been concatenated; their prompts
        were right-padded with zeros then, and the first ``prompt_width`` columns are the sample's own prompt).

        Shapes:
            → ``[n, A]`` float32. grpo (``A = G`` token columns, zero after the first EOS unless ``score_tail``):
            one_step's or trace's
            per-token log-probs (their sum is the estimate; d1's and TraceRL's per-token ratio; trace's rows are
            rebuilt from ``replay["step_map"]``), or for the other estimators the sequence
            estimate divided by the number of real tokens in every real column (their sum is the estimate; the ratio
            of every token is the sequence ratio ``exp(ΔELBO / L)``). wd1: the estimate; spg: the ELBO and the EUBO;
            divided by the number of real tokens when ``normalize_by_length``.
        """
        config = self.config
        widths = replay["prompt_width"]
        parts, order = [], []
        for width in torch.unique(widths).tolist():
            rows = (widths == width).nonzero().squeeze(-1)
            prompt = replay["prompt_ids"].index_select(0, rows)[:, :width]
            completion = replay["completion_ids"].index_select(0, rows)
            scored = self.scored_positions(replay["completion_mask"].index_select(0, rows))  # [n, G]
            num_tokens = scored.sum(dim=1).float()
            prompt_masked = replay.get("plan_prompt_masked")
            if prompt_masked is not None:
                prompt_masked = prompt_masked.index_select(0, rows)[:, plan, :, :width].transpose(0, 1).bool()
            reduction, beta = ("eubo", float(config.estimator_options.get("beta", 1.5))) \
                if self.estimator == "spg_upper" else ("elbo", 1.0)
            if self.estimator == TRACE_ESTIMATOR:  # rebuilt from the trajectory, identically for π_θ, π_old, π_ref
                masks = trace_plan(prompt, completion, replay["completion_mask"].index_select(0, rows),
                                   step_map=replay["step_map"].index_select(0, rows), **config.estimator_options)
            else:
                masks = MaskPlan(
                    completion_masked=replay["plan_masked"].index_select(0, rows)[:, plan].transpose(0, 1).bool(),
                    weights=replay["plan_weights"].index_select(0, rows)[:, plan].transpose(0, 1).float(),
                    num_tokens=num_tokens, prompt_masked=prompt_masked, reduction=reduction, beta=beta,
                    name=self.estimator,
                )
            model = scorer
            if config.cfg_scale > 0:  # score the guided policy that sampled (d1's get_logits)
                model = guided(scorer, scale=config.cfg_scale, mask_id=self.adapter.mask_id,
                               pad_id=self.adapter.pad_id, prompt_length=width)
            token_logp = plan_token_logprobs(model, prompt, completion, masks, mask_id=self.adapter.mask_id,
                                             micro_batch=config.score_micro_batch)  # [D, n, L]
            if config.objective == "spg":  # one set of forwards, reduced two ways (SPG's ELBO and EUBO)
                lower = dataclasses.replace(masks, reduction="elbo")
                upper = dataclasses.replace(masks, reduction="eubo", beta=config.spg_beta)
                columns = [lower.reduce(token_logp), upper.reduce(token_logp)]
            else:
                columns = [masks.reduce(token_logp)]
            if config.token_columns:
                real = scored.to(token_logp.dtype)  # [n, G]
                if config.per_token:  # d1: each token's own (draw-averaged) log-prob, for a per-token ratio
                    scores = (masks.weights.to(token_logp.dtype) * token_logp).mean(dim=0)  # [n, G]
                else:  # the sequence estimate spread evenly: every token's ratio is exp(ΔELBO / L)
                    scores = real * (columns[0] / num_tokens.clamp(min=1.0)).unsqueeze(1)  # [n, G]
            else:
                scores = torch.stack(columns, dim=1)  # [n, A]
                if config.normalized:
                    scores = scores / num_tokens.clamp(min=1.0).unsqueeze(1)
            parts.append(scores)
            order.append(rows)
        scores = torch.cat(parts)
        index = torch.cat(order)
        return scores.index_select(0, torch.argsort(index.to(scores.device)))

    # ------------------------------------------------------------------ reference and export
    def reference_module(self) -> nn.Module | None:
        """Full fine-tuning's frozen copy of the initial model (None with LoRA)."""
        return self.reference

    def _reference_module(self, policy: nn.Module) -> AbstractContextManager[nn.Module]:
        """The reference policy: the model with its LoRA adapter disabled, or the frozen copy."""
        return reference_policy(self.runtime.unwrap(policy), self.reference)

    def export(self, policy: nn.Module, directory: str | Path) -> str:
        """LoRA: the peft adapter folder (``PeftModel.from_pretrained(base, directory)``). Full fine-tuning: the
        model's ``save_pretrained`` folder with its tokenizer (``AutoModelForMaskedLM`` for the toy's BERT, or the
        family's class with ``trust_remote_code`` for LLaDA and Dream, and ``AutoTokenizer``)."""
        fmt = super().export(policy, directory)
        if fmt == "pretrained":
            self.adapter.tokenizer.save_pretrained(str(directory))
        return fmt

    # ------------------------------------------------------------------ data
    def _load_rows(self, split: str) -> list[dict[str, Any]]:
        config = self.config
        if config.dataset == "toy_addition":
            return toy.addition_splits(eval_size=config.eval_size, train_size=config.train_size,
                                       seed=config.data_seed)[split]
        source = config.dataset if split == "train" else config.eval_dataset
        path = Path(config.dataset if source is None else source).expanduser()
        if path.is_dir():
            path = path / ("train.jsonl" if split == "train" else "test.jsonl")
        elif split == "eval" and source is None:
            return []  # a single training file and no eval_dataset: nothing held out
        if not path.is_file():
            raise FileNotFoundError(f"dllm plugin: no {split} rows at {path} (plugin.dataset / plugin.eval_dataset)")
        rows = read_jsonl_prompts(path)
        limit = config.train_size if split == "train" else config.eval_size
        return rows[:limit] if limit else rows


__all__ = ["DLLMLoraConfig", "DLLMPlugin", "DLLMPluginConfig"]
