"""Dream's sampler (``plugin.sampler: dream``, :mod:`mmrl.plugins.dllm.dream_sampler`) against the ``_sample`` loop
of Dream's ``generation_utils.py`` as Dream writes it (batched masks, the global RNG, ``Categorical`` draws, the
batch-averaged count of positions to commit), a schedule by hand, batch independence, and the plugin's wiring."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmrl.plugins.dllm.dream_sampler import DREAM_ALGORITHMS, dream_generate

VOCAB, MASK = 16, 15


class TinyScorer:
    """``input_ids [B, T] → logits [B, T, V]`` that depend on the token, its position and the whole sequence (so
    every step sees new logits and no two masked positions tie), the mask token never a candidate."""

    def __init__(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randn(VOCAB, 8, generator=generator)
        self.positions = torch.randn(64, 8, generator=generator)
        self.head = torch.randn(8, VOCAB, generator=generator) * 2

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens[input_ids] + self.positions[: input_ids.shape[1]]  # [B, T, 8]
        hidden = hidden + hidden.mean(dim=1, keepdim=True)
        logits = hidden @ self.head  # [B, T, V]
        logits[..., MASK] = float("-inf")
        return logits


def reference_sample_tokens(logits, temperature, top_p, top_k, margin_confidence=False, neg_entropy=False):
    """Dream's ``sample_tokens`` (generation_utils.py), written out as Dream writes it."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = 0
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, remove)
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
    if top_k is not None:
        top_k = min(top_k, logits.size(-1))
        logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1, None], torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.distributions.Categorical(probs=probs).sample()
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        ordered, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = ordered[:, 0] - ordered[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


def reference_generate(model, prompt, gen_length, steps, *, temperature, alg, alg_temp, top_p, top_k, eps=1e-3):
    """Dream's ``_sample`` loop (no padding: attention "full"), the logits already aligned by the scorer."""
    x = F.pad(prompt, (0, gen_length), value=MASK)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        mask_logits = model(x)[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index], dtype=torch.long) + MASK
            transfer = torch.rand(*x0.shape) < p_transfer
            if bool(transfer.any()):
                _, x0[transfer] = reference_sample_tokens(mask_logits[transfer], temperature, top_p, top_k)
            x[mask_index] = x0.clone()
        else:
            confidence, x0 = reference_sample_tokens(mask_logits, temperature, top_p, top_k,
                                                     margin_confidence=alg == "topk_margin",
                                                     neg_entropy=alg == "entropy")
            num_mask_token = mask_index.sum() / mask_index.shape[0]
            number = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
            full = torch.full_like(x, -torch.inf, dtype=mask_logits.dtype)
            full[mask_index] = confidence
            if number > 0:
                if alg_temp is None or alg_temp == 0:
                    _, transfer_index = torch.topk(full, number)
                else:
                    transfer_index = torch.multinomial(F.softmax(full / alg_temp, dim=-1), num_samples=number)
                x_ = torch.zeros_like(x, dtype=torch.long) + MASK
                x_[mask_index] = x0.clone()
                rows = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
                x[rows, transfer_index] = x_[rows, transfer_index]
    return x[:, prompt.shape[1]:]


SETTINGS = [
    # (alg, temperature, alg_temp, top_p, top_k)
    ("origin", 0.0, None, None, None),
    ("origin", 0.9, None, 0.9, None),
    ("maskgit_plus", 0.0, 0.0, None, None),
    ("maskgit_plus", 1.0, 0.0, None, 5),
    ("topk_margin", 0.8, 0.0, 0.95, None),
    ("entropy", 1.0, 0.0, 0.95, None),  # DiffuCoder's coupled-GRPO rollouts
    ("entropy", 1.2, 0.5, None, None),
    ("entropy", 0.0, None, None, None),
]


@pytest.mark.parametrize(("alg", "temperature", "alg_temp", "top_p", "top_k"), SETTINGS)
@pytest.mark.parametrize("steps", [5, 10])
def test_the_sampler_is_dreams_loop_for_one_sample(alg, temperature, alg_temp, top_p, top_k, steps):
    model = TinyScorer()
    prompt = torch.tensor([[3, 7, 1, 9]])
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        expected = reference_generate(model, prompt.clone(), 10, steps, temperature=temperature, alg=alg,
                                      alg_temp=alg_temp, top_p=top_p, top_k=top_k)
        out = dream_generate(model, prompt, mask_id=MASK, gen_length=10, steps=steps, temperature=temperature,
                             alg=alg, alg_temp=alg_temp, top_p=top_p, top_k=top_k,
                             generators=[torch.Generator().manual_seed(seed)])
        assert torch.equal(out.completion_ids, expected), (alg, seed)
        assert bool((out.completion_ids != MASK).all()) and bool((out.step_map >= 0).all())


def test_sampled_settings_do_sample():
    # the comparison above can fail: different seeds give different completions at temperature > 0
    model, prompt = TinyScorer(), torch.tensor([[3, 7, 1, 9]])
    outs = {tuple(dream_generate(model, prompt, mask_id=MASK, gen_length=10, steps=5, temperature=1.5,
                                 generators=[torch.Generator().manual_seed(seed)]).completion_ids[0].tolist())
            for seed in range(6)}
    assert len(outs) > 1


