"""The reference plugin's rollout: its old log-probs come from the sampling pass itself (issue 26 item 1).

The decoder's sampling loop computes, step by step, the very logits a teacher-forced pass over the sampled tokens
computes (the same ``step`` on the same inputs), so the rollout scores the sampled tokens with those logits instead
of running the decoder a second time (the second pass cost about 6% of the reference recipe's training step,
benchmarks/step_floors.py).
"""

from __future__ import annotations

import pytest
import torch

from mmrl.config import from_dict
from mmrl.plugin import PromptBatch, Runtime
from mmrl.plugins.toy.model import TinySequencePolicy
from mmrl.plugins.toy.plugin import ToyPlugin, ToyPluginConfig


def make_plugin(**options) -> ToyPlugin:
    config = from_dict(ToyPluginConfig, {"train_size": 16, "eval_size": 4, **options}, "plugin")
    return ToyPlugin(config, Runtime())


def training_batch(plugin: ToyPlugin, size: int = 12) -> PromptBatch:
    rows = plugin.dataset("train")[:size]
    return PromptBatch(rows=rows, group_ids=torch.arange(size) // 4, group_size=4, seeds=torch.arange(size) + 100,
                       generator=torch.Generator(), training=True)


def test_the_rollout_runs_the_decoder_once(monkeypatch):
    plugin = make_plugin()
    teacher_forced = []
    original = TinySequencePolicy.forward

    def counted(self, *args, **kwargs):
        teacher_forced.append(args[1].shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TinySequencePolicy, "forward", counted)
    rollout = plugin.rollout(plugin.policy(), training_batch(plugin))
    assert teacher_forced == []
    assert rollout.old_logp is not None and rollout.old_logp.shape == rollout.mask.shape


def test_old_logp_equals_the_training_forward():
    """The sampled tokens scored by the sampling pass and by ``forward`` (the learner's pass) agree, at two
    temperatures, on a batch where some samples stop early (EOS, then masked EOS padding)."""
    for temperature in (1.0, 0.7):
        plugin = make_plugin(temperature=temperature, init_seed=3)
        policy = plugin.policy()
        batch = training_batch(plugin)
        rollout = plugin.rollout(policy, batch)
        assert bool((rollout.mask == 0).any()), "no sample stopped early: the padding is not exercised"
        with torch.no_grad():
            recomputed = plugin.forward(policy, rollout, need_reference=False).logp  # [N, T]
        assert rollout.old_logp.shape == recomputed.shape
        torch.testing.assert_close(rollout.old_logp, recomputed, rtol=0, atol=1e-6)
        # An independent computation of the same numbers: log-softmax of the teacher-forced logits, gathered.
        logits = policy(rollout.replay["prompt_ids"], rollout.replay["tokens"]).detach()  # [N, T, V_out]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(
            -1, rollout.replay["tokens"].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(rollout.old_logp, expected, rtol=0, atol=1e-6)


def test_prompt_ids_are_the_digits_padded_with_pad():
    """The prompt encoding (one ``torch.tensor`` call over padded rows) against a row-by-row construction, and its
    one-line error for a prompt wider than the model."""
    plugin = make_plugin(min_length=1, max_length=5)
    sequences = [row["digits"] for row in plugin.dataset("train")] + [[]]
    width, pad = plugin.tiny.max_prompt_length, plugin.tiny.pad_id
    expected = torch.full((len(sequences), width), pad, dtype=torch.long)
    for i, digits in enumerate(sequences):
        for j, digit in enumerate(digits):
            expected[i, j] = digit
    ids = plugin._encode(sequences)
    assert ids.dtype == torch.long and torch.equal(ids, expected)
    assert {len(digits) for digits in sequences} >= {0, width}, "the rows do not span empty to full width"
    assert plugin._encode([]).shape == (0, width)
    with pytest.raises(ValueError, match="exceeds the model's width"):
        plugin._encode([[1] * (width + 1)])
