"""GRPO end to end through mmrl.trainer.Trainer on tiny Qwen2-VL and Qwen2.5-VL: batch > 1, G >= 2, mixed image
sizes, registry rewards, LoRA and full fine-tuning, the KL term, checkpoints, and the recipes under configs/vlm."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config, to_dict
from mmrl.plugins.vlm.plugin import replay_prompts
from mmrl.reward import RewardError, RewardInput, reward_functions
from mmrl.trainer import Trainer
from mmrl.trainer.checkpoint import list_checkpoints
from tests.helpers import record_gradients
from tests.vlm.conftest import plugin_options, prompt_batch, unused_pixel_bounds

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vlm"


def completion_digits(batch) -> list[float]:
    """A test-only reward with spread on random text (fraction of characters that are digits), so that a tiny random
    model gets non-zero advantages: format and iou are 0 on its outputs."""
    texts = batch.payload["completions"]
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in texts]


reward_functions.register("test_completion_digits", completion_digits)


def _config(tmp_path, model, family, iou_args=None, **plugin_overrides):
    """Two steps of 3 prompts x G=2; iou reads boxes in the family's convention (from the plugin) unless iou_args
    names one."""
    options = plugin_options(model, **plugin_overrides)
    return load_config({
        "plugin": {"name": "vlm", **options},
        "run": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 3, "group_size": 2, "batch_size": 4},
        "algorithm": {"micro_batch_size": 4, "kl_coef": 0.04, "minibatches": 1},
        "optim": {"lr": 5.0e-2},
        "rewards": {"functions": [
            {"name": "format"},
            {"name": "iou", "args": iou_args or {}},
            {"name": "test_completion_digits"},
        ]},
        "eval": {"at_start": False, "num_prompts": 2},
    })


def _snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_two_grpo_steps_with_lora(tmp_path, tiny_models, family):
    """3 prompts x G=2 with mixed image sizes, sampled in rollout chunks of 4 and trained in shuffled micro-batches
    of 4 (a different composition): ratio 1 on the first inner step, KL 0 at step 1, LoRA weights move, the base
    model and the vision tower do not."""
    trainer = Trainer(_config(tmp_path, tiny_models[family], family))
    plugin = trainer.plugin
    before = _snapshot(plugin.model)
    result = trainer.train()
    assert [record["step"] for record in result.history] == [1, 2]
    for record in result.history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5, record["loss/first_step_ratio_deviation"]
        assert record["samples/generated"] == 6.0
        assert {"reward/format_mean", "reward/iou_mean", "policy/entropy"} <= set(record)
    assert abs(result.history[0]["policy/kl"]) < 1e-6  # the reference equals the policy before any update
    assert result.history[1]["policy/kl"] > 0  # and moves once the adapter has been updated
    after = _snapshot(plugin.model)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed and all("lora_" in name for name in changed)
    assert any("lora_A" in name for name in changed) and any("lora_B" in name for name in changed)
    tower = {name for name, _ in plugin.model.named_parameters() if ".visual." in name}
    assert tower and not tower & set(changed)
    (checkpoint,) = list_checkpoints(tmp_path / "run")
    assert (checkpoint / "policy" / "adapter_model.safetensors").is_file()
    samples = [json.loads(line) for line in next((tmp_path / "run" / "samples").rglob("eval.jsonl")).open()]
    assert len(samples) == 2 and {"prompt", "output", "solution", "reward"} <= set(samples[0])


def test_full_finetuning_trains_the_language_model_only(tmp_path, tiny_models):
    """lora: null with freeze_vision: the language model moves, the vision tower does not; the KL reference is a
    frozen copy kept because kl_coef > 0; the checkpoint holds exactly the trainable weights. The rollouts carry the
    plugin's own old log-probs so that the first-step ratio check compares them with the training forward's."""
    trainer = _with_old_logp(Trainer(_config(tmp_path, tiny_models["qwen2_vl"], "qwen2_vl", lora=None)))
    plugin = trainer.plugin
    assert plugin._reference is not None
    before = _snapshot(plugin.model)
    result = trainer.train()
    assert all(r["loss/first_step_ratio_deviation"] < 1e-5 for r in result.history)
    assert abs(result.history[0]["policy/kl"]) < 1e-6
    after = _snapshot(plugin.model)
    vision = {name for name in before if name.startswith("model.visual.")}
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert vision and not vision & changed
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in changed
    reference = dict(plugin._reference.named_parameters())
    assert all(torch.equal(reference[name], before[name]) for name in before)  # the reference never trains
    from safetensors.torch import load_file

    (checkpoint,) = list_checkpoints(tmp_path / "run")
    saved = load_file(str(checkpoint / "policy" / "trainable.safetensors"))
    assert saved and not any(name.startswith("model.visual.") for name in saved)


# A 640x480 image with the object at [64, 48, 320, 240] (issue 19), as each family writes it: Qwen2-VL on the 0–1000
# grid with box tokens, Qwen2.5-VL in pixels of the 644x476 resized input (x·644/640, y·476/480).
PERFECT_ANSWERS = {
    "qwen2_vl": "<|box_start|>(100,100),(500,500)<|box_end|>",
    "qwen2_5_vl": '<answer>{"bbox_2d": [64.4, 47.6, 322, 238]}</answer>',
}


def test_box_rewards_take_the_model_familys_convention(tmp_path, tiny_models, family):
    """The trainer hands the plugin's reward context to the rewards at start-up: iou with no convention reads the
    family's frame (a perfect answer scores 1), a convention of another family is refused before training, and
    allow_convention_mismatch keeps it."""
    other = "qwen2_5_vl" if family == "qwen2_vl" else "qwen2_vl"
    batch = RewardInput(rows=[{"solution": [64, 48, 320, 240], "image_size": [640, 480], "resized_size": [644, 476]}
                              for _ in PERFECT_ANSWERS],
                        payload={"completions": [PERFECT_ANSWERS[family], PERFECT_ANSWERS[other]]})
    trainer = Trainer(_config(tmp_path / "default", tiny_models[family], family))
    column = trainer.scorer.names.index("iou")
    iou_scores = trainer.scorer.score(batch).scores[:, column].tolist()
    assert iou_scores[0] == pytest.approx(1.0) and iou_scores[1] < 0.5
    with pytest.raises(RewardError, match=f"reward 'iou': option convention '{other}' differs from '{family}'"):
        Trainer(_config(tmp_path / "mismatch", tiny_models[family], family, iou_args={"convention": other}))
    override = {"convention": other, "allow_convention_mismatch": True}
    trainer = Trainer(_config(tmp_path / "override", tiny_models[family], family, iou_args=override))
    iou_scores = trainer.scorer.score(batch).scores[:, column].tolist()
    assert iou_scores[1] == pytest.approx(1.0) and iou_scores[0] < 0.5


def test_every_vlm_recipe_validates_offline():
    recipes = sorted(CONFIGS.glob("*.yaml"))
    assert {p.name for p in recipes} >= {"qwen25vl_3b_grounding.yaml", "qwen25vl_counting.yaml", "toy_grounding.yaml",
                                         "qwen25vl_7b_video.yaml", "glm41v_grounding.yaml", "internvl3_grounding.yaml"}
    for recipe in recipes:
        config = load_config(recipe)
        assert config.plugin.name == "vlm"
        if recipe.name == "grounding.yaml":  # the grounding world trains without a KL term (docs/vlm.md §13)
            assert config.algorithm.kl_coef == 0
            continue
        assert config.algorithm.kl_estimator == "k3" and config.algorithm.kl_coef > 0
    # The overrides that the counting recipe's comments suggest (one GPU with LoRA; synthetic counting data).
    counting = CONFIGS / "qwen25vl_counting.yaml"
    lora = load_config(counting, ["plugin.lora.rank=64", "plugin.lora.alpha=128", "plugin.dtype=bfloat16",
                                  "optim.lr=1e-5", "rollout.prompts_per_step=4"]).plugin.config
    assert lora.lora is not None and lora.lora.rank == 64 and lora.dtype == "bfloat16"
    video = load_config(CONFIGS / "qwen25vl_7b_video.yaml").plugin.config  # Video-R1's 128·28² frames
    assert video.video_min_pixels == video.video_max_pixels == 128 * 28 * 28 and video.max_new_tokens == 768
    synthetic = load_config(counting, ["plugin.data={synthetic: {tasks: [counting], train_size: 20000}}"])
    assert synthetic.plugin.config.data.train is None
    assert synthetic.plugin.config.data.synthetic.tasks == ["counting"]


def test_toy_recipe_runs_one_step_offline(tmp_path, tiny_models):
    """configs/vlm/toy_grounding.yaml as written (tiny model built on first use), shortened to one step."""
    model = tmp_path / "tiny"
    config = load_config(CONFIGS / "toy_grounding.yaml", [
        f"plugin.model={model}", f"run.output_dir={tmp_path / 'run'}", "run.max_steps=1", "run.progress=false",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "plugin.max_new_tokens=6", "eval.num_prompts=2",
    ])
    result = Trainer(config).train()
    assert (model / "config.json").is_file()
    assert result.history[0]["loss/first_step_ratio_deviation"] < 1e-5
    assert "eval/iou_mean" in result.evaluations[1]


@pytest.mark.parametrize(("family", "convention"), [("glm4v", "glm4v"), ("glm46v", "glm4v"), ("internvl", "qwen2_vl"),
                                                    ("gemma4", "absolute"), ("gemma3", "qwen2_5_vl"),
                                                    ("mistral3", "qwen2_5_vl"), ("smolvlm", "qwen2_5_vl"),
                                                    ("idefics3", "qwen2_5_vl")])
def test_toy_recipe_runs_with_a_tiny_build_of_another_family(tmp_path, family, convention):
    """plugin.tiny_model builds every family the tests build, e.g. GLM-4.1V and InternVL: the toy recipe's step on
    it, boxes read in the family's convention (InternVL: 0-1000 of the image, Qwen2-VL's; Gemma 3: pixels of its
    square input, Qwen2.5-VL's)."""
    from mmrl.plugins.vlm.adapters import vlm_adapters

    if family not in vlm_adapters:
        pytest.skip(f"transformers has no {family}")
    model = tmp_path / f"tiny-{family}"
    # The recipe's pixel bounds back at the config's defaults for a family that refuses them (Gemma 3: both)
    defaults = {"min_pixels": 3136, "max_pixels": 401408}
    config = load_config(CONFIGS / "toy_grounding.yaml", [
        f"plugin.model={model}", f"plugin.tiny_model={family}", f"run.output_dir={tmp_path / 'run'}",
        "run.max_steps=1", "run.progress=false", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "plugin.max_new_tokens=6", "eval.num_prompts=2",
        *(f"plugin.{option}={defaults[option]}" for option in unused_pixel_bounds(model, family)),
    ])
    trainer = Trainer(config)
    assert trainer.plugin.adapter.name == family
    assert trainer.plugin.reward_context()["box_convention"] == convention
    result = trainer.train()
    assert result.history[0]["loss/first_step_ratio_deviation"] < 1e-5


