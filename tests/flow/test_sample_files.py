"""The evaluation sample files beside the grid: an LTX-2 evaluation writes each sample's waveform as a 16-bit PCM WAV
file (the tiny LTX-2 of tests/flow/test_ltx2.py), and a Wan video-to-video grid shows the input video's filmstrip
left of the result's (the tiny ``wan_v2v`` setup of tests/flow/test_wan_v2v.py)."""

from __future__ import annotations

import json
import math
import wave

import numpy as np
import torch

from tests.flow.checks import image_batch
from tests.flow.conftest import prompt_batch
from tests.flow.test_ltx2 import ltx2, pipelines  # noqa: F401 (fixtures)
from tests.flow.test_wan_v2v import _build, videos, wan_folder  # noqa: F401 (fixtures)


def _read_wav(path):
    """(channels, rate, int16 samples [channels, samples]) of a 16-bit WAV file."""
    with wave.open(str(path), "rb") as handle:
        assert handle.getsampwidth() == 2 and handle.getcomptype() == "NONE"
        channels, rate = handle.getnchannels(), handle.getframerate()
        data = np.frombuffer(handle.readframes(handle.getnframes()), dtype="<i2")
    return channels, rate, torch.from_numpy(data.astype(np.int16)).reshape(-1, channels).t()


def test_an_ltx2_evaluation_writes_each_samples_audio_as_a_wav_file(ltx2, tmp_path):  # noqa: F811 (fixture)
    plugin = ltx2(eval_num_steps=2, cfg=False)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog"], 1, training=False)).validate()
    audios, rates = rollout.payload["audios"], rollout.payload["audio_sample_rate"]  # [N, channels, S], [N]
    written = plugin.save_samples(rollout, torch.tensor([0.5, 0.25]), tmp_path, tag="eval_rank1_32x32")
    sounds = [tmp_path / f"eval_rank1_32x32_{k:03d}.wav" for k in range(2)]
    assert written == [tmp_path / "eval_rank1_32x32.png", tmp_path / "eval_rank1_32x32.jsonl", *sounds]
    for k, path in enumerate(sounds):
        channels, rate, pcm = _read_wav(path)
        assert (channels, rate) == (audios.shape[1], int(rates[k])) == (2, 16_000)
        expected = (audios[k].clamp(-1, 1) * 32767).round().to(torch.int16)
        assert pcm.shape == audios[k].shape and torch.equal(pcm, expected)  # interleaved channels, 16-bit rounding
        assert float((pcm.float() / 32767 - audios[k].clamp(-1, 1)).abs().max()) <= 0.5 / 32767 + 1e-7
    assert not torch.equal(_read_wav(sounds[0])[2], _read_wav(sounds[1])[2])
    records = [json.loads(line) for line in (tmp_path / "eval_rank1_32x32.jsonl").read_text().splitlines()]
    assert [record["audio"] for record in records] == [path.name for path in sounds]


def test_the_wav_file_clamps_and_interleaves(tmp_path):
    from mmrl.plugins.flow.images import save_wav

    waveform = torch.tensor([[0.0, 0.5, 2.0, -1.5], [-0.25, 1.0, -1.0, 1e-6]])  # [2 channels, 4 samples]
    channels, rate, pcm = _read_wav(save_wav(waveform, 22_050, tmp_path / "x.wav"))
    assert (channels, rate) == (2, 22_050)
    assert pcm.tolist() == [[0, 16384, 32767, -32767], [-8192, 32767, -32767, 0]]


def test_a_v2v_grid_shows_the_input_videos_filmstrip_left_of_the_result(wan_folder, videos, tmp_path):  # noqa: F811
    from PIL import Image

    from mmrl.plugins.flow.images import MIN_CELL, PAD, filmstrips

    plugin = _build(wan_folder, videos, eval_num_steps=2, cfg=False)
    rows = plugin.dataset("train")[:2]
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, training=False)).validate()
    inputs, outputs = rollout.payload["condition_videos"], rollout.payload["videos"]  # [N, 3, F, H, W]
    grid, records = plugin.save_samples(rollout, torch.tensor([0.5, 0.25]), tmp_path, tag="eval")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["eval.jsonl", "eval.png"]  # no audio, no WAV
    strip_in, strip_out = filmstrips(inputs), filmstrips(outputs)  # [N, 3, H, k·W]
    expected = torch.cat([strip_in, strip_out], dim=-1)
    height, width = expected.shape[-2:]
    scale = max(1, math.ceil(MIN_CELL / width))
    pixels = (expected.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)  # [N, H, W', 3]
    with Image.open(grid) as picture:
        array = torch.from_numpy(np.asarray(picture.convert("RGB")).copy())
    for k in range(2):  # two samples: one row of two cells, the captions under them
        x = PAD + k * (width * scale + PAD)
        cell = array[PAD:PAD + height * scale:scale, x:x + width * scale:scale]  # one pixel per source pixel
        assert torch.equal(cell, pixels[k])
        shown = cell[:, :strip_in.shape[-1]].permute(2, 0, 1).float() / 255  # the input strip, [3, H, k·W]
        torch.testing.assert_close(shown, strip_in[k].float(), rtol=0, atol=0.5 / 255 + 1e-6)
    assert strip_in.shape[-1] == inputs.shape[2] * inputs.shape[-1]  # all 5 frames of the input video shown
    assert records.read_text().count("\n") == 2
