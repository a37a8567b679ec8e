"""Time and peak memory of one GRPO step on a VLM: mmrl's trainer with the vlm plugin against TRL's GRPOTrainer.

Both sides train the same saved checkpoint (a tiny or small random Qwen2-VL / Qwen2.5-VL built offline by
:mod:`mmrl.plugins.vlm.testing`) on the same synthetic coloured-shapes rows (mixed image sizes), with the same
processor (same min/max pixels), prompt text, batch (P prompts × G samples, one micro-batch of P·G, one optimizer
step per generation), max_new_tokens, sampling (temperature 1, no top-p/top-k), KL β (k3 against the disabled LoRA
adapter, or a reference copy under full fine-tuning), clip ε = 0.2, token-mean loss (TRL: ``loss_type="dapo"``),
AdamW with the same learning rate and gradient clipping, gradient checkpointing on or off on both, and the same
reward functions (mmrl's ``format`` and ``iou`` plus a digit-fraction reward that gives a random model non-zero
advantages), called on both sides through mmrl's implementation.

A step is everything: generation, rewards, advantages, log-prob forwards, backward, optimizer step. mmrl: one
``Trainer.training_step()``; TRL: the wall time between consecutive ``on_step_end`` callbacks (data loading,
generation and logging included). Time is reported as wall time and as the process's CPU time
(``time.process_time``), which machine load from other jobs barely affects (with one torch thread it is the work the
step does). Known differences that remain:

- Neither side runs an old-policy pass here: with one optimizer step per generation and μ = 1, TRL uses the detached
  current log-probs, and mmrl's learner needs no old log-probs either (the vlm rollout leaves them out and the core
  uses ``logp.detach()``: ratio 1, the same gradient). Both run
  generation, one no-grad reference pass (β > 0) and the training forward. (Before issue 8's change mmrl always ran
  the extra pass: about 14% of its step on the small model.)
- mmrl runs the frozen vision tower once per prompt and prefills each prompt once for its G samples
  (``cache_image_features``, ``share_prompt_prefill``); TRL encodes and prefills all P·G rows in every pass.
- Under ``--full`` mmrl keeps the vision tower frozen (``freeze_vision``); the benchmark freezes it on the TRL side
  too before training, so both optimise the same weights.
- TRL reads images from a ``datasets.Dataset`` (PNG-encoded, decoded per step); mmrl's rows hold PIL images.
- mmrl suppresses all vision placeholder tokens in sampling; TRL suppresses the image token only.
- TRL gets a processor whose tokenizer pads on the left by default (see ``run_trl``; it fails on mixed image sizes
  otherwise); mmrl passes the padding side explicitly.
- Log-probs: mmrl's chunked selective log-softmax with a recomputing backward; TRL its own path.

Each side runs in its own process (``--rounds`` alternating rounds, to spread machine-load drift over both), does
``--warmup`` untimed steps, then ``--steps`` timed steps; the table reports the median over all timed steps, and the
time ratios are medians of the per-round ratios (each round pairs an mmrl and a TRL process run back to back).
Peak memory:

- CUDA: ``torch.cuda.max_memory_allocated()`` over the timed steps, minus what was allocated before them;
- CPU: the high-water mark of bytes held by torch tensors allocated during one extra, untimed, profiled step (torch
  profiler memory events; allocator caches and Python objects are not counted), and the process's peak RSS
  (``ru_maxrss``: weights, libraries and everything else included).

TRL is a benchmark-only dependency (``pip install trl``); without it the comparison stops with a one-line error,
and ``--no-trl`` times mmrl's step alone (no TRL process, no ratios). ``--json`` writes ``settings`` (the arguments),
``trl_version``, ``mmrl`` and ``trl`` (each ``times`` and ``cpu_times`` in seconds, ``median_s``, ``median_cpu_s``,
``round_medians``, ``peak_bytes``, ``peak_rss``, ``completion_length``), ``round_ratios`` and ``round_cpu_ratios``;
under ``--no-trl`` the TRL entries are null. Examples::

    python benchmarks/vlm_grpo_step.py                       # CPU, tiny Qwen2.5-VL, LoRA, 4 prompts x G=4
    python benchmarks/vlm_grpo_step.py --size small --family qwen2_vl --full
    python benchmarks/vlm_grpo_step.py --device cuda --size small --json vlm_step.json
    # the smallest run (what tests/benchmarks/test_smoke.py does): one step of mmrl alone, 1 prompt x G=2, 4 tokens
    python benchmarks/vlm_grpo_step.py --no-trl --rounds 1 --warmup 0 --steps 1 --prompts 1 --group 2 \
        --max-new-tokens 4 --json vlm_step.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEMPLATE = ("{question} Output the thinking process in <think> </think> and final answer in <answer> </answer> "
            "tags.")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION_PATTERN = r".*(^|\.)visual(\.|$).*"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"], default="qwen2_5_vl",
                        help="qwen3_vl: mmrl alone (--no-trl), e.g. to time its deepstack feature cache.")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny", help="Model size (testing.SIZES).")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prompts", type=int, default=4, help="Prompts per step (P).")
    parser.add_argument("--group", type=int, default=4, help="Samples per prompt (G).")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0 skips the reference).")
    parser.add_argument("--full", action="store_true", help="Full fine-tuning instead of LoRA (r=8, alpha=16).")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--attn", choices=["eager", "sdpa"], default="sdpa")
    parser.add_argument("--max-pixels", type=int, default=16 * 28 * 28)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="Timed steps per round.")
    parser.add_argument("--rounds", type=int, default=2, help="Alternating (mmrl, TRL) process pairs.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU).")
    parser.add_argument("--no-feature-cache", action="store_true",
                        help="mmrl: re-run the frozen vision tower in every pass (plugin.cache_image_features false).")
    parser.add_argument("--no-shared-prompt-forward", action="store_true",
                        help="mmrl: run the whole prompt + completion sequence of every sample in the teacher-forced "
                        "passes (plugin.share_prompt_forward false) instead of each distinct prompt once.")
    parser.add_argument("--decoder", choices=["mmrl", "hf"], default="mmrl",
                        help="mmrl: the rollout's decode loop (plugin.decoder): the plugin's own or HF generate.")
    parser.add_argument("--no-trl", action="store_true",
                        help="Time mmrl's step alone: no TRL process (TRL need not be installed) and no ratios.")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    parser.add_argument("--side", choices=["mmrl", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- shared parts


def digit_fraction(batch: Any) -> list[float]:
    """Fraction of digit characters: a reward with spread on a random model's text (format and iou are ~0)."""
    from mmrl.rewards.boxes import completion_texts

    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completion_texts(batch, "completions")]


