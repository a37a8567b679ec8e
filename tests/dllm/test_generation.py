"""LLaDA-style block decoding on models whose logits the tests control (hand-checkable commit orders)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from mmrl.plugins.dllm.generation import (
    check_schedule,
    completion_mask,
    generate,
    gumbel_argmax,
    transfer_schedule,
)

V, EOS, MASK = 6, 4, 5  # tokens 0..3 content, 4 EOS, 5 mask


class ScriptedModel:
    """logits[b, i] = c_i at token target_i (0 elsewhere) while position i is masked; once position i holds a token,
    the model would rather have (target_i + 1) mod 4 there with a huge logit — so a decoder that re-decided committed
    positions would change them. Records every input it sees."""

    def __init__(self, targets: list[int], confidences: list[float], prompt_length: int):
        self.targets, self.confidences, self.prompt_length = targets, confidences, prompt_length
        self.calls: list[Tensor] = []

    def __call__(self, x: Tensor) -> Tensor:
        self.calls.append(x.clone())
        batch, length = x.shape
        logits = torch.zeros(batch, length, V, dtype=torch.float64)
        for i, (target, c) in enumerate(zip(self.targets, self.confidences, strict=True)):
            position = self.prompt_length + i
            masked = x[:, position] == MASK
            logits[masked, position, target] = c
            logits[~masked, position, (target + 1) % 4] = 50.0
        return logits


def test_transfer_schedule_spreads_the_remainder_over_the_first_steps():
    schedule = transfer_schedule(torch.tensor([5, 6, 2, 0]), 3)
    assert schedule.tolist() == [[2, 2, 1], [2, 2, 2], [1, 1, 0], [0, 0, 0]]
    assert schedule.sum(dim=1).tolist() == [5, 6, 2, 0]


def test_commit_order_counts_and_block_boundaries_by_hand():
    # G = 6 in blocks of 3, 4 steps → 2 steps per block committing 2 then 1 token.
    # Completion confidences c = [1, 3, 2 | 5, 0.5, 4]: the most confident position (3) belongs to block 1 and must
    # wait for block 0; within a block the order is by confidence.
    prompt = torch.tensor([[0, 1]])
    model = ScriptedModel(targets=[0, 1, 2, 3, 0, 1], confidences=[1.0, 3.0, 2.0, 5.0, 0.5, 4.0], prompt_length=2)
    out = generate(model, prompt, mask_id=MASK, gen_length=6, block_length=3, steps=4)
    assert out.steps_per_block == 2
    assert out.completion_ids.tolist() == [[0, 1, 2, 3, 0, 1]]  # committed tokens never re-decided
    assert out.step_map.tolist() == [[1, 0, 0, 2, 3, 2]]
    assert len(model.calls) == 4
    for step, x in enumerate(model.calls):
        block = step // 2
        later = x[0, 2 + 3 * (block + 1):]
        assert (later == MASK).all(), f"step {step} saw tokens beyond its block"
        assert torch.equal(x[0, :2], prompt[0])
    # The number of tokens committed per step is (2, 1, 2, 1).
    assert [int((out.step_map == s).sum()) for s in range(4)] == [2, 1, 2, 1]


def test_ties_go_to_the_leftmost_position():
    # The ties must be exact by construction: rows that are permutations of each other do not softmax to the same
    # bits on every CPU (the vectorised kernels sum in lane order). With a logit of 100 the softmax of each row is
    # exp(0) / (1 + 4·e^-100) and 4·e^-100 ≈ 1.5e-43 is far below half an ulp of 1, so every confidence is exactly
    # 1.0 whatever the summation order.
    model = ScriptedModel(targets=[1, 2, 3, 0], confidences=[100.0] * 4, prompt_length=1)
    out = generate(model, torch.tensor([[3]]), mask_id=MASK, gen_length=4, block_length=4, steps=4)
    assert out.step_map.tolist() == [[0, 1, 2, 3]]


def test_zero_temperature_is_greedy_and_ignores_the_generators():
    torch.manual_seed(0)
    table = torch.randn(8, V, dtype=torch.float64)

    def model(x: Tensor) -> Tensor:
        return table[: x.shape[1]].expand(x.shape[0], -1, -1)

    prompt = torch.tensor([[1, 2], [3, 0]])
    a = generate(model, prompt, mask_id=MASK, gen_length=6, block_length=2, steps=6,
                 generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    b = generate(model, prompt, mask_id=MASK, gen_length=6, block_length=2, steps=6,
                 generators=[torch.Generator().manual_seed(s) for s in (7, 8)])
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_ids[0], table[2:8, :MASK].argmax(-1))  # the mask token is never an output


def test_gumbel_max_equals_llada_form():
    # LLaDA samples argmax(exp(l) / (-log u)^τ); ours is argmax(l + τ·g), g = -log(-log u): same u, same token.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 7, generator=generator, dtype=torch.float64)
    u = torch.rand(2000, 7, generator=generator, dtype=torch.float64)
    for tau in (0.3, 0.9, 1.0, 2.5):
        llada = (logits.exp() / (-torch.log(u)) ** tau).argmax(-1)
        assert torch.equal(gumbel_argmax(logits, tau, u), llada)
    assert torch.equal(gumbel_argmax(logits, 0.0, None), logits.argmax(-1))


@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_sampled_tokens_follow_softmax_over_temperature(tau):
    # Random remasking makes the commit decision independent of the sampled token, so each committed token is a
    # draw from softmax(l/τ); 3000 samples from their own seeds, chi-square with 2 degrees of freedom.
    logits = torch.tensor([1.0, 0.0, -1.0, -math.inf, -math.inf, -math.inf], dtype=torch.float64)

    def model(x: Tensor) -> Tensor:
        return logits.expand(x.shape[0], x.shape[1], -1)

    n = 3000
    out = generate(model, torch.zeros(n, 1, dtype=torch.long), mask_id=MASK, gen_length=1, block_length=1, steps=1,
                   temperature=tau, remasking="random",
                   generators=[torch.Generator().manual_seed(s) for s in range(n)])
    counts = torch.bincount(out.completion_ids[:, 0], minlength=3)[:3].double()
    expected = (logits[:3] / tau).softmax(-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # the 0.999 quantile of chi-square(2)


def test_samples_do_not_depend_on_their_batch():
    torch.manual_seed(1)
    weight = torch.randn(V, V, dtype=torch.float64)

    def model(x: Tensor) -> Tensor:  # context-dependent logits
        return torch.nn.functional.one_hot(x, V).double().cumsum(1) @ weight

    prompts = torch.tensor([[0, 1], [2, 3], [1, 1]])
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    kwargs = dict(mask_id=MASK, gen_length=4, block_length=2, steps=4, temperature=1.0)
    together = generate(model, prompts, generators=gens([10, 11, 12]), **kwargs)
    alone = generate(model, prompts[1:2], generators=gens([11]), **kwargs)
    assert torch.equal(together.completion_ids[1], alone.completion_ids[0])
    assert torch.equal(together.step_map[1], alone.step_map[0])
    random_remask = generate(model, prompts, generators=gens([10, 11, 12]), remasking="random", **kwargs)
    assert (random_remask.step_map >= 0).all() and (random_remask.completion_ids != MASK).all()


def test_classifier_free_guidance_masks_the_prompt_and_mixes_logits():
    seen: list[Tensor] = []

    def model(x: Tensor) -> Tensor:
        seen.append(x.clone())
        logits = torch.zeros(x.shape[0], x.shape[1], V, dtype=torch.float64)
        conditional = (x[:, 1] != MASK).double()  # the prompt's real token is visible
        logits[:, :, 0] = 1.0  # both passes like token 0
        logits[:, :, 1] = 0.6 + 0.5 * conditional.unsqueeze(1)  # the prompt makes token 1 likelier
        return logits

    prompt = torch.tensor([[3, 2]])  # position 0 stands for padding (prompt_mask False), position 1 a real token
    keep = torch.tensor([[False, True]])
    # cond: [1, 1.1], uncond: [1, 0.6]; s = 0: argmax cond = 1; with s = 1: un + 2(cond - un) = [1, 1.6] → 1.
    out = generate(model, prompt, mask_id=MASK, gen_length=1, block_length=1, steps=1, cfg_scale=1.0,
                   prompt_mask=keep)
    assert len(seen) == 2
    assert seen[1][0, 0] == prompt[0, 0] and seen[1][0, 1] == MASK  # only real prompt tokens are masked
    assert out.completion_ids.item() == 1


def test_completion_mask_keeps_tokens_up_to_and_including_the_first_stop():
    ids = torch.tensor([[3, EOS, 1, EOS], [1, 2, 3, 0], [EOS, 1, 1, 1], [1, 7, 2, EOS]])
    assert completion_mask(ids, [EOS]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert completion_mask(ids, [EOS, 7]).tolist()[3] == [1, 1, 0, 0]


def test_bad_geometry_is_named():
    with pytest.raises(ValueError, match="multiple of block_length"):
        check_schedule(10, 4, 10)
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        check_schedule(8, 4, 3)
    with pytest.raises(ValueError, match="remasking"):
        generate(lambda x: torch.zeros(*x.shape, V), torch.zeros(1, 1, dtype=torch.long), mask_id=MASK,
                 gen_length=2, block_length=2, steps=2, remasking="top_k")


@pytest.mark.parametrize("temperature, remasking", [(1.0, "low_confidence"), (0.7, "random"), (0.0, "random")])
def test_read_ahead_noise_is_the_per_step_noise(monkeypatch, temperature, remasking):
    """With CPU generators every step's uniforms of a sample are read in one call (SampleStreams.reserve); drawing
    them one call per sample per step instead (the plain path, forced here) gives the same tokens and commit steps
    and leaves the generators in the same state."""
    from mmrl.plugins.dllm import generation

    torch.manual_seed(2)
    weight = torch.randn(V, V, dtype=torch.float64)

    def model(x: Tensor) -> Tensor:  # context-dependent logits
        return torch.nn.functional.one_hot(x, V).double().cumsum(1) @ weight

    class PerCall:  # stands in for SampleStreams: hands the generators back, so every draw is one rand per sample
        def __new__(cls, generators):
            return generators

    prompts = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0]])
    kwargs = dict(mask_id=MASK, gen_length=6, block_length=3, steps=6, temperature=temperature, remasking=remasking)
    runs = []
    for streams in (True, False):
        if not streams:
            monkeypatch.setattr(generation, "SampleStreams", PerCall)
        generators = [torch.Generator().manual_seed(s) for s in (3, 4, 5, 6)]
        out = generate(model, prompts, generators=generators, **kwargs)
        runs.append((out, [float(torch.rand(1, generator=g, dtype=torch.float64)) for g in generators]))
    (read_ahead, after_read_ahead), (per_call, after_per_call) = runs
    assert torch.equal(read_ahead.completion_ids, per_call.completion_ids)
    assert torch.equal(read_ahead.step_map, per_call.step_map)
    assert after_read_ahead == after_per_call  # the generators' next values: the same state
