"""The toy world: tokenizer, addition task, pretraining loss and the committed checkpoint."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from mmrl.plugins.dllm import pretrain, toy
from mmrl.plugins.dllm.adapters import MaskedLMAdapter

torch.set_num_threads(1)


def test_tokenizer_round_trips_characters():
    tokenizer = toy.build_tokenizer()
    ids = tokenizer("47+38=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "47+38="
    assert (tokenizer.pad_token_id, tokenizer.mask_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([*ids, 2, 2], skip_special_tokens=True) == "47+38="


def test_addition_splits_are_disjoint_deterministic_and_complete():
    splits = toy.addition_splits(eval_size=500, seed=1234)
    train = {(r["a"], r["b"]) for r in splits["train"]}
    held_out = {(r["a"], r["b"]) for r in splits["eval"]}
    assert len(held_out) == 500 and len(train) == 9500 and not train & held_out
    assert splits == toy.addition_splits(eval_size=500, seed=1234)
    row = toy.addition_row(47, 38)
    assert row == {"prompt": "47+38=", "solution": "85", "a": 47, "b": 38, "carry": True}
    assert toy.forgotten_carry(47, 38) == 75 and toy.forgotten_carry(41, 38) == 79


def test_corpus_forgets_the_carry_at_the_requested_rate():
    rng = random.Random(0)
    carry, plain = toy.addition_row(47, 38), toy.addition_row(41, 38)
    answers = [toy.corpus_answer(carry, 0.7, rng) for _ in range(4000)]
    assert answers.count("75") / 4000 == pytest.approx(0.7, abs=0.03) and set(answers) == {"75", "85"}
    assert {toy.corpus_answer(plain, 0.7, rng) for _ in range(100)} == {"79"}


def test_masked_diffusion_loss_matches_its_formula():
    # (1/G) Σ_masked −log p / t, averaged over the batch, with the masks and t drawn from the same generator.
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer, seed=3, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    prompt, completion = toy.encode_examples(tokenizer, ["1+2=", "30+45="], ["3", "75"])
    assert completion.tolist() == [[7, 2, 2, 2], [11, 9, 2, 2]]

    def scorer(ids):
        return model(input_ids=ids).logits

    loss = pretrain.masked_diffusion_loss(scorer, prompt, completion, mask_id=1,
                                          generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(5)
    t = 0.999 * torch.rand(2, generator=generator) + 1e-3
    masked = torch.rand(2, 4, generator=generator) < t.unsqueeze(1)
    with torch.no_grad():
        logp = scorer(torch.cat([prompt, torch.where(masked, 1, completion)], 1))[:, 6:].log_softmax(-1)
    nll = -logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    expected = sum(float((nll[b] * masked[b]).sum() / t[b] / 4) for b in range(2)) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_committed_checkpoint_reproduces_its_recorded_held_out_accuracy():
    record = json.loads((toy.ASSETS / "pretrain.json").read_text())
    held_out = record["held_out"]
    assert 0.3 <= held_out["accuracy"] <= 0.6  # the pretrained model leaves room for RL
    adapter = MaskedLMAdapter(str(toy.ASSETS))
    model = adapter.load_model().eval()
    rows = toy.addition_splits(eval_size=record["arguments"]["eval_size"],
                               seed=record["arguments"]["data_seed"])["eval"]
    metrics = pretrain.evaluate(adapter.scorer(model), adapter.tokenizer, rows, mask_id=adapter.mask_id,
                                stop_ids=adapter.stop_ids)
    assert metrics["accuracy"] == pytest.approx(held_out["accuracy"], abs=0.01)
    assert metrics["forgotten_carry_rate"] > 0.5  # the systematic mistake RL has to remove


def test_pretraining_script_writes_a_loadable_checkpoint(tmp_path):
    summary = pretrain.pretrain(pretrain.parser().parse_args([
        "--output", str(tmp_path), "--steps", "6", "--batch-size", "16", "--eval-every", "3", "--eval-size", "20",
        "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32",
    ]))
    assert [r["step"] for r in summary["history"]] == [3, 6]
    assert summary["command"].startswith("python -m mmrl.plugins.dllm.pretrain --output")
    adapter = MaskedLMAdapter(str(tmp_path))
    assert adapter.load_model().config.hidden_size == 16


def test_the_eos_tail_is_masked_when_the_toy_model_scores_3_plus_4_is_17():
    """Issue 21's example: "3+4=" → "17", EOS, then one tail position. The ELBO is enumerated here by hand over the
    7 mask sets of the 3 real tokens, the tail masked in every row (d1/SPG); with the tail left visible (as the EOS
    fill used to be) it is a different number, so the test tells the two apart."""
    from mmrl.plugins.dllm.estimators import exact_elbo

    adapter = MaskedLMAdapter(str(toy.ASSETS))
    model = adapter.load_model(attn_implementation="eager").eval()
    tokenizer, mask_id, eos = adapter.tokenizer, adapter.mask_id, adapter.eos_id
    prompt = torch.tensor([tokenizer("3+4=", add_special_tokens=False)["input_ids"]])
    completion = torch.tensor([tokenizer("17", add_special_tokens=False)["input_ids"] + [eos, eos]])
    real = torch.tensor([[1, 1, 1, 0]])

    def enumerated(tail_masked: bool) -> float:
        total = 0.0
        for size in (1, 2, 3):
            subsets = list(itertools.combinations(range(3), size))
            for subset in subsets:
                row = completion[0].clone()
                row[list(subset)] = mask_id
                if tail_masked:
                    row[3] = mask_id
                with torch.no_grad():
                    logp = adapter.logits(model, torch.cat([prompt[0], row]).unsqueeze(0))[0, 4:].log_softmax(-1)
                total += sum(float(logp[i, completion[0, i]]) for i in subset) / size / len(subsets)
        return total

    with torch.no_grad():
        got = exact_elbo(adapter.scorer(model), prompt, completion, real, mask_id=mask_id).item()
    masked, visible = enumerated(True), enumerated(False)
    assert got == pytest.approx(masked, abs=1e-4)
    assert abs(masked - visible) > 0.3  # -11.94 against -11.21 on the committed checkpoint
