"""Pretrain the toy masked diffusion LM of the dLLM plugin and write the checkpoint in ``assets/``.

The committed checkpoint was made with (2 CPU threads are not needed; one keeps the run bitwise reproducible)::

    python -m mmrl.plugins.dllm.pretrain --output plugins/dllm/assets --seed 0

(the defaults below are the exact settings; ``pretrain.json`` in the output folder records them with the final
held-out accuracies). The objective is the masked-diffusion SFT loss of LLaDA (Nie et al. 2025, arXiv:2502.09992,
the MDLM ELBO of Sahoo et al. 2024, arXiv:2406.07524, with the prompt never masked): per example
``t ~ U(ε, 1)``, every completion position (answer, EOS and EOS padding) masked independently with probability t, and

    loss = (1/G) Σ_{masked i} −log p_θ(x^i | c, x_t) / t,

averaged over the batch. The corpus is :func:`mmrl.plugins.dllm.toy.addition_splits`'s training split with the units
carry forgotten in ``--wrong-rate`` of the copies of carry problems (see :mod:`mmrl.plugins.dllm.toy`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmrl.plugins.dllm import toy
from mmrl.plugins.dllm.generation import completion_mask, generate


def masked_diffusion_loss(scorer: Any, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *, mask_id: int,
                          generator: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """LLaDA's SFT loss on a batch (see the module docstring).

    Shapes:
        prompt_ids ``[B, P]``, completion_ids ``[B, G]`` → scalar.
    """
    batch, length = completion_ids.shape
    t = (1.0 - eps) * torch.rand(batch, generator=generator) + eps  # [B]
    masked = torch.rand(batch, length, generator=generator) < t.unsqueeze(1)  # [B, G]
    inputs = torch.cat([prompt_ids, torch.where(masked, mask_id, completion_ids)], dim=1)
    logits = scorer(inputs)[:, prompt_ids.shape[1]:].float()  # [B, G, V]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), completion_ids.reshape(-1), reduction="none")
    per_example = (nll.view(batch, length) * masked / t.unsqueeze(1)).sum(dim=1) / length
    return per_example.mean()


@torch.no_grad()
def evaluate(scorer: Any, tokenizer: Any, rows: list[dict[str, Any]], *, mask_id: int, stop_ids: tuple[int, ...],
             batch_size: int = 500) -> dict[str, float]:
    """Greedy accuracy on ``rows`` (one block, one token per step), split by carry / no carry, and how often the
    answer is the forgotten-carry one."""
    answers: list[str] = []
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        prompt_ids, _ = toy.encode_examples(tokenizer, [r["prompt"] for r in part], ["0"] * len(part))
        out = generate(scorer, prompt_ids, mask_id=mask_id, gen_length=toy.GEN_LENGTH,
                       block_length=toy.GEN_LENGTH, steps=toy.GEN_LENGTH)
        answers += completion_texts(tokenizer, out.completion_ids, stop_ids)
    return answer_metrics(rows, answers)


def completion_texts(tokenizer: Any, completion_ids: torch.Tensor, stop_ids: tuple[int, ...]) -> list[str]:
    """The text of each completion up to, not including, its first stop token."""
    keep = completion_mask(completion_ids, stop_ids)
    return [tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
            for ids, mask in zip(completion_ids.tolist(), keep.tolist(), strict=True)]


def answer_metrics(rows: list[dict[str, Any]], answers: list[str]) -> dict[str, float]:
    """Accuracy of ``answers`` on addition ``rows``, split by carry / no carry, and how often a carry problem gets the
    forgotten-carry answer."""
    correct, forgotten, carry_total, carry_right = 0, 0, 0, 0
    for row, text in zip(rows, answers, strict=True):
        right = text == row["solution"]
        correct += right
        if row["carry"]:
            carry_total += 1
            carry_right += right
            forgotten += text == str(toy.forgotten_carry(row["a"], row["b"]))
    return {
        "accuracy": correct / max(len(rows), 1),
        "carry_accuracy": carry_right / max(carry_total, 1),
        "no_carry_accuracy": (correct - carry_right) / max(len(rows) - carry_total, 1),
        "forgotten_carry_rate": forgotten / max(carry_total, 1),
    }


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    from mmrl.plugins.dllm.adapters import MaskedLMAdapter

    rng, generator, tokenizer = seeded_start(args)
    model = toy.build_model(tokenizer, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.layers,
                            num_heads=args.heads, intermediate_size=args.intermediate_size)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(output)  # the adapter reads the tokenizer and config.json from the folder
    model.config.save_pretrained(output)
    adapter = MaskedLMAdapter(str(output))
    scorer = adapter.scorer(model)
    splits = toy.addition_splits(eval_size=args.eval_size, seed=args.data_seed)

    def loss_of(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return masked_diffusion_loss(scorer, prompt_ids, completion_ids, mask_id=adapter.mask_id,
                                     generator=generator), {}

    history = training_loop(args, model, list(model.parameters()), tokenizer, splits["train"], rng, loss_of,
                            lambda: evaluate(scorer, tokenizer, splits["eval"], mask_id=adapter.mask_id,
                                             stop_ids=adapter.stop_ids))
    model.save_pretrained(output)
    return write_summary(output, "mmrl.plugins.dllm.pretrain", args, model, history)


def seeded_start(args: argparse.Namespace) -> tuple[random.Random, torch.Generator, Any]:
    """The start of a toy pretraining run: ``args.threads`` torch threads, the global seed, then the corpus's
    ``random.Random``, the noise generator and the toy tokenizer (in this order, so runs stay bitwise reproducible)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return random.Random(args.seed), torch.Generator().manual_seed(args.seed), toy.build_tokenizer()


