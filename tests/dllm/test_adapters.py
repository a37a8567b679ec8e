"""Model adapters: special ids, logit shifts and attention masks, on the toy checkpoint and on recording stubs."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from mmrl.plugins.dllm import toy
from mmrl.plugins.dllm.adapters import (
    DreamAdapter,
    LLaDAAdapter,
    MaskedLMAdapter,
    adapter_for,
    dllm_adapters,
    padding_inputs,
)

torch.set_num_threads(1)


class Recorder(nn.Module):
    """Returns logits[:, i] = one-hot of input token i+1 (a next-token predictor) and records its arguments."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.calls: list[tuple[tuple, dict]] = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        ids = args[0] if args else kwargs["input_ids"]
        following = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        return SimpleNamespace(logits=nn.functional.one_hot(following, self.vocab).float())


def _fake_checkpoint(tmp_path, model_type: str, **config) -> str:
    folder = tmp_path / model_type
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(toy.ASSETS / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 23, **config}))
    return str(folder)


def test_registry_and_auto_detection(tmp_path):
    assert {"masked_lm", "llada", "dream"} <= set(dllm_adapters.names())
    assert adapter_for(str(toy.ASSETS)) is MaskedLMAdapter
    assert adapter_for(_fake_checkpoint(tmp_path, "llada")) is LLaDAAdapter
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        adapter_for(_fake_checkpoint(tmp_path, "gpt2"))


def test_masked_lm_logits_do_not_depend_on_left_padding():
    adapter = MaskedLMAdapter(str(toy.ASSETS))
    model = adapter.load_model().eval()
    sequence = torch.tensor([[11, 12, 14, 7, 18, 1, 1, 1, 2]])  # "34+9=" then masks and EOS
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), sequence], dim=1)
    with torch.no_grad():
        plain, shifted = adapter.logits(model, sequence), adapter.logits(model, padded)[:, 3:]
    assert torch.allclose(plain, shifted, atol=1e-5)
    attention, positions = padding_inputs(padded, 0)
    assert attention[0].tolist() == [0, 0, 0] + [1] * 9 and positions[0, 3:].tolist() == list(range(9))


def test_model_loads_without_hub_kernels_so_decoding_and_training_run_one_path():
    # transformers' default picks hub kernels by the train/eval mode and re-kernelizes on every switch; the plugin
    # decodes in eval mode and trains in train mode
    model = MaskedLMAdapter(str(toy.ASSETS)).load_model()
    assert not model.use_kernels
    model.train()
    model.eval()
    # transformers 5.24 records the mode it kernelized for; 5.18 (the declared floor) has no such attribute
    assert getattr(model, "kernels_mode", None) is None


def test_llada_adapter_passes_no_attention_mask_and_pads_with_eos(tmp_path):
    path = _fake_checkpoint(tmp_path, "llada", mask_token_id=22)
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLaDAAdapter(path)
    adapter = LLaDAAdapter(path, trust_remote_code=True)
    assert adapter.mask_id == 22  # from config.json, not the tokenizer's [MASK]
    assert adapter.pad_id == adapter.eos_id == 2  # d1: pad = EOS; 126081/126348 are outside this vocabulary
    recorder = Recorder(23)
    ids = torch.tensor([[2, 2, 5, 6, 22, 22]])
    adapter.logits(recorder, ids)
    args, kwargs = recorder.calls[0]
    assert torch.equal(args[0], ids) and "attention_mask" not in kwargs
    assert LLaDAAdapter.extra_stop_ids == (126081, 126348) and LLaDAAdapter.default_mask_id == 126336


