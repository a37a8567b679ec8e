"""Supervised pretraining of the grounding world's model (the committed ``assets/qwen2_5_vl`` checkpoint).

The model (:mod:`~mmrl.plugins.vlm.grounding.model`, random weights) learns by teacher forcing to answer fresh
training questions of the world (:mod:`~mmrl.plugins.vlm.grounding.world`, every kind in turn; a new scene for every
example, never one at a held-out place) with the completion :func:`~mmrl.plugins.vlm.grounding.world.answer_text`
writes in the family's box convention. The prompts are the ones the VLM plugin builds (the same chat template,
format instruction, image resizing and processor calls, through the plugin's adapter), so that the RL run continues
exactly where pretraining stopped. The loss is the mean cross-entropy of the completion tokens (the EOS included);
the whole model trains, the vision tower too. AdamW, linear warm-up then a constant learning rate, so that a run
stopped at step k has the weights a longer run had at step k.

Every ``--eval-every`` steps the model answers ``--eval-questions`` validation questions greedily (held-out
compositions, drawn with another seed than the RL recipe's evaluation set), scored by the world's reward per kind
and by ``format``; the checkpoint folder is rewritten then (atomically), with ``pretrain.json`` holding the command,
the options, the timings and every evaluation::

    python -m mmrl.plugins.vlm.grounding.pretrain --out /tmp/grounding-model --steps 3000 --threads 1

``--image-position after`` puts the question before the image (the RL recipe's ``plugin.image_position`` must
match), so that under causal attention the image tokens can attend to it. ``--subject-loss W`` then adds W times an
auxiliary loss that supervises exactly that: a linear head (not saved with the checkpoint) reads the language
model's hidden state after block ``--subject-layer`` at each image token and predicts how much of the token's patch
the objects the question is about cover (:func:`subject_coverage`). It is deep supervision of the step the answer
needs (which image tokens the question names) for a model too small to find it from the answer tokens alone
(docs/vlm.md, section 13).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.plugins.vlm.adapters.base import IMAGE_POSITIONS
from mmrl.plugins.vlm.grounding import model as world_model
from mmrl.plugins.vlm.grounding import world

VALIDATION_SEED = 1_000
"""Seed of the validation questions (the RL recipe evaluates on seed 0's held-out questions)."""


class Learner:
    """The model, its adapter (the VLM plugin's prompt and batching code) and the family's box convention."""

    def __init__(self, checkpoint: str | Path, family: str, device: str = "cpu", image_position: str = "before"):
        from mmrl.plugins.vlm.adapters import vlm_adapters

        adapter_class = vlm_adapters.get(family)
        self.adapter = adapter_class(str(checkpoint), min_pixels=world_model.MIN_PIXELS,
                                     max_pixels=world_model.MAX_PIXELS)
        self.model = self.adapter.load_model(dtype=torch.float32, attn_implementation="sdpa").to(device)
        self.convention = adapter_class.box_convention
        self.device = device
        self.image_position = image_position
        self.subject_head: torch.nn.Linear | None = None  # add_subject_head
        self._subject_layer: torch.nn.Module | None = None  # set with subject_head
        tokenizer = self.adapter.tokenizer
        self.eos_id = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def rows(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Records with ``resized_size``, as the plugin's loader attaches it."""
        return [{**record, "resized_size": list(self.adapter.resized_size(record["image_size"]))}
                for record in records]

    def prompts(self, rows: Sequence[dict[str, Any]], images: Sequence[np.ndarray]) -> list[dict[str, torch.Tensor]]:
        """The plugin's prompt inputs for rows and their images (``[H, W, 3]`` uint8 arrays)."""
        from PIL import Image

        texts = [self.adapter.chat_text(self.adapter.messages(
            world_model.PROMPT_TEMPLATE.format(question=row["problem"]), 1, image_position=self.image_position))
            for row in rows]
        loaded = [self.adapter.load_images([Image.fromarray(image)]) for image in images]
        return self.adapter.encode(texts, loaded)

    def add_subject_head(self, layer: int) -> torch.nn.Module:
        """Attach the auxiliary head of :meth:`loss`'s ``subject`` term (a linear read-out of the language model's
        hidden state after block ``layer`` at each image token); returns it for the optimizer. Pretraining only:
        the head is not part of the checkpoint."""
        blocks = self.model.model.language_model.layers
        if not 0 <= layer < len(blocks):
            raise ValueError(f"subject layer must be in [0, {len(blocks) - 1}], got {layer}")
        if self.image_position != "after":
            # With the image first, causal attention keeps the question out of the image tokens' states.
            raise ValueError("the subject loss needs image_position 'after' (the image tokens must see the question)")
        self.subject_head = torch.nn.Linear(self.model.config.text_config.hidden_size, 1).to(self.device)
        self._subject_layer = blocks[layer]
        return self.subject_head

    def loss(self, rows: Sequence[dict[str, Any]], images: Sequence[np.ndarray]) -> torch.Tensor:
        """Mean cross-entropy of the answer tokens (EOS included), teacher-forced."""
        return self.losses(rows, images)[0]

    def losses(self, rows: Sequence[dict[str, Any]], images: Sequence[np.ndarray]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The answer loss (:meth:`loss`) and, with a subject head attached (:meth:`add_subject_head`), the subject
        loss: the binary cross-entropy of the head's logit at each image token against how much of the token's
        28x28 patch the boxes of the objects the question is about cover (:func:`subject_coverage`), averaged over
        each image's tokens, then over the rows."""
        captured: list[torch.Tensor] = []
        hook = None
        if self.subject_head is not None:
            def keep(_module: Any, _args: Any, output: Any) -> None:
                captured.append(output[0] if isinstance(output, tuple) else output)
            hook = self._subject_layer.register_forward_hook(keep)
        try:
            answer, input_ids, grids = self._answer_loss(rows, images)
        finally:
            if hook is not None:
                hook.remove()
        if self.subject_head is None:
            return answer, None
        if len(captured) != 1:
            raise RuntimeError(f"the subject layer ran {len(captured)} times in one forward; expected once")
        hidden = captured[0]  # [n, S, D]
        image_token = int(self.model.config.image_token_id)
        terms = []
        for i, row in enumerate(rows):
            positions = (input_ids[i] == image_token).nonzero()[:, 0]
            logits = self.subject_head(hidden[i, positions].float())[:, 0]  # [h * w]
            target = torch.as_tensor(subject_coverage(row, grids[i]), dtype=logits.dtype, device=logits.device)
            if target.shape != logits.shape:
                raise ValueError(f"row {i}: {logits.shape[0]} image tokens in the prompt, {target.shape[0]} in its "
                                 f"image grid {grids[i]}; the subject loss needs one image per prompt")
            terms.append(torch.nn.functional.binary_cross_entropy_with_logits(logits, target))
        return answer, torch.stack(terms).mean()

    def _answer_loss(self, rows: Sequence[dict[str, Any]], images: Sequence[np.ndarray]
                     ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """The answer loss, the batch's ``input_ids`` ``[n, S]`` and each prompt's image grid ``(t, h, w)``."""
        prompts = self.prompts(rows, images)
        grids = [prompt["image_grid_thw"].reshape(-1, 3)[0].tolist() for prompt in prompts]
        answers = [world.answer_text(row, self.convention, row["resized_size"]) for row in rows]
        tokenizer = self.adapter.tokenizer
        completions = [torch.tensor(tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.eos_id])
                       for answer in answers]
        inputs, width = self.adapter.collate(prompts, completions, device=self.device)
        targets = inputs["input_ids"][:, width:]  # [n, C]
        logits = self.adapter.completion_logits(self.model, inputs, targets.shape[1])  # [n, C, V]
        mask = inputs["attention_mask"][:, width:].bool()  # [n, C]
        return torch.nn.functional.cross_entropy(logits[mask].float(), targets[mask]), inputs["input_ids"], grids

    @torch.no_grad()
    def answer(self, rows: Sequence[dict[str, Any]], images: Sequence[np.ndarray], max_new_tokens: int = 96
               ) -> list[str]:
        """Greedy completions (special tokens kept, the final EOS dropped), as the plugin's evaluation decodes."""
        from transformers import GenerationConfig

        prompts = self.prompts(rows, images)
        eos = sorted({self.eos_id, int(self.adapter.tokenizer.pad_token_id)})
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  pad_token_id=self.adapter.pad_token_id, num_beams=1, repetition_penalty=1.0,
                                  suppress_tokens=self.adapter.suppressed_token_ids())
        self.model.eval()
        saved = self.model.generation_config
        try:
            self.model.generation_config = config
            sequences, width = self.adapter.generate(self.model, prompts, config, device=self.device)
        finally:
            self.model.generation_config = saved
            self.model.train()
        texts = []
        for tokens in sequences[:, width:].tolist():
            ended = [i for i, token in enumerate(tokens) if token in eos]
            texts.append(self.adapter.tokenizer.decode(tokens[:ended[0]] if ended else tokens,
                                                       skip_special_tokens=False))
        return texts


def subject_coverage(row: dict[str, Any], grid_thw: Sequence[int], merge: int = 2, patch: int = 14) -> np.ndarray:
    """For each merged image token (raster order), the share of its ``merge * patch`` pixel square inside the box of
    an object the row's question is about (locate: the one asked for; find: every object of the shape; count:
    every object of the colour); ``[h * w]`` in [0, 1]. Boxes are in pixels of the resized image, which the world's
    images keep (their sides are multiples of 28 within the recipe's pixel bounds)."""
    _, grid_h, grid_w = (int(v) for v in grid_thw)
    h, w, side = grid_h // merge, grid_w // merge, merge * patch
    color, shape = row["subject"]["color"], row["subject"]["shape"]
    about = {"locate": lambda o: o["color"] == color and o["shape"] == shape,
             "find": lambda o: o["shape"] == shape, "count": lambda o: o["color"] == color}[row["kind"]]
    edges_x, edges_y = np.arange(w + 1) * side, np.arange(h + 1) * side
    covered = np.zeros((h, w))
    for thing in row["objects"]:
        if not about(thing):
            continue
        x1, y1, x2, y2 = thing["box"]
        across = np.clip(np.minimum(edges_x[1:], x2) - np.maximum(edges_x[:-1], x1), 0, None)  # [w]
        down = np.clip(np.minimum(edges_y[1:], y2) - np.maximum(edges_y[:-1], y1), 0, None)  # [h]
        covered += np.outer(down, across) / side ** 2
    return np.clip(covered, 0.0, 1.0).reshape(-1)


def score(rows: Sequence[dict[str, Any]], texts: Sequence[str], convention: str) -> dict[str, float]:
    """Mean world reward per kind and overall, and the share of answers in the R1 format."""
    from mmrl.plugins.vlm.grounding.reward import grounding_world
    from mmrl.reward import RewardInput
    from mmrl.rewards.reasoning import format_reward

    batch = RewardInput(rows=list(rows), payload={"completions": list(texts)})
    scores = grounding_world(batch, convention=convention)
    result = {}
    for kind in world.KINDS:
        values = [s for s, row in zip(scores, rows, strict=True) if row["kind"] == kind]
        if values:
            result[kind] = float(np.mean(values))
    result["all"] = float(np.mean(scores))
    result["format"] = float(np.mean(format_reward(batch)))
    return result


def evaluate(learner: Learner, rows: Sequence[dict[str, Any]], batch_size: int = 32) -> dict[str, float]:
    """Greedy answers to ``rows`` scored by :func:`score`."""
    texts: list[str] = []
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        texts += learner.answer(part, [world.record_image(row) for row in part])
    return score(rows, texts, learner.convention)


def training_batch(rng: np.random.Generator, size: int, step: int, kinds: Sequence[str] = world.KINDS,
                   max_objects: int = world.MAX_OBJECTS, every_object: bool = False) -> list[dict[str, Any]]:
    """``size`` fresh training records, the kinds in turn (shifted by the step, so each kind gets every slot); scenes
    with more than ``max_objects`` objects are drawn again (a curriculum's easy stage). With ``every_object`` a
    locate scene asks about each object that is alone of its kind (:func:`world.scene_rows_every_object`), filling
    as many slots: the batch holds the same image with different questions and answers."""
    if not 1 <= max_objects <= world.MAX_OBJECTS:
        # Every scene holds at least one object: a smaller bound would redraw forever.
        raise ValueError(f"max_objects must be in [1, {world.MAX_OBJECTS}], got {max_objects}")
    rows: list[dict[str, Any]] = []
    i = 0
    while len(rows) < size:
        while True:
            scene = world.make_scene(kinds[(step + i) % len(kinds)], "train", rng)
            if len(scene["things"]) <= max_objects:
                break
        rows.extend(world.scene_rows(scene, every_object)[:size - len(rows)])
        i += 1
    return rows


def _write_checkpoint(learner: Learner, out: Path, record: dict[str, Any]) -> None:
    """Rewrite ``out`` atomically: a staging folder renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    world_model.save(learner.model, learner.adapter.processor, staging)
    (staging / "pretrain.json").write_text(json.dumps(record, indent=1) + "\n")
    old = out.with_name(f".{out.name}-old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.vlm.grounding.pretrain",
                                     description="Pretrain the grounding world's model by supervised fine-tuning.")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder (rewritten at each evaluation)")
    parser.add_argument("--family", choices=("qwen2_5_vl", "qwen2_vl"), default="qwen2_5_vl")
    parser.add_argument("--init", type=Path, default=None, help="continue from this checkpoint folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(world.KINDS),
                        help="comma-separated question kinds to train and validate on, in turn; a kind listed twice "
                             "gets twice the questions (default: all three)")
    parser.add_argument("--max-objects", type=int, default=world.MAX_OBJECTS,
                        help="train on scenes with at most this many objects (validation keeps the world's scenes)")
    parser.add_argument("--every-object", action="store_true",
                        help="locate scenes ask about each object alone of its kind (the same image, several answers)")
    parser.add_argument("--image-position", choices=IMAGE_POSITIONS, default="before",
                        help="the image before the question (Qwen's order) or after it (the image tokens can attend "
                             "to the question); the RL recipe's plugin.image_position must match")
    parser.add_argument("--subject-loss", type=float, default=0.0,
                        help="weight of an auxiliary loss (needs --image-position after): a linear head on the "
                             "language model's hidden state at each image token predicts how much of the token's "
                             "patch the question's objects cover; the head is not saved")
    parser.add_argument("--subject-layer", type=int, default=1,
                        help="the language model block whose output the subject head reads (0-based)")
    parser.add_argument("--dims", type=json.loads, default=None,
                        help="JSON object overriding model.DIMS for a fresh model, e.g. '{\"rope_theta\": 100}'")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-questions", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--stop-at", type=float, default=None,
                        help="stop after the first evaluation whose validation locate IoU reaches this value")
    args = parser.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    unknown = sorted(set(kinds) - set(world.KINDS))
    if unknown:
        parser.error(f"--kinds: unknown kind(s) {unknown}; allowed: {', '.join(world.KINDS)}")
    if not 1 <= args.max_objects <= world.MAX_OBJECTS:
        parser.error(f"--max-objects: got {args.max_objects}; allowed: 1 to {world.MAX_OBJECTS}")
    if args.dims is not None and args.init is not None:
        parser.error("--dims applies to a fresh model; it cannot change the model given by --init")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grounding-init-") as scratch:
        init = args.init
        if init is None:
            model, processor = world_model.build_model(args.family, seed=args.seed, dims=args.dims)
            init = world_model.save(model, processor, Path(scratch) / "init")
        learner = Learner(init, args.family, image_position=args.image_position)
    parameters = list(learner.model.parameters())
    if args.subject_loss > 0:
        try:
            parameters += list(learner.add_subject_head(args.subject_layer).parameters())
        except ValueError as error:
            parser.error(f"--subject-loss: {error}")
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(args.warmup, 1)))
    rng = np.random.default_rng([args.seed, 7])
    validation = learner.rows(world.make_records(args.eval_questions, "test", VALIDATION_SEED, kinds))
    record: dict[str, Any] = {"command": "python -m mmrl.plugins.vlm.grounding.pretrain " + " ".join(sys.argv[1:]),
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "model": {**world_model.DIMS, **(args.dims or {})}, "torch": torch.__version__,
                              "machine": platform.machine(),
                              "log": []}
    if args.init is not None:
        # The model is the one --init holds, which model.DIMS need not be: a continued run records the stage it
        # started from (the checkpoint's whole history in one file) and that stage's sizes; without a record they
        # are not known here.
        record["model"] = None
        if (args.init / "pretrain.json").is_file():
            record["previous_stage"] = json.loads((args.init / "pretrain.json").read_text())
            record["model"] = record["previous_stage"].get("model")
    losses: list[float] = []
    subject_losses: list[float] = []
    learner.model.train()
    for step in range(1, args.steps + 1):
        rows = learner.rows(training_batch(rng, args.batch_size, step, kinds, args.max_objects, args.every_object))
        loss, subject = learner.losses(rows, [world.record_image(row) for row in rows])
        optimizer.zero_grad(set_to_none=True)
        (loss if subject is None else loss + args.subject_loss * subject).backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"pretraining loss became {losses[-1]} at step {step}")
        if subject is not None:
            subject_losses.append(float(subject.detach()))
            if not math.isfinite(subject_losses[-1]):
                raise FloatingPointError(f"subject loss became {subject_losses[-1]} at step {step}")
        if step % args.log_every == 0:
            subject_text = f", subject loss {np.mean(subject_losses[-args.log_every:]):.4f}" if subject_losses else ""
            print(f"step {step}: loss {np.mean(losses[-args.log_every:]):.4f}{subject_text} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            scores = evaluate(learner, validation)
            entry = {"step": step, "loss": float(np.mean(losses[-args.eval_every:])),
                     **({"subject_loss": float(np.mean(subject_losses[-args.eval_every:]))} if subject_losses else {}),
                     "seconds": round(time.perf_counter() - started, 1),
                     **{f"validation/{key}": round(value, 4) for key, value in scores.items()}}
            record["log"].append(entry)
            record["seconds"] = entry["seconds"]
            _write_checkpoint(learner, args.out, record)
            print(json.dumps(entry), flush=True)
            if args.stop_at is not None and scores.get("locate", 0.0) >= args.stop_at:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
