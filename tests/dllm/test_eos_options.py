"""LLaDA's ``logits_eos_inf`` and ``confidence_eos_eot_inf`` (ML-GSAI/LLaDA@b7e6c35 ``generate.py`` L91-98) in
:func:`generate` and the plugin, against the loop as LLaDA's ``generate`` writes it."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mmrl.config import ConfigError
from mmrl.plugins.dllm.generation import generate

torch.set_num_threads(1)

V, EOS, EOT, MASK = 8, 5, 6, 7  # tokens 0..4 content, 5 EOS, 6 end of turn, 7 mask


def _model(seed: int, stop_bias: float = 1.0):
    """Context-dependent random logits (a fresh tensor per call) that like EOS and EoT. The mask logit is −10⁴: never
    a candidate and of probability exactly 0 in float64, so LLaDA's loop (where the mask token may be a candidate)
    and mmrl's (where it never is) see the same logits; −∞ would turn guidance's difference into NaN."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, V, generator=generator, dtype=torch.float64)
    position = torch.randn(16, V, generator=generator, dtype=torch.float64)
    position[:, [EOS, EOT]] += stop_bias

    def model(x: Tensor) -> Tensor:
        logits = torch.nn.functional.one_hot(x, V).double().cumsum(1) @ weight + position[: x.shape[1]]
        logits[..., MASK] = -1e4
        return logits

    return model