def test_dream_adapter_undoes_the_shift_and_builds_a_bidirectional_mask(tmp_path):
    adapter = DreamAdapter(_fake_checkpoint(tmp_path, "Dream", mask_token_id=22), trust_remote_code=True)
    recorder = Recorder(23)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8]])  # two pads (id 0)
    logits = adapter.logits(recorder, ids)
    # The recorder predicts the next token at each position; after the shift, position i scores token i.
    assert torch.equal(logits[0, 1:].argmax(-1), ids[0, 1:])
    _, kwargs = recorder.calls[0]
    pairs = kwargs["attention_mask"]
    assert pairs.shape == (1, 1, 6, 6) and not pairs[0, 0, 0].any() and pairs[0, 0, 2:, 2:].all()
    assert kwargs["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3]
    adapter.logits(recorder, torch.tensor([[5, 6, 7]]))
    assert recorder.calls[1][1]["attention_mask"] == "full"


def test_special_id_overrides_and_errors(tmp_path):
    adapter = MaskedLMAdapter(str(toy.ASSETS), stop_ids=[2, 17], pad_id=0)
    assert adapter.stop_ids == (2, 17) and adapter.eos_id == 2
    with pytest.raises(ValueError, match="equals the mask id"):
        MaskedLMAdapter(str(toy.ASSETS), pad_id=1)
    with pytest.raises(ValueError, match="stop token"):
        MaskedLMAdapter(str(toy.ASSETS), stop_ids=[1])


def test_scorer_feeds_the_estimators(tmp_path):
    from mmrl.plugins.dllm.estimators import likelihood_estimators

    adapter = MaskedLMAdapter(str(toy.ASSETS))
    model = adapter.load_model().eval()
    prompt = torch.tensor([[0, 11, 12, 14, 7, 18]])
    completion = torch.tensor([[9, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 0, 0]])
    with torch.no_grad():
        estimate: Tensor = likelihood_estimators.get("one_step")(
            adapter.scorer(model), prompt, completion, mask, mask_id=adapter.mask_id)
        inputs = torch.tensor([[0, 11, 12, 14, 7, 18, 1, 1, 1, 1]])  # the tail after EOS is masked as well
        logp = adapter.logits(model, inputs)[0, 6:8].log_softmax(-1)
    assert estimate.item() == pytest.approx(float(logp[0, 9] + logp[1, 2]), abs=1e-5)


def _pad_is_eos_checkpoint(tmp_path) -> str:
    """A Dream-style folder whose tokenizer and config set pad = EOS, as Dream-v0's do (151643 for both); here the
    toy tokenizer with its pad token set to [EOS] (id 2)."""
    folder = tmp_path / "dream_pad_eos"
    tokenizer = toy.build_tokenizer()
    tokenizer.pad_token = "[EOS]"
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "Dream", "vocab_size": 23, "mask_token_id": 1,
                                                    "eos_token_id": 2, "pad_token_id": 2, "bos_token_id": 2}))
    return str(folder)


def test_pad_equal_to_eos_hides_only_the_left_padding(tmp_path):
    adapter = DreamAdapter(_pad_is_eos_checkpoint(tmp_path), trust_remote_code=True)
    assert adapter.pad_id == adapter.eos_id == 2 and adapter.pad_is_stop and "leading run" in adapter.describe()
    recorder = Recorder(23)
    ids = torch.tensor([[2, 2, 5, 6, 7, 2, 1, 1],  # two pads, a prompt, a completion "7 EOS" and a masked tail
                        [5, 6, 5, 7, 2, 2, 1, 1]])  # no padding; the EOS after the prompt is a real token
    adapter.logits(recorder, ids)
    _, kwargs = recorder.calls[0]
    visible = kwargs["attention_mask"][:, 0].diagonal(dim1=-2, dim2=-1)  # [B, T]: which positions are attended
    assert visible.tolist() == [[False, False] + [True] * 6, [True] * 8]
    assert kwargs["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5], list(range(8))]
    attention, positions = padding_inputs(ids, 2)
    assert attention.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]


def test_pad_equal_to_eos_leaves_the_toy_logits_unchanged():
    # The toy model with the padding id overridden to EOS must score a sequence that contains EOS exactly as with
    # its real padding id: an EOS after the first real token is a real token, not padding.
    model = MaskedLMAdapter(str(toy.ASSETS)).load_model().eval()
    sequence = torch.tensor([[11, 12, 14, 7, 18, 9, 2, 1]])  # "34+9=", then "7", EOS and a mask
    with torch.no_grad():
        real_pad = MaskedLMAdapter(str(toy.ASSETS)).logits(model, sequence)
        eos_pad = MaskedLMAdapter(str(toy.ASSETS), pad_id=2).logits(model, sequence)
        padded = MaskedLMAdapter(str(toy.ASSETS), pad_id=2).logits(model, torch.cat([torch.full((1, 2), 2), sequence],
                                                                                    dim=1))[:, 2:]
    assert torch.allclose(real_pad, eos_pad, atol=1e-6) and torch.allclose(real_pad, padded, atol=1e-5)