def reward_functions(family: str) -> list[tuple[str, Any]]:
    from mmrl.rewards.perception import iou
    from mmrl.rewards.reasoning import format_reward

    return [("format", format_reward), ("iou", lambda batch: iou(batch, convention=family)),
            ("digits", digit_fraction)]


def dataset_rows(args: argparse.Namespace, adapter: Any) -> list[dict[str, Any]]:
    """The synthetic rows both sides train on (the plugin's own synthetic data with the same seed)."""
    from mmrl.plugins.vlm.data import attach_sizes, make_shapes

    rows = make_shapes(64, seed=0, tasks=["grounding"], min_side=56, max_side=160)
    return attach_sizes(rows, adapter.resized_size)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def tensor_peak(events: Any) -> int:
    """High-water mark of bytes held by torch tensors allocated while a profiler recorded ``events``.

    Each operator's own allocations net of its own frees (``self_cpu_memory_usage``) and the frees recorded outside
    operators (``[memory]`` events, negative) are summed in time order.
    """
    changes = []
    for event in events:
        amount = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if amount:
            changes.append((event.time_range.start, amount))
    live = peak = 0
    for _, amount in sorted(changes, key=lambda change: change[0]):
        live += amount
        peak = max(peak, live)
    return int(peak)


def profiled_peak(run_step: Any) -> int:
    """:func:`tensor_peak` of one call of ``run_step()`` (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run_step()
    return tensor_peak(profiler.events())


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------- mmrl side


def run_mmrl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mmrl.config import load_config
    from mmrl.reward import reward_functions as registry
    from mmrl.trainer import Trainer

    for name, function in reward_functions(args.family):
        registry.register(f"bench_{name}", function)
    # Scratch folders are TemporaryDirectory objects: removed when dropped or at exit, even after an error.
    scratch = tempfile.TemporaryDirectory(prefix="mmrl-bench-")
    output = scratch.name
    samples = args.prompts * args.group
    config = load_config({
        "plugin": {
            "name": "vlm", "model": args.model, "family": args.family, "attn_implementation": args.attn,
            "min_pixels": 4 * 28 * 28, "max_pixels": args.max_pixels, "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0, "lora": None if args.full else {"rank": 8, "alpha": 16.0},
            "dtype": "bfloat16" if args.device == "cuda" and not args.full else "auto",
            "freeze_vision": True, "gradient_checkpointing": args.gradient_checkpointing,
            "cache_image_features": not args.no_feature_cache,
            "share_prompt_forward": not args.no_shared_prompt_forward, "decoder": args.decoder,
            "prompt_template": TEMPLATE,
            # The trainer refuses an empty eval split; the benchmark never evaluates, and make_shapes draws its rows
            # in order, so the 64 training rows are the ones TRL trains on (dataset_rows) whatever eval_size is.
            "data": {"synthetic": {"train_size": 64, "eval_size": 4, "tasks": ["grounding"], "seed": 0}},
        },
        "run": {"output_dir": output, "max_steps": 10_000, "seed": 0, "progress": False,
                "cpu": args.device == "cpu", "mixed_precision": "bf16" if args.device == "cuda" else "no"},
        "rollout": {"prompts_per_step": args.prompts, "group_size": args.group},
        "algorithm": {"micro_batch_size": samples, "kl_coef": args.beta, "aggregation": "token_mean",
                      "policy_loss": {"name": "grpo", "clip_low": 0.2, "clip_high": 0.2}},
        "optim": {"lr": args.lr, "max_grad_norm": 1.0},
        "rewards": {"functions": [{"name": f"bench_{name}"} for name, _ in reward_functions(args.family)]},
        "eval": {"at_start": False},
    })
    trainer = Trainer(config)

    def step() -> dict[str, float]:
        metrics = trainer.training_step()
        trainer.step += 1
        return metrics

    for _ in range(args.warmup):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, cpu_times, lengths = [], [], []
    for _ in range(args.steps):
        synchronize(args.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics = step()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        lengths.append(metrics.get("rollout/completion_length", float("nan")))
    result: dict[str, Any] = {"times": times, "cpu_times": cpu_times, "completion_length": statistics.mean(lengths)}
    if args.device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - before
    else:
        result["peak_bytes"] = profiled_peak(step)
    result["peak_rss"] = peak_rss_bytes()
    return result


# ---------------------------------------------------------------------------------------------------- TRL side


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.reward import RewardInput

    adapter = adapter_for(args.family, args.model)(args.model, min_pixels=4 * 28 * 28, max_pixels=args.max_pixels)
    # TRL tokenizes prompts left-padded but builds mm_token_type_ids from a second processor call that pads on the
    # tokenizer's default side; with right padding and prompts of different lengths (mixed image sizes) its M-RoPE
    # index fails ("shape mismatch" in get_rope_index). Left padding by default avoids it.
    adapter.processor.tokenizer.padding_side = "left"
    rows = dataset_rows(args, adapter)
    dataset = Dataset.from_list([{
        "prompt": [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": TEMPLATE.format(question=row["prompt"])}]}],
        "image": row["image"], "solution": row["solution"], "image_size": row["image_size"],
        "resized_size": row["resized_size"],
    } for row in rows])

    def trl_reward(function: Any, name: str) -> Any:
        def reward(completions: list[Any], solution: list[Any], image_size: list[Any], resized_size: list[Any],
                   **_: Any) -> list[float]:
            batch = RewardInput(rows=[{"solution": s, "image_size": i, "resized_size": r}
                                      for s, i, r in zip(solution, image_size, resized_size, strict=True)],
                                payload={"completions": completions})
            return [float(v) for v in function(batch)]

        reward.__name__ = name
        return reward

    samples = args.prompts * args.group
    dtype = torch.bfloat16 if args.device == "cuda" and not args.full else torch.float32
    scratch = tempfile.TemporaryDirectory(prefix="trl-bench-")
    config = GRPOConfig(
        output_dir=scratch.name, per_device_train_batch_size=samples,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=args.group,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        beta=args.beta, epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group",
        learning_rate=args.lr, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_steps=args.warmup + args.steps + (0 if args.device == "cuda" else 1), logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=args.device == "cpu", bf16=args.device == "cuda",
        gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        log_completions=False, model_init_kwargs={"attn_implementation": args.attn, "dtype": dtype},
    )
    peft_config = None if args.full else LoraConfig(r=8, lora_alpha=16.0, lora_dropout=0.0,
                                                    target_modules=LORA_TARGETS, exclude_modules=VISION_PATTERN)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.cpu_marks: list[float] = []
            self.profiler: Any = None
            self.peak = 0
            self.before = 0

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            synchronize(args.device)
            self.marks.append(time.perf_counter())
            self.cpu_marks.append(time.process_time())

        def on_step_begin(self, _args: Any, state: Any, *__: Any, **___: Any) -> None:
            if args.device == "cpu" and state.global_step == args.warmup + args.steps:  # the extra, profiled step
                from torch.profiler import ProfilerActivity, profile

                self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.profiler.__enter__()

        def on_step_end(self, _args: Any, state: Any, *__: Any, **___: Any) -> None:
            synchronize(args.device)
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                self.peak = tensor_peak(self.profiler.events())
                self.profiler = None
                return
            self.marks.append(time.perf_counter())
            self.cpu_marks.append(time.process_time())
            if args.device == "cuda" and state.global_step == args.warmup:
                self.before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

    clock = Clock()
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=[trl_reward(f, n) for n, f in reward_functions(args.family)], args=config,
        train_dataset=dataset, processing_class=adapter.processor, peft_config=peft_config, callbacks=[clock],
    )
    if args.full:  # as mmrl's freeze_vision: TRL has no switch, but builds its optimizer from requires_grad in train()
        adapter.vision_tower(trainer.model).requires_grad_(False)
    trainer.train()
    intervals = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    cpu_intervals = [b - a for a, b in zip(clock.cpu_marks, clock.cpu_marks[1:], strict=False)]
    lengths = [record["completions/mean_length"] for record in trainer.state.log_history
               if "completions/mean_length" in record]
    result: dict[str, Any] = {"times": intervals[args.warmup:args.warmup + args.steps],
                              "cpu_times": cpu_intervals[args.warmup:args.warmup + args.steps],
                              "completion_length": statistics.mean(lengths[args.warmup:]) if lengths else float("nan")}
    if args.device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - clock.before
    else:
        result["peak_bytes"] = clock.peak
    result["peak_rss"] = peak_rss_bytes()
    return result


# ---------------------------------------------------------------------------------------------------- driver


def run_side(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = run_mmrl(args) if args.side == "mmrl" else run_trl(args)
    Path(args.out).write_text(json.dumps(result))
    return 0


def table(results: dict[str, Any]) -> str:
    settings = results["settings"]
    memory = ("CUDA max_memory_allocated above the weights" if settings["device"] == "cuda"
              else "peak live torch tensors during one step (profiler)")
    header = ("| framework | step time (wall) | step time (CPU) | steps timed | mean completion length | peak memory "
              "| peak RSS |\n|---|---|---|---|---|---|---|")
    lines = [header]
    for side, name in (("mmrl", "mmrl (vlm plugin)"), ("trl", f"TRL {results['trl_version']} GRPOTrainer")):
        data = results[side]
        if data is None:  # --no-trl
            continue
        rss = f"{data['peak_rss'] / 2**20:.0f} MiB" if data.get("peak_rss") else "-"
        lines.append(f"| {name} | {data['median_s']:.3f} s | {data['median_cpu_s']:.3f} s | {len(data['times'])} "
                     f"| {data['completion_length']:.1f} | {data['peak_bytes'] / 2**20:.1f} MiB | {rss} |")
    mode = "full fine-tuning" if settings["full"] else "LoRA r=8"
    if settings.get("no_feature_cache"):
        mode += ", mmrl without the image-feature cache"
    if settings.get("no_shared_prompt_forward"):
        mode += ", mmrl without the shared prompt forward"
    if settings.get("decoder", "mmrl") != "mmrl":
        mode += f", mmrl decoding with {settings['decoder']}"
    summary = (f"\n\n{settings['size']} {settings['family']}, {mode}, {settings['prompts']} prompts x "
               f"G={settings['group']}, max_new_tokens {settings['max_new_tokens']}, beta {settings['beta']}, "
               f"{settings['attn']} attention, {settings['device']}, {settings['threads']} thread(s). ")
    if results["trl"] is None:
        summary += "mmrl alone (--no-trl): no TRL comparison. "
    else:
        ratio_time = statistics.median(results["round_ratios"])  # paired by round: robust to load drift
        ratio_cpu = statistics.median(results["round_cpu_ratios"])
        ratio_memory = results["mmrl"]["peak_bytes"] / max(results["trl"]["peak_bytes"], 1)
        summary += (f"mmrl / TRL (medians of the per-round ratios): CPU time x{ratio_cpu:.2f} "
                    f"({', '.join(f'{r:.2f}' for r in results['round_cpu_ratios'])}), wall time x{ratio_time:.2f} "
                    f"({', '.join(f'{r:.2f}' for r in results['round_ratios'])}), peak memory x{ratio_memory:.2f}. ")
    return "\n".join(lines) + summary + f"Memory column: {memory}."


def trl_version(args: argparse.Namespace) -> str | None:
    """The installed TRL's version, None under ``--no-trl``; a missing TRL is a one-line error naming the ways out."""
    if args.no_trl:
        return None
    try:
        import trl
    except ImportError:
        raise SystemExit("benchmarks/vlm_grpo_step.py: TRL is not installed, and the comparison runs its GRPOTrainer: "
                         "pip install trl, or pass --no-trl to time mmrl's step alone") from None
    return str(trl.__version__)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side is not None:
        return run_side(args)
    version = trl_version(args)

    from mmrl.plugins.vlm.testing import build_tiny_model

    scratch = tempfile.TemporaryDirectory(prefix="vlm-bench-")  # the model and the sides' results
    folder = Path(scratch.name)
    model = build_tiny_model(args.family, folder / f"{args.size}-{args.family}", size=args.size)
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--json")]
    if args.json:  # drop "--json PATH" as well
        passthrough = [a for a in passthrough if a != args.json]
    sides = ("mmrl",) if args.no_trl else ("mmrl", "trl")
    collected: dict[str, dict[str, Any]] = {
        side: {"times": [], "cpu_times": [], "peak_bytes": 0, "peak_rss": 0, "lengths": []} for side in sides
    }
    for round_index in range(args.rounds):
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            out = folder / f"{side}-{round_index}.json"
            command = [sys.executable, str(Path(__file__).resolve()), *passthrough, "--side", side,
                       "--model", str(model), "--out", str(out)]
            subprocess.run(command, check=True, cwd=str(ROOT))
            data = json.loads(out.read_text())
            target = collected[side]
            target["times"] += data["times"]
            target["cpu_times"] += data["cpu_times"]
            target["peak_bytes"] = max(target["peak_bytes"], data["peak_bytes"])
            target["peak_rss"] = max(target["peak_rss"], data["peak_rss"])
            target["lengths"].append(data["completion_length"])
            target.setdefault("round_medians", []).append(statistics.median(data["times"]))
            target.setdefault("round_cpu_medians", []).append(statistics.median(data["cpu_times"]))
            print(f"round {round_index} {side}: median {statistics.median(data['times']):.3f} s wall, "
                  f"{statistics.median(data['cpu_times']):.3f} s CPU", flush=True)
    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("side", "model", "out")},
                               "trl_version": version, "trl": None, "round_ratios": None, "round_cpu_ratios": None}
    for side, data in collected.items():
        results[side] = {"times": data["times"], "median_s": statistics.median(data["times"]),
                         "cpu_times": data["cpu_times"], "median_cpu_s": statistics.median(data["cpu_times"]),
                         "round_medians": data["round_medians"], "peak_bytes": data["peak_bytes"],
                         "peak_rss": data["peak_rss"], "completion_length": statistics.mean(data["lengths"])}
    if "trl" in collected:
        for key, source in (("round_ratios", "round_medians"), ("round_cpu_ratios", "round_cpu_medians")):
            results[key] = [m / t for m, t in zip(collected["mmrl"][source], collected["trl"][source], strict=True)]
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
