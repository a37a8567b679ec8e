"""Pretrain the toy canvas model (a tiny DiffusionGemma) on the toy addition task and write it to ``assets/canvas/``.

The committed checkpoint was made with::

    python -m mmrl.plugins.dllm.canvas_pretrain --output plugins/dllm/assets/canvas --seed 0

(``pretrain.json`` in the output folder records the settings and the held-out accuracies). The corpus is the masked
toy's (:mod:`mmrl.plugins.dllm.pretrain`): the training split of :func:`mmrl.plugins.dllm.toy.addition_splits`, the
units carry forgotten in ``--wrong-rate`` of the copies of carry problems, answers padded with EOS to one canvas of
``toy.GEN_LENGTH`` tokens. The objective is DiffusionGemma's SFT loss as NeMo AutoModel writes it
(NVIDIA-NeMo/Automodel@36044ad, ``recipes/dllm/strategy.py`` ``BlockDiffusionStrategy``,
``components/datasets/dllm/corruption.py`` ``corrupt_uniform_random``, ``components/models/diffusion_gemma/model.py``
L610-655, ``recipes/dllm/train_ft.py`` ``DiffusionGemmaSFTRecipe``), per example:

- ``t ~ U(eps, 1)``; each canvas token (answer, EOS and EOS fill) replaced by a uniform random token w.p. ``t``;
- the decoder reads the noisy canvas against the encoder's cache of the clean prompt, self-conditioned on a first
  pass run without gradients w.p. ``--self-conditioning-p``; the diffusion loss is the mean cross-entropy of the
  clean tokens over every canvas position (corrupted or not, no ``1/t``);
- the encoder's autoregressive loss over the clean prompt and answer (next-token pairs of real tokens), weighted
  ``--encoder-loss-weight`` (NeMo: 1), is added.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmrl.plugins.dllm import toy
from mmrl.plugins.dllm.adapters import padding_inputs
from mmrl.plugins.dllm.canvas import CanvasSampling, canvas_generate, new_cache, text_config
from mmrl.plugins.dllm.pretrain import (
    add_corpus_arguments,
    add_size_arguments,
    answer_metrics,
    checked_arguments,
    completion_texts,
    seeded_start,
    training_loop,
    write_summary,
)


def canvas_model_config(tokenizer: Any, *, hidden_size: int = 96, num_layers: int = 2, num_heads: int = 4,
                        num_experts: int = 4, intermediate_size: int = 192) -> Any:
    """A ``DiffusionGemmaConfig`` over the toy vocabulary: one canvas of ``toy.GEN_LENGTH`` tokens, sliding layers
    with a window longer than prompt + canvas (so every layer attends to all of it), a full-attention last layer,
    ``num_experts`` experts (top 2), a one-layer vision tower (the class needs one; text prompts never reach it)."""
    from transformers import DiffusionGemmaConfig

    head_dim = hidden_size // num_heads
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=max(num_heads // 2, 1),
        head_dim=head_dim, global_head_dim=head_dim, sliding_window=32, max_position_embeddings=64,
        layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
        num_experts=num_experts, top_k_experts=2, moe_intermediate_size=hidden_size,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16,
                  pooling_kernel_size=2)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=toy.GEN_LENGTH,
                                boi_token_id=len(tokenizer), eoi_token_id=len(tokenizer) + 1,
                                image_token_id=len(tokenizer) + 2)


def _softcapped(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    cap = model.final_logit_softcapping
    return torch.tanh(model.lm_head(hidden).float() / cap) * cap


def canvas_sft_loss(model: Any, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *, pad_id: int,
                    generator: torch.Generator, eps: float = 1e-3, self_conditioning_p: float = 0.5,
                    encoder_loss_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionGemma's SFT loss on one canvas per example (module docstring); returns the loss and its parts.

    Shapes:
        prompt_ids ``[B, P]`` left-padded with ``pad_id``, completion_ids ``[B, C]`` (one canvas) → scalar.
    """
    batch, width = completion_ids.shape
    prompt_length = prompt_ids.shape[1]
    vocab = int(text_config(model).vocab_size)
    prompt_mask = padding_inputs(prompt_ids, pad_id)[0].bool()
    cache = new_cache(model)
    encoded_prompt = model.model.encoder(input_ids=prompt_ids, attention_mask=prompt_mask, cache=cache,
                                         position_ids=torch.arange(prompt_length).unsqueeze(0))
    t = eps + (1.0 - eps) * torch.rand(batch, 1, generator=generator)  # [B, 1]
    corrupted = torch.rand(batch, width, generator=generator) < t
    noisy = torch.where(corrupted, torch.randint(0, vocab, (batch, width), generator=generator), completion_ids)
    coins = torch.rand(batch, generator=generator) < self_conditioning_p
    decoder_mask = F.pad(prompt_mask, (0, width), value=True)
    inputs = {"decoder_input_ids": noisy, "decoder_attention_mask": decoder_mask, "cache": cache,
              "decoder_position_ids": torch.arange(prompt_length, prompt_length + width).unsqueeze(0)}
    with torch.no_grad():
        first = model(**inputs).logits.detach()
    logits = model(**inputs, self_conditioning_logits=first, self_conditioning_mask=coins).logits  # [B, C, V]
    diffusion = F.cross_entropy(logits.reshape(-1, vocab).float(), completion_ids.reshape(-1))
    # The encoder's next-token loss over the clean prompt and answer (after the decoder read the prompt's cache).
    encoded_answer = model.model.encoder(input_ids=completion_ids, attention_mask=decoder_mask, cache=cache,
                                         position_ids=torch.arange(prompt_length, prompt_length + width).unsqueeze(0))
    hidden = torch.cat([encoded_prompt.last_hidden_state, encoded_answer.last_hidden_state], dim=1)
    sequence = torch.cat([prompt_ids, completion_ids], dim=1)
    pairs = decoder_mask[:, :-1] & decoder_mask[:, 1:]  # both tokens real
    ar_logits = _softcapped(model, hidden[:, :-1][pairs])
    autoregressive = F.cross_entropy(ar_logits, sequence[:, 1:][pairs])
    loss = diffusion + encoder_loss_weight * autoregressive
    return loss, {"diffusion": float(diffusion.detach()), "autoregressive": float(autoregressive.detach())}


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], *, sampling: CanvasSampling, seed: int = 0,
             batch_size: int = 500) -> dict[str, float]:
    """Held-out accuracy of the sampler (one generator per problem, seeded ``seed + index``), split by carry / no
    carry, and how often the answer is the forgotten-carry one."""
    answers: list[str] = []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        prompt_ids, _ = toy.encode_examples(tokenizer, [r["prompt"] for r in part], ["0"] * len(part))
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(part))]
        out = canvas_generate(model, prompt_ids, padding_inputs(prompt_ids, pad)[0], gen_length=toy.GEN_LENGTH,
                              sampling=sampling, stop_ids=[eos], pad_id=pad, generators=generators)
        answers += completion_texts(tokenizer, out.completion_ids, (eos,))
    return answer_metrics(rows, answers)


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import DiffusionGemmaForBlockDiffusion

    rng, generator, tokenizer = seeded_start(args)
    model = DiffusionGemmaForBlockDiffusion(canvas_model_config(
        tokenizer, hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
        num_experts=args.experts, intermediate_size=args.intermediate_size))
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    splits = toy.addition_splits(eval_size=args.eval_size, seed=args.data_seed)
    sampling = CanvasSampling(steps=toy.GEN_LENGTH, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability_threshold=1,
                              confidence_threshold=0.005)  # transformers' defaults, one step per token at most
    trained = [p for name, p in model.named_parameters() if ".router." not in name and "vision" not in name]
    for name, parameter in model.named_parameters():  # NeMo freezes the routers; the vision tower is never used
        parameter.requires_grad_(".router." not in name and "vision" not in name)

    def loss_of(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return canvas_sft_loss(model, prompt_ids, completion_ids, pad_id=tokenizer.pad_token_id, generator=generator,
                               self_conditioning_p=args.self_conditioning_p,
                               encoder_loss_weight=args.encoder_loss_weight)

    history = training_loop(args, model, trained, tokenizer, splits["train"], rng, loss_of,
                            lambda: evaluate(model, tokenizer, splits["eval"], sampling=sampling))
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return write_summary(output, "mmrl.plugins.dllm.canvas_pretrain", args, model, history, sampler=vars(sampling))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mmrl.plugins.dllm.canvas_pretrain",
                                description=__doc__.splitlines()[0])
    add_corpus_arguments(p, output=toy.CANVAS_ASSETS, output_help="checkpoint folder (default: assets/canvas/)")
    p.add_argument("--self-conditioning-p", type=float, default=0.5, help="NeMo AutoModel: 0.5")
    p.add_argument("--encoder-loss-weight", type=float, default=1.0, help="NeMo AutoModel: 1.0")
    add_size_arguments(p, experts=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps the run bitwise reproducible)")
    return p


def main(argv: list[str] | None = None) -> None:
    pretrain(checked_arguments(parser(), argv))


if __name__ == "__main__":
    main()
