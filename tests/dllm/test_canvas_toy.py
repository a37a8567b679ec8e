"""The toy canvas world: DiffusionGemma's SFT loss against its formula, the pretraining script, the committed tiny
DiffusionGemma and a short RL run of ``configs/dllm/toy_canvas.yaml`` through the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion

from mmrl.config import load_config
from mmrl.plugins.dllm import canvas_pretrain, toy
from mmrl.plugins.dllm.adapters import DiffusionGemmaAdapter
from mmrl.plugins.dllm.canvas import CanvasSampling
from mmrl.trainer import Trainer

torch.set_num_threads(1)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "dllm" / "toy_canvas.yaml"


def _tiny_model(seed: int = 0):
    tokenizer = toy.build_tokenizer()
    torch.manual_seed(seed)
    config = canvas_pretrain.canvas_model_config(tokenizer, hidden_size=32, num_layers=2, num_heads=2,
                                                 intermediate_size=64)
    return tokenizer, DiffusionGemmaForBlockDiffusion(config).eval()


@pytest.mark.parametrize(("self_conditioning_p", "encoder_loss_weight"), [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)])
def test_sft_loss_matches_its_formula(self_conditioning_p, encoder_loss_weight):
    """The batched loss (left-padded prompts, one cache) equals the formula computed row by row on the unpadded
    prompts with the same noise: the mean cross-entropy over every canvas position of the decoder on the noisy
    canvas (self-conditioned on a first pass where the coin says so), plus the weighted mean next-token
    cross-entropy of the encoder over the real tokens."""
    tokenizer, model = _tiny_model()
    rows = toy.addition_splits(eval_size=10, seed=0)["eval"][:3]
    prompt_ids, completion_ids = toy.encode_examples(tokenizer, [r["prompt"] for r in rows],
                                                     [r["solution"] for r in rows])
    loss, parts = canvas_pretrain.canvas_sft_loss(
        model, prompt_ids, completion_ids, pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(4),
        self_conditioning_p=self_conditioning_p, encoder_loss_weight=encoder_loss_weight)
    # The same draws, in the loss's order.
    generator = torch.Generator().manual_seed(4)
    batch, width = completion_ids.shape
    t = 1e-3 + (1.0 - 1e-3) * torch.rand(batch, 1, generator=generator)
    corrupted = torch.rand(batch, width, generator=generator) < t
    noisy = torch.where(corrupted, torch.randint(0, len(tokenizer), (batch, width), generator=generator),
                        completion_ids)
    coins = torch.rand(batch, generator=generator) < self_conditioning_p
    diffusion, ar_terms = [], []
    torch.set_grad_enabled(False)
    for b in range(batch):
        prompt = prompt_ids[b][prompt_ids[b] != tokenizer.pad_token_id].unsqueeze(0)
        logits = model(input_ids=prompt, decoder_input_ids=noisy[b:b + 1]).logits
        if coins[b]:
            logits = model(input_ids=prompt, decoder_input_ids=noisy[b:b + 1],
                           self_conditioning_logits=logits.detach()).logits
        diffusion.append(F.cross_entropy(logits[0].float(), completion_ids[b], reduction="none"))
        sequence = torch.cat([prompt[0], completion_ids[b]]).unsqueeze(0)
        hidden = model.model.encoder(input_ids=sequence).last_hidden_state
        cap = model.final_logit_softcapping
        ar_logits = torch.tanh(model.lm_head(hidden[0, :-1]).float() / cap) * cap
        ar_terms.append(F.cross_entropy(ar_logits, sequence[0, 1:], reduction="none"))
    torch.set_grad_enabled(True)
    expected_diffusion = torch.cat(diffusion).mean()
    expected_ar = torch.cat(ar_terms).mean()
    assert parts["diffusion"] == pytest.approx(float(expected_diffusion), abs=1e-5)
    assert parts["autoregressive"] == pytest.approx(float(expected_ar), abs=1e-5)
    assert float(loss) == pytest.approx(float(expected_diffusion + encoder_loss_weight * expected_ar), abs=1e-5)


def test_pretraining_script_writes_a_loadable_checkpoint(tmp_path):
    summary = canvas_pretrain.pretrain(canvas_pretrain.parser().parse_args([
        "--output", str(tmp_path), "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--eval-size", "10",
        "--hidden-size", "16", "--layers", "2", "--heads", "2", "--intermediate-size", "32",
    ]))
    assert [r["step"] for r in summary["history"]] == [2, 4]
    assert summary["command"].startswith("python -m mmrl.plugins.dllm.canvas_pretrain --output")
    adapter = DiffusionGemmaAdapter(str(tmp_path))
    assert adapter.canvas_length == toy.GEN_LENGTH and adapter.stop_ids == (toy.build_tokenizer().eos_token_id,)
    assert adapter.load_model().config.text_config.hidden_size == 16


def test_committed_checkpoint_reproduces_its_recorded_held_out_accuracy():
    record = json.loads((toy.CANVAS_ASSETS / "pretrain.json").read_text())
    held_out = record["held_out"]
    assert 0.4 <= held_out["accuracy"] <= 0.7 and held_out["forgotten_carry_rate"] > 0.5  # room for RL
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(toy.CANVAS_ASSETS).eval()
    rows = toy.addition_splits(eval_size=record["arguments"]["eval_size"],
                               seed=record["arguments"]["data_seed"])["eval"]
    sampling = CanvasSampling(steps=toy.GEN_LENGTH, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability_threshold=1,
                              confidence_threshold=0.005)
    metrics = canvas_pretrain.evaluate(model, toy.build_tokenizer(), rows, sampling=sampling)
    assert metrics["accuracy"] == pytest.approx(held_out["accuracy"], abs=0.02)
    assert metrics["forgotten_carry_rate"] > 0.5


def test_short_toy_canvas_run_trains_the_bundled_model(tmp_path):
    """Three steps of the toy canvas recipe on the bundled checkpoint (adapter diffusion_gemma, model null): the ratio
    is 1 on every step's first inner step, the weights move, the evaluation is written."""
    config = load_config(str(CONFIG), [f"run.output_dir={tmp_path}", "run.max_steps=3", "eval.every=3",
                                       "plugin.eval_size=16", "eval.num_prompts=16", "rollout.prompts_per_step=4",
                                       "run.progress=false"])
    trainer = Trainer(config)
    assert trainer.plugin.adapter.model_path == str(toy.CANVAS_ASSETS)
    before = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    history = trainer.train().history
    moved = [name for name, p in trainer.plugin.policy().named_parameters() if not torch.equal(before[name], p)]
    assert moved
    for record in history:
        assert record["loss/first_step_ratio_deviation"] == 0.0
    assert (tmp_path / "samples" / "step_000003" / "eval.jsonl").is_file()
