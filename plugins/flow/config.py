"""The ``plugin:`` section of the flow plugin (``name: flow``): its options, their validation, the adapter class it
names and the prompt rows it points at. :mod:`mmrl.plugins.flow.plugin` re-exports :class:`FlowPluginConfig` and
:class:`FlowLoraConfig`; docs/flow.md has the options table."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mmrl.config import ConfigError, config_field
from mmrl.plugins.flow.credit import CreditConfig, credit_strategies
from mmrl.plugins.flow.dgpo import DGPOConfig
from mmrl.plugins.flow.matching import MatchingConfig
from mmrl.plugins.flow.nft import NFTConfig
from mmrl.plugins.flow.schedule import default_window_range, trained_step_count
from mmrl.policy import lora_config_class
from mmrl.prompts import read_prompt_file

if TYPE_CHECKING:
    from mmrl.plugins.flow.sde import SDEKind

FlowLoraConfig = lora_config_class(
    "FlowLoraConfig", __name__, rank=32, alpha=64.0, init="gaussian",
    doc="LoRA on the transformer (:class:`mmrl.policy.LoraConfig` with Flow-GRPO's defaults). ``plugin.lora: null`` "
    "trains the whole transformer instead.",
    refs={"rank": "Flow-GRPO: 32 (SD3.5), 64 (FLUX); DanceGRPO: 128",
          "alpha": "Flow-GRPO: 64 (SD3.5), 128 (FLUX); DanceGRPO: 256", "init": "Flow-GRPO: gaussian"},
    targets_help="Module-name suffixes to adapt (peft matching). Null: the adapter's defaults (SD3: attention "
    "q/k/v/out of both streams; FLUX: also the feed-forward layers).",
)


@dataclass
class FlowPluginConfig:
    """The ``plugin:`` section of the flow plugin (``name: flow``)."""

    model: str = config_field(help="A diffusers pipeline folder or hub id, e.g. stabilityai/stable-diffusion-3.5-"
                              "medium or black-forest-labs/FLUX.1-dev.")
    adapter: str = config_field(
        "auto", help="Model adapter: 'sd3', 'flux', 'flux_kontext', 'qwen_image', 'qwen_image_edit', 'qwen_image21', "
        "'qwen_image21_edit', 'flux2', 'flux2_klein', 'flux2_edit', 'flux2_klein_edit', 'wan', 'wan_i2v', 'z_image', "
        "'hunyuan_video15', 'hunyuan_video15_i2v', 'ltx2', 'ltx2_i2v', 'wan_v2v', 'flux3', 'chroma', 'sana', "
        "'longcat_image', 'longcat_image_edit' or another registered one (`mmrl list`); 'auto' reads "
        "model_index.json (a local modular pipeline's modular_model_index.json: FLUX.3; the *_edit adapters "
        "sharing a text-to-image pipeline class are chosen by name only)."
    )
    lora: FlowLoraConfig | None = config_field(
        default_factory=FlowLoraConfig, help="LoRA options; null for full fine-tuning of the transformer."
    )
    gradient_checkpointing: bool = config_field(False, help="Recompute transformer activations in the backward.")
    resolution: int = config_field(
        512, minimum=1, help="Image (video frame) side in pixels: the height and width wherever plugin.height or "
        "plugin.width is null (square images by default).",
        ref="Flow-GRPO and DanceGRPO image runs: 512 (DanceGRPO FLUX: 720)",
    )
    height: int | None = config_field(
        None, minimum=1, help="Image (video frame) height in pixels, as the diffusers pipelines' height=; a multiple "
        "of the adapter's VAE factor x patch size (16 for the shipped families, 32 for Qwen-Image 2.1). Null: "
        "resolution.",
        ref="Wan2.1 480p: height 480, width 832",
    )
    width: int | None = config_field(
        None, minimum=1, help="Image (video frame) width in pixels, as the diffusers pipelines' width=; the same "
        "multiple as height. Null: resolution.", ref="Wan2.1 480p: height 480, width 832",
    )
    eval_height: int | None = config_field(
        None, minimum=1, eval_only=True,
        help="Image (video frame) height of evaluation rollouts, the same multiple as height; the input images of "
        "an editing run are brought to it too. Null: the training height.",
        ref="Flow-Factory examples: train at 384 px, evaluate at 512 or 1024 (eval.resolution)",
    )
    eval_width: int | None = config_field(
        None, minimum=1, eval_only=True,
        help="Image (video frame) width of evaluation rollouts. Null: the training width.",
        ref="Flow-Factory examples: train at 384 px, evaluate at 512 or 1024 (eval.resolution)",
    )
    condition_size: list[int] | None = config_field(
        None, help="[height, width] in pixels that image-editing adapters (flux_kontext, qwen_image_edit, "
        "qwen_image21_edit, flux2_edit, flux2_klein_edit) bring every input image to, the same multiple as height; "
        "with buckets, the input images' area (each at its bucket's aspect ratio). Null: the generated size. The "
        "pipelines size input images on their own (Qwen-Image-Edit: about 1024x1024 whatever the output; "
        "Qwen-Image 2.1: output_resolution² at each input's aspect ratio).",
        ref="Flow-Factory condition_image_size; QwenImageEditPlusPipeline VAE_IMAGE_SIZE = 1024*1024",
    )
    eval_condition_size: list[int] | None = config_field(
        None, eval_only=True, help="[height, width] of input images at evaluation. Null: condition_size, itself "
        "null: the evaluation size.", ref="Flow-Factory examples: eval condition_image_size 1024",
    )
    buckets: list[list[int]] | None = config_field(
        None, help="Aspect-ratio buckets: a list of [height, width] output sizes in pixels (each side the same "
        "multiple as height). Every prompt row is generated at the bucket whose aspect ratio is nearest its own: an "
        "editing or image-to-video row's input image's (the image its pipeline sizes the output by), a text-to-image "
        "row's 'aspect_ratio' (width / height, or \"W:H\"), else height x width's; each training step draws its "
        "prompts from one bucket. Null: every row at height x width.",
        ref="FluxKontextPipeline PREFERRED_KONTEXT_RESOLUTIONS; QwenImageEdit(Plus)Pipeline: output at 1024x1024 "
        "area with the input's aspect ratio; Flow-Factory auto_resize",
    )
    eval_buckets: list[list[int]] | None = config_field(
        None, eval_only=True, help="Aspect-ratio buckets of evaluation rollouts, as buckets. Null: buckets.",
        ref="Flow-Factory examples: evaluate at 1024 px (Qwen-Image-Edit) with the input's aspect ratio",
    )
    num_frames: int | None = config_field(
        None, minimum=1, help="Frames per video for video adapters (wan, hunyuan_video15), 1 + a multiple of the VAE's "
        "temporal factor (Wan, HunyuanVideo 1.5: 4). Null: the adapter's default (Wan 33, HunyuanVideo 1.5 121); "
        "image adapters take null only.",
        ref="DanceGRPO HunyuanVideo: 53 frames at 480x480; WanPipeline default: 81",
    )
    num_steps: int = config_field(10, minimum=1, help="Denoising steps of a training rollout.",
                                  ref="Flow-GRPO denoising reduction: 10 (SD3.5), 6 (FLUX)")
    eval_num_steps: int = config_field(40, minimum=1, eval_only=True,
                                       help="Denoising steps of an evaluation (plain ODE).",
                                       ref="Flow-GRPO eval: 40 (SD3.5), 28 (FLUX)")
    guidance_scale: float | None = config_field(
        None, minimum=0.0, help="Guidance of training rollouts (true CFG scale, or FLUX's guidance embedding). "
        "Null: the adapter's default (SD3 4.5, or 1.0 with cfg false; FLUX 3.5; Z-Image 5.0, or 0.0 with cfg false: "
        "ZImagePipeline's scale, standard CFG at 1 + w).", ref="Flow-GRPO: 4.5 (SD3.5)",
    )
    eval_guidance_scale: float | None = config_field(None, minimum=0.0, eval_only=True,
                                                     help="Guidance at evaluation (null: guidance_scale).")
    guidance_scale_2: float | None = config_field(
        None, minimum=0.0,
        help="CFG scale of the steps the low-noise expert (transformer_2) takes in a two-expert Wan 2.2 pipeline "
        "(boundary_ratio), in rollouts, the training forward and evaluation alike; the high-noise steps take "
        "guidance_scale (eval_guidance_scale at evaluation). Null: the same scale as the high-noise steps "
        "(WanPipeline's guidance_scale_2 rule). Refused for other pipelines.",
        ref="Wan2.2-T2V-A14B: guidance 4.0 high-noise, 3.0 low-noise (Wan-Video/Wan2.2 wan_t2v_A14B.py)",
    )
    train_experts: list[Literal["transformer", "transformer_2"]] | None = config_field(
        None, help="Which experts of a two-expert Wan 2.2 pipeline train (a LoRA on each, or full fine-tuning of "
        "each): 'transformer' (high-noise: timesteps >= boundary_ratio*1000) and/or 'transformer_2' (low-noise). "
        "The others stay frozen; their steps are still sampled but give no gradient. Null: every expert (one "
        "transformer for other pipelines, where only null or [transformer] is allowed).",
        ref="Flow-Factory Wan2.2 LoRA recipe: target_components [transformer, transformer_2]",
    )
    cfg: bool | None = config_field(
        None, help="True classifier-free guidance (an unconditional pass with negative_prompt) in rollouts and in "
        "the training forward. Null: on for SD3, off for FLUX (guidance-distilled, no CFG pass) and Qwen-Image 2.1 "
        "(sampled without guidance).",
        ref="Flow-GRPO train.cfg",
    )
    negative_prompt: str = config_field("", help="Negative prompt of the unconditional pass.",
                                        ref="Flow-GRPO eval protocol: ''")
    cfg_normalization: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True,
        help="Z-Image only (with cfg): caps each sample's guided velocity at this multiple of its conditional "
        "velocity's norm (over the whole latent), in rollouts, the training forward and evaluation alike "
        "(ZImagePipeline's cfg_normalization; its true is 1.0). Null: no cap, the pipeline's default.",
        ref="diffusers ZImagePipeline cfg_normalization; Flow-Factory z_image.py",
    )
    cfg_truncation: float | None = config_field(
        None, minimum=0.0, maximum=1.0,
        help="Z-Image only (with cfg): no guidance (the conditional velocity alone) at the steps whose "
        "(1000 - timestep)/1000 = 1 - sigma exceeds it, late in sampling (ZImagePipeline's cfg_truncation). Null: "
        "guidance at every step (the pipeline's default 1.0).",
        ref="diffusers ZImagePipeline cfg_truncation; Flow-Factory z_image.py",
    )
    adapter_options: dict[str, Any] = config_field(
        default_factory=dict,
        help="Settings only one model family has, by name, in rollouts, the training forward and evaluation alike: "
        "each adapter documents the keys it takes (ltx2: its audio CFG scale, guidance rescale, spatio-temporal and "
        "modality-isolation guidance, frame rate; ltx2_i2v: those and the input image's image_crf; wan_v2v: "
        "strength; chroma: text_mask; sana: complex_human_instruction; longcat_image: enable_cfg_renorm, "
        "cfg_renorm_min; docs/flow.md section 15) and refuses any other in one line. Empty: the pipeline's defaults.",
    )
    sde: str = config_field(
        "flow_grpo", help="SDE of the stochastic steps: flow_grpo, dance_grpo, cps or another stochastic kind "
        "registered in mmrl.plugins.flow.sde.sde_kind_registry (`mmrl list`: sde_kinds; mmrl.plugins.flow.sde).",
        ref="Flow-GRPO arXiv:2505.05470; DanceGRPO arXiv:2505.07818; CPS arXiv:2509.05952",
    )
    noise_level: float = config_field(
        0.7, minimum=0.0, exclusive_minimum=True,
        help="a of the flow_grpo SDE, η of dance_grpo (0.3), the angle fraction of cps (0.8). Above 0: with 0 every "
        "step is deterministic, with nothing to train and an undefined KL.",
        ref="Flow-GRPO: 0.7 (SD3.5), 0.9 (FLUX); DanceGRPO: 0.3",
    )
    cps_log_prob: Literal["flow_grpo", "gaussian"] = config_field(
        "flow_grpo", help="The log-prob of a cps step: Flow-GRPO's CPS objective -mean((x' - mu)^2) (its clip range "
        "1e-5), or 'gaussian', the exact log-density. Warning: the exact density scales as 1/(2 std^2) with std = "
        "sigma_next*sin(a*pi/2): 0.6 at step 0 and 6934 at step 8 of SD3.5's 10-step grid, so the last trained steps "
        "dominate the gradient and no single clip range fits every step. Ignored by the other sde kinds.",
        ref="Flow-GRPO code: sd3_sde_with_logprob.py, cps 'remove all constants'",
    )
    train_steps: Literal["fraction", "random", "window"] = config_field(
        "fraction", help="Which steps are trained: the first timestep_fraction of them (Flow-GRPO), a random "
        "timestep_fraction per sample (DanceGRPO), or an SDE window with ODE outside it (Flow-GRPO-Fast).",
    )
    timestep_fraction: float = config_field(
        0.99, minimum=0.0, exclusive_minimum=True, maximum=1.0,
        help="Fraction of steps trained in the fraction and random modes.", ref="Flow-GRPO: 0.99; DanceGRPO: 0.6",
    )
    window_size: int = config_field(3, minimum=1, help="SDE steps of the window mode (all trained).",
                                    ref="Flow-GRPO-Fast sde_window_size")
    window_range: list[int] | None = config_field(
        None, help="[lo, hi): the window lies within steps lo..hi-1. Null: [0, num_steps/2), the high-noise half.",
        ref="Flow-GRPO-Fast sde_window_range",
    )
    share_initial_noise: bool = config_field(
        False, help="All samples of a prompt start from the same noise (drawn from the group id), so they differ "
        "only through SDE noise.", ref="DanceGRPO --init_same_noise",
    )
    static_shift: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True,
        help="Null: training rollouts step on the pipeline's own sigma grid (FLUX: its resolution-dependent dynamic "
        "shift). A number s: the grid of DanceGRPO's trainers, sigma_i = s*t/(1 + (s-1)*t) on t = 1 - i/S, whatever "
        "the resolution. Evaluation keeps the pipeline's grid.",
        ref="DanceGRPO, MixGRPO, BranchGRPO, GCPO FLUX/Wan/Qwen-Image scripts: --shift 3",
    )
    decode_latent: Literal["sample", "predicted_x0"] = config_field(
        "sample", help="The latent a training rollout decodes for its rewards: 'sample', the state after the last "
        "step (with that step's SDE noise), or 'predicted_x0', the last step's prediction of the clean latent, "
        "x - sigma*v at the last step's input (a deterministic last step ends there anyway; an ODE tail decodes its "
        "solver's end). Evaluation decodes its ODE's end.",
        ref="DanceGRPO, BranchGRPO and GCPO trainers: predicted_x0; Flow-GRPO: sample",
    )
    kl_variance: Literal["flow_grpo", "transition", "none"] = config_field(
        "flow_grpo", help="Denominator of the KL between means: Flow-GRPO's 2·s² (its β values assume it), the "
        "exact transition variance 2·s²·Δ, or none (the mean squared distance of the means, the CPS authors' KL).",
        ref="Flow-GRPO code; flow_grpo#22; FlowCPS scripts/train_sd3.py",
    )
    dataset: str | None = config_field(
        None, help="Training prompts: a .txt file (one per line), a .jsonl file (objects with 'prompt' and any "
        "metadata rewards read), or a folder with train/test files (train.txt or train_metadata.jsonl, ...). An "
        "image-conditioned adapter (flux_kontext, qwen_image_edit, flux2_edit, wan_i2v, ...) needs a .jsonl whose "
        "rows also name the 'image' to edit or start from (a path relative to the file).",
    )
    eval_dataset: str | None = config_field(None, eval_only=True, help="Evaluation prompts file (default: the test "
                                            "file of a dataset folder).")
    prompts: list[str] | None = config_field(None, help="Training prompts given inline (instead of dataset).")
    eval_prompts: list[str] | None = config_field(None, eval_only=True, help="Evaluation prompts given inline.")
    max_sequence_length: int | None = config_field(
        None, minimum=1, help="T5 tokens per prompt (null: the pipeline's default, SD3 256, FLUX 512)."
    )
    embedding_cache_size: int = config_field(
        1024, minimum=1, help="Prompts whose text embeddings are kept on the device (least recently used first out); "
        "image-conditioned adapters keep as many input images' encodings (and their (prompt, image) text encodings)."
    )
    transformer_batch_size: int | None = config_field(
        None, minimum=1,
        help="Run the transformer on fixed batches of this many samples, padding the last one, in rollouts and in "
        "the training forward alike, so kernels see the same shapes whatever the micro-batch and batch-size-"
        "dependent numerics cannot break ratio == 1 (on CPU the velocities become bit-identical). Set it to "
        "algorithm.micro_batch_size. Null: the batch as it comes.",
        ref="flow_grpo#104, DanceGRPO#57 (batch-dependent kernels break ratio == 1)",
    )
    likelihood: Literal["sde", "matching", "nft", "dgpo"] = config_field(
        "sde", help="The log-prob of an action: 'sde', the Gaussian density of each trained SDE step (Flow-GRPO, "
        "DanceGRPO and the credit strategies), 'matching', Advantage Weighted Matching: the weighted, negated "
        "flow-matching loss of the final sample at plugin.matching.num_times noised copies, one action column each "
        "(plugin.matching; docs/flow.md section 16), or 'nft', DiffusionNFT: the implicit positive and negative "
        "policies' x0 errors at int(num_steps*timestep_fraction) grid times of the final sample, two columns per "
        "time, for algorithm.policy_loss nft; rollouts sample with the old (EMA) policy (plugin.nft; section 17), "
        "or 'dgpo', DGPO: the negated flow-matching error of the final sample at plugin.dgpo.num_times grid times "
        "shared by the step, with noise shared within each group, and the reference's, for algorithm.policy_loss "
        "dgpo (plugin.dgpo; section 18).",
        ref="AWM arXiv:2509.25050; scxue/advantage_weighted_matching; DiffusionNFT arXiv:2509.16117, "
        "NVlabs/DiffusionNFT; DGPO arXiv:2510.08425, Luo-Yihong/DGPO",
    )
    matching: MatchingConfig = field(default_factory=MatchingConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    dgpo: DGPOConfig = field(default_factory=DGPOConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)

    def validate(self, path: str) -> None:
        from mmrl.plugins.flow.adapters import flow_adapters

        if self.adapter != "auto" and self.adapter not in flow_adapters:
            raise ConfigError(f"{path}.adapter", self.adapter, f"'auto' or one of {', '.join(flow_adapters.names())}")
        self._check_sde_kind(path)
        if self.likelihood == "matching":
            self._check_matching(path)
        if self.likelihood == "nft":
            self._check_nft(path)
        if self.likelihood == "dgpo":
            self._check_dgpo(path)
        highest = self.sde_kind().max_noise_level
        if highest is not None and self.noise_level > highest:
            raise ConfigError(f"{path}.noise_level", self.noise_level, f"a number in (0, {highest:g}] for sde "
                              f"{self.sde!r}")
        strategy = credit_strategies.get(self.credit.strategy)
        if strategy.uses_step_selection:
            if self.train_steps == "random" and self.num_steps < 2:
                raise ConfigError(f"{path}.num_steps", self.num_steps, "at least 2 with train_steps 'random'")
            if self.step_selection_count() < 1:
                raise ConfigError(f"{path}.timestep_fraction", self.timestep_fraction,
                                  f"a fraction that trains at least one of the {self.num_steps} steps")
            if self.train_steps == "window":
                if self.window_size > self.num_steps:
                    raise ConfigError(f"{path}.window_size", self.window_size,
                                      f"at most num_steps ({self.num_steps})")
                lo, hi = self.resolved_window_range()
                if not 0 <= lo < hi <= self.num_steps or hi - lo < self.window_size:
                    raise ConfigError(f"{path}.window_range", self.window_range,
                                      f"[lo, hi] with 0 <= lo < hi <= {self.num_steps} and hi - lo >= window_size")
            if self.likelihood == "sde":  # matching rollouts train no SDE step
                self._refuse_a_deterministic_last_step(path)
        strategy(self).validate(self, f"{path}.credit")
        if self.train_experts is not None and (not self.train_experts
                                               or len(set(self.train_experts)) != len(self.train_experts)):
            raise ConfigError(f"{path}.train_experts", self.train_experts, "null or a non-empty list of distinct "
                              "experts among transformer, transformer_2")
        if self.guidance_scale_2 is not None and self.cfg is False and self.guidance_scale_2 != 1.0:
            raise ConfigError(f"{path}.guidance_scale_2", self.guidance_scale_2, "null or 1.0 with plugin.cfg false: "
                              "the experts are guided only through the unconditional pass that cfg: false turns off")
        for key in ("condition_size", "eval_condition_size"):
            size = getattr(self, key)
            if size is not None and (len(size) != 2 or any(isinstance(side, bool) or not isinstance(side, int)
                                                            or side < 1 for side in size)):
                raise ConfigError(f"{path}.{key}", size, "null or [height, width], two positive integers (pixels)")
        for key in ("buckets", "eval_buckets"):
            buckets = getattr(self, key)
            if buckets is not None and (not isinstance(buckets, list) or not buckets or any(
                    not isinstance(size, list) or len(size) != 2 or any(
                        isinstance(side, bool) or not isinstance(side, int) or side < 1 for side in size)
                    for size in buckets)):
                raise ConfigError(f"{path}.{key}", buckets, "null or a non-empty list of [height, width] sizes, each "
                                  "two positive integers (pixels)")
            if buckets is not None and len({tuple(size) for size in buckets}) != len(buckets):
                raise ConfigError(f"{path}.{key}", buckets, "distinct [height, width] sizes")
        if self.eval_buckets is not None and self.buckets is None:
            raise ConfigError(f"{path}.eval_buckets", self.eval_buckets, "null without plugin.buckets (evaluation "
                              "then runs at eval_height x eval_width)")
        for key in ("eval_height", "eval_width"):
            if self.buckets is not None and getattr(self, key) is not None:
                raise ConfigError(f"{path}.{key}", getattr(self, key), "null with plugin.buckets: evaluation sizes "
                                  "are set by plugin.eval_buckets then")
        if (self.dataset is None) == (self.prompts is None):
            raise ConfigError(f"{path}.dataset", self.dataset, "exactly one of dataset (a file or folder) and prompts")
        if self.prompts is not None and not self.prompts:
            raise ConfigError(f"{path}.prompts", self.prompts, "a non-empty list of prompts")

    def _refuse_sde_credit(self, path: str, likelihood: str) -> None:
        """The forward-process likelihoods (``matching``, ``nft``) take Flow-GRPO's uniform credit only and none of the
        credit options that act on SDE transition log-probs."""
        credit = self.credit
        if credit.strategy != "step":
            raise ConfigError(f"{path}.credit.strategy", credit.strategy, f"'step' with plugin.likelihood {likelihood} "
                              "(its actions are training times of the final sample, not denoising steps to credit)")
        for key in ("ratio_norm", "ratio_norm_reweight", "noise_weighting"):
            if getattr(credit, key):
                raise ConfigError(f"{path}.credit.{key}", True, f"false with plugin.likelihood {likelihood} (it acts "
                                  f"on SDE transition log-probs, which {likelihood} has none of)")

    def _check_matching(self, path: str) -> None:
        """``likelihood: matching`` takes Flow-GRPO's uniform credit only and none of the options that shape SDE
        log-probs; the discrete time samplers need a grid step in each stratum."""
        self._refuse_sde_credit(path, "matching")
        for key, default in (("train_steps", "fraction"), ("cps_log_prob", "flow_grpo"),
                             ("kl_variance", "flow_grpo")):
            if getattr(self, key) != default:
                raise ConfigError(f"{path}.{key}", getattr(self, key), f"{default!r} with plugin.likelihood matching "
                                  "(an SDE log-prob option; matching's are under plugin.matching)")
        if self.share_initial_noise and self.matching.sde_sigma_range is None:
            raise ConfigError(f"{path}.share_initial_noise", True, "false with plugin.likelihood matching and ODE "
                              "rollouts (matching.sde_sigma_range null): the samples of a group would be identical")
        self.matching.check_grid(f"{path}.matching", self.num_steps, self.timestep_fraction)

    def _check_nft(self, path: str) -> None:
        """``likelihood: nft`` takes Flow-GRPO's uniform credit only and none of the SDE log-prob options; its
        deterministic rollouts need each sample's own initial noise and at least one trained time."""
        self._refuse_sde_credit(path, "nft")
        for key, default in (("train_steps", "fraction"), ("cps_log_prob", "flow_grpo"),
                             ("kl_variance", "flow_grpo"), ("decode_latent", "sample")):
            if getattr(self, key) != default:
                raise ConfigError(f"{path}.{key}", getattr(self, key), f"{default!r} with plugin.likelihood nft "
                                  "(its rollouts are deterministic and train no SDE step; nft's options are under "
                                  "plugin.nft)")
        if self.share_initial_noise:
            raise ConfigError(f"{path}.share_initial_noise", True, "false with plugin.likelihood nft (deterministic "
                              "rollouts: the samples of a group would be identical)")
        if self.nft_num_times() < 1:
            raise ConfigError(f"{path}.timestep_fraction", self.timestep_fraction, f"a fraction with int(num_steps * "
                              f"fraction) >= 1 with plugin.likelihood nft (the trained times; num_steps "
                              f"{self.num_steps})")

    def _check_dgpo(self, path: str) -> None:
        """``likelihood: dgpo`` takes Flow-GRPO's uniform credit only and none of the SDE log-prob options; its ODE
        rollouts need each sample's own initial noise, and its M times distinct grid steps among the first
        ``trunc_steps + 1``."""
        self._refuse_sde_credit(path, "dgpo")
        for key, default in (("train_steps", "fraction"), ("cps_log_prob", "flow_grpo"),
                             ("kl_variance", "flow_grpo"), ("decode_latent", "sample")):
            if getattr(self, key) != default:
                raise ConfigError(f"{path}.{key}", getattr(self, key), f"{default!r} with plugin.likelihood dgpo "
                                  "(its rollouts are ODE and train no SDE step; dgpo's options are under plugin.dgpo)")
        if self.share_initial_noise:
            raise ConfigError(f"{path}.share_initial_noise", True, "false with plugin.likelihood dgpo (ODE rollouts: "
                              "the samples of a group would be identical)")
        dgpo = self.dgpo
        if dgpo.trunc_steps >= self.num_steps:
            raise ConfigError(f"{path}.dgpo.trunc_steps", dgpo.trunc_steps, f"at most num_steps - 1 "
                              f"({self.num_steps - 1}): the times are grid steps 0..trunc_steps")
        if dgpo.num_times > dgpo.trunc_steps + 1:
            raise ConfigError(f"{path}.dgpo.num_times", dgpo.num_times, f"at most trunc_steps + 1 "
                              f"({dgpo.trunc_steps + 1}): distinct grid steps among 0..trunc_steps")
        if dgpo.switch_ema_ref is not None and not dgpo.ema_ref:
            raise ConfigError(f"{path}.dgpo.switch_ema_ref", dgpo.switch_ema_ref, "null with dgpo.ema_ref false (the "
                              "rollouts would sample with a fast EMA that is not kept); set ema_ref: true")

    def nft_num_times(self) -> int:
        """K of ``likelihood: nft``: ⌊num_steps·timestep_fraction⌋ grid times per sample (upstream's
        ``num_train_timesteps``, train_nft_sd3.py:L569)."""
        return int(self.num_steps * self.timestep_fraction)

    def _check_sde_kind(self, path: str) -> None:
        """``sde`` names a stochastic kind of the registry (built-in or registered by a package); the deterministic
        ``ode`` kind has no log-prob to train."""
        from mmrl.plugins.flow.sde import sde_kind_registry, sde_kinds

        stochastic = [kind for kind in sde_kinds() if sde_kind_registry.get(kind).stochastic]
        if self.sde not in stochastic:
            raise ConfigError(f"{path}.sde", self.sde, f"a stochastic SDE kind registered in sde_kind_registry: "
                              f"{', '.join(stochastic)}")

    def sde_kind(self) -> type[SDEKind]:
        """The class of ``sde`` in the SDE-kind registry (its properties: :attr:`SDEKind.stochastic`,
        :attr:`SDEKind.max_noise_level`, :attr:`SDEKind.deterministic_last_step`)."""
        from mmrl.plugins.flow.sde import sde_kind_registry

        return sde_kind_registry.get(self.sde)

    def _refuse_a_deterministic_last_step(self, path: str) -> None:
        """With a kind whose last step is deterministic (:attr:`SDEKind.deterministic_last_step`: ``cps``, whose std
        σ_next·sin(a·π/2) is 0 at σ_next = 0) that step has no log-prob to train (0, no gradient) and its KL to the
        reference is infinite (means that differ) or NaN (equal means), so a step selection that can train it is
        refused. Flow-GRPO never trains that step either (``num_train_timesteps = num_steps - 1``; its CPS configs
        keep the SDE window within the first half). The credit strategies that choose their own steps refuse it in
        their own checks (branch points, tree splits, the sliding window's range)."""
        if not self.sde_kind().deterministic_last_step:
            return
        last = self.num_steps - 1
        if self.train_steps == "fraction" and self.step_selection_count() > last:
            raise ConfigError(f"{path}.timestep_fraction", self.timestep_fraction,
                              f"a fraction that leaves out the last of the {self.num_steps} steps with sde "
                              f"{self.sde!r} (its last step is deterministic: no log-prob, infinite KL), e.g. 0.99")
        if self.train_steps == "window" and self.resolved_window_range()[1] > last:
            raise ConfigError(f"{path}.window_range", self.window_range,
                              f"[lo, hi] with hi <= {last} with sde {self.sde!r} (the window must not reach the "
                              "deterministic last step: no log-prob, infinite KL)")

    def num_actions(self) -> int:
        """A, the width of the action axis (trained steps per sample for 'step'; see the credit strategy; the
        training times with ``likelihood: matching``)."""
        if self.likelihood == "matching":
            return self.matching.num_times
        if self.likelihood == "nft":  # (e⁺, e⁻) per time
            return 2 * self.nft_num_times()
        if self.likelihood == "dgpo":
            return self.dgpo.num_times
        return credit_strategies.get(self.credit.strategy)(self).num_actions(self)

    def step_selection_count(self) -> int:
        """Steps per sample that plugin.train_steps trains (the action budget of 'step' and 'chunk')."""
        return trained_step_count(self.train_steps, self.num_steps, timestep_fraction=self.timestep_fraction,
                                  window_size=self.window_size)

    def size_options(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """``((key, height), (key, width))``: each side in pixels and the option that sets it (``height`` or
        ``width``, or ``resolution`` where that one is null), so an error names the option the user wrote."""
        height = ("resolution", self.resolution) if self.height is None else ("height", self.height)
        width = ("resolution", self.resolution) if self.width is None else ("width", self.width)
        return height, width

    def resolved_size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels of every generated image (video frame) of training rollouts."""
        (_, height), (_, width) = self.size_options()
        return height, width

    def resolved_eval_size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels of evaluation rollouts: ``eval_height`` / ``eval_width``, else the training
        size's."""
        height, width = self.resolved_size()
        return self.eval_height or height, self.eval_width or width

    def resolved_condition_sizes(self) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """``(training, evaluation)`` input-image sizes, None where they follow the generated size."""
        training = None if self.condition_size is None else (self.condition_size[0], self.condition_size[1])
        evaluation = training if self.eval_condition_size is None else (self.eval_condition_size[0],
                                                                         self.eval_condition_size[1])
        return training, evaluation

    def resolved_buckets(self, split: str) -> list[tuple[int, int]] | None:
        """The ``(height, width)`` buckets of ``split`` ('train': ``buckets``; 'eval': ``eval_buckets``, else
        ``buckets``), None without buckets."""
        chosen = self.eval_buckets if split == "eval" and self.eval_buckets is not None else self.buckets
        return None if chosen is None else [(int(size[0]), int(size[1])) for size in chosen]

    def resolved_window_range(self) -> tuple[int, int]:
        if self.window_range is None:
            return default_window_range(self.num_steps, self.window_size)
        if len(self.window_range) != 2:
            raise ConfigError("plugin.window_range", self.window_range, "two integers [lo, hi]")
        return int(self.window_range[0]), int(self.window_range[1])

    def resolved_guidance_scales(self, adapter_default: float, *, guided_by_cfg: bool = False,
                                 unguided: float = 1.0, cfg: bool | None = None) -> tuple[float, float]:
        """(rollout, evaluation) guidance scales: ``guidance_scale`` (null: ``adapter_default``, the adapter's) and
        ``eval_guidance_scale`` (null: the rollout's). For a model guided only by the CFG pass (``guided_by_cfg``:
        SD3) without the pass (``cfg``, the resolved switch; None: this config's ``cfg``) the default is
        ``unguided``, the scale at which the adapter's guidance is the conditional velocity alone (1.0 for
        v_u + w·(v_c − v_u); 0.0 for Z-Image's v_c + w·(v_c − v_u)), and any other value is refused: it would be
        silently ignored."""
        if guided_by_cfg and (self.cfg if cfg is None else cfg) is False:
            for key in ("guidance_scale", "eval_guidance_scale"):
                value = getattr(self, key)
                if value is not None and value != unguided:
                    raise ConfigError(f"plugin.{key}", value, f"null or {unguided} with plugin.cfg false: the model is "
                                      "guided only through the unconditional pass that cfg: false turns off")
            adapter_default = unguided
        rollout = adapter_default if self.guidance_scale is None else self.guidance_scale
        return rollout, rollout if self.eval_guidance_scale is None else self.eval_guidance_scale

    def resolved_expert_guidance_scales(self, rollout: float, evaluation: float) -> tuple[tuple[float, float],
                                                                                          tuple[float, float]]:
        """(rollout, evaluation) ``(high-noise, low-noise)`` pairs of a two-expert pipeline from the resolved
        single scales: the low-noise scale is ``guidance_scale_2``, or each phase's own scale when it is null
        (``WanPipeline.__call__``: ``guidance_scale_2 = guidance_scale`` when it is None)."""
        low = self.guidance_scale_2
        return (rollout, rollout if low is None else low), (evaluation, evaluation if low is None else low)


def adapter_class(config: FlowPluginConfig) -> Any:
    """The :class:`~mmrl.plugins.flow.adapters.base.FlowAdapter` subclass ``config.adapter`` names ('auto': the one
    registered for the pipeline class in the model's model_index.json, or a local modular pipeline's
    modular_model_index.json)."""
    from mmrl.plugins.flow.adapters import adapter_for_pipeline, flow_adapters
    from mmrl.plugins.flow.adapters.base import read_model_index

    if config.adapter != "auto":
        return flow_adapters.get(config.adapter)
    folder = Path(config.model).expanduser()
    modular = folder / "modular_model_index.json"  # a diffusers modular pipeline's folder (FLUX.3)
    if folder.is_dir() and modular.is_file() and not (folder / "model_index.json").is_file():
        return adapter_for_pipeline(str(json.loads(modular.read_text()).get("_class_name")), config.model)
    index = read_model_index(config.model)
    return adapter_for_pipeline(str(index.get("_class_name")), config.model)


def load_rows(config: FlowPluginConfig, split: str, *, images: str | None = None,
              max_images: int | None = 1, last_image: bool = False) -> list[dict[str, Any]]:
    """Prompt rows ``{"prompt": ..., **metadata}`` of ``split`` from the inline lists or the files.

    With ``images``, the name of an image-conditioned adapter, every row must name the image to condition on:
    ``"image"``, a path relative to the prompt file's folder (or absolute), which must exist, or a non-empty list of
    such paths (several input images: at most ``max_images``, None for any number); rows come back with the
    absolute path(s), a list staying a list. With ``last_image`` a row may also name a ``"last_image"`` (a video's
    last frame), resolved the same way; without, such a row is refused. Inline prompt lists hold no images and are
    refused."""
    inline = config.prompts if split == "train" else config.eval_prompts
    if inline is not None and images is not None:
        raise ConfigError(f"plugin.{'prompts' if split == 'train' else 'eval_prompts'}", inline,
                          f"null: the {images} adapter conditions every sample on an input image, so its rows come "
                          "from a JSONL file (plugin.dataset / eval_dataset) whose rows have a 'prompt' and an 'image' "
                          "path")
    if inline is not None:
        return [{"prompt": prompt} for prompt in inline]
    source = config.dataset if split == "train" else config.eval_dataset
    if split == "eval" and source is None and config.dataset is not None and Path(config.dataset).is_dir():
        source = config.dataset
    if source is None:
        return []
    path = Path(source).expanduser()
    if path.is_dir():
        stem = "train" if split == "train" else "test"
        candidates = [path / f"{stem}.txt", path / f"{stem}_metadata.jsonl", path / f"{stem}.jsonl"]
        found = [candidate for candidate in candidates if candidate.is_file()]
        if not found:
            raise FileNotFoundError(f"prompt folder {path} has none of {', '.join(c.name for c in candidates)}")
        path = found[0]
    rows = read_prompt_file(path)
    if not rows and split == "train":
        raise ValueError(f"{path} holds no prompts")
    return rows if images is None else [_with_image_paths(row, number, path, images, max_images, last_image)
                                        for number, row in enumerate(rows, start=1)]


def row_image_paths(row: dict[str, Any]) -> list[str]:
    """The input image paths of a prompt row that :func:`load_rows` checked: ``[row["image"]]``, or the list."""
    image = row["image"]
    return [str(path) for path in image] if isinstance(image, list) else [str(image)]


def _with_image_paths(row: dict[str, Any], number: int, source: Path, adapter: str,
                      max_images: int | None, last_image: bool = False) -> dict[str, Any]:
    """``row`` with its ``"image"`` (a path or a list of paths) and ``"last_image"`` resolved against the folder of
    ``source`` (the prompt file), each checked to exist."""
    image = row.get("image")
    several = isinstance(image, list)
    names = image if several else [image]
    if not names or any(not isinstance(name, str) or not name.strip() for name in names):
        raise ValueError(f"{source} row {number} has no 'image' (the path of its input image, or a non-empty list of "
                         f"paths), which the {adapter} adapter needs in every row; got {image!r}")
    if max_images is not None and len(names) > max_images:
        raise ValueError(f"{source} row {number} names {len(names)} input images; the {adapter} adapter takes "
                         f"{'one' if max_images == 1 else f'at most {max_images}'} per row (several: qwen_image_edit "
                         "with a QwenImageEditPlusPipeline, qwen_image21_edit, flux2_edit, flux2_klein_edit)")
    last = row.get("last_image")
    if last is not None and not last_image:
        raise ValueError(f"{source} row {number} names a 'last_image' (a video's last frame), which the {adapter} "
                         "adapter does not take (wan_i2v does: first-and-last-frame video)")
    if last is not None and (not isinstance(last, str) or not last.strip()):
        raise ValueError(f"{source} row {number}: 'last_image' must be the path of the video's last frame, got "
                         f"{last!r}")
    paths = []
    for name in [*names, *([] if last is None else [last])]:
        path = Path(name).expanduser()
        path = path if path.is_absolute() else source.parent / path
        if not path.is_file():
            raise FileNotFoundError(f"{source} row {number}: image {name!r} is not a file (at {path}; relative paths "
                                    "are read from the prompt file's folder)")
        paths.append(str(path))
    resolved = {**row, "image": paths[:len(names)] if several else paths[0]}
    if last is not None:
        resolved["last_image"] = paths[-1]
    return resolved