def _with_old_logp(trainer):
    """Make the plugin's training rollouts carry old log-probs from a teacher-forced pass inside rollout() (the vlm
    plugin leaves them to the core), through the very function the training forward uses."""
    plugin, original = trainer.plugin, trainer.plugin.rollout

    def rollout(policy, batch):
        result = original(policy, batch)
        if batch.training:
            assert result.old_logp is None
            with torch.no_grad():
                result.old_logp, _ = plugin.token_logp(plugin.runtime.unwrap(policy), replay_prompts(result.replay),
                                                       result.replay["completion_ids"], result.num_actions,
                                                       with_entropy=False)
        return result

    plugin.rollout = rollout
    return trainer


def _count_rollout_passes(trainer):
    """Wrap the plugin so that ``counts["rollout"]`` counts teacher-forced passes made inside rollout() (old_logp)
    and ``counts["other"]`` those made elsewhere (KL reference, training forward)."""
    plugin, counts, inside = trainer.plugin, {"rollout": 0, "other": 0}, []
    original_rollout, original_logp = plugin.rollout, plugin.token_logp

    def rollout(policy, batch):
        inside.append(True)
        try:
            return original_rollout(policy, batch)
        finally:
            inside.pop()

    def token_logp(*args, **kwargs):
        counts["rollout" if inside else "other"] += 1
        return original_logp(*args, **kwargs)

    plugin.rollout, plugin.token_logp = rollout, token_logp
    return counts


