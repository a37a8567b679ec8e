"""Canvas models (DiffusionGemma) in the dLLM plugin: the sampler against transformers' ``generate``, the likelihood
surrogate against independent per-canvas forwards (values and gradients), the noise plans, the adapter, the plugin's
checks and a training run through the trainer (full fine-tuning and LoRA), on a tiny DiffusionGemma built from its
config classes and loaded with ``from_pretrained``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

from mmrl.config import ConfigError, load_config
from mmrl.plugins.dllm.adapters import DiffusionGemmaAdapter, adapter_for
from mmrl.plugins.dllm.canvas import (
    CanvasSamplerConfig,
    CanvasSampling,
    canvas_generate,
    canvas_token_logprobs,
    draw_uniform_plan,
    entropy_bound_accept,
)
from mmrl.plugins.dllm.estimators import likelihood_estimators
from mmrl.plugins.dllm.testing import save_tiny_diffusion_gemma
from mmrl.reward import reward_functions
from mmrl.trainer import Trainer

torch.set_num_threads(1)

CANVAS = 4
PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"), canvas_length=CANVAS)


@pytest.fixture(scope="module")
def model(checkpoint):
    return DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint).eval()


def _prompts(seed: int, pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 5 tokens, the second left-padded by ``pad``."""
    ids = torch.randint(4, 20, (2, 5), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = PAD, 0
    return ids, mask


# ---------------------------------------------------------------------- sampler
@pytest.mark.parametrize(("entropy_bound", "stability", "confidence"),
                         [(0.1, 1, 0.005), (0.1, 0, 100.0), (2.0, 0, 3.125), (2.0, 2, 100.0), (0.5, None, None)])
def test_sampler_draws_what_transformers_generate_draws(model, entropy_bound, stability, confidence):
    """With the global RNG, canvas_generate makes transformers' calls in transformers' order: the same tokens, the
    same padding after EOS and the same decoder passes (tokens_per_forward), left padding and early stops included
    (confidence 100 stops every row at once, 3.125 some rows before others)."""
    for seed in range(3):
        ids, mask = _prompts(seed)
        sampling = CanvasSampling(steps=5, t_min=0.4, t_max=0.8, entropy_bound=entropy_bound,
                                  stability_threshold=stability, confidence_threshold=confidence)
        kwargs = {} if stability is None else {"stability_threshold": stability, "confidence_threshold": confidence}
        torch.manual_seed(seed)
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=12, max_denoising_steps=5, t_min=0.4,
                                   t_max=0.8, sampler_config=EntropyBoundSamplerConfig(entropy_bound=entropy_bound),
                                   pad_token_id=PAD, eos_token_id=EOS, **kwargs)
        torch.manual_seed(seed)
        ours = canvas_generate(model, ids, mask, gen_length=12, sampling=sampling, stop_ids=[EOS], pad_id=PAD)
        theirs = reference.sequences[:, ids.shape[1]:]
        width = theirs.shape[1]
        assert torch.equal(ours.completion_ids[:, :width], theirs)
        assert bool((ours.completion_ids[:, width:] == PAD).all())  # transformers stopped: every row had its EOS
        written = (ours.completion_ids != PAD).sum(dim=1).float()
        assert torch.allclose(written / ours.decoder_passes.float(), reference.tokens_per_forward.float())


def test_early_stopping_happens_in_the_compared_settings(model):
    """The settings above do stop rows early (else the comparison would not cover adaptive stopping)."""
    ids, mask = _prompts(0)
    sampling = CanvasSampling(steps=5, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability_threshold=0,
                              confidence_threshold=100.0)
    torch.manual_seed(0)
    out = canvas_generate(model, ids, mask, gen_length=12, sampling=sampling, stop_ids=[EOS], pad_id=PAD)
    assert int(out.decoder_passes.max()) <= 3  # one step per canvas
    assert out.decoder_calls == out.canvases <= 3  # one batched forward per canvas decoded
    finished_after = (out.completion_ids == EOS).int().argmax(dim=1) // 4 + 1  # the canvas holding each EOS
    assert out.canvases == (3 if not bool((out.completion_ids == EOS).any(dim=1).all()) else int(finished_after.max()))


