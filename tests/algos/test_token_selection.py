"""The high-entropy minority (``algorithm.top_entropy_quantile``; arXiv:2506.01939, TRL ``top_entropy_quantile``)."""

from __future__ import annotations

import pytest
import torch

from mmrl.algos.token_selection import entropy_threshold, high_entropy_mask
from mmrl.config import ConfigError, load_config
from mmrl.trainer import Trainer
from tests.helpers import record_gradients, toy_config, trainable_gradients

ENTROPY = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_threshold_and_mask_by_hand():
    # active entropies sorted: 0.1 0.3 0.5 0.7 0.9; rho = 0.4 → quantile 0.6 at position 0.6·4 = 2.4 → 0.5 + 0.4·0.2
    threshold = entropy_threshold(ENTROPY[MASK > 0], 1 - 0.4)
    assert threshold.item() == pytest.approx(0.58)
    kept = high_entropy_mask(ENTROPY, MASK, threshold)
    assert kept.tolist() == [[False, False, True], [False, True, False]]  # the masked 5.0 never counts
    # rho = 1 keeps every active action; rho = 0 only the largest; nothing active, nothing kept
    assert high_entropy_mask(ENTROPY, MASK, entropy_threshold(ENTROPY[MASK > 0], 0.0)).sum() == 5
    assert high_entropy_mask(ENTROPY, MASK, entropy_threshold(ENTROPY[MASK > 0], 1.0)).tolist() == [
        [False, False, True], [False, False, False]]
    assert entropy_threshold(torch.zeros(0), 0.5) is None
    assert not high_entropy_mask(ENTROPY, MASK, None).any()


def test_trls_mask_written_out_agrees():
    # huggingface/trl@f2cd577 grpo_trainer.py:1413-1432 on one process
    generator = torch.Generator().manual_seed(0)
    entropy = torch.rand(6, 9, generator=generator) * 3
    mask = (torch.rand(6, 9, generator=generator) > 0.3).float()
    for rho in (0.2, 0.5, 0.9):
        local = entropy[mask.bool()].float()
        trl = ((entropy * mask) >= torch.quantile(local, 1 - rho)) & mask.bool()
        assert torch.equal(high_entropy_mask(entropy, mask, entropy_threshold(local, 1 - rho)), trl)


def test_the_policy_term_trains_the_high_entropy_actions_only(tmp_path):
    # One micro-batch, one optimizer step on the sampling weights (ratio 1): the gradient is that of
    # −Σ A·ratio·keep / (active actions), the denominator counting every active action (TRL's).
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.top_entropy_quantile=0.2",
                                 "optim.max_grad_norm=null"))
    policy, plugin = trainer.policy, trainer.plugin
    expected = {}
    collect = trainer.collector.collect

    def recorded(*args, **kwargs):
        batch = collect(*args, **kwargs)
        rollout = batch.rollout.to(trainer.accelerator.device)
        output = plugin.forward(policy, rollout, need_reference=False)
        active = rollout.mask[rollout.mask > 0]
        values = output.entropy.detach()[rollout.mask > 0]
        keep = (output.entropy.detach() >= torch.quantile(values, 0.8)) & (rollout.mask > 0)
        assert 0 < int(keep.sum()) < active.numel()
        ratio = torch.exp(output.logp - output.logp.detach())
        loss = -(batch.advantages.unsqueeze(1) * ratio * keep).sum() / active.numel()
        expected.update(trainable_gradients(loss, plugin.model))
        return batch

    trainer.collector.collect = recorded
    steps = record_gradients(trainer, plugin.model)
    history = trainer.train().history
    assert history[0]["policy/high_entropy_fraction"] == pytest.approx(0.2, abs=0.05)
    for name, grad in expected.items():
        torch.testing.assert_close(steps[0][name], grad, rtol=1e-4, atol=1e-6)


def test_options_that_cannot_select_are_refused():
    with pytest.raises(ConfigError, match=r"top_entropy_quantile.*action_chunk_size"):
        toy_config("/tmp/unused", "algorithm.top_entropy_quantile=0.2", "algorithm.action_chunk_size=1")


@pytest.mark.parametrize(("config", "extra", "match"), [
    ("configs/flow/shapes.yaml", [], "plugin flow"),
    ("configs/dllm/toy.yaml", [], "plugin dllm"),
    ("configs/vlm/toy_grounding.yaml", ["plugin.entropy=false"], "plugin.entropy"),
])
def test_plugins_without_per_action_entropy_refuse_it_when_the_config_is_loaded(config, extra, match):
    from pathlib import Path

    path = str(Path(__file__).resolve().parents[2] / config)
    with pytest.raises(ConfigError, match=rf"top_entropy_quantile.*{match}"):
        load_config(path, ["algorithm.top_entropy_quantile=0.2", *extra])
    if extra:  # the vlm plugin computes entropy by default
        assert load_config(path, ["algorithm.top_entropy_quantile=0.2"]).algorithm.top_entropy_quantile == 0.2