def test_one_optimizer_step_per_rollout_skips_the_old_logp_pass(tmp_path, tiny_models):
    """μ = 1, one mini-batch: nobody runs a teacher-forced old-policy pass (old_logp=None, the core uses the detached
    training log-probs) and every optimizer step gets the gradient it gets with old log-probs from such a pass; with
    μ = 2 the core runs that pass itself, once per rollout chunk. Gradients are compared, not parameters after AdamW
    (see tests.helpers.record_gradients)."""
    family, model = "qwen2_5_vl", tiny_models["qwen2_5_vl"]
    fast = Trainer(_config(tmp_path / "fast", model, family))
    fast_counts = _count_rollout_passes(fast)
    fast_gradients = record_gradients(fast, fast.plugin.model)
    fast_result = fast.train()
    # 2 steps x 6 samples in micro-batches of 4: the reference and the training forward run twice per step each.
    assert fast_counts == {"rollout": 0, "other": 8}
    assert all(r["loss/first_step_ratio_deviation"] == 0.0 for r in fast_result.history)
    forced = _with_old_logp(Trainer(_config(tmp_path / "forced", model, family)))
    forced_counts = _count_rollout_passes(forced)
    forced_gradients = record_gradients(forced, forced.plugin.model)
    forced_result = forced.train()
    assert forced_counts == {"rollout": 4, "other": 8}  # rollout chunks of 4: two old_logp passes per step
    assert all(r["loss/first_step_ratio_deviation"] < 1e-5 for r in forced_result.history)
    assert len(fast_gradients) == len(forced_gradients) == 2 and fast_gradients[0].keys() == forced_gradients[0].keys()
    for step, (got, expected) in enumerate(zip(fast_gradients, forced_gradients, strict=True)):
        assert any(g.abs().max() > 1e-4 for g in expected.values())  # a real gradient, not only rounding noise
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    assert [r["reward/mean"] for r in fast_result.history] == [r["reward/mean"] for r in forced_result.history]
    epochs = Trainer(load_config(to_dict(_config(tmp_path / "epochs", model, family)), ["algorithm.inner_epochs=2"]))
    epochs_counts = _count_rollout_passes(epochs)
    epochs_result = epochs.train()
    # Per step: the core's old-policy pass in rollout chunks of 4 (2 passes), then μ = 2 epochs of 2 micro-batches,
    # each with the reference and the training forward (8 passes); none inside rollout().
    assert epochs_counts == {"rollout": 0, "other": 20}
    assert all(r["loss/first_step_ratio_deviation"] < 1e-5 for r in epochs_result.history)


