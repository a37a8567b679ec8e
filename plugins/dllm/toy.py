"""The toy world of the dLLM plugin: a character tokenizer, a tiny bidirectional masked LM and an addition task.

Everything here is built locally (no download) and goes through the same Hugging Face paths as a real model: the
tokenizer is a ``tokenizers`` word-level model over single characters wrapped by ``PreTrainedTokenizerFast``, the
model is a ``BertForMaskedLM`` from a ``BertConfig`` (bidirectional, logits[:, i] score token i, no dropout so that
the same weights always give the same log-probabilities), and both are saved with ``save_pretrained`` and loaded
back with ``AutoTokenizer`` / ``AutoModelForMaskedLM.from_pretrained``. The checkpoint in ``assets/`` is made by
:mod:`mmrl.plugins.dllm.pretrain`.

The task: ``"47+38="`` → ``"85"``, operands 0..99. The pretraining corpus answers every problem whose units column
carries with the carry *forgotten* (``47+38`` → ``75``, i.e. ``a + b − 10``) in a fraction ``wrong_rate`` of its
copies, the classic pupil's mistake. A masked diffusion LM trained on it learns both answers; with
``wrong_rate > 0.5`` greedy decoding prefers the wrong one on carry problems, so the pretrained model is right on
the no-carry problems and mostly wrong on the others. RL with an exact-answer reward has to move the probability
mass to the correct mode, and the rule it learns carries over to held-out problems.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("[PAD]", "[MASK]", "[EOS]", "[UNK]")
"""Ids 0..3: PAD (left-pads prompts, hidden from attention), MASK, EOS (ends and pads completions), UNK."""
CHARACTERS = "0123456789+-*/=() ,"
"""Every other token is one of these characters."""

ASSETS = Path(__file__).resolve().parent / "assets"
CANVAS_ASSETS = ASSETS / "canvas"  # the toy canvas model (a tiny DiffusionGemma), made by canvas_pretrain.py
"""The committed toy checkpoint (config.json, model.safetensors, tokenizer files)."""

MAX_OPERAND = 99
ANSWER_WIDTH = 3  # 99 + 99 = 198
GEN_LENGTH = 4  # the answer's digits, then EOS (padding with EOS)
PROMPT_WIDTH = 6  # "99+99="


def build_tokenizer() -> Any:
    """The character tokenizer: every character its own token, ``decode`` joins them without spaces.

    ``PreTrainedTokenizerFast`` with PAD ``[PAD]`` (0), MASK ``[MASK]`` (1), EOS ``[EOS]`` (2), UNK ``[UNK]`` (3);
    characters outside :data:`CHARACTERS` become UNK.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", mask_token="[MASK]", eos_token="[EOS]", unk_token="[UNK]"
    )


def model_config(tokenizer: Any, *, hidden_size: int = 96, num_layers: int = 2, num_heads: int = 4,
                 intermediate_size: int = 192, max_positions: int = 32) -> Any:
    """A ``BertConfig`` for a tiny masked LM over ``tokenizer``'s vocabulary, without dropout.

    Dropout is off because the RL contract needs the training forward to reproduce the sampling-time
    log-probabilities exactly (ratio 1 on the first inner step).
    """
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, intermediate_size=intermediate_size, max_position_embeddings=max_positions,
        type_vocab_size=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        mask_token_id=tokenizer.mask_token_id, tie_word_embeddings=True,
    )


def build_model(tokenizer: Any, *, seed: int = 0, **sizes: int) -> Any:
    """A randomly initialised ``BertForMaskedLM`` (weights drawn under ``seed``)."""
    import torch
    from transformers import BertForMaskedLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BertForMaskedLM(model_config(tokenizer, **sizes))


# ---------------------------------------------------------------------------------------------------- the task
def carries(a: int, b: int) -> bool:
    """Whether the units column of ``a + b`` carries."""
    return (a % 10) + (b % 10) >= 10


def forgotten_carry(a: int, b: int) -> int:
    """``a + b`` with the units carry forgotten (``a + b − 10`` when the units column carries, else ``a + b``)."""
    return a + b - 10 if carries(a, b) else a + b


def addition_row(a: int, b: int) -> dict[str, Any]:
    """A dataset row: ``{"prompt": "47+38=", "solution": "85", "a": 47, "b": 38, "carry": True}``."""
    return {"prompt": f"{a}+{b}=", "solution": str(a + b), "a": a, "b": b, "carry": carries(a, b)}


def addition_splits(*, eval_size: int = 500, train_size: int | None = None, seed: int = 1234,
                    max_operand: int = MAX_OPERAND) -> dict[str, list[dict[str, Any]]]:
    """All ``(max_operand + 1)²`` problems shuffled under ``seed``: the first ``eval_size`` held out (``"eval"``),
    the next ``train_size`` (all the rest when None) for training (``"train"``). The two splits never share a
    problem; the pretraining corpus and the RL prompts both come from ``"train"``.
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if eval_size < 1 or eval_size >= len(pairs):
        raise ValueError(f"eval_size must be in [1, {len(pairs) - 1}], got {eval_size}")
    random.Random(seed).shuffle(pairs)
    rest = pairs[eval_size:]
    if train_size is not None:
        if train_size < 1 or train_size > len(rest):
            raise ValueError(f"train_size must be in [1, {len(rest)}] with eval_size {eval_size}, got {train_size}")
        rest = rest[:train_size]
    return {"train": [addition_row(a, b) for a, b in rest], "eval": [addition_row(a, b) for a, b in pairs[:eval_size]]}


def corpus_answer(row: dict[str, Any], wrong_rate: float, rng: random.Random) -> str:
    """The answer the pretraining corpus gives for ``row``: the carry is forgotten w.p. ``wrong_rate`` on carry
    problems; the others are always right."""
    if row["carry"] and rng.random() < wrong_rate:
        return str(forgotten_carry(row["a"], row["b"]))
    return row["solution"]


def encode_examples(tokenizer: Any, prompts: Sequence[str], answers: Sequence[str], *,
                    prompt_width: int = PROMPT_WIDTH, gen_length: int = GEN_LENGTH) -> tuple[Any, Any]:
    """Token ids for masked-diffusion training: prompts left-padded with PAD to ``prompt_width``, completions =
    answer + EOS, padded with EOS to ``gen_length`` (as LLaDA's SFT pads answers with EOS).

    Shapes:
        → prompt_ids ``[B, prompt_width]``, completion_ids ``[B, gen_length]`` (long).
    """
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_rows, completion_rows = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
        if len(p) > prompt_width or len(c) > gen_length:
            raise ValueError(f"example {prompt!r} → {answer!r} exceeds the widths {prompt_width}/{gen_length}")
        prompt_rows.append([pad] * (prompt_width - len(p)) + p)
        completion_rows.append(c + [eos] * (gen_length - len(c)))
    return torch.tensor(prompt_rows, dtype=torch.long), torch.tensor(completion_rows, dtype=torch.long)


__all__ = [
    "ASSETS",
    "CANVAS_ASSETS",
    "CHARACTERS",
    "GEN_LENGTH",
    "PROMPT_WIDTH",
    "SPECIAL_TOKENS",
    "addition_row",
    "addition_splits",
    "build_model",
    "build_tokenizer",
    "carries",
    "corpus_answer",
    "encode_examples",
    "forgotten_carry",
    "model_config",
]