def training_loop(args: argparse.Namespace, model: torch.nn.Module, parameters: list[torch.nn.Parameter],
                  tokenizer: Any, train_rows: list[dict[str, Any]], rng: random.Random,
                  loss_of: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
                  evaluate_now: Callable[[], dict[str, float]]) -> list[dict[str, Any]]:
    """``args.steps`` AdamW steps on ``parameters`` (the :func:`learning_rate` schedule, gradient norm clipped to 1)
    of ``loss_of(prompt_ids, completion_ids)`` → ``(loss, parts)`` on :func:`corpus_batch` batches; every
    ``args.eval_every`` steps and at the end, ``evaluate_now()`` in eval mode. Returns the evaluation records (step,
    loss, the loss's parts, seconds, the metrics); the model is left in eval mode."""
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    history = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.train()
        prompt_ids, completion_ids = corpus_batch(tokenizer, train_rows, args, rng)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        loss, parts = loss_of(prompt_ids, completion_ids)
        optimizer_step(optimizer, loss, parameters)
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            metrics = evaluate_now()
            record = {"step": step, "loss": round(float(loss.detach()), 4),
                      **{k: round(v, 4) for k, v in parts.items()},
                      "seconds": round(time.perf_counter() - started, 1),
                      **{k: round(v, 4) for k, v in metrics.items()}}
            history.append(record)
            print(json.dumps(record), flush=True)
    model.eval()
    return history


def corpus_batch(tokenizer: Any, rows: list[dict[str, Any]], args: argparse.Namespace,
                 rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``args.batch_size`` problems drawn from ``rows`` with the corpus's answers (the carry forgotten w.p.
    ``args.wrong_rate``), encoded: ``[B, P]`` prompt ids, ``[B, G]`` completion ids."""
    batch = [rows[rng.randrange(len(rows))] for _ in range(args.batch_size)]
    answers = [toy.corpus_answer(row, args.wrong_rate, rng) for row in batch]
    return toy.encode_examples(tokenizer, [r["prompt"] for r in batch], answers)


def optimizer_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, parameters: list[torch.nn.Parameter]) -> None:
    """Backward of ``loss``, the gradient norm of ``parameters`` clipped to 1, one step."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up over ``args.warmup`` steps, then a linear decay to a tenth at ``args.steps``."""
    return args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * (1 - step / args.steps))


def write_summary(output: Path, module: str, args: argparse.Namespace, model: Any, history: list[dict[str, Any]],
                  **extra: Any) -> dict[str, Any]:
    """Write ``pretrain.json`` (the command, its arguments, the parameter count, the last and every held-out record)
    to ``output`` and return it."""
    summary = {
        "command": f"python -m {module} " + " ".join(
            f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()),
        "arguments": vars(args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out": history[-1] if history else {},
        **extra,
        "history": history,
        "torch": torch.__version__,
    }
    (output / "pretrain.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mmrl.plugins.dllm.pretrain", description=__doc__.splitlines()[0])
    add_corpus_arguments(p, output=toy.ASSETS, output_help="checkpoint folder (default: the plugin's assets/)")
    add_size_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps the run bitwise reproducible)")
    return p


def add_corpus_arguments(p: argparse.ArgumentParser, *, output: Path, output_help: str) -> None:
    """The options of a toy pretraining run: output, seed, schedule, corpus and held-out evaluation."""
    p.add_argument("--output", default=str(output), help=output_help)
    p.add_argument("--seed", type=int, default=0, help="weights, batches, noise and corpus noise")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wrong-rate", type=float, default=0.7,
                   help="fraction of carry-problem answers with the carry forgotten")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--data-seed", type=int, default=1234, help="the train/held-out split (plugin.data_seed)")


def add_size_arguments(p: argparse.ArgumentParser, **extra: int) -> None:
    """The model's sizes (and ``extra`` integer options, e.g. ``experts=4``)."""
    p.add_argument("--hidden-size", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    for name, default in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--intermediate-size", type=int, default=192)


def checked_arguments(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed options, ``--wrong-rate`` checked."""
    args = p.parse_args(argv)
    if not 0.0 <= args.wrong_rate <= 1.0:
        raise SystemExit(f"--wrong-rate must be in [0, 1], got {args.wrong_rate}")
    return args


def main(argv: list[str] | None = None) -> None:
    pretrain(checked_arguments(parser(), argv))


if __name__ == "__main__":
    main()