ATTENTION_AND_MLP = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LORA_KINDS = {
    "qwen3_5": ATTENTION_AND_MLP | {"in_proj_qkv", "in_proj_z", "out_proj"},
    "qwen3_vl_moe": {"q_proj", "k_proj", "v_proj", "o_proj"},  # the experts are fused parameters, not modules
    "qwen3_5_moe": ATTENTION_AND_MLP | {"in_proj_qkv", "in_proj_z", "out_proj"},  # MLP: the shared expert's
    "glm4v": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"},  # GLM-4.1V's fused MLP input
    "glm4v_moe": {"q_proj", "k_proj", "v_proj", "o_proj"},  # peft would move MLP names onto the experts
    "glm46v": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"},  # GLM-4.6V-Flash: GLM-4.1V's MLP
    # GLM-4.6V: peft keeps the MLP names on the dense layers and shared experts (model_type glm46v has no MoE mapping)
    "glm46v_moe": ATTENTION_AND_MLP,
    "internvl": ATTENTION_AND_MLP,  # its ViT's q/k/v_proj are excluded with the tower and the projector
    "gemma4": ATTENTION_AND_MLP,  # its ViT's q/k/v and gate/up/down_proj are excluded with the tower and embedder
    "gemma3": ATTENTION_AND_MLP,  # SigLIP's q/k/v_proj are excluded with the tower and the projector
    "mistral3": ATTENTION_AND_MLP,  # Pixtral's q/k/v/o and gate/up/down_proj are excluded with the tower and projector
    "smolvlm": ATTENTION_AND_MLP,  # SigLIP's q/k/v_proj are excluded with the tower and the connector
    "idefics3": ATTENTION_AND_MLP,
}
# The adapter that loads a build of another name (GLM-4.6V's MoE build is family glm46v, MoE read from the checkpoint)
LORA_ADAPTERS = {"glm46v_moe": "glm46v"}
# The test reward needs spread at step 1 for the LoRA to move: the tiny InternVL's and Gemma 3's six first completions
# at run seed 0 hold no digit (reward std 0, no update), at seed 2 they do.
RUN_SEEDS = {"internvl": 2, "gemma3": 2}


