"""The VLM plugin: GRPO for vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V/4.5V/4.6V,
InternVL, Gemma 3/4, Mistral 3) through transformers.

How it maps onto the rollout contract (docs/vlm.md has the long version):

- an action is one completion token; A = the longest completion of the rollout (at most ``max_new_tokens``, which
  :meth:`VLMPlugin.max_actions` returns); the mask covers each completion up to and including its EOS;
- ``old_logp`` is None, never generate's scores: when the run needs them (several optimizer steps per rollout) the
  core computes them with :meth:`forward`, the teacher-forced pass of :meth:`VLMPlugin.token_logp` (the same
  collation, image tensors, temperature and selective log-softmax as training), so the first inner step has ratio 1;
  otherwise it uses the detached training log-probs, the same loss and gradient;
- ``payload["completions"]`` holds the decoded completions (special tokens kept unless ``skip_special_tokens``:
  Qwen2-VL's box tokens are special tokens);
- ``replay`` holds, per sample and as lists of tensors (prompts and images differ in size), the prompt token ids,
  ``mm_token_type_ids``, ``image_grid_thw``, the prompt's own ``pixel_values`` rows — or, with the vision tower
  frozen, its ``image_embeds`` (the tower runs once per prompt and rollout, ``cache_image_features``) — and the
  completion token ids;
  :meth:`forward` collates any subset of samples (prompts left-padded, completions right-padded, pixel rows
  concatenated in sample order). The G copies of a prompt share its tensors, so the repeat is per image by
  construction, for any batch size and mixed image sizes;
- generation is the plugin's decode loop (:mod:`mmrl.plugins.vlm.decode`; ``decoder: hf`` selects HF ``generate``),
  batched over prompts of different image sizes (each prompt prefilled once for its G samples,
  ``share_prompt_prefill``) and seeded from the batch's sample seeds: a rollout is reproducible for a
  seed, but unlike the toy plugin it depends on the batch composition (sampling draws from one RNG stream for the
  whole batch). Evaluation decodes greedily;
- the KL reference is the same model with its LoRA adapter disabled; with full fine-tuning it is a frozen copy of
  ``plugin.model``, loaded only when the run needs a reference (``Runtime.needs_reference``, i.e. kl_coef > 0).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError, config_field
from mmrl.extras import require_extra
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime
from mmrl.policy import attach_lora, check_reference_sync, lora_config_class, reference_policy
from mmrl.prompts import check_chat_template_kwargs
from mmrl.rollout import Rollout, RolloutError

R1_TEMPLATE = ("{question} Output the thinking process in <think> </think> and final answer in <answer> </answer> "
               "tags.")
"""The R1-style format instruction of R1-V, Visual-RFT and VLM-R1 (vlm.md §2.3), usable as ``prompt_template``."""

REPLAY_PROMPT_KEYS = ("input_ids", "mm_token_type_ids", "pixel_values", "image_position_ids", "image_embeds",
                      "image_deepstack", "image_grid_thw", "pixel_values_videos", "video_embeds", "video_deepstack",
                      "video_grid_thw", "second_per_grid_ts")
"""The per-prompt inputs a rollout's replay keeps (those a prompt carries). Mistral 3's ``image_sizes`` is not one:
its forward needs each image's size with ``pixel_values``, and :meth:`~mmrl.plugins.vlm.adapters.mistral3.
Mistral3Adapter.collate` reads it back from the replayed ``input_ids``, exactly: Pixtral's processor writes an image
of ``h × w`` tokens as ``h`` rows of ``w`` ``[IMG]`` ended by ``[IMG_BREAK]`` / ``[IMG_END]`` and its ``image_sizes``
are ``(h, w) × patch × merge`` (its resize rounds both sides up to whole cells), which ``encode`` checks for every
prompt. The ids travel with each sample through every path that recomputes log-probs (the core's old-policy pass,
micro-batch ``select``, ``concat`` of rollout chunks, ``to(device)``; rollouts are not written to disk, so resuming
replays none), the image tokens are suppressed in completions (and read from the prompt ids only), so the sizes of
any subset of samples are those of its own prompts whatever the batch's other image sizes
(tests/vlm/test_mistral3.py::test_replayed_image_sizes_are_exact_for_any_micro_batch)."""


VLMLoraConfig = lora_config_class(
    "VLMLoraConfig", __name__, rank=64, alpha=128.0,
    doc="LoRA on the language model (:class:`mmrl.policy.LoraConfig` with VLM-R1's defaults). ``plugin.lora: null`` "
    "fine-tunes all weights instead.",
    refs={"rank": "VLM-R1 LoRA runs: r = 64 (vlm.md §5)", "alpha": "VLM-R1 LoRA runs: alpha = 128"},
    targets_help="Module-name suffixes to adapt. Null: the language model's q/k/v/o and gate/up/down projections. "
    "The vision tower is excluded while freeze_vision is true.",
)


@dataclass
class ShapesDataConfig:
    """The synthetic coloured-shapes dataset (:func:`mmrl.plugins.vlm.data.make_shapes`)."""

    train_size: int = config_field(256, minimum=1, help="Training rows.")
    eval_size: int = config_field(32, minimum=0, eval_only=True,
                                  help="Evaluation rows (drawn after the training rows, which stay the same "
                                       "whatever this is).")
    seed: int = config_field(0, help="Seed of the images and questions (independent of the run seed).")
    tasks: list[Literal["grounding", "counting", "motion"]] = config_field(
        default_factory=lambda: ["grounding"],
        help="Questions to ask, alternating: 'grounding' (where is the red circle? one box), 'counting' (how "
        "many squares?) and/or 'motion' (a 4-frame video: which way does the red circle move? an option letter). "
        "Rewards do not dispatch on the task, so pick the ones your rewards score.",
    )
    min_side: int = config_field(56, minimum=28, help="Smallest image width or height in pixels.")
    max_side: int = config_field(160, minimum=28, help="Largest image width or height in pixels.")
    max_objects: int = config_field(4, minimum=1, help="Most shapes of the asked kind in one image.")
    directory: str | None = config_field(
        None, help="Write the PNGs and train/eval JSONL here (reused while the options match) and train from the "
        "files. Null: keep the images in memory.",
    )

    def validate(self, path: str) -> None:
        if self.max_side < self.min_side:
            raise ConfigError(f"{path}.max_side", self.max_side, f"an integer >= min_side ({self.min_side})")
        if not self.tasks:
            raise ConfigError(f"{path}.tasks", self.tasks, "a non-empty list of 'grounding', 'counting' and 'motion'")


@dataclass
class VLMDataConfig:
    """Where the prompts come from: JSONL files (docs/vlm.md) or the synthetic shapes generator."""

    train: str | None = config_field(None, help="Training JSONL (image, problem, solution, task per line).")
    eval: str | None = config_field(None, eval_only=True, help="Evaluation JSONL; null: no held-out rows.")
    image_root: str | None = config_field(
        None, help="Folder that relative image paths are resolved against (default: each JSONL file's folder).",
    )
    synthetic: ShapesDataConfig | None = config_field(
        None, help="Generate coloured-shapes images and questions instead of reading files, e.g. "
        "{train_size: 64, eval_size: 8, tasks: [grounding]}.",
    )

    def validate(self, path: str) -> None:
        if (self.train is None) == (self.synthetic is None):
            raise ConfigError(f"{path}.train", self.train, "exactly one of train (a JSONL file) and synthetic")
        if self.synthetic is not None and (self.eval is not None or self.image_root is not None):
            raise ConfigError(f"{path}.eval", self.eval, "null with synthetic data (its eval rows are generated)")


@dataclass
class VLMPluginConfig:
    """The ``plugin:`` section of the VLM plugin (``name: vlm``)."""

    model: str = config_field(help="A checkpoint folder or hub id, e.g. Qwen/Qwen2.5-VL-3B-Instruct.")
    data: VLMDataConfig = config_field(help="Prompt rows: {train: file.jsonl, eval: ...} or {synthetic: {...}}.")
    family: str = config_field(
        "auto", help="Model adapter: qwen2_vl, qwen2_5_vl; qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, glm4v, "
        "glm4v_moe, glm46v (GLM-4.6V and GLM-4.6V-Flash), internvl (InternVL3/3.5, dense or MoE), gemma4, gemma3, "
        "mistral3 (Mistral Small 3.1/3.2, Ministral 3, Magistral Small 1.2), smolvlm (SmolVLM2), idefics3 (SmolVLM v1) "
        "(when transformers has them) or another registered one; 'auto' reads model_type from the checkpoint's "
        "config.json.",
    )
    tiny_model: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "glm4v",
                        "glm4v_moe", "internvl", "internvl_moe", "gemma4", "gemma4_moe",
                        "gemma3", "mistral3", "glm46v", "glm46v_moe", "smolvlm", "idefics3"] | None = config_field(
        None, help="Offline runs: when the model folder does not exist, build a tiny random checkpoint of this family "
        "there first (mmrl.plugins.vlm.testing). Null: the model must exist.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = config_field(
        "auto", help="Weight dtype. 'auto': the mixed-precision dtype for the frozen base under LoRA (adapters stay "
        "float32), float32 master weights for full fine-tuning.",
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = config_field(
        "sdpa", help="Attention kernel passed to from_pretrained (flash_attention_2 needs the flash-attn package).",
    )
    lora: VLMLoraConfig | None = config_field(
        default_factory=VLMLoraConfig, help="LoRA options; null for full fine-tuning.",
    )
    freeze_vision: bool = config_field(
        True, help="Keep the vision tower (ViT and merger) frozen: excluded from LoRA, or requires_grad off under full "
        "fine-tuning.", ref="VLM-R1 freezes 'visual'; vLLM has no ViT LoRA (vlm.md §4)",
    )
    gradient_checkpointing: bool = config_field(False, help="Recompute activations in the backward (memory lever).")
    min_pixels: int = config_field(4 * 28 * 28, minimum=1, help="Lower bound on each image's resized area.",
                                   ref="qwen-vl-utils default 3,136")
    max_pixels: int = config_field(
        512 * 28 * 28, minimum=1, help="Upper bound on each image's resized area: the biggest memory lever.",
        ref="R1-V / Visual-RFT: 401,408 (= 512·28²); PR1: 1,000,000; VLM-R1 REC: 12,845,056",
    )
    video_min_pixels: int = config_field(
        128 * 28 * 28, minimum=1, help="Lower bound on each video frame's resized area (every frame of a video is "
        "resized to one size).", ref="qwen-vl-utils 0.0.14: VIDEO_MIN_TOKEN_NUM 128 tokens of 28x28 pixels",
    )
    video_max_pixels: int = config_field(
        768 * 28 * 28, minimum=1, help="Upper bound on each video frame's resized area; a video costs about "
        "frames/2 times a frame's tokens.", ref="qwen-vl-utils 0.0.14: VIDEO_MAX_TOKEN_NUM 768 tokens of 28x28 pixels",
    )
    video_total_pixels: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True, help="Budget of a video's total area over all its frames: a "
        "frame's upper bound becomes max(min(video_max_pixels, video_total_pixels / frames x 2), 1.05 x "
        "video_min_pixels), so long videos get smaller frames. Null: qwen-vl-utils' 128,000 tokens x (patch x "
        "merge)^2 x 0.9 (GLM-4.1V/4.5V: the checkpoint's own clip bound on frames x height x width).",
        ref="qwen-vl-utils 0.0.14 fetch_video: total_pixels = MODEL_SEQ_LEN * factor^2 * 0.9",
    )
    video_fps: float = config_field(
        2.0, minimum=0.0, exclusive_minimum=True, help="Frames per second of a row's video frames when the row has "
        "no 'video_fps': Qwen2.5-VL spaces the temporal positions by it, Qwen3-VL writes each frame's timestamp.",
        ref="qwen-vl-utils FPS = 2.0",
    )
    max_new_tokens: int = config_field(256, minimum=1, help="Completion budget; the action axis A is at most this.")
    temperature: float = config_field(1.0, minimum=0.0, exclusive_minimum=True,
                                      help="Sampling temperature; log-probs divide the logits by it too.",
                                      ref="R1-V, VLM-R1, TRL: 1.0")
    top_p: float = config_field(1.0, minimum=0.0, exclusive_minimum=True, maximum=1.0,
                                help="Nucleus sampling (1 disables). Log-probs stay those of the full tempered "
                                "distribution, as in TRL.", ref="PR1 (vLLM): 0.9")
    top_k: int = config_field(0, minimum=0, help="Top-k sampling (0 disables).", ref="PR1 (vLLM): 50")
    system_prompt: str | None = config_field(None, help="Optional system message before every prompt.")
    chat_template_kwargs: dict[str, Any] = config_field(
        default_factory=dict, help="Extra variables for the processor's chat template, e.g. {enable_thinking: false} "
        "for Qwen3.5 or GLM-4.5V (hybrid thinking), passed to apply_chat_template with every prompt.",
        ref="TRL GRPOConfig.chat_template_kwargs",
    )
    image_position: Literal["before", "after"] = config_field(
        "before", help="Where the images sit in the user turn: 'before' the question (Qwen's documented order) or "
        "'after' it. Under causal attention only 'after' lets the image tokens attend to the question (a "
        "question-aware reading of the image); a checkpoint answers best in the order it was trained with.",
        ref="Qwen2.5-VL model card, R1-V, VLM-R1: images first",
    )
    prompt_template: str = config_field(
        "{question}", help="The user text; {question} is the row's prompt. R1 format: '{question} Output the thinking "
        "process in <think> </think> and final answer in <answer> </answer> tags.'", ref="R1-V, VLM-R1",
    )
    skip_special_tokens: bool = config_field(
        False, help="Drop special tokens when decoding completions. Keep false for Qwen2-VL grounding: its "
        "<|box_start|> tokens are special. The final EOS is always dropped.",
    )
    cache_image_features: bool = config_field(
        True, help="With the vision tower frozen, run it once per prompt per rollout and feed its features to "
        "generation, the old/reference log-prob passes and the training forward (instead of once per sample and "
        "pass). Exact: a frozen tower's output does not change within a step. Ignored when freeze_vision is false "
        "and for families whose adapter cannot take precomputed features (supports_feature_cache: false).",
    )
    share_prompt_prefill: bool = config_field(
        True, help="Generation prefills each distinct prompt once and copies its KV cache to the prompt's G samples "
        "(the prompt, image tokens included, is computed once per group instead of G times).",
    )
    decoder: Literal["mmrl", "hf"] = config_field(
        "mmrl", help="The rollout's decode loop: 'mmrl', the plugin's own (mmrl.plugins.vlm.decode: prefill, then one "
        "single-token forward per new token with the sampling settings above), or 'hf', transformers' generate. "
        "Both sample from the same distribution and, for the same logits and seed, pick the same tokens.",
    )
    share_prompt_forward: bool = config_field(
        True, help="The teacher-forced passes (training forward and backward, reference, old_logp) run each distinct "
        "prompt once and its G completions on top of its KV cache, instead of the whole prompt + completion "
        "sequence per sample (mmrl.plugins.vlm.prefix). Exact up to float rounding. Needs fused_lm_head; the plain "
        "pass runs under DDP/FSDP wrappers (one model call per backward) and under gradient checkpointing with "
        "gradients on (transformers drops the KV cache there).",
    )
    fused_lm_head: bool = config_field(
        True, help="Apply the LM head inside the chunked log-softmax (from the final hidden states), so the [N, C, V] "
        "logits never exist as a whole; the backward recomputes each chunk. Set false under FSDP or ZeRO-3, where "
        "the head's weight is sharded outside the model call.",
    )
    logprob_chunk_size: int | None = config_field(
        256, minimum=1, help="Sequence positions per float32 chunk of the selective log-softmax (null: all at once).",
    )
    entropy: bool = config_field(True, help="Compute per-token entropy (logged; trains with algorithm.entropy_coef).")
    temporal_contrast: int = config_field(
        0, minimum=0, help="T-GRPO (Video-R1): in a training rollout, also sample this many completions of every "
        "prompt with a video on its frames in a random order, handed to the rewards as payload['shuffled_completions'] "
        "(each sample: its group's texts) for the temporal_contrast reward; never trained on. Video-R1: "
        "group_size // 2. 0: off.",
        ref="Video-R1 (arXiv:2503.21776) T-GRPO; tulerfeng/Video-R1@59d65c3 vllm_grpo_trainer_modified.py:500-520",
    )
    router_aux_loss_coef: float = config_field(
        0.001, minimum=0.0, help="Mixture-of-experts models (qwen3_vl_moe, qwen3_5_moe, glm4v_moe, GLM-4.6V, "
        "InternVL3.5 MoE, Gemma 4 26B-A4B): weight of the routers' load-balancing loss (transformers' "
        "load_balancing_loss_func, or the same Switch loss from Gemma 4's router probabilities, over the training "
        "pass's real tokens) added to the loss, its mean over an optimizer step's forwards; 0 disables. Ignored for "
        "dense models. The training pass then runs per sample (no shared prompt: the loss is over whole sequences).",
        ref="TRL GRPOConfig.router_aux_loss_coef = 0.001 (grpo_trainer.py:1506-1509, 3218-3221 at f2cd577); "
        "Switch Transformer eqs. 4-6",
    )

    def validate(self, path: str) -> None:
        from mmrl.plugins.vlm.adapters import vlm_adapters

        if self.family != "auto" and self.family not in vlm_adapters:
            raise ConfigError(f"{path}.family", self.family, f"'auto' or one of {', '.join(vlm_adapters.names())}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"{path}.max_pixels", self.max_pixels, f"at least min_pixels ({self.min_pixels})")
        check_chat_template_kwargs(self.chat_template_kwargs, f"{path}.chat_template_kwargs")
        if self.video_min_pixels > self.video_max_pixels:
            raise ConfigError(f"{path}.video_max_pixels", self.video_max_pixels,
                              f"at least video_min_pixels ({self.video_min_pixels})")
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None}
        except ValueError:
            fields = {"<malformed>"}
        if fields != {"question"}:
            raise ConfigError(f"{path}.prompt_template", self.prompt_template,
                              "a template using {question} and no other {field} (write {{ }} for braces)")


class VLMPlugin(Plugin):
    """Group-relative RL for vision-language models with perception and reasoning rewards."""

    name = "vlm"
    config_class = VLMPluginConfig

    @classmethod
    def check_config(cls, train_config: Any) -> None:
        """Refuse ``algorithm.ref_sync_every`` with LoRA (:func:`mmrl.policy.check_reference_sync`), and
        ``algorithm.top_entropy_quantile``, ``algorithm.entropy_target`` and ``algorithm.entropy_coef`` without
        ``plugin.entropy``."""
        check_reference_sync(train_config)
        if not train_config.plugin.config.entropy:
            train_config.algorithm.refuse_entropy_readers("plugin.entropy false (it computes no per-token entropy), or "
                                                          "plugin.entropy: true")

    def __init__(self, config: VLMPluginConfig, runtime: Runtime):
        # One line naming mmrl[vlm] instead of an import traceback; qwen_vl_utils (and the torchvision it needs) is
        # optional: the adapters fall back to a built-in equivalent of process_vision_info.
        require_extra("vlm", "plugin 'vlm'", ["transformers", "peft", "PIL"])
        super().__init__(config, runtime)
        from mmrl.plugins.vlm.adapters import adapter_for

        if config.tiny_model is not None and not Path(config.model).exists():
            from mmrl.plugins.vlm.testing import build_tiny_model

            build_tiny_model(config.tiny_model, config.model)
        self.adapter = adapter_for(config.family, config.model)(
            config.model, min_pixels=config.min_pixels, max_pixels=config.max_pixels,
            video_min_pixels=config.video_min_pixels, video_max_pixels=config.video_max_pixels,
            video_total_pixels=config.video_total_pixels,
        )
        check_pixel_bounds(self.adapter, config)
        self.weight_dtype = self._weight_dtype()
        model = self.adapter.load_model(dtype=self.weight_dtype, attn_implementation=config.attn_implementation)
        model.to(runtime.device)
        if config.lora is None:
            model.requires_grad_(True)
            if config.freeze_vision:
                for module in self.adapter.vision_modules(model):
                    module.requires_grad_(False)
        else:
            attach_lora(model, config.lora, default_targets=self.adapter.lora_target_modules,
                        what="the language model", base_model=config.model,
                        exclude_modules=self.adapter.vision_module_pattern if config.freeze_vision else None)
        if config.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model
        self.cache_features = (config.cache_image_features and config.freeze_vision
                               and self.adapter.supports_feature_cache)
        self.eos_ids = self.adapter.generation_eos_ids(model)
        self.suppressed_ids = [i for i in self.adapter.suppressed_token_ids() if i not in self.eos_ids]
        self._reference: nn.Module | None = None
        if config.lora is None and runtime.needs_reference:
            self._reference = self._load_reference()
        self._rows = self._load_rows()
        # A dataset with any video row gives every prompt the video entries, so that every rollout's replay has the
        # same keys whichever rows it drew (rollouts of several chunks or rounds are concatenated).
        self.video_rows = any(row.get("video") is not None for rows in self._rows.values() for row in rows)
        if self.video_rows and not self.adapter.supports_videos:
            split = next(name for name, rows in self._rows.items() if any(row.get("video") is not None for row in rows))
            raise ValueError(f"vlm family {self.adapter.name!r} does not take videos, and the {split!r} split holds "
                             "video rows: train this family on image rows only")
        if not self.adapter.batches_images_with_videos:
            for split, rows in self._rows.items():
                if any(row_images(row) for row in rows) and any(row_videos(row) for row in rows):
                    raise ValueError(f"vlm family {self.adapter.name!r} cannot take images and videos in one batch, "
                                     f"and the {split!r} split holds rows of both: train image rows and video rows "
                                     "in separate runs")

    # ------------------------------------------------------------------ contract
    def policy(self) -> nn.Module:
        return self.model

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            raise KeyError(f"vlm plugin has splits {sorted(self._rows)}, not {split!r}")
        return self._rows[split]

    def max_actions(self) -> int:
        return self.config.max_new_tokens

    def reward_context(self) -> dict[str, Any]:
        """``{"box_convention": ...}``: the coordinate convention of the boxes this model family writes (the
        adapter's :attr:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.box_convention`). The box rewards (``iou``,
        ``giou``, ``detection``) default to it and refuse a different ``convention`` unless
        ``allow_convention_mismatch`` is set."""
        return {"box_convention": self.adapter.box_convention}

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        model = self.runtime.unwrap(policy)
        prompts = self.encode_rows(batch.rows, batch.group_ids, model=model if self.cache_features else None)
        sequences, width = self._generate(model, prompts, batch)  # [n, P + C'], P
        generated = sequences[:, width:]  # [n, C']
        lengths = completion_lengths(generated, self.eos_ids)  # [n]
        completions = [generated[i, : int(length)] for i, length in enumerate(lengths.tolist())]
        texts = self.decode(completions)
        payload: dict[str, Any] = {"completions": texts, "completion_tokens": lengths}  # tokens up to the EOS
        if self.config.temporal_contrast:  # evaluation: no contrast group (the reward then scores accuracy alone)
            payload["shuffled_completions"] = (self.shuffled_frame_completions(model, batch) if batch.training
                                               else [[] for _ in range(len(batch))])
        if not batch.training:  # evaluation rollouts are scored, never trained: no log-probs
            empty = torch.zeros(len(batch), 0, device=self.runtime.device)
            return Rollout(group_ids=batch.group_ids, old_logp=empty, mask=empty.clone(), payload=payload)
        num_actions = int(lengths.max())
        mask = (torch.arange(num_actions, device=lengths.device) < lengths.unsqueeze(1)).float()  # [n, A]
        replay: dict[str, Any] = {key: [p[key] for p in prompts] for key in REPLAY_PROMPT_KEYS if key in prompts[0]}
        replay["completion_ids"] = completions
        image_tokens = [self.adapter.image_token_count(p) for p in prompts]
        video_tokens = [float(p["video_grid_thw"].prod(-1).sum()) / self.adapter.merge_size ** 2
                        for p in prompts if "video_grid_thw" in p]
        clipped = completion_clipped(generated, lengths, self.eos_ids)  # [n] out of budget without an EOS
        return Rollout(
            group_ids=batch.group_ids,
            old_logp=None,  # the core's old-policy pass (forward) computes them when the run needs them
            mask=mask.to(self.runtime.device),
            payload=payload,
            replay=replay,
            truncated=clipped.to(self.runtime.device),
            metrics={
                "completion_length": float(lengths.float().mean()),
                "completion_clipped": float(clipped.float().mean()),
                "prompt_length": float(sum(len(p["input_ids"]) for p in prompts) / len(prompts)),
                "image_tokens": sum(image_tokens) / len(image_tokens),
                **({"video_tokens": sum(video_tokens) / len(prompts)} if video_tokens else {}),
            },
        )

    def forward(
        self, policy: nn.Module, rollout: Rollout, *, need_reference: bool, actions: Tensor | None = None
    ) -> PolicyOutput:
        if actions is not None:
            raise RolloutError("the vlm plugin recomputes all tokens in one forward; leave action_chunk_size null")
        prompts = replay_prompts(rollout.replay)
        completions = rollout.replay["completion_ids"]
        width = rollout.num_actions
        # The reference and the training pass read the same samples: collate them (and split their prompts) once.
        inputs = PassInputs(self, prompts, completions)
        ref_logp = None
        if need_reference:  # first: its temporaries are freed before the policy's activations are kept for backward
            with torch.no_grad(), self.reference_model(policy) as reference:
                ref_logp, _ = self.token_logp(reference, prompts, completions, width, with_entropy=False,
                                              inputs=inputs)
        aux_loss = None
        if self.adapter.moe and self.config.router_aux_loss_coef > 0 and torch.is_grad_enabled():
            from mmrl.plugins.vlm.adapters.base import RouterAuxLoss

            with RouterAuxLoss(policy, self.adapter.router_load_balancing_loss) as router:
                logp, entropy = self.token_logp(policy, prompts, completions, width, with_entropy=self.config.entropy,
                                                inputs=inputs, router_logits=True)
            aux_loss = self.config.router_aux_loss_coef * torch.stack(router.values).float().mean()
        else:
            logp, entropy = self.token_logp(policy, prompts, completions, width, with_entropy=self.config.entropy,
                                            inputs=inputs)
        return PolicyOutput(logp=logp, ref_logp=ref_logp, entropy=entropy, aux_loss=aux_loss)

    # ------------------------------------------------------------------ log-probs
    def token_logp(self, model: nn.Module, prompts: Sequence[dict[str, Tensor]], completions: Sequence[Tensor],
                   width: int, *, with_entropy: bool, inputs: PassInputs | None = None, router_logits: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
        """Log-prob (and entropy) of every completion token, teacher-forced: ``[n, width]`` float32 each.

        The one function behind the training forward and the core's old-policy pass (both through :meth:`forward`).
        Samples are collated (:meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.collate`); only the C positions
        that predict completion tokens reach the LM head, which
        :func:`~mmrl.plugins.vlm.logprobs.fused_head_log_softmax` applies chunk by chunk together with the tempered
        log-softmax (``fused_lm_head``; otherwise the model's logits go through
        :func:`~mmrl.plugins.vlm.logprobs.selective_log_softmax`). Columns past a sample's completion (and past C)
        are 0 (masked out). ``inputs``: the samples' :class:`PassInputs` when the caller scores them more than once.
        ``router_logits``: an MoE model's forward also computes its routers' load-balancing loss
        (``output_router_logits``), over the whole sequences of the plain pass.
        """
        from mmrl.plugins.vlm.adapters.base import logit_softcap
        from mmrl.plugins.vlm.logprobs import fused_head_log_softmax, selective_log_softmax
        from mmrl.plugins.vlm.prefix import shared_prompt_hidden

        prepared = PassInputs(self, prompts, completions) if inputs is None else inputs
        inputs, prompt_width = prepared.inputs, prepared.prompt_width
        num_completion = int(inputs["input_ids"].shape[1]) - prompt_width
        if num_completion > width:
            raise RolloutError(f"vlm replay holds completions of {num_completion} tokens for a rollout of {width} "
                               "actions")
        tokens = inputs["input_ids"][:, prompt_width:]  # [n, C]
        suppress = torch.tensor(self.suppressed_ids, dtype=torch.long, device=tokens.device)
        options = dict(temperature=self.config.temperature, chunk_size=self.config.logprob_chunk_size,
                       with_entropy=with_entropy, suppress=suppress)
        if router_logits:
            inputs = {**inputs, "output_router_logits": True}
        if self.config.fused_lm_head:
            with self.runtime.autocast():
                split = prepared.split(model) if self._can_share_prompts(model) and not router_logits else None
                shared = (shared_prompt_hidden(self.adapter, model, prompts, inputs, prompt_width, num_completion,
                                               split=split) if split is not None else None)
                hidden, head = shared or self.adapter.completion_hidden(model, inputs, num_completion)  # [n, C, H]
            # The head is applied here, so its logit soft-capping too (Gemma: identity_head switched the model's off)
            logp, entropy = fused_head_log_softmax(hidden, head.weight, head.bias, tokens, **options,
                                                   softcap=logit_softcap(model))
        else:
            with self.runtime.autocast():
                logits = self.adapter.completion_logits(model, inputs, num_completion)  # [n, C, V]
            logp, entropy = selective_log_softmax(logits, tokens, **options)
        padding = inputs["attention_mask"][:, prompt_width:] == 0  # [n, C]: right padding of shorter completions
        logp = nn.functional.pad(logp.float().masked_fill(padding, 0.0), (0, width - num_completion))  # [n, width]
        if entropy is not None:
            entropy = nn.functional.pad(entropy.float().masked_fill(padding, 0.0), (0, width - num_completion))
        return logp, entropy

    def _can_share_prompts(self, model: nn.Module) -> bool:
        """Whether :meth:`token_logp` may split its pass (``share_prompt_forward``): not through a DDP/FSDP wrapper
        (two calls per backward), nor under gradient checkpointing with gradients on (transformers drops the cache),
        nor with gradients on for a family whose cache updates states in place (Qwen3.5's linear attention,
        :attr:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.cache_keeps_gradients`), and then, in bf16 or fp16, in no
        pass at all (with gradient checkpointing configured, or such a family), so that the no-grad passes compute
        as the training pass does."""
        # The flag as getattr reads a plain attribute (the instance's __dict__, then its class: transformers'
        # GradientCheckpointingLayer declares False there, gradient_checkpointing_enable sets the instance's), without
        # nn.Module.__getattr__'s raise for every module that lacks it (0.26 against ~0.1 ms per call, 200 modules)
        configured = any(
            vars(module).get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing", False)) is True
            for module in model.modules())
        checkpointing = configured and model.training and torch.is_grad_enabled()
        in_place = torch.is_grad_enabled() and not self.adapter.cache_keeps_gradients
        # In low precision, when the training pass cannot share, no pass does: there the shared pass rounds differently
        # from the plain one (bf16 + sdpa + checkpointing: first-step ratio off by 3e-4 to 3e-3 for Qwen3-VL, Qwen3.5,
        # Gemma 3 and Mistral 3 from pixels, the old-policy and reference passes shared and the training pass plain),
        # so every pass of a step takes one path and the ratio is 1 on-policy; in float32 the two agree to ~1e-7.
        if not (self.config.share_prompt_forward and self.adapter.supports_shared_prefill
                and self.runtime.unwrap(model) is model and not checkpointing and not in_place):
            return False
        if not configured and self.adapter.cache_keeps_gradients:  # the training pass shares too
            return True
        return self.runtime.dtype == torch.float32 and all(  # the parameter scan only where it decides
            parameter.dtype not in (torch.bfloat16, torch.float16) for parameter in model.parameters())

    def reference_module(self) -> nn.Module | None:
        """Full fine-tuning's reference, the initial checkpoint loaded again (None with LoRA)."""
        if self.config.lora is not None:
            return None
        if self._reference is None:
            self._reference = self._load_reference()
        return self._reference

    def reference_model(self, policy: nn.Module) -> AbstractContextManager[nn.Module]:
        """The KL reference (:func:`mmrl.policy.reference_policy`): the policy with its LoRA adapter disabled, or
        (full fine-tuning) a frozen copy of the initial checkpoint, loaded from ``plugin.model`` at construction when
        ``runtime.needs_reference`` (else on the first forward that asks for it)."""
        return reference_policy(self.runtime.unwrap(policy), self.reference_module())

    # ------------------------------------------------------------------ prompts and completions
    def encode_rows(self, rows: Sequence[dict[str, Any]], group_ids: Tensor | None = None, *,
                    model: nn.Module | None = None) -> list[dict[str, Tensor]]:
        """Per-sample prompt inputs of ``rows``; rows of one group are encoded once and share their tensors.

        With ``model`` the images are also run through its (frozen) vision tower once per prompt, and the prompts
        carry ``image_embeds`` instead of ``pixel_values``.
        """
        keys = list(range(len(rows))) if group_ids is None else [int(g) for g in group_ids.tolist()]
        first: dict[int, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        unique = [rows[i] for i in first.values()]
        images = [self.adapter.load_images(row_images(row)) for row in unique]
        videos = [self.adapter.load_videos(row_videos(row)) for row in unique]
        rates = [row_video_fps(row, len(clips), self.config.video_fps)
                 for row, clips in zip(unique, videos, strict=True)]
        texts = [self.adapter.chat_text(self.adapter.messages(self.question(row), len(group),
                                                              self.config.system_prompt,
                                                              image_position=self.config.image_position,
                                                              num_videos=len(clips)),
                                        **self.config.chat_template_kwargs)
                 for row, group, clips in zip(unique, images, videos, strict=True)]
        encoded = self.adapter.encode(texts, images, videos, rates, video_entries=self.video_rows)
        for row, prompt in zip(unique, encoded, strict=True):
            _check_resized_size(row, prompt, self.adapter)
        if model is not None:
            with self.runtime.autocast():
                encoded = self.adapter.image_features(model, encoded)
        index = {key: position for position, key in enumerate(first)}
        return [encoded[index[key]] for key in keys]

    def shuffled_frame_completions(self, model: nn.Module, batch: PromptBatch) -> list[list[str]]:
        """T-GRPO's contrast group (``plugin.temporal_contrast``): for each group of ``batch`` whose prompt has a
        video, ``temporal_contrast`` completions of the prompt with every video's frames in a random order; per
        sample, its group's texts (empty for a prompt without a video).

        Video-R1 shuffles the sampled frames of the prompt's video (``video_inputs[0][torch.randperm(T)]``,
        tulerfeng/Video-R1@59d65c3 ``vllm_grpo_trainer_modified.py:500-503``) and samples ``num_generations // 2``
        completions of it (``:572-590``) with the same sampling settings. Here each video of a prompt gets its own
        permutation, drawn from a generator seeded by the seed of the group's first sample on this process (under
        ``rollout.layout: contiguous``, which the group-wise ``temporal_contrast`` reward needs on several
        processes, the group's first sample whatever the number of processes), and the sampling is seeded from the
        batch's seeds, as the main rollout is.
        """
        from mmrl.seeding import derive_seed

        count = self.config.temporal_contrast
        first: dict[int, int] = {}
        for i, group in enumerate(batch.group_ids.tolist()):
            first.setdefault(int(group), i)
        shuffled_rows, owners = [], []
        for group, index in first.items():
            clips = row_videos(batch.rows[index])
            if not clips:
                continue
            generator = torch.Generator().manual_seed(derive_seed(int(batch.seeds[index]), 0x7E3F))
            permuted = [[clip[int(j)] for j in torch.randperm(len(clip), generator=generator)] for clip in clips]
            shuffled_rows.append({**batch.rows[index], "video": permuted})
            owners.append(group)
        texts_of: dict[int, list[str]] = {}
        if shuffled_rows:
            rows = [row for row in shuffled_rows for _ in range(count)]
            group_ids = torch.arange(len(shuffled_rows)).repeat_interleave(count)
            seeds = torch.tensor([derive_seed(int(batch.seeds[first[g]]), 0x7E3F, k) for g in owners
                                  for k in range(count)], dtype=torch.long)
            contrast = PromptBatch(rows=rows, group_ids=group_ids, group_size=count, seeds=seeds,
                                   generator=batch.generator, training=True, step=batch.step,
                                   max_steps=batch.max_steps)
            prompts = self.encode_rows(rows, group_ids, model=model if self.cache_features else None)
            sequences, width = self._generate(model, prompts, contrast)
            generated = sequences[:, width:]
            lengths = completion_lengths(generated, self.eos_ids)
            texts = self.decode([generated[i, : int(n)] for i, n in enumerate(lengths.tolist())])
            for position, group in enumerate(owners):
                texts_of[group] = texts[position * count:(position + 1) * count]
        return [list(texts_of.get(int(group), [])) for group in batch.group_ids.tolist()]

    def question(self, row: dict[str, Any]) -> str:
        if "prompt" not in row:
            raise KeyError(f"vlm dataset row has no 'prompt' (keys: {sorted(row)})")
        return self.config.prompt_template.format(question=row["prompt"])

    def decode(self, completions: Sequence[Tensor]) -> list[str]:
        """Completion texts; a final EOS token is dropped, other special tokens per ``skip_special_tokens``."""
        eos = set(self.eos_ids)
        texts = []
        for tokens in completions:
            ids = tokens.tolist()
            if ids and ids[-1] in eos:
                ids = ids[:-1]
            texts.append(self.adapter.tokenizer.decode(ids, skip_special_tokens=self.config.skip_special_tokens))
        return texts

    def generation_config(self, training: bool) -> Any:
        """A fresh ``GenerationConfig`` with every setting that shapes the sampling distribution given explicitly:
        the checkpoint's own generation_config.json (Qwen's sets a repetition penalty and top-k/top-p) must not
        leak in, or the sampled tokens would not follow the tempered softmax that the log-probs score. Vision
        placeholder tokens are suppressed (the log-probs exclude them too). Training samples with
        ``temperature``/``top_p``/``top_k``; evaluation decodes greedily."""
        from transformers import GenerationConfig

        config = self.config
        settings: dict[str, Any] = dict(max_new_tokens=config.max_new_tokens, eos_token_id=self.eos_ids,
                                        pad_token_id=self.adapter.pad_token_id, num_beams=1, repetition_penalty=1.0,
                                        suppress_tokens=self.suppressed_ids or None, use_cache=True)
        if training:
            settings.update(do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
        else:
            settings.update(do_sample=False)
        return GenerationConfig(**settings)

    def _generate(self, model: nn.Module, prompts: Sequence[dict[str, Tensor]], batch: PromptBatch
                  ) -> tuple[Tensor, int]:
        """Batched sampling under :meth:`generation_config` (:meth:`VLMAdapter.generate` with ``plugin.decoder``: a
        prompt's samples share its prefill), seeded from the batch's sample seeds (one seed for the call: both
        decoders draw the whole batch from one RNG stream)."""
        from mmrl.plugins.vlm.adapters.base import _base_model
        from mmrl.seeding import derive_seed

        generation_config = self.generation_config(batch.training)
        hf_model = _base_model(model)
        saved = hf_model.generation_config
        device = torch.device(self.runtime.device)
        devices = [device.index or 0] if device.type == "cuda" else []
        try:
            # generate() fills unset fields from model.generation_config; swap in ours so nothing is inherited.
            hf_model.generation_config = generation_config
            with torch.random.fork_rng(devices=devices), self.runtime.autocast():
                torch.manual_seed(derive_seed(*batch.seeds.tolist()))
                return self.adapter.generate(model, prompts, generation_config, device=self.runtime.device,
                                             share_prefill=self.config.share_prompt_prefill,
                                             decoder=self.config.decoder)
        finally:
            hf_model.generation_config = saved

    # ------------------------------------------------------------------ samples, checkpoints
    def save_samples(self, rollout: Rollout, rewards: Tensor, directory: str | Path, *, tag: str) -> list[Path]:
        """``{tag}.jsonl``: prompt, image paths, task, solution, output and reward of each sample."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{tag}.jsonl"
        with path.open("w") as handle:
            for i, row in enumerate(rollout.rows):
                images = [image if isinstance(image, str) else "<in-memory image>" for image in row_images(row)]
                record = {"prompt": row.get("prompt"), "image": images, "task": row.get("task"),
                          "solution": row.get("solution"), "output": rollout.payload["completions"][i],
                          "reward": float(rewards[i])}
                if row.get("video") is not None:
                    record["video"] = [[frame if isinstance(frame, str) else "<in-memory frame>" for frame in clip]
                                       for clip in row_videos(row)]
                handle.write(json.dumps(record, default=str) + "\n")
        return [path]

    def export(self, policy: nn.Module, directory: str | Path) -> str:
        """LoRA: the peft adapter folder (``PeftModel.from_pretrained(base, directory)``). Full fine-tuning: the
        model's ``save_pretrained`` folder with its processor, which the family's model class (e.g.
        ``Qwen2_5_VLForConditionalGeneration``) and ``AutoProcessor`` load."""
        fmt = super().export(policy, directory)
        if fmt == "pretrained":
            self.adapter.processor.save_pretrained(str(directory))
        return fmt

    # ------------------------------------------------------------------ building blocks
    def _weight_dtype(self) -> torch.dtype:
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.config.dtype != "auto":
            return names[self.config.dtype]
        return self.runtime.dtype if self.config.lora is not None else torch.float32

    def _load_reference(self) -> nn.Module:
        """A frozen copy of the initial checkpoint (full fine-tuning's KL reference), read from ``plugin.model``:
        the initial weights even when the run resumes from a checkpoint."""
        reference = self.adapter.load_model(dtype=self.weight_dtype,
                                            attn_implementation=self.config.attn_implementation)
        return reference.to(self.runtime.device).requires_grad_(False).eval()

    def _load_rows(self) -> dict[str, list[dict[str, Any]]]:
        from mmrl.plugins.vlm import data as vlm_data

        config = self.config.data
        if config.synthetic is not None:
            shapes = config.synthetic
            options = dict(seed=shapes.seed, tasks=list(shapes.tasks), min_side=shapes.min_side,
                           max_side=shapes.max_side, max_objects=shapes.max_objects)
            if shapes.directory is None:
                rows = vlm_data.make_shapes(shapes.train_size + shapes.eval_size, **options)
                splits = {"train": rows[: shapes.train_size], "eval": rows[shapes.train_size:]}
            else:
                folder = Path(shapes.directory)
                manifest = folder / "manifest.json"
                wanted = {**asdict(shapes), "directory": None}
                if not manifest.is_file() or json.loads(manifest.read_text()) != wanted:
                    vlm_data.write_shapes_dataset(folder, train_size=shapes.train_size, eval_size=shapes.eval_size,
                                                  **options)
                    manifest.write_text(json.dumps(wanted))
                splits = {"train": vlm_data.load_jsonl(folder / "train.jsonl"),
                          "eval": vlm_data.load_jsonl(folder / "eval.jsonl") if shapes.eval_size else []}
        else:
            splits = {"train": vlm_data.load_jsonl(config.train, image_root=config.image_root),
                      "eval": vlm_data.load_jsonl(config.eval, image_root=config.image_root) if config.eval else []}
        return {split: vlm_data.attach_sizes(rows, self.adapter.resized_size) for split, rows in splits.items()}


# ---------------------------------------------------------------------------------------------------- helpers


def completion_lengths(tokens: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """``[n]`` number of tokens of each completion up to and including its first EOS (all of them without one)."""
    is_eos = torch.isin(tokens, torch.tensor(list(eos_ids), device=tokens.device))  # [n, C]
    width = tokens.shape[1]
    positions = torch.arange(width, device=tokens.device).expand_as(tokens)
    first = torch.where(is_eos, positions, torch.full_like(positions, width)).min(dim=1).values  # [n]
    return torch.clamp(first + 1, max=width)


def completion_clipped(tokens: Tensor, lengths: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """``[n]`` True for completions that ran out of budget without an EOS."""
    last = tokens.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # [n]
    return ~torch.isin(last, torch.tensor(list(eos_ids), device=tokens.device))


def replay_prompts(replay: dict[str, Any]) -> list[dict[str, Tensor]]:
    """Per-sample prompt inputs stored in a rollout's replay (lists of tensors, one entry per sample)."""
    missing = [key for key in ("input_ids", "completion_ids") if key not in replay]
    if "pixel_values" not in replay and "image_embeds" not in replay:
        missing.append("pixel_values or image_embeds")
    if missing:
        raise RolloutError(f"vlm rollout replay lacks {missing}; it was not produced by the vlm plugin")
    keys = [key for key in REPLAY_PROMPT_KEYS if key in replay]
    return [dict(zip(keys, values, strict=True)) for values in zip(*(replay[key] for key in keys), strict=True)]


class PassInputs:
    """The collated inputs of one set of samples for :meth:`VLMPlugin.token_logp`, prepared once for every pass over
    them: the reference and the training pass of a micro-batch read the same ``collate`` output, and the same
    distinct-prompt split with its M-RoPE position ids (:func:`~mmrl.plugins.vlm.prefix.prompt_split`, computed on
    first use; the positions are a function of the inputs, so the policy and its reference share them).

    Attributes:
        inputs: ``collate(prompts, completions)``'s model inputs, ``[n, P + C]``.
        prompt_width: P.
    """

    def __init__(self, plugin: VLMPlugin, prompts: Sequence[dict[str, Tensor]], completions: Sequence[Tensor]):
        self.plugin, self.prompts = plugin, prompts
        self.inputs, self.prompt_width = plugin.adapter.collate(prompts, completions, device=plugin.runtime.device)
        self._split: Any = _UNSET

    def split(self, model: nn.Module) -> Any:
        """The samples' :class:`~mmrl.plugins.vlm.prefix.PromptSplit`, or None where the plain pass must run."""
        from mmrl.plugins.vlm.prefix import prompt_split

        if self._split is _UNSET:
            self._split = prompt_split(self.plugin.adapter, model, self.prompts, self.inputs, self.prompt_width)
        return self._split


_UNSET = object()


def row_images(row: dict[str, Any]) -> list[Any]:
    """The images of a row as a list (``image`` may be one path or PIL image, or a list of them)."""
    images = row.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def row_videos(row: dict[str, Any]) -> list[list[Any]]:
    """The videos of a row, each as its list of frames. ``video`` may be one video (a list of frames: paths or PIL
    images) or a list of videos (a list of such lists); no ``video`` means none."""
    videos = row.get("video")
    if videos is None:
        return []
    if not isinstance(videos, (list, tuple)) or not videos:
        raise ValueError(f"a row's 'video' must be a list of frames or a list of such lists, got {videos!r}")
    if all(isinstance(item, (list, tuple)) for item in videos):
        return [list(item) for item in videos]
    if any(isinstance(item, (list, tuple)) for item in videos):
        raise ValueError("a row's 'video' mixes frames and lists of frames; give one video as a list of frames or "
                         "several as a list of such lists")
    return [list(videos)]


def row_video_fps(row: dict[str, Any], num_videos: int, default: float) -> list[float]:
    """The frame rate of each of a row's ``num_videos`` videos: the row's ``video_fps`` (one number for all, or one
    per video), else ``default`` (``plugin.video_fps``)."""
    rate = row.get("video_fps", default)
    rates = list(rate) if isinstance(rate, (list, tuple)) else [rate] * num_videos
    if len(rates) != num_videos or not all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                           and math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"a row's 'video_fps' must be a positive number or one per video ({num_videos}), got "
                         f"{rate!r}")
    return [float(r) for r in rates]


def check_pixel_bounds(adapter: Any, config: VLMPluginConfig) -> None:
    """Refuse, in one line, a ``plugin.min_pixels`` / ``max_pixels`` that the adapter's family cannot honour (its
    ``unused_pixel_bounds``: Gemma 3 resizes every image to its tower's square, Mistral 3 never enlarges one) when it
    differs from the config's default: mmrl has no silent fallbacks, and a bound the processor ignores would leave
    the run's images other than the option says.

    "Default" is the value :class:`VLMPluginConfig` declares (3,136 and 401,408): the config cannot tell an option
    left out from one written at its default, so both pass, and the recipes of these families, which leave the
    bounds out, load as they are.

    Raises:
        ConfigError: a non-default bound the family does not use, naming the option, the family and the fix.
    """
    import dataclasses

    defaults = {field.name: field.default for field in dataclasses.fields(VLMPluginConfig)}
    for option in adapter.unused_pixel_bounds:
        value = getattr(config, option)
        if value != defaults[option]:
            raise ConfigError(f"plugin.{option}", value,
                              f"{defaults[option]} (the default) for family {adapter.name!r}: "
                              f"{adapter.pixel_bounds_refusal()}; plugin.{option} is not used by this family, "
                              "remove it")


def _check_resized_size(row: dict[str, Any], prompt: dict[str, Tensor], adapter: Any) -> None:
    """The row's ``resized_size`` (the adapter's :meth:`resized_size` of its first image at this run's bounds) must
    be what the processor produced; otherwise box rewards in pixels of the resized input would rescale with the wrong
    frame. The processor's size of the first image is read from ``image_grid_thw`` (the Qwen-VL and GLM families) or,
    for a family whose prompts state their images' sizes in their ids (Mistral 3: rows of ``[IMG]`` tokens,
    ``image_sizes``), from the ids; InternVL's tiles have neither (its boxes do not read the size), nor have Gemma's
    fixed squares."""
    expected = row.get("resized_size")
    if expected is None:
        return
    grid = prompt.get("image_grid_thw")
    if grid is not None and grid.numel():
        actual = [int(grid[0, 2]) * adapter.patch_size, int(grid[0, 1]) * adapter.patch_size]
    elif grid is None and (sizes := adapter.image_sizes(prompt["input_ids"])) is not None:
        # [images, 2] (height, width), the processor's (encode)
        if not sizes.shape[0]:
            return
        actual = [int(sizes[0, 1]), int(sizes[0, 0])]
    else:
        return
    if [int(v) for v in expected] != actual:
        raise RuntimeError(f"row resized_size {list(expected)} differs from the processor's {actual} (width, height); "
                           "the row was prepared for other min_pixels/max_pixels")


__all__ = ["R1_TEMPLATE", "VLMDataConfig", "VLMLoraConfig", "VLMPlugin", "VLMPluginConfig", "ShapesDataConfig",
           "completion_lengths", "replay_prompts", "row_images", "row_video_fps", "row_videos"]
