"""Audio rewards: ``clap``, the text-audio similarity of a CLAP model (Wu et al. 2023, "Large-scale Contrastive
Language-Audio Pretraining with Feature Fusion and Keyword-to-Caption Augmentation", arXiv:2211.06687).

``payload["audios"]`` (the ``output`` option) holds one waveform per sample: a float tensor ``[N, channels, samples]``
(what the flow plugin's ltx2 adapters decode, :meth:`~mmrl.plugins.flow.adapters.ltx2.LTX2Adapter.decode_extra`), a
tensor ``[N, samples]`` (mono), or a list of N tensors ``[channels, samples]`` / ``[samples]`` (lengths may differ),
with its sample rate in ``payload["audio_sample_rate"]`` (``[N]``; the ``rate_output`` option) or fixed by the
``sample_rate`` option. A waveform with a non-finite sample is malformed model output and scores NaN
(``rewards.on_nonfinite`` decides); a missing entry, another rank or a count that is not N is a one-line
:class:`~mmrl.reward.RewardError` naming the reward and what it reads.

The score is the cosine of CLAP's unit-normalised audio and text embeddings (transformers' ``ClapModel``: the audio
and text projections of ``get_audio_features`` / ``get_text_features``), as Flow-Factory's CLAP reward defines it
(X-GenGroup/Flow-Factory@a0b2bc5 ``src/flow_factory/rewards/clap.py``: channels averaged to mono, resampled to 48 kHz,
``ClapProcessor``, the cosine of the normalised ``audio_embeds`` and ``text_embeds``; its default checkpoint
``laion/larger_clap_general``, the default here too). Where mmrl differs:

- resampling: to the feature extractor's ``sampling_rate`` (48 kHz for the LAION checkpoints) by linear interpolation
  in torch (``torch.nn.functional.interpolate``, antialiased when downsampling), the same on every machine;
  Flow-Factory uses torchaudio's windowed-sinc ``resample`` (torchaudio is not a dependency of mmrl). For LTX-2's
  24 kHz vocoder output this is a 2x upsampling, which linear interpolation does without aliasing, slightly damping the
  top of the band (the CLAP mel spectrogram stops at 14 kHz);
- the feature extractor runs with its own settings (``truncation``, ``padding``), and ``is_longer`` is set to whether
  each clip is longer than the extractor's ``max_length_s`` (10 s): for clips that all fit, the extractor marks one
  clip of the batch at random as longer, which on a fused checkpoint (``enable_fusion``) embeds that clip by another
  path, so its score would depend on the batch and the draw. Flow-Factory calls the processor with
  ``truncation=True``, which reaches the extractor as a truncation mode other than ``fusion``: the same features as
  here for the unfused checkpoints (``laion/larger_clap_general``, ``laion/clap-htsat-unfused``) on clips of up to
  10 s. A clip longer than ``max_length_s`` is cut by the extractor at a random place (``rand_trunc``) or fused from
  random crops (``fusion``), as CLAP embeds long audio, so its score varies between calls; LTX-2's 121 frames at
  24 fps are 5 s.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from mmrl.extras import require_extra
from mmrl.registry import Range
from mmrl.reward import Reward, RewardError, RewardInput
from mmrl.rewards.image_models import RewardWeightsError, _check_positive, load_pretrained, pick_device

BatchSize = Annotated[int, Range(1)]
SampleRate = Annotated[int, Range(1)]


def read_audios(batch: RewardInput, output: str, rate_output: str, sample_rate: int | None, reward: str
                ) -> tuple[list[Tensor], list[int]]:
    """The mono float64 waveforms ``[samples]`` (channels averaged) of ``batch.payload[output]`` and the sample rate of
    each, from ``sample_rate`` or else ``batch.payload[rate_output]``; a one-line RewardError naming ``reward`` when
    they cannot be read."""
    where = f"reward {reward!r}: payload[{output!r}]"
    needs = "audio waveforms [N, channels, samples] (the flow plugin's ltx2 adapters write them)"
    if output not in batch.payload:
        raise RewardError(f"reward {reward!r} reads {needs} from payload[{output!r}], but the plugin produced "
                          f"{sorted(batch.payload)}")
    value = batch.payload[output]
    if isinstance(value, Tensor) and value.dim() in (2, 3):
        samples = list(value.unbind(0))
    elif isinstance(value, (list, tuple)) and all(isinstance(item, Tensor) and item.dim() in (1, 2) for item in value):
        samples = list(value)
    else:
        shape = f" of shape {list(value.shape)}" if isinstance(value, Tensor) else ""
        raise RewardError(f"{where} is a {type(value).__name__}{shape}; expected {needs}, a tensor [N, samples] or a "
                          "list of tensors [channels, samples]")
    if len(samples) != len(batch):
        raise RewardError(f"{where} holds {len(samples)} waveforms for {len(batch)} samples")
    waveforms = []
    for index, sample in enumerate(samples):
        if not sample.is_floating_point() or sample.shape[-1] == 0 or sample.numel() == 0:
            raise RewardError(f"{where} waveform {index} is {sample.dtype} of shape {list(sample.shape)}; expected "
                              "float samples in [-1, 1], at least one")
        sample = sample.detach().to("cpu", torch.float64)
        waveforms.append(sample if sample.dim() == 1 else sample.mean(dim=0))
    if sample_rate is not None:
        return waveforms, [int(sample_rate)] * len(waveforms)
    if rate_output not in batch.payload:
        raise RewardError(f"reward {reward!r} reads the sample rate of the audio from payload[{rate_output!r}], which "
                          f"the plugin did not produce (it produced {sorted(batch.payload)}); set the reward's "
                          "sample_rate option")
    rates = batch.payload[rate_output]
    rates = rates.flatten().tolist() if isinstance(rates, Tensor) else list(rates)
    if len(rates) != len(batch) or not all(isinstance(r, int | float) and r > 0 and float(r).is_integer()
                                           for r in rates):
        raise RewardError(f"reward {reward!r}: payload[{rate_output!r}] must hold one positive integer sample rate per "
                          f"sample ({len(batch)}), got {rates[:5]!r}")
    return waveforms, [int(r) for r in rates]


def resample(waveform: Tensor, source: int, target: int) -> Tensor:
    """``waveform [samples]`` at ``source`` Hz → ``target`` Hz, ``round(samples · target / source)`` samples, by
    linear interpolation between sample centres (antialiased when ``target < source``: the triangle filter widened
    by the rate ratio); unchanged when the rates agree."""
    if source == target:
        return waveform
    length = max(1, round(waveform.shape[0] * target / source))
    grid = waveform.view(1, 1, 1, -1)  # interpolate's antialias needs a 2-D ("bilinear") resize
    return torch.nn.functional.interpolate(grid, size=(1, length), mode="bilinear", align_corners=False,
                                           antialias=target < source).flatten()


class Clap(Reward):
    """CLAP text-audio similarity: cos(E_audio(audio), E_text(prompt)) of a transformers ``ClapModel``, in [-1, 1]
    (module docstring: inputs, resampling, and where it differs from Flow-Factory's CLAP reward)."""

    name: ClassVar[str] = "clap"

    def __init__(self, model: str = "laion/larger_clap_general", processor: str | None = None, field: str = "prompt",
                 output: str = "audios", rate_output: str = "audio_sample_rate", sample_rate: SampleRate | None = None,
                 batch_size: BatchSize = 16, device: str | None = None):
        """Options (the config's ``args``).

        Args:
            model: ClapModel weights: a hub id or a local folder written by save_pretrained.
            processor: The matching ClapProcessor (feature extractor and tokenizer): a hub id or a local folder
                (null: the model's).
            field: Dataset column holding the text each audio is compared with.
            output: Payload entry holding the waveforms.
            rate_output: Payload entry holding each waveform's sample rate (read when sample_rate is null).
            sample_rate: The waveforms' sample rate in Hz (null: read from rate_output).
            batch_size: Waveforms per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        require_extra("image-rewards", f"reward {self.name!r}", ["transformers"])
        from transformers import ClapModel, ClapProcessor

        rate = {} if sample_rate is None else {"sample_rate": sample_rate}
        _check_positive(self.name, batch_size=batch_size, **rate)  # before loading the model
        self.field, self.output, self.rate_output = field, output, rate_output
        self.sample_rate, self.batch_size = sample_rate, batch_size
        self.device = pick_device(self.name, device)
        self.processor = load_pretrained(self.name, "processor" if processor else "model", processor or model,
                                         ClapProcessor.from_pretrained, "the CLAP processor")
        clap = load_pretrained(self.name, "model", model, ClapModel.from_pretrained, "the CLAP model")
        if not isinstance(clap, ClapModel):
            raise RewardWeightsError(f"reward {self.name!r}: {model!r} is a {type(clap).__name__}, not a ClapModel")
        # float32: the audio encoder's BatchNorm over mel bins is kept in full precision (as Flow-Factory does)
        self.model = clap.float().to(self.device).eval().requires_grad_(False)
        extractor = self.processor.feature_extractor
        self.rate = int(extractor.sampling_rate)  # 48 kHz for the LAION checkpoints
        self.max_samples = int(extractor.nb_max_samples)  # max_length_s · sampling_rate
        text = self.model.config.text_config  # RoBERTa positions start after the padding index
        self.max_length = min(int(getattr(self.processor.tokenizer, "model_max_length", 512) or 512),
                              int(text.max_position_embeddings) - int(text.pad_token_id or 0) - 1)

    def __call__(self, batch: RewardInput) -> Tensor:
        waveforms, rates = read_audios(batch, self.output, self.rate_output, self.sample_rate, self.name)
        prompts = [str(value) for value in batch.column(self.field)]
        scores = torch.full((len(batch),), math.nan, dtype=torch.float64)
        valid = [i for i, wave in enumerate(waveforms) if bool(torch.isfinite(wave).all())]
        if not valid:
            return scores
        with torch.no_grad():
            texts = list(dict.fromkeys(prompts[i] for i in valid))
            text = self.text_features(texts)  # [T, D]
            positions = torch.tensor([texts.index(prompts[i]) for i in valid], device=self.device)
            for start in range(0, len(valid), self.batch_size):
                chunk = valid[start:start + self.batch_size]
                audio = self.audio_features([resample(waveforms[i], rates[i], self.rate) for i in chunk])
                cosine = (audio * text[positions[start:start + len(chunk)]]).sum(-1)
                scores[chunk] = cosine.to("cpu", torch.float64)
        return scores

    def text_features(self, texts: list[str]) -> Tensor:
        """Unit-norm CLAP text embeddings ``[T, D]`` (float32)."""
        tokens = self.processor.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                          return_tensors="pt")
        features = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                                attention_mask=tokens["attention_mask"].to(self.device))
        return torch.nn.functional.normalize(_pooled(features).float(), dim=-1)

    def audio_features(self, waveforms: list[Tensor]) -> Tensor:
        """Unit-norm CLAP audio embeddings ``[n, D]`` (float32) of mono waveforms at the extractor's sample rate."""
        inputs = self.processor.feature_extractor([wave.numpy() for wave in waveforms], sampling_rate=self.rate,
                                                  return_tensors="pt")
        longer = torch.tensor([[wave.shape[0] > self.max_samples] for wave in waveforms])  # not a random clip
        features = self.model.get_audio_features(input_features=inputs["input_features"].to(self.device, torch.float32),
                                                 is_longer=longer.to(self.device))
        return torch.nn.functional.normalize(_pooled(features).float(), dim=-1)


def _pooled(features: Any) -> Tensor:
    """The projected embedding of ``get_*_features``: its ``pooler_output`` (transformers 5) or the tensor itself."""
    return features if isinstance(features, Tensor) else features.pooler_output