def llada_generate(model, prompt: Tensor, *, steps: int, gen_length: int, block_length: int, temperature: float,
                   remasking: str, cfg_scale: float, logits_eos_inf: bool, confidence_eos_eot_inf: bool,
                   generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """LLaDA's ``generate`` for one prompt, restated: the same in-place writes into ``logits``, the same aliasing
    of ``logits_with_noise`` at temperature 0. Its uniforms are read from ``generator`` in mmrl's order (per step:
    the Gumbel uniforms of the block, then the random confidences), and ties go to the leftmost position (mmrl's
    stated rule; ``torch.topk`` leaves their order open). Returns the completion and the step each position was
    committed at."""
    width = prompt.shape[1]
    x = torch.cat([prompt, torch.full((1, gen_length), MASK)], dim=1)
    step_map = torch.full((1, width + gen_length), -1)
    prompt_index = x != MASK
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    for block in range(num_blocks):
        start, end = width + block * block_length, width + (block + 1) * block_length
        n = int((x[:, start:end] == MASK).sum())
        counts = [n // per_block + (i < n % per_block) for i in range(per_block)]
        for i in range(per_block):
            mask_index = x == MASK
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = MASK
                logits, un_logits = model(torch.cat([x, un_x])).chunk(2)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x)
            if logits_eos_inf:
                logits[:, :, EOS] = -torch.inf
            if temperature == 0:
                logits_with_noise = logits  # LLaDA's add_gumbel_noise returns its argument
            else:
                u = torch.full(logits.shape, 0.5, dtype=torch.float64)  # outside the block: never read
                u[0, start:end] = torch.rand((block_length, V), generator=generator, dtype=torch.float64)
                logits_with_noise = logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature
            x0 = logits_with_noise.argmax(-1)
            if confidence_eos_eot_inf:
                logits_with_noise[:, :, EOS] = logits[:, :, EOT] = -torch.inf
            if remasking == "low_confidence":
                x0_p = logits.softmax(-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
            else:
                x0_p = torch.zeros(x.shape, dtype=torch.float64)
                x0_p[0, start:end] = torch.rand(block_length, generator=generator, dtype=torch.float64)
            x0_p[:, end:] = -torch.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            chosen = torch.sort(confidence[0], descending=True, stable=True).indices[: counts[i]]
            x[0, chosen] = x0[0, chosen]
            step_map[0, chosen] = block * per_block + i
    return x[:, width:], step_map[:, width:]


PROMPTS = torch.tensor([[0, 1, 2], [3, 3, 4], [4, 0, 1], [2, 2, 0]])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize(("logits_eos_inf", "confidence_eos_eot_inf", "remasking", "cfg_scale"), [
    (True, False, "low_confidence", 0.0),
    (False, True, "low_confidence", 0.0),
    (True, True, "low_confidence", 0.0),
    (False, True, "low_confidence", 0.5),
    (True, True, "random", 0.0),
])
def test_options_match_llada_loop(temperature, logits_eos_inf, confidence_eos_eot_inf, remasking, cfg_scale):
    model = _model(3)
    geometry = dict(steps=6, gen_length=6, block_length=3, temperature=temperature, remasking=remasking,
                    cfg_scale=cfg_scale)
    options = dict(logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf)
    seeds = [11, 12, 13, 14]
    out = generate(model, PROMPTS, mask_id=MASK, eos_id=EOS, eot_id=EOT,
                   generators=[torch.Generator().manual_seed(s) for s in seeds], **geometry, **options)
    plain = generate(model, PROMPTS, mask_id=MASK, generators=[torch.Generator().manual_seed(s) for s in seeds],
                     **geometry)
    for b, seed in enumerate(seeds):
        tokens, steps = llada_generate(model, PROMPTS[b : b + 1], generator=torch.Generator().manual_seed(seed),
                                       **geometry, **options)
        assert torch.equal(out.completion_ids[b], tokens[0]), f"sample {b}"
        assert torch.equal(out.step_map[b], steps[0]), f"sample {b}"
    if remasking == "low_confidence":  # the options act on these prompts
        assert not (torch.equal(out.completion_ids, plain.completion_ids) and torch.equal(out.step_map,
                                                                                          plain.step_map))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_eos_inf_never_generates_eos(temperature):
    model = _model(5, stop_bias=2.5)
    kwargs = dict(mask_id=MASK, gen_length=8, block_length=4, steps=8, temperature=temperature)
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(len(PROMPTS))]  # noqa: E731
    plain = generate(model, PROMPTS, generators=gens(), **kwargs).completion_ids
    assert (plain == EOS).any()  # the plain sampler does propose EOS here
    banned = generate(model, PROMPTS, generators=gens(), logits_eos_inf=True, eos_id=EOS, **kwargs).completion_ids
    assert not (banned == EOS).any()
    assert (banned != MASK).all()


@pytest.mark.parametrize(("first", "temperature", "step_map"), [
    (EOS, 0.0, [1, 0]),  # greedy: LLaDA's logits_with_noise is logits, EOS leaves the confidence softmax too
    (EOS, 1.0, [0, 1]),  # sampled: only EoT leaves it; an EOS candidate keeps its confidence (≈ 1 here)
    (EOT, 0.0, [1, 0]),
    (EOT, 1.0, [1, 0]),
])
def test_confidence_eos_eot_inf_defers_what_llada_code_defers(first, temperature, step_map):
    # One block of 2, one token per step. Position 0 proposes `first` with p ≈ 1 (a logit of 40: Gumbel noise never
    # overturns it), position 1 token 1 with p ≈ 0.96: without the option position 0 goes first.
    def model(x: Tensor) -> Tensor:
        logits = torch.zeros(x.shape[0], x.shape[1], V, dtype=torch.float64)
        logits[:, -2, first] = 40.0
        logits[:, -1, 1] = 5.0
        logits[..., MASK] = float("-inf")
        return logits

    kwargs = dict(mask_id=MASK, gen_length=2, block_length=2, steps=2, temperature=temperature,
                  generators=[torch.Generator().manual_seed(0)])
    plain = generate(model, torch.tensor([[0]]), **kwargs)
    assert plain.step_map.tolist() == [[0, 1]]
    out = generate(model, torch.tensor([[0]]), confidence_eos_eot_inf=True, eos_id=EOS, eot_id=EOT, **kwargs)
    assert out.completion_ids.tolist() == [[first, 1]]
    assert out.step_map.tolist() == [step_map]


def test_generate_needs_the_ids():
    kwargs = dict(mask_id=MASK, gen_length=2, block_length=2, steps=2)
    with pytest.raises(ValueError, match="logits_eos_inf needs eos_id"):
        generate(_model(0), PROMPTS, logits_eos_inf=True, **kwargs)
    with pytest.raises(ValueError, match="confidence_eos_eot_inf needs eos_id and eot_id"):
        generate(_model(0), PROMPTS, confidence_eos_eot_inf=True, eos_id=EOS, **kwargs)


# ---------------------------------------------------------------------- the plugin (toy checkpoint: EOS is id 2)
def test_plugin_passes_the_options_and_the_stop_ids():
    from tests.dllm.test_plugin import _batch, _plugin

    # UNK (3) named as the end of turn: the plugin passes eos 2 and eot 3 to generate. One plugin, its options
    # switched between rollouts (_decode reads them at every call).
    plugin = _plugin(eos_token_ids=[2, 3])
    config = plugin.config
    rows = plugin.dataset("eval")[:6]
    batch = lambda: _batch(rows, list(range(6)), training=False)  # noqa: E731
    assert (plugin.rollout(plugin.policy(), batch()).replay["completion_ids"] == 2).any()
    config.logits_eos_inf = True
    assert not (plugin.rollout(plugin.policy(), batch()).replay["completion_ids"] == 2).any()
    config.logits_eos_inf, config.confidence_eos_eot_inf = False, True
    rollout = plugin.rollout(plugin.policy(), batch())
    expected = generate(plugin.adapter.scorer(plugin.policy()), rollout.replay["prompt_ids"],
                        mask_id=plugin.adapter.mask_id, gen_length=config.gen_length,
                        block_length=config.block_length, steps=config.steps, temperature=config.eval_temperature,
                        confidence_eos_eot_inf=True, eos_id=2, eot_id=3, generators=batch().sample_generators())
    assert torch.equal(rollout.replay["completion_ids"], expected.completion_ids)
    assert torch.equal(rollout.replay["step_map"], expected.step_map)


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"confidence_eos_eot_inf": True}, "confidence_eos_eot_inf", "false for "),
    ({"confidence_eos_eot_inf": True, "remasking": "random", "eval_remasking": "random"}, "confidence_eos_eot_inf",
     "false with remasking and eval_remasking random"),
    ({"sampler": "dream", "logits_eos_inf": True}, "logits_eos_inf", "false (its default) with Dream's sampler"),
    ({"sampler": "dream", "confidence_eos_eot_inf": True, "eos_token_ids": [2, 3]}, "confidence_eos_eot_inf",
     "false (its default) with Dream's sampler"),
])
def test_plugin_refuses_bad_combinations(options, key, allowed):
    import re

    from tests.dllm.test_plugin import _plugin

    with pytest.raises(ConfigError, match=rf"^config key 'plugin.{key}': got .*; allowed: {re.escape(allowed)}"):
        _plugin(**options)
