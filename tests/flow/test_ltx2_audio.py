"""LTX-2's audio in the rollout payload and scored by the ``clap`` reward, on the tiny ``LTX2Pipeline`` of
tests/flow/test_ltx2.py and a tiny CLAP model (tests/rewards/test_clap.py): the payload's ``"audios"`` are the
pipeline's waveforms of the final latents (:meth:`LTX2Adapter.decode_audio`, which test_ltx2.py checks against the
pipeline) at the vocoder's rate, and a GRPO step trains on frames and audio scored together."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.conftest import prompt_batch
from tests.flow.test_ltx2 import FRAMES, STG_BLOCKS, TOKENS, ltx2, pipelines  # noqa: F401 (fixtures)
from tests.rewards.test_clap import save_tiny_clap


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory) -> str:
    return save_tiny_clap(tmp_path_factory.mktemp("tiny_clap_flow") / "clap")


def test_rollout_payload_carries_the_decoded_audio(ltx2):  # noqa: F811 (the fixture imported above)
    plugin = ltx2(num_steps=3, cfg=False)
    adapter = plugin.adapter
    finals = []
    decode = adapter.decode
    adapter.decode = lambda latents: finals.append(latents) or decode(latents)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog"], 2)).validate()
    audios, rates = rollout.payload["audios"], rollout.payload["audio_sample_rate"]
    assert audios.dtype == torch.float32 and audios.shape[:2] == (4, 2) and audios.shape[2] > 0  # [N, channels, S]
    torch.testing.assert_close(audios, adapter.decode_audio(finals[0]), rtol=0, atol=0)
    assert rates.tolist() == [16_000] * 4 == [adapter.pipeline.vocoder.config.output_sampling_rate] * 4
    assert float((audios[0] - audios[2]).abs().max()) > 1e-6  # other noise, other audio
    assert torch.equal(rollout.select([2]).payload["audios"], audios[2:3])  # per sample, as the contract wants
    evaluation = plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 1, training=False)).validate()
    torch.testing.assert_close(evaluation.payload["audios"], adapter.decode_audio(finals[-1]), rtol=0, atol=0)


def test_a_grpo_step_scores_frames_and_audio(train_config, tmp_path, tiny_clap):
    rewards = ("rewards.functions=[{name: per_frame, weight: 1.0, args: {reward: test_brightness, stride: 2}}, "
               f"{{name: clap, weight: 0.5, args: {{model: '{tiny_clap}', device: cpu}}}}]")
    trainer = Trainer(train_config("ltx2", tmp_path, rewards, "run.max_steps=1",
                                   "rewards.multi_reward=normalize_then_sum", num_frames=FRAMES,
                                   max_sequence_length=TOKENS, resolution=32, num_steps=2, cfg=False,
                                   adapter_options={"stg_blocks": STG_BLOCKS}))
    before = {key: p.detach().clone() for key, p in trainer.plugin.policy().named_parameters() if "lora_" in key}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1]
    record = history[0]
    assert record["loss/first_step_ratio_deviation"] < 1e-5
    assert math.isfinite(record["reward/clap_mean"]) and record["reward/clap_std"] > 0
    after = dict(trainer.plugin.policy().named_parameters())
    assert any(not torch.equal(before[key], after[key]) for key in before)