@pytest.mark.parametrize("family", sorted(LORA_KINDS))
def test_newer_families_train_with_lora(tmp_path, family):
    """Qwen3.5 (Gated DeltaNet and full-attention layers), GLM-4.1V (fused gate_up_proj), InternVL and Gemma 3 (a
    vision tower whose projections share the language model's names) and the MoE models, when transformers has them:
    LoRA reaches the
    modules each family has (the linear-attention projections; the MoE models' fused experts are no module targets,
    Qwen3.5-MoE's shared expert is; lora.target_parameters reaches the experts, tested below) and none of the vision
    modules; two GRPO steps with the KL term run at ratio 1, the LoRA moves and nothing else does (the vision tower,
    and InternVL's and Gemma 3's projector, included)."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if LORA_ADAPTERS.get(family, family) not in vlm_adapters:
        pytest.skip(f"transformers has no {LORA_ADAPTERS.get(family, family)}")
    model = build_tiny_model(family, tmp_path / family)
    trainer = Trainer(load_config(to_dict(_config(tmp_path, model, family)), [f"run.seed={RUN_SEEDS.get(family, 0)}"]))
    plugin = trainer.plugin
    assert plugin.adapter.name == LORA_ADAPTERS.get(family, family)
    adapted = {name.rsplit(".lora_", 1)[0] for name, _ in plugin.model.named_parameters() if ".lora_A." in name}
    assert {name.rsplit(".", 1)[-1] for name in adapted} == LORA_KINDS[family]
    assert not any(re.match(plugin.adapter.vision_module_pattern, name) or ".experts." in name for name in adapted)
    vision_ids = {id(p) for module in plugin.adapter.vision_modules(plugin.model) for p in module.parameters()}
    vision = {name for name, p in plugin.model.named_parameters() if id(p) in vision_ids}
    before = _snapshot(plugin.model)
    result = trainer.train()
    assert all(r["loss/first_step_ratio_deviation"] < 1e-5 for r in result.history)
    assert result.history[0]["reward/std"] > 0  # a gradient at step 1 (RUN_SEEDS)
    assert abs(result.history[0]["policy/kl"]) < 1e-6 and result.history[1]["policy/kl"] > 0
    after = _snapshot(plugin.model)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all("lora_" in name for name in changed)
    assert any(".q_proj.lora_B" in name for name in changed)
    assert vision and not vision & changed


# The tiny MoE builds, the adapter that loads each (Gemma 4's is family gemma4, MoE read from the checkpoint), and
# each one's fused expert tensor and router weight (Gemma 4's decoder layer holds them beside its dense MLP).
MOE_BUILDS = {"qwen3_vl_moe": "qwen3_vl_moe", "qwen3_5_moe": "qwen3_5_moe", "glm4v_moe": "glm4v_moe",
              "glm46v_moe": "glm46v", "gemma4_moe": "gemma4"}
MOE_NAMES = {"gemma4_moe": ("experts.gate_up_proj", "router.proj.weight")}
DEFAULT_MOE_NAMES = ("mlp.experts.gate_up_proj", "mlp.gate.weight")


def _moe_trainer(tmp_path, build, **plugin_overrides):
    """A Trainer on the tiny MoE ``build`` (skipped when transformers has not its adapter)."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if MOE_BUILDS[build] not in vlm_adapters:
        pytest.skip(f"transformers has no {MOE_BUILDS[build]}")
    trainer = Trainer(_config(tmp_path, build_tiny_model(build, tmp_path / build), MOE_BUILDS[build],
                              **plugin_overrides))
    assert trainer.plugin.adapter.name == MOE_BUILDS[build] and trainer.plugin.adapter.moe
    return trainer