def test_a_schedule_by_hand():
    # G = 4, 2 steps: t = [1, 0.5005, 0.001]; step 0 commits int(4·(1 − 0.5005/1)) = int(1.998) = 1 (a truncation,
    # not a rounding), the last step the other 3
    out = dream_generate(TinyScorer(), torch.tensor([[3, 7]]), mask_id=MASK, gen_length=4, steps=2, alg="entropy")
    assert sorted(out.step_map[0].tolist()) == [0, 1, 1, 1]
    assert math.isclose(4 * (1 - 0.5005), 1.998, rel_tol=1e-6)
    # 8 positions in 4 steps: t_1..t_4 = 0.75025, 0.5005, 0.25075, 0.001; k = int(8·0.24975) = 1, then
    # int(7·(1 − 0.5005/0.75025)) = int(2.330) = 2, int(5·(1 − 0.25075/0.5005)) = int(2.495) = 2, the last 3
    out = dream_generate(TinyScorer(), torch.tensor([[3, 7]]), mask_id=MASK, gen_length=8, steps=4, alg="maskgit_plus")
    assert [int((out.step_map[0] == i).sum()) for i in range(4)] == [1, 2, 2, 3]


@pytest.mark.parametrize("alg", DREAM_ALGORITHMS)
def test_a_sample_does_not_depend_on_its_batch(alg):
    model = TinyScorer(1)
    prompts = torch.tensor([[3, 7, 1, 9], [2, 2, 5, 4], [8, 1, 1, 0]])
    options = {"mask_id": MASK, "gen_length": 8, "steps": 4, "temperature": 1.0, "alg": alg, "top_p": 0.95}
    together = dream_generate(model, prompts, generators=[torch.Generator().manual_seed(s) for s in (4, 5, 6)],
                              **options)
    for row, seed in enumerate((4, 5, 6)):
        alone = dream_generate(model, prompts[row:row + 1], generators=[torch.Generator().manual_seed(seed)],
                               **options)
        assert torch.equal(together.completion_ids[row], alone.completion_ids[0])
        assert torch.equal(together.step_map[row], alone.step_map[0])


def test_bad_arguments_are_refused():
    model, prompt = TinyScorer(), torch.tensor([[3]])
    with pytest.raises(ValueError, match="alg must be one of"):
        dream_generate(model, prompt, mask_id=MASK, gen_length=2, steps=2, alg="greedy")
    with pytest.raises(ValueError, match="need steps >= 1, 0 < eps < 1"):
        dream_generate(model, prompt, mask_id=MASK, gen_length=2, steps=2, eps=1.0)


# ---------------------------------------------------------------------------------------------- the plugin
def test_the_plugin_rolls_out_with_dreams_sampler_at_ratio_one():
    """The toy masked model with sampler dream: the completions are dream_generate's with each sample's generator
    (another algorithm gives others), and the training forward replays the rollout (ratio 1)."""
    from mmrl.plugins.dllm.adapters import DreamAdapter, LLaDAAdapter
    from tests.dllm.test_plugin import _batch, _plugin, _scored

    plugin = _plugin(sampler="dream", dream_sampler={"alg": "entropy", "top_p": 0.95})
    assert plugin.sampler == "dream" and _plugin().sampler == "llada"  # the toy adapter's default is LLaDA's
    assert DreamAdapter.default_sampler == "dream" and LLaDAAdapter.default_sampler == "llada"
    rows = plugin.dataset("train")[:4]
    batch = _batch(rows, [11, 12, 13, 14])
    rollout = _scored(plugin, plugin.rollout(plugin.policy(), batch).validate())
    prompt_ids = rollout.replay["prompt_ids"]
    config = plugin.config
    expected = dream_generate(plugin.adapter.scorer(plugin.policy()), prompt_ids, mask_id=plugin.adapter.mask_id,
                              gen_length=config.gen_length, steps=config.steps, temperature=config.temperature,
                              alg="entropy", top_p=0.95, generators=batch.sample_generators())
    assert torch.equal(rollout.replay["completion_ids"], expected.completion_ids)
    other = _plugin(sampler="dream", dream_sampler={"alg": "origin"})
    assert not torch.equal(other.rollout(other.policy(), batch).replay["completion_ids"], expected.completion_ids)
    full = plugin.forward(plugin.policy(), rollout, need_reference=False).logp
    assert torch.equal(full, rollout.old_logp)


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"block_length": 2, "gen_length": 4, "steps": 4}, "block_length", "gen_length (4) with Dream's sampler"),
    ({"remasking": "random"}, "remasking", "'low_confidence' (its default) with Dream's sampler"),
    ({"cfg_scale": 1.0}, "cfg_scale", "0.0 (its default) with Dream's sampler"),
    ({"dream_sampler": {"alg": "origin", "alg_temp": 0.5}}, "dream_sampler.alg_temp", "0 or null with alg origin"),
    ({"dream_sampler": {"eps": 1.0}}, "dream_sampler.eps", "a time in (0, 1)"),
])
def test_options_dreams_sampler_has_no_place_for_are_refused(options, key, allowed):
    import re

    from mmrl.config import ConfigError
    from tests.dllm.test_plugin import _plugin

    with pytest.raises(ConfigError, match=rf"^config key 'plugin.{key}': got .*; allowed: {re.escape(allowed)}"):
        _plugin(sampler="dream", **options)
