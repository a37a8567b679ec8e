"""The ``clap`` reward on tiny CLAP models (unfused and fused), built from transformers' config classes with random
weights, saved with ``save_pretrained`` and loaded back through the reward's own loading code; checked against the
cosine of the model's embeddings computed here independently (the processor on waveforms resampled in numpy), and
its one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward, reward_functions
from mmrl.rewards.audio import Clap
from tests.helpers import BASE

RATE = 48_000  # the LAION extractors' rate; the tiny extractor keeps it, with 1 s clips (max_length_s)
PROMPTS = ["a dog barking", "rain on a roof", "a dog barking"]


def tiny_clap_tokenizer():
    """A byte-level BPE ``RobertaTokenizerFast`` trained on a few words (CLAP's text tower is RoBERTa)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import RobertaTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["the sound of a dog barking a cat rain on a roof piano music a red car"] * 4,
                                  trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", tokenizer.token_to_id("</s>")),
                                                            ("<s>", tokenizer.token_to_id("<s>")))
    return RobertaTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                unk_token="<unk>", mask_token="<mask>", cls_token="<s>", sep_token="</s>",
                                model_max_length=32)


def save_tiny_clap(folder: Path, fused: bool = False, seed: int = 0) -> str:
    """A ``ClapModel`` + ``ClapProcessor`` folder: 8 mel bins at 48 kHz, 1 s clips, a 2-stage HTS-AT audio tower and a
    one-layer RoBERTa, 8-d embeddings; ``fused`` as laion/clap-htsat-fused (feature fusion, ``truncation: fusion``)."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    tokenizer = tiny_clap_tokenizer()
    extractor = ClapFeatureExtractor(feature_size=8, sampling_rate=RATE, hop_length=480, max_length_s=1,
                                     fft_window_size=1024, truncation="fusion" if fused else "rand_trunc")
    config = ClapConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "intermediate_size": 32, "max_position_embeddings": 40, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": 0, "eos_token_id": 2},
        audio_config={"num_mel_bins": 8, "spec_size": 32, "window_size": 4, "depths": [1, 1],
                      "num_attention_heads": [1, 2], "patch_embeds_hidden_size": 8, "hidden_size": 16,
                      "enable_fusion": fused, "fusion_type": "aff_2d" if fused else None},
        projection_dim=8)
    torch.manual_seed(seed)
    model = ClapModel(config).eval()
    with torch.no_grad():  # non-trivial running statistics of the mel BatchNorm
        norm = model.audio_model.audio_encoder.batch_norm
        norm.running_mean.copy_(torch.randn(8) * 2 - 5)
        norm.running_var.copy_(torch.rand(8) * 4 + 1)
    model.save_pretrained(folder)
    ClapProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory) -> str:
    return save_tiny_clap(tmp_path_factory.mktemp("tiny_clap") / "unfused")


def waveforms(n: int, samples: int = 12_000, channels: int = 2, seed: int = 0) -> torch.Tensor:
    """``[n, channels, samples]`` float32 tones with noise in [-1, 1], different per sample."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(samples) / 24_000
    tones = torch.stack([torch.sin(2 * math.pi * (220 + 330 * i) * t) for i in range(n)])  # [n, S]
    noise = torch.randn(n, channels, samples, generator=generator)
    return (0.5 * tones[:, None] + 0.2 * noise).clamp(-1, 1)


def batch_of(audios, prompts=None, rate=24_000) -> RewardInput:
    prompts = prompts or PROMPTS[: len(audios)]
    payload = {"audios": audios, "audio_sample_rate": torch.full((len(audios),), rate, dtype=torch.int64)}
    return RewardInput(rows=[{"prompt": p} for p in prompts], payload=payload)


def reference_scores(folder: str, audios: torch.Tensor, prompts: list[str], rate: int) -> torch.Tensor:
    """The cosine of ClapModel's audio and text embeddings, written out here: the channels averaged, linear
    interpolation between sample centres in numpy, the processor's extractor and tokenizer, ``is_longer`` False."""
    from transformers import ClapModel, ClapProcessor

    model = ClapModel.from_pretrained(folder).eval()
    processor = ClapProcessor.from_pretrained(folder)
    clips = []
    for audio in audios.double().numpy():
        mono = audio.mean(axis=0)
        length = round(len(mono) * RATE / rate)
        centres = (np.arange(length) + 0.5) * rate / RATE - 0.5  # output sample centres on the input's axis
        clips.append(np.interp(np.clip(centres, 0, len(mono) - 1), np.arange(len(mono)), mono))
    features = processor.feature_extractor(clips, sampling_rate=RATE, return_tensors="pt")
    tokens = processor.tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                    input_features=features["input_features"].float(), is_longer=torch.zeros(len(clips), 1, dtype=bool))
    audio = out.audio_embeds / out.audio_embeds.norm(dim=-1, keepdim=True)
    text = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    return (audio * text).sum(-1).double()


def test_clap_is_registered_and_its_options_are_checked():
    assert reward_functions.get("clap") is Clap
    data = {**BASE, "rewards": {"functions": [
        {"name": "clap", "args": {"model": "/models/clap", "sample_rate": 24000, "batch_size": 4}}]}}
    assert load_config(data, ["run.output_dir=unused"]).rewards.functions[0].args["sample_rate"] == 24000
    with pytest.raises(ConfigError, match=r"rewards\.functions\[0\]\.args\.sample_rate.*an integer >= 1"):
        load_config({**BASE, "rewards": {"functions": [{"name": "clap", "args": {"sample_rate": 0}}]}})