def _moe_changes(tmp_path, build, **plugin_overrides):
    """Two GRPO steps on the tiny MoE ``build`` at ratio 1; the names of the parameters they changed and of the
    vision modules' parameters."""
    trainer = _moe_trainer(tmp_path, build, **plugin_overrides)
    plugin = trainer.plugin
    vision_ids = {id(p) for module in plugin.adapter.vision_modules(plugin.model) for p in module.parameters()}
    vision = {name for name, p in plugin.model.named_parameters() if id(p) in vision_ids}
    before = _snapshot(plugin.model)
    result = trainer.train()
    assert all(r["loss/first_step_ratio_deviation"] < 1e-5 for r in result.history)
    after = _snapshot(plugin.model)
    return {name for name in before if not torch.equal(before[name], after[name])}, vision


@pytest.mark.parametrize("build", sorted(MOE_BUILDS))
def test_moe_full_finetuning_trains_the_experts(tmp_path, build):
    """lora: null on the MoE models: the fused expert tensors and the routers train with the rest of the language
    model, the vision tower stays frozen, ratio 1."""
    changed, vision = _moe_changes(tmp_path, build, lora=None)
    experts, router = MOE_NAMES.get(build, DEFAULT_MOE_NAMES)
    assert any(name.endswith(experts) for name in changed)
    assert any(name.endswith(router) for name in changed)
    assert vision and not vision & changed


