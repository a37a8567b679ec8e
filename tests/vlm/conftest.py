"""Fixtures of the VLM plugin tests: tiny Qwen2-VL and Qwen2.5-VL checkpoints built once per session (offline,
random weights, saved and loaded back through from_pretrained), plugin configs and prompt batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmrl.config.schema import from_dict
from mmrl.plugin import PromptBatch, Runtime

FAMILIES = ("qwen2_vl", "qwen2_5_vl")

# Small enough for a loaded 2-core CPU: 56..160-pixel images resized to at most 16·28² pixels (≤ 16 image tokens).
PLUGIN_BASE: dict[str, Any] = {
    "attn_implementation": "eager",
    "min_pixels": 4 * 28 * 28,
    "max_pixels": 16 * 28 * 28,
    "max_new_tokens": 10,
    "lora": {"rank": 4, "alpha": 8.0},
    "data": {"synthetic": {"train_size": 12, "eval_size": 4, "tasks": ["grounding"], "seed": 2}},
    "prompt_template": "{question} Output the thinking process in <think> </think> and final answer in <answer> "
                       "</answer> tags.",
}


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: avoid oversubscription
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from mmrl.plugins.vlm.testing import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_vlms")
    return {family: build_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def plugin_options(model: Path | str, **overrides: Any) -> dict[str, Any]:
    """:data:`PLUGIN_BASE` for ``model`` with ``overrides``, less the pixel bounds the model's family refuses
    (``unused_pixel_bounds``: Gemma 3 takes neither, Mistral 3 no ``min_pixels``) unless ``overrides`` set them."""
    options = {**PLUGIN_BASE, "model": str(model)}
    for option in unused_pixel_bounds(model, overrides.get("tiny_model")):
        options.pop(option)
    options.update(overrides)
    return options


def unused_pixel_bounds(model: Path | str, tiny_model: str | None = None) -> tuple[str, ...]:
    """The pixel bounds the adapter of ``model`` (its config.json's ``model_type``, or the ``tiny_model`` family it
    will be built as) does not take; none for a model that is neither."""
    from mmrl.plugins.vlm.adapters import adapter_for, vlm_adapters

    if tiny_model is not None:
        adapter = vlm_adapters.get(tiny_model) if tiny_model in vlm_adapters else None
    elif (Path(model) / "config.json").is_file():
        adapter = adapter_for("auto", str(model))
    else:
        adapter = None
    return tuple(getattr(adapter, "unused_pixel_bounds", ()))


def make_plugin(model: Path | str, runtime: Runtime | None = None, **overrides: Any):
    from mmrl.plugins.vlm.plugin import VLMPlugin, VLMPluginConfig

    config = from_dict(VLMPluginConfig, plugin_options(model, **overrides), "plugin")
    return VLMPlugin(config, runtime or Runtime())


@pytest.fixture(scope="session")
def lora_plugins(tiny_models):
    """One LoRA plugin per family, shared by tests that only sample and recompute (they never change weights)."""
    return {family: make_plugin(path) for family, path in tiny_models.items()}


def prompt_batch(rows: list[dict[str, Any]], group_size: int, *, seed: int = 0, training: bool = True
                 ) -> PromptBatch:
    """Each row repeated group_size times (group ids 0..len(rows)-1), one seed per sample."""
    repeated = [row for row in rows for _ in range(group_size)]
    n = len(repeated)
    return PromptBatch(
        rows=repeated,
        group_ids=torch.arange(len(rows)).repeat_interleave(group_size),
        group_size=group_size,
        seeds=torch.arange(n, dtype=torch.long) + 1000 * seed,
        generator=torch.Generator().manual_seed(seed),
        training=training,
    )


def assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, processor_inputs, atol=1e-5):
    """Each sample's old log-probs (sample i of ``rollout`` asks ``rows[i // group]``) equal a plain transformers
    forward of ``processor_inputs(row)`` (the processor's output for the row's hand-written chat) with the completion
    appended: the prompt ids match the replay's, and the tempered log-softmax of the logits (the plugin's suppressed
    ids removed) gives each completion token its old log-prob, within ``atol``."""
    model = plugin.policy()
    replay = rollout.replay
    for i in range(len(rollout.group_ids)):
        inputs = processor_inputs(rows[i // group])
        prompt_ids = inputs["input_ids"][0]
        assert torch.equal(replay["input_ids"][i], prompt_ids)
        completion = replay["completion_ids"][i]
        inputs["input_ids"] = torch.cat([prompt_ids, completion]).unsqueeze(0)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:  # InternVL's processor writes none
            types = inputs["mm_token_type_ids"][0]
            inputs["mm_token_type_ids"] = torch.cat([types, torch.zeros_like(completion)])[None]
        with torch.no_grad():
            logits = model(**inputs).logits[0, len(prompt_ids) - 1:-1].float()  # [C, V]
        logits[:, plugin.adapter.suppressed_token_ids()] = -torch.inf
        expected = (logits / plugin.config.temperature).log_softmax(-1).gather(-1, completion.unsqueeze(-1))[:, 0]
        torch.testing.assert_close(rollout.old_logp[i, :len(completion)], expected, rtol=0, atol=atol)


def assert_two_lora_grpo_steps_and_a_peft_export(tmp_path: Path, family: str, check_rows,
                                                 language_model: str = "language_model",
                                                 adapter: str | None = None) -> None:
    """``tiny_model: family`` builds the checkpoint; 3 prompts x G=2 through the trainer with two inner epochs: ratio 1
    on the first inner step (the core's old-policy pass against the training forward), KL > 0 at step 2, only LoRA
    weights of the language model move (none in the tower or projector); the exported adapter loads with
    ``PeftModel.from_pretrained`` and reproduces the trained policy's log-probs, which the untrained base does not.
    ``check_rows(plugin)`` checks the family's training rows (their boxes' frame) before training; ``language_model``
    is the name of the language model's module (SmolVLM's is ``text_model``); ``adapter`` the adapter that loads the
    ``family`` build when it has another name (``glm46v_moe`` is loaded by ``glm46v``)."""
    from peft import PeftModel

    from mmrl.config import load_config
    from mmrl.plugins.vlm.plugin import replay_prompts
    from mmrl.policy import export_run
    from mmrl.trainer import Trainer
    from tests.vlm.test_export import distinct_characters  # noqa: F401 — registers the test reward

    options = plugin_options(tmp_path / f"tiny-{family}", tiny_model=family, max_new_tokens=6)
    config = load_config({
        "plugin": {"name": "vlm", **options},
        "run": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 3, "group_size": 2, "batch_size": 4},
        # two inner epochs: the core's old-policy pass (eval mode, no grad, pieces of 4) and the first inner step's
        # training forward (train mode, shuffled micro-batches of 4) are compared, not one pass with itself
        "algorithm": {"micro_batch_size": 4, "kl_coef": 0.04, "minibatches": 1, "inner_epochs": 2},
        "optim": {"lr": 5.0e-2},
        "rewards": {"functions": [{"name": "format"}, {"name": "iou"}, {"name": "test_export_distinct"}]},
        "eval": {"at_start": False, "num_prompts": 1, "save_samples": False},
    })
    trainer = Trainer(config)
    plugin = trainer.plugin
    assert plugin.adapter.name == (adapter or family)
    check_rows(plugin)
    before = {name: p.detach().clone() for name, p in plugin.model.named_parameters()}
    result = trainer.train()
    assert [record["step"] for record in result.history] == [1, 2]
    for record in result.history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5, record["loss/first_step_ratio_deviation"]
    assert result.history[1]["policy/kl"] > 0  # the adapter moved away from the reference
    changed = {name for name, p in plugin.model.named_parameters() if not torch.equal(before[name], p)}
    assert changed and all("lora_" in name and language_model in name for name in changed)

    rollout = plugin.rollout(plugin.policy(), prompt_batch(plugin.dataset("train")[:2], 2, seed=5))

    def logp(model):
        with torch.no_grad():
            values, _ = plugin.token_logp(model, replay_prompts(rollout.replay), rollout.replay["completion_ids"],
                                          rollout.num_actions, with_entropy=False)
        return values.masked_fill(rollout.mask == 0, 0.0)  # [N, A]

    ours = logp(plugin.model)
    out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="step-00000002")
    exported = PeftModel.from_pretrained(plugin.adapter.load_model(dtype=torch.float32, attn_implementation="eager"),
                                         str(out))
    torch.testing.assert_close(logp(exported), ours, rtol=0, atol=1e-5)
    base = plugin.adapter.load_model(dtype=torch.float32, attn_implementation="eager")
    assert float((logp(base) - ours).abs().max()) > 1e-3