def test_clap_is_the_cosine_of_the_clap_embeddings(tiny_clap):
    reward = build_reward("clap", {"model": tiny_clap, "device": "cpu", "batch_size": 2})
    audios = waveforms(3)
    scores = reward(batch_of(audios))
    assert scores.shape == (3,) and scores.dtype == torch.float64 and torch.isfinite(scores).all()
    assert float(scores.max() - scores.min()) > 1e-4  # the samples differ
    torch.testing.assert_close(scores, reference_scores(tiny_clap, audios, PROMPTS, 24_000), atol=1e-5, rtol=1e-5)
    same_audio = reward(batch_of(audios[:1].expand(2, -1, -1), ["a dog barking", "rain on a roof"]))
    assert abs(float(same_audio[0] - same_audio[1])) > 1e-5  # the prompt matters
    # per sample: a sample scores the same alone, in another batch, with a list payload, or at the model's rate
    alone = reward(batch_of(audios[1:2], PROMPTS[1:2]))
    torch.testing.assert_close(alone, scores[1:2], atol=1e-6, rtol=0)
    listed = reward(batch_of(list(audios)))  # a list of [channels, samples] tensors
    torch.testing.assert_close(listed, scores, atol=1e-6, rtol=0)
    fixed = build_reward("clap", {"model": tiny_clap, "device": "cpu", "sample_rate": 24_000})
    plain = RewardInput(rows=[{"prompt": p} for p in PROMPTS], payload={"audios": audios})
    torch.testing.assert_close(fixed(plain), scores, atol=1e-6, rtol=0)


def test_a_fused_checkpoint_scores_every_clip_the_same_way(tmp_path):
    """The extractor flags a random short clip as longer; the reward does not, so a fused model's scores do not
    depend on the batch."""
    folder = save_tiny_clap(tmp_path / "fused", fused=True, seed=1)
    reward = Clap(model=folder, device="cpu")
    audios = waveforms(3, seed=2)
    scores = reward(batch_of(audios))
    torch.testing.assert_close(scores, reference_scores(folder, audios, PROMPTS, 24_000), atol=1e-5, rtol=1e-5)
    for index in range(3):
        torch.testing.assert_close(reward(batch_of(audios[index:index + 1], PROMPTS[index:index + 1])),
                                   scores[index:index + 1], atol=1e-6, rtol=0)


def test_non_finite_audio_scores_nan_for_that_sample_only(tiny_clap):
    reward = Clap(model=tiny_clap, device="cpu")
    audios = waveforms(3)
    broken = audios.clone()
    broken[1, 0, 5] = float("nan")
    scores = reward(batch_of(broken))
    assert torch.isnan(scores[1]) and torch.isfinite(scores[[0, 2]]).all()
    torch.testing.assert_close(scores[[0, 2]], reward(batch_of(audios))[[0, 2]], atol=1e-6, rtol=0)
    scorer = RewardScorer(["clap"], [reward], [1.0], on_nonfinite="error")
    with pytest.raises(RewardError, match=r"^reward 'clap' returned NaN or infinite scores for samples \[1\]"):
        scorer.score(batch_of(broken))


@pytest.mark.parametrize(("payload", "message"), [
    ({"videos": torch.zeros(2, 3, 1, 4, 4)},
     r"^reward 'clap' reads audio waveforms \[N, channels, samples\] \(the flow plugin's ltx2 adapters write them\) "
     r"from payload\['audios'\], but the plugin produced \['videos'\]$"),
    ({"audios": torch.zeros(2, 1, 2, 100)},
     r"^reward 'clap': payload\['audios'\] is a Tensor of shape \[2, 1, 2, 100\]; expected audio waveforms "),
    ({"audios": torch.zeros(3, 2, 100)}, r"^reward 'clap': payload\['audios'\] holds 3 waveforms for 2 samples$"),
    ({"audios": torch.zeros(2, 2, 100, dtype=torch.int16)}, r"^reward 'clap': payload\['audios'\] waveform 0 is "),
    ({"audios": torch.zeros(2, 2, 100)},
     r"^reward 'clap' reads the sample rate of the audio from payload\['audio_sample_rate'\], which the plugin did "
     r"not produce .*; set the reward's sample_rate option$"),
    ({"audios": torch.zeros(2, 2, 100), "audio_sample_rate": torch.tensor([24000, 0])},
     r"^reward 'clap': payload\['audio_sample_rate'\] must hold one positive integer sample rate per sample"),
])
def test_malformed_inputs_are_one_line_errors(tiny_clap, payload, message):
    reward = Clap(model=tiny_clap, device="cpu")
    with pytest.raises(RewardError, match=message):
        reward(RewardInput(rows=[{"prompt": "a"}, {"prompt": "b"}], payload=payload))


def test_missing_weights_name_the_reward_and_the_option(tmp_path, monkeypatch):
    with pytest.raises(RewardError, match=r"^reward 'clap': model folder '/nonexistent/clap' does not exist; set "
                                          r"this reward's args.model to a folder"):
        Clap(model="/nonexistent/clap", device="cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(RewardError, match=r"^reward 'clap': the CLAP processor 'laion/larger_clap_general' is not in "
                                          r"the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        Clap(device="cpu")