def test_a_sample_does_not_depend_on_its_batch(model):
    ids = torch.randint(4, 20, (3, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    sampling = CanvasSampling(steps=4, t_min=0.4, t_max=0.8, entropy_bound=0.3, stability_threshold=1,
                              confidence_threshold=0.005)

    def generators():
        return [torch.Generator().manual_seed(100 + i) for i in range(3)]

    together = canvas_generate(model, ids, mask, gen_length=8, sampling=sampling, stop_ids=[EOS], pad_id=PAD,
                               generators=generators())
    for row, generator in enumerate(generators()):
        alone = canvas_generate(model, ids[row:row + 1], mask[row:row + 1], gen_length=8, sampling=sampling,
                                stop_ids=[EOS], pad_id=PAD, generators=[generator])
        assert torch.equal(alone.completion_ids[0], together.completion_ids[row])
        assert torch.equal(alone.step_map[0], together.step_map[row])


def test_entropy_bound_acceptance_by_hand():
    # Sorted: 0.01 (pos 2), 0.05 (pos 0), 0.2 (pos 3), 0.3 (pos 1); sum of the accepted minus their largest:
    # 0, 0.01, 0.06, 0.26 -> the first three fit a bound of 0.1.
    entropy = torch.tensor([[0.05, 0.3, 0.01, 0.2]])
    assert entropy_bound_accept(entropy, 0.1).tolist() == [[True, False, True, True]]
    assert entropy_bound_accept(entropy, 0.005).tolist() == [[False, False, True, False]]  # always the lowest one


def test_temperature_schedule():
    sampling = CanvasSampling(steps=4, t_min=0.4, t_max=0.8, entropy_bound=0.1)
    assert [round(float(sampling.temperature(n)), 6) for n in (4, 3, 2, 1)] == [0.8, 0.7, 0.6, 0.5]


# ---------------------------------------------------------------------- likelihood
def _clean_and_real(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two completions of 3 canvases: the first ends (EOS) in canvas 2, the second in canvas 1."""
    completion = torch.randint(4, 20, (2, 12), generator=torch.Generator().manual_seed(seed))
    completion[0, 9], completion[0, 10:] = EOS, PAD
    completion[1, 5], completion[1, 6:] = EOS, PAD
    real = torch.zeros_like(completion)
    real[0, :10], real[1, :6] = 1, 1
    return completion, real


def _independent_logprobs(model, prompt, prompt_mask, completion, real, plan):
    """Per draw, row and canvas: one fresh forward of the unpadded prompt and the clean earlier canvases (encoded at
    once) with the noisy canvas, self-conditioned by a first pass where the draw's coin says so."""
    draws, batch, width = plan.corrupted.shape
    out = torch.zeros(draws, batch, width)
    for d in range(draws):
        for b in range(batch):
            context_prompt = prompt[b][prompt_mask[b].bool()]
            clean = torch.where(real[b].bool(), completion[b], torch.full_like(completion[b], EOS))
            noisy = torch.where(plan.corrupted[d, b], plan.tokens[d, b], clean)
            for k in range(math.ceil(int(real[b].sum()) / CANVAS)):
                columns = slice(k * CANVAS, (k + 1) * CANVAS)
                context = torch.cat([context_prompt, clean[:k * CANVAS]]).unsqueeze(0)
                inputs = {"input_ids": context, "decoder_input_ids": noisy[columns].unsqueeze(0)}
                logits = model(**inputs).logits
                if plan.self_conditioning[d, b]:
                    with torch.no_grad():
                        first = logits.detach()
                    logits = model(**inputs, self_conditioning_logits=first).logits
                logp = logits[0].float().log_softmax(-1).gather(-1, completion[b, columns].unsqueeze(-1)).squeeze(-1)
                out[d, b, columns] = logp * real[b, columns]
    return out


@pytest.mark.parametrize("self_conditioning_p", [0.0, 1.0, 0.5])
def test_token_logprobs_match_independent_forwards_in_value_and_gradient(model, self_conditioning_p):
    """The cached block-causal scoring (prompt left-padded, canvases encoded one by one as sampling does) equals a
    fresh forward per canvas of the unpadded prompt and the clean earlier canvases, self-conditioning included, and
    so does the gradient of their sum (which flows through the encoder's cache)."""
    prompt, prompt_mask = _prompts(1)
    completion, real = _clean_and_real(2)
    plan = draw_uniform_plan(real, canvas_length=CANVAS, vocab_size=model.config.text_config.vocab_size,
                             num_samples=3, generators=[torch.Generator().manual_seed(s) for s in (5, 6)],
                             self_conditioning_p=self_conditioning_p)
    model.zero_grad()
    ours = canvas_token_logprobs(model, prompt, prompt_mask, completion, real, plan, canvas_length=CANVAS,
                                 eos_id=EOS)
    ours.sum().backward()
    ours_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    theirs = _independent_logprobs(model, prompt, prompt_mask, completion, real, plan)
    theirs.sum().backward()
    theirs_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert torch.allclose(ours, theirs, atol=2e-5)
    assert bool((ours[:, 0, 10:] == 0).all()) and bool((ours[:, 1, 6:] == 0).all())  # nothing after the EOS
    assert bool((ours[:, 0, :10] < 0).all())
    assert ours_grad.keys() == theirs_grad.keys()
    for name, grad in ours_grad.items():
        assert torch.allclose(grad, theirs_grad[name], atol=1e-5, rtol=1e-3), name


def test_micro_batches_give_the_same_scores(model):
    prompt, prompt_mask = _prompts(1)
    completion, real = _clean_and_real(2)
    plan = draw_uniform_plan(real, canvas_length=CANVAS, vocab_size=model.config.text_config.vocab_size,
                             num_samples=2, generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    with torch.no_grad():
        whole = canvas_token_logprobs(model, prompt, prompt_mask, completion, real, plan, canvas_length=CANVAS,
                                      eos_id=EOS)
        split = canvas_token_logprobs(model, prompt, prompt_mask, completion, real, plan, canvas_length=CANVAS,
                                      eos_id=EOS, micro_batch=1)
    assert torch.allclose(whole, split, atol=1e-6)


def test_uniform_plan_corruption_rates_and_independence():
    real = torch.zeros(3, 12, dtype=torch.long)
    real[0, :10], real[1, :3], real[2, :12] = 1, 1, 1
    generators = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    plan = draw_uniform_plan(real, canvas_length=4, vocab_size=50, num_samples=4000, generators=generators,
                             eps=0.2, self_conditioning_p=0.3)
    window = torch.tensor([[1] * 12, [1] * 4 + [0] * 8, [1] * 12]).bool()
    assert not bool(plan.corrupted[:, ~window].any())  # only the canvases holding real tokens
    rate = plan.corrupted[:, window].float().mean()
    assert abs(float(rate) - 0.6) < 0.01  # E[t] for t ~ U(0.2, 1)
    assert abs(float(plan.self_conditioning.float().mean()) - 0.3) < 0.02
    assert int(plan.tokens.min()) >= 0 and int(plan.tokens.max()) == 49
    assert torch.equal(plan.weights[0], real.float())
    alone = draw_uniform_plan(real[1:2], canvas_length=4, vocab_size=50, num_samples=4000,
                              generators=[torch.Generator().manual_seed(2)], eps=0.2, self_conditioning_p=0.3)
    assert torch.equal(alone.corrupted[:, 0], plan.corrupted[:, 1]) and torch.equal(alone.tokens[:, 0],
                                                                                  plan.tokens[:, 1])
    with pytest.raises(ValueError, match="eps must be in"):
        draw_uniform_plan(real, canvas_length=4, vocab_size=50, num_samples=1, generators=generators, eps=1.0)


def test_registered_estimator_is_the_draw_average_of_the_token_logprobs(model):
    prompt = torch.randint(4, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    completion, real = _clean_and_real(3)
    estimator = likelihood_estimators.get("uniform_one_step")
    with torch.no_grad():
        value = estimator(model, prompt, completion, real, num_samples=3, generator=torch.Generator().manual_seed(9))
        again = estimator(model, prompt, completion, real, num_samples=3, generator=torch.Generator().manual_seed(9))
        generator = torch.Generator().manual_seed(9)
        plan = draw_uniform_plan(real, canvas_length=CANVAS, vocab_size=model.config.text_config.vocab_size,
                                 num_samples=3, generators=[generator, generator])
        direct = _independent_logprobs(model, prompt, torch.ones_like(prompt), completion, real, plan)
    assert torch.equal(value, again)
    assert torch.allclose(value, direct.mean(dim=0).sum(dim=-1), atol=1e-4)


# ---------------------------------------------------------------------- adapter and config
def test_adapter_reads_the_checkpoint(tmp_path):
    folder = save_tiny_diffusion_gemma(tmp_path / "m", canvas_length=CANVAS,
                                       generation_config={"eos_token_id": [EOS, 3], "t_min": 0.3,
                                                          "sampler_config": {"entropy_bound": 0.25,
                                                                             "_cls_name": "EntropyBoundSamplerConfig"}})
    assert adapter_for(folder) is DiffusionGemmaAdapter
    adapter = DiffusionGemmaAdapter(folder)
    assert adapter.mask_id is None and adapter.noise == "uniform"
    assert adapter.stop_ids == (EOS, 3) and adapter.pad_id == PAD and adapter.canvas_length == CANVAS
    sampling = CanvasSamplerConfig(t_max=0.9).resolve(adapter.generation_config, 6)
    assert (sampling.t_min, sampling.t_max, sampling.entropy_bound, sampling.steps) == (0.3, 0.9, 0.25, 6)
    assert (sampling.stability_threshold, sampling.confidence_threshold) == (1, 0.005)  # transformers' defaults
    assert CanvasSamplerConfig(adaptive_stopping=False).resolve({}, 2).stability_threshold is None
    with pytest.raises(ValueError, match="no mask token"):
        DiffusionGemmaAdapter(folder, mask_id=1)
    with pytest.raises(ConfigError, match="above t_min"):
        CanvasSamplerConfig(t_max=0.2).resolve(adapter.generation_config, 6)


@reward_functions.register("test_canvas_digits")
def _digit_share(batch):
    """The share of digits in a completion (random completions have some: a reward with spread)."""
    return [sum(c.isdigit() for c in text) / 8 for text in batch.output("completions")]


def _config(checkpoint, tmp_path, *overrides: str):
    base = {
        "plugin": {"name": "dllm", "model": checkpoint, "train_size": 32, "eval_size": 4, "num_mc_samples": 2,
                   "gen_length": 8, "block_length": CANVAS, "steps": 6},
        "run": {"max_steps": 2, "seed": 0, "progress": False, "save_every": 0, "output_dir": str(tmp_path)},
        "rollout": {"prompts_per_step": 2, "group_size": 4},
        "algorithm": {"inner_epochs": 2, "micro_batch_size": 8, "kl_coef": 0.04},
        "optim": {"lr": 1e-3},
        "rewards": {"functions": [{"name": "test_canvas_digits"}]},
        "eval": {"at_start": False, "num_prompts": 2},
    }
    return load_config(base, list(overrides))


@pytest.mark.parametrize(("override", "match"), [
    ("plugin.estimator=elbo_l", "uniform_one_step \\(or null\\) for the diffusion_gemma canvas model"),
    ("plugin.block_length=2 plugin.steps=8", "4, the canvas_length of"),
    ("plugin.temperature=0.9", "its sampler is set by plugin.canvas_sampler"),
    ("plugin.cfg_scale=1.0", "its sampler is set by plugin.canvas_sampler"),
    ("plugin.confidence_eos_eot_inf=true", "its sampler is set by plugin.canvas_sampler"),
    ("plugin.score_tail=true", "False \\(its default\\) for the diffusion_gemma canvas model"),
])
def test_plugin_refuses_masked_model_options_for_a_canvas_model(checkpoint, tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(_config(checkpoint, tmp_path, *override.split()))


def test_plugin_refuses_the_canvas_estimator_for_a_masked_model(tmp_path):
    config = _config(None, tmp_path, "plugin.model=null", "plugin.gen_length=4", "plugin.steps=4",
                     "plugin.estimator=uniform_one_step")
    with pytest.raises(ConfigError, match="scores canvas models only"):
        Trainer(config)


# ---------------------------------------------------------------------- training
def _train(config):
    trainer = Trainer(config)
    module = trainer.plugin.policy()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    result = trainer.train()
    moved = {name for name, p in module.named_parameters() if not torch.equal(before[name], p)}
    return trainer, result, moved


def test_full_fine_tuning_trains_with_routers_and_vision_frozen(checkpoint, tmp_path):
    trainer, result, moved = _train(_config(checkpoint, tmp_path))
    plugin = trainer.plugin
    assert plugin.estimator == "uniform_one_step" and plugin.config.per_token
    for record in result.history:
        assert record["loss/first_step_ratio_deviation"] == 0.0
        assert 0 < record["rollout/denoising_steps"] <= 6
        assert record["optim/grad_norm"] > 0
    trainable = {name for name, p in plugin.policy().named_parameters() if p.requires_grad}
    assert not any(".router." in n or "vision" in n for n in trainable)
    assert moved and moved <= trainable
    assert any(".self_attn." in name for name in moved)
    exported = plugin.export(plugin.policy(), tmp_path / "export")
    assert exported == "pretrained"
    reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "export")
    name = next(iter(sorted(moved)))
    assert torch.equal(dict(reloaded.named_parameters())[name], dict(plugin.policy().named_parameters())[name])


def test_lora_is_shared_by_the_encoder_and_the_decoder(checkpoint, tmp_path):
    trainer, result, moved = _train(_config(checkpoint, tmp_path, "plugin.lora={rank: 4, alpha: 8.0}"))
    module = trainer.plugin.policy()
    modules = dict(module.named_modules())
    encoder_q = modules["model.encoder.language_model.layers.0.self_attn.q_proj"]
    decoder_q = modules["model.decoder.layers.0.self_attn.q_proj"]
    assert encoder_q.lora_A["default"].weight is decoder_q.lora_A["default"].weight
    assert not any("vision_tower" in n or "self_conditioning" in n for n, m in modules.items()
                   if hasattr(m, "lora_A"))
    assert moved and all("lora_" in name for name in moved)
    assert result.history[0]["loss/first_step_ratio_deviation"] == 0.0
    assert result.history[0]["optim/grad_norm"] > 0
    # The exported peft folder names the shared weights under both modules; peft loads them into a fresh model.
    for loaded in _exported_twins(trainer, checkpoint, tmp_path / "export", "layers.0.self_attn.q_proj"):
        assert torch.equal(loaded.lora_A["default"].weight, decoder_q.lora_A["default"].weight.detach())


def _exported_twins(trainer, checkpoint, folder, name):
    """Export the run's LoRA as a peft folder, load it into a fresh model with ``PeftModel``, and return the
    encoder's and the decoder's module ``name`` (relative to their layer stacks' parents)."""
    from peft import PeftModel

    assert trainer.plugin.export(trainer.plugin.policy(), folder) == "peft_lora"
    reloaded = PeftModel.from_pretrained(DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint), str(folder))
    loaded = dict(reloaded.named_modules(remove_duplicate=False))
    return [loaded[f"base_model.model.model.{side}.{name}"] for side in ("encoder.language_model", "decoder")]


def test_lora_on_the_fused_experts_trains_them_shared_by_encoder_and_decoder(checkpoint, tmp_path):
    """``lora.target_parameters`` puts LoRA on the experts' fused weights (no nn.Linear), tied between the encoder and
    the decoder as the other adapter layers; a name that matches no parameter is refused (peft would only warn)."""
    lora = "plugin.lora={rank: 4, alpha: 8.0, target_parameters: [experts.gate_up_proj, experts.down_proj]}"
    trainer, result, moved = _train(_config(checkpoint, tmp_path / "run", lora))
    modules = dict(trainer.plugin.policy().named_modules())
    encoder, decoder = (modules[f"model.{side}.layers.0.experts"] for side in ("encoder.language_model", "decoder"))
    assert encoder.lora_B["default"].weight is decoder.lora_B["default"].weight
    assert any(".experts." in name and "lora_B" in name for name in moved)  # B starts at 0 and moves
    assert result.history[0]["loss/first_step_ratio_deviation"] == 0.0
    for loaded in _exported_twins(trainer, checkpoint, tmp_path / "export", "layers.0.experts"):
        assert torch.equal(loaded.lora_B["default"].weight, decoder.lora_B["default"].weight.detach())
    bad = "plugin.lora={rank: 4, alpha: 8.0, target_parameters: [experts.nothing]}"
    with pytest.raises(ConfigError, match="'experts.nothing' matches no parameter"):
        Trainer(_config(checkpoint, tmp_path / "bad", bad))


def test_wd1_objective_scores_the_sequence(checkpoint, tmp_path):
    trainer, result, moved = _train(_config(checkpoint, tmp_path, "plugin.objective=wd1", "algorithm.advantage=wd1",
                                            "algorithm.policy_loss=wd1", "algorithm.kl_coef=0"))
    assert trainer.plugin.max_actions() == 1 and moved
    assert json.dumps(result.history[-1])  # finite, serialisable metrics


def test_edge_inputs_of_the_likelihood(model):
    """A completion with nothing to score (an all-zero mask) gets zeros without a forward's worth of error; one
    completion alone scores as it does within a batch; the plan refuses a generator count that is not the batch."""
    prompt, prompt_mask = _prompts(1)
    completion, real = _clean_and_real(2)
    vocab = model.config.text_config.vocab_size
    nothing = torch.zeros_like(real)
    plan = draw_uniform_plan(nothing, canvas_length=CANVAS, vocab_size=vocab, num_samples=2,
                             generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    with torch.no_grad():
        zeros = canvas_token_logprobs(model, prompt, prompt_mask, completion, nothing, plan, canvas_length=CANVAS,
                                      eos_id=EOS)
    assert not bool(plan.corrupted.any()) and torch.equal(zeros, torch.zeros(2, 2, 12))
    plan = draw_uniform_plan(real, canvas_length=CANVAS, vocab_size=vocab, num_samples=2,
                             generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    alone_plan = draw_uniform_plan(real[:1], canvas_length=CANVAS, vocab_size=vocab, num_samples=2,
                                   generators=[torch.Generator().manual_seed(1)])
    with torch.no_grad():
        both = canvas_token_logprobs(model, prompt, prompt_mask, completion, real, plan, canvas_length=CANVAS,
                                     eos_id=EOS)
        alone = canvas_token_logprobs(model, prompt[:1], prompt_mask[:1], completion[:1], real[:1], alone_plan,
                                      canvas_length=CANVAS, eos_id=EOS)
    assert torch.allclose(alone[:, 0], both[:, 0], atol=1e-5)
    with pytest.raises(ValueError, match="1 generators for 2 completions"):
        draw_uniform_plan(real, canvas_length=CANVAS, vocab_size=vocab, num_samples=1,
                          generators=[torch.Generator()])