@pytest.mark.parametrize("build", sorted(MOE_BUILDS))
def test_moe_lora_reaches_the_fused_experts_with_target_parameters(tmp_path, build):
    """``lora.target_parameters`` adds LoRA on the fused expert tensors (peft's target_parameters) to the attention
    LoRA: two GRPO steps at ratio 1 move the experts' adapters and only adapters."""
    lora = {"rank": 4, "alpha": 8.0, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
    changed, _ = _moe_changes(tmp_path, build, lora=lora)
    assert changed and all("lora_" in name for name in changed)
    assert any(".experts." in name and ".lora_B." in name for name in changed)


def _routed(plugin, build, inputs):
    """The model's output for ``inputs`` with the router logits it records. GLM-4.6V's wrapper cannot return them
    (``Glm46VModel`` builds its output from the MoE language model's, which has them, with a class that has no
    ``router_logits`` field: a TypeError): for it they are read off the language model's own output."""
    from types import SimpleNamespace

    from mmrl.plugins.vlm.adapters.base import _base_model

    if build != "glm46v_moe":
        return plugin.model(**inputs, output_router_logits=True, use_cache=False)
    language_model = _base_model(plugin.model).model.language_model
    recorded = []
    handle = language_model.register_forward_hook(lambda _module, _args, output: recorded.append(output.router_logits))
    try:
        with pytest.raises(TypeError, match="router_logits"):
            plugin.model(**inputs, output_router_logits=True, use_cache=False)
    finally:
        handle.remove()
    return SimpleNamespace(router_logits=recorded[0])


def _switch_load_balancing(router_logits, attention_mask, num_experts, top_k, *, probabilities_given=False):
    """transformers' load_balancing_loss_func written out: over every layer's real tokens together, the fraction
    of top-k assignments f_e and the mean router probability P_e of each expert; num_experts · Σ_e f_e · P_e (Switch
    Transformer eqs. 4-6, with the layers pooled). ``probabilities_given``: the router outputs are already its
    softmax (Gemma 4)."""
    real = attention_mask.reshape(-1).bool()
    assignments = torch.zeros(num_experts)
    probabilities = torch.zeros(num_experts)
    rows = 0
    for logits in router_logits:
        probs = (logits.float() if probabilities_given else logits.float().softmax(-1))[real]  # [tokens, E]
        chosen = probs.topk(top_k, dim=-1).indices  # [tokens, k]
        assignments += torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probabilities += probs.sum(0)
        rows += probs.shape[0]
    return num_experts * float(((assignments / rows) * (probabilities / rows)).sum())


@pytest.mark.parametrize("build", sorted(MOE_BUILDS))
def test_moe_training_pass_adds_the_router_load_balancing_loss(tmp_path, build):
    """The training forward of an MoE model returns aux_loss = router_aux_loss_coef × the routers' load-balancing
    loss over the micro-batch's real tokens (prompt and completion), computed by hand from the router logits (Gemma
    4: the router probabilities it records; transformers computes no aux_loss for it); the log-probs are the same as
    without it; no-grad passes and router_aux_loss_coef 0 return none; a run logs loss/aux."""
    from mmrl.plugins.vlm.plugin import PassInputs

    trainer = _moe_trainer(tmp_path, build, router_aux_loss_coef=0.5)
    plugin = trainer.plugin
    batch = prompt_batch(plugin.dataset("train")[:2], 2, seed=3)
    rollout = plugin.rollout(plugin.policy(), batch)
    output = plugin.forward(plugin.policy(), rollout, need_reference=False)
    prepared = PassInputs(plugin, replay_prompts(rollout.replay), rollout.replay["completion_ids"])
    with torch.no_grad():
        # the positions the plugin passes (Gemma 4's plain rotary positions of left-padded rows; M-RoPE: none)
        routed = _routed(plugin, build, plugin.adapter._positioned(prepared.inputs))
        text = plugin.model.config.text_config
        experts = getattr(text, "num_experts", None) or text.num_local_experts  # GLM-4.5V: n_routed_experts
        top_k = getattr(text, "top_k_experts", None) or text.num_experts_per_tok  # Gemma 4: top_k_experts
        expected = _switch_load_balancing(routed.router_logits, prepared.inputs["attention_mask"], experts, top_k,
                                          probabilities_given=build == "gemma4_moe")
        plain = plugin.forward(plugin.policy(), rollout, need_reference=False)
    assert output.aux_loss.requires_grad and plain.aux_loss is None
    assert float(output.aux_loss.detach()) == pytest.approx(0.5 * expected, rel=1e-5)
    torch.testing.assert_close(output.logp.detach(), plain.logp, rtol=0, atol=1e-5)
    plugin.config.router_aux_loss_coef = 0.0
    assert plugin.forward(plugin.policy(), rollout, need_reference=False).aux_loss is None
    plugin.config.router_aux_loss_coef = 0.5
    history = trainer.train().history
    assert all(record["loss/aux"] > 0 for record in history)
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)
