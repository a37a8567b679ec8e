"""Cost of a flow-plugin rollout (SDE sampling with log-probs and stored trajectories) against the plain diffusers
pipeline sampling the same model with the same steps, batch and decode.

Both sides run the very same modules: the plugin's pipeline object, its transformer with the (zero-initialised)
LoRA adapter injected, its VAE. Prompt embeddings are computed once and handed to both (the plugin caches them; the
pipeline gets ``prompt_embeds=``), so text encoding is outside the timed region on both sides. Each side decodes
the final latents with the VAE to float images (``output_type="pt"``).

Time: ``--warmup`` calls of each side, then ``--repeats`` back-to-back pairs (pipeline, rollout), CUDA synchronised;
the table gives the median time of each side and the median of the per-pair ratios (robust to machine load that
drifts during the run). Peak memory:

- CUDA: ``torch.cuda.max_memory_allocated()`` during the call, minus what was allocated before it (the weights);
- CPU: the high-water mark of bytes held by torch tensors allocated during the call, from the torch profiler's
  memory events (one extra, untimed call per side), so allocator caching and Python objects are not counted.

``--json`` also writes the settings (``kind``, ``size``, ``device``, ``dtype``, ``batch``, ``steps``, ``height``,
``width``, ``frames`` (1 for image models), ``cfg``, ``threads``), ``transformer_parameters``, ``trained_steps``,
the median times ``pipeline_seconds`` and ``rollout_seconds``, ``time_ratio`` (median of the per-pair ratios),
``time_ratio_of_fastest`` and the peaks ``pipeline_peak_bytes`` and ``rollout_peak_bytes``.

``--kind`` takes several kinds: they run one after the other in the same process (one import of torch and diffusers,
one thread setting), each with its own pipeline built and dropped in turn, and the table has a row per kind. The
JSON of one kind is that kind's dict (as above); of several kinds, a list of those dicts in the order given.
Examples::

    # CPU, tiny random SD3 (what docs/performance.md reports; --kind flux, qwen_image, flux2, flux2_klein, wan or
    # z_image for the others)
    python benchmarks/flow_rollout.py
    # several kinds in one run: one table, a JSON list of one dict per kind
    python benchmarks/flow_rollout.py --kind sd3 flux qwen_image flux2 --threads 1 --json rollout.json
    # GPU, SD3.5-Medium-sized transformer and VAE with random weights, bf16, 512 px, 10 steps, CFG 4.5
    python benchmarks/flow_rollout.py --device cuda --size sd35-medium
    # Wan2.1's native 480p frames (height 480, width 832) on the tiny Wan: --kind wan --height 480 --width 832
    # the smallest run: one image, 2 steps, one timed pair
    python benchmarks/flow_rollout.py --device cpu --batch 1 --steps 2 --warmup 0 --repeats 1 --threads 1 \
        --json rollout.json
    # what tests/benchmarks/test_smoke.py does: the smallest run of every kind, in one process, at 32 x 64 px
    python benchmarks/flow_rollout.py --kind sd3 flux qwen_image flux2 flux2_klein wan z_image flux_kontext wan_i2v \
        --device cpu --batch 1 --steps 2 --height 32 --width 64 --warmup 0 --repeats 1 --threads 1 --json rollout.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("sd3", "flux", "qwen_image", "flux2", "flux2_klein", "wan", "z_image", "flux_kontext", "wan_i2v")
VIDEO_KINDS = ("wan", "wan_i2v")
PROMPTS = ["a photo of a cat", "a red car on a street", "a painting of a house", "a dog in the snow"]
IMAGE_KINDS = ("flux_kontext", "wan_i2v")
"""Image-conditioned kinds: every row names one input image (a random RGB PNG at the run's size); the pipeline gets
the same image (``image=``) and encodes it on every call, where the plugin encodes it once and caches it."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", nargs="+", choices=KINDS, default=["sd3"], metavar="KIND",
                        help=f"Model family, one or more of {', '.join(KINDS)} (their tiny pipelines from "
                        "mmrl.plugins.flow.testing); several run one after the other in this process, each with the "
                        "same settings.")
    parser.add_argument("--size", choices=["tiny", "sd35-medium"], default="tiny",
                        help="tiny: the test pipelines; sd35-medium: SD3.5-Medium's transformer and VAE (random).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="Weights and autocast dtype (default: bf16 on CUDA, fp32 on CPU).")
    parser.add_argument("--batch", type=int, default=8, help="Images per call.")
    parser.add_argument("--steps", type=int, default=10, help="Denoising steps (Flow-GRPO rollouts: 10).")
    parser.add_argument("--resolution", type=int, default=None,
                        help="Height and width in pixels where --height/--width are not given (default: 64 tiny, "
                        "512 sd35-medium).")
    parser.add_argument("--height", type=int, default=None, help="Image (frame) height in pixels (plugin.height).")
    parser.add_argument("--width", type=int, default=None, help="Image (frame) width in pixels (plugin.width).")
    parser.add_argument("--frames", type=int, default=None,
                        help="Frames per video of --kind wan or wan_i2v (default: 5, the tiny Wan's 3 latent frames).")
    parser.add_argument("--cfg", choices=["on", "off"], default=None, help="True CFG (default: the adapter's).")
    parser.add_argument("--lora-rank", type=int, default=32, help="Rank of the (zero-initialised) LoRA adapter.")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    parser.add_argument("--json", type=Path, default=None,
                        help="Also write the results here: one kind's dict, or a list of dicts for several kinds.")
    args = parser.parse_args(argv)
    repeated = sorted({kind for kind in args.kind if args.kind.count(kind) > 1})
    if repeated:
        parser.error(f"--kind names {', '.join(repeated)} more than once; give each kind once")
    others = [kind for kind in args.kind if kind not in VIDEO_KINDS]
    if args.frames is not None and others:
        parser.error(f"--frames is for --kind wan or wan_i2v, not {', '.join(others)}")
    return args


def build_plugin(args: argparse.Namespace, folder: Path, dataset: Path | None = None) -> Any:
    from mmrl.config import from_dict
    from mmrl.plugin import Runtime
    from mmrl.plugins.flow.plugin import FlowPlugin, FlowPluginConfig
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    precision = {torch.float32: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    if args.size == "sd35-medium" and device.type == "cuda":
        with torch.device(device):  # random init of 2.2B parameters is much faster on the GPU
            save_tiny_pipeline(args.kind, folder, size=args.size, dtype=None if dtype == torch.float32 else dtype)
    else:
        save_tiny_pipeline(args.kind, folder, size=args.size, dtype=None if dtype == torch.float32 else dtype)
    options = {
        "model": str(folder), "prompts": PROMPTS, "height": args.height, "width": args.width, "num_steps": args.steps,
        "lora": {"rank": args.lora_rank, "alpha": 2 * args.lora_rank}, "timestep_fraction": 0.99,
        # Tiny FLUX.2 pads after a 33-token system turn: 48 leaves the prompt its tokens (FLUX.2 [klein]'s Qwen3
        # template about 20 of 32).
        "max_sequence_length": {"flux2": 48, "flux2_klein": 32}.get(args.kind, 16) if args.size == "tiny" else 256,
    }
    if args.kind in VIDEO_KINDS:
        options["num_frames"] = args.frames
    if dataset is not None:  # image-conditioned kinds: rows with an input image come from a JSONL file
        options.update(prompts=None, dataset=str(dataset))
    if args.cfg is not None:
        options["cfg"] = args.cfg == "on"
    config = from_dict(FlowPluginConfig, options, "plugin")
    runtime = Runtime(device=device, mixed_precision=precision, autocast=autocast)
    return FlowPlugin(config, runtime)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(call: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def peak_bytes(call: Callable[[], Any], device: torch.device) -> int:
    """Extra memory a call needs at its peak (module docstring)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    changes = []
    for event in profiler.events():
        amount = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if amount:
            changes.append((event.time_range.start, amount))
    live = peak = 0
    for _, amount in sorted(changes):
        live += amount
        peak = max(peak, live)
    return peak


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one kind: ``args.kind`` is a single kind here (``main`` runs each of ``--kind`` in turn)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bf16" if str(args.device).startswith("cuda") else "fp32")
    args.resolution = args.resolution or (64 if args.size == "tiny" else 512)
    args.height, args.width = args.height or args.resolution, args.width or args.resolution
    if args.kind in VIDEO_KINDS:
        from mmrl.plugins.flow.testing import TINY_WAN_FRAMES

        args.frames = args.frames or TINY_WAN_FRAMES
    elif args.frames is not None:
        raise SystemExit(f"--frames is for --kind wan or wan_i2v, not {args.kind}")
    with tempfile.TemporaryDirectory(prefix="flow-bench-inputs-") as inputs:
        return _run(args, Path(inputs))


def _run(args: argparse.Namespace, inputs: Path) -> dict[str, Any]:
    from mmrl.plugin import PromptBatch

    device = torch.device(args.device)
    image, dataset = None, None
    if args.kind in IMAGE_KINDS:
        from PIL import Image

        pixels = torch.rand(args.height, args.width, 3, generator=torch.Generator().manual_seed(0))
        image = Image.fromarray((pixels * 255).round().to(torch.uint8).numpy())
        image.save(inputs / "input.png")
        dataset = inputs / "rows.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": prompt, "image": "input.png"}) + "\n" for prompt in PROMPTS))
    with tempfile.TemporaryDirectory(prefix="flow-bench-") as folder:
        plugin = build_plugin(args, Path(folder) / "pipeline", dataset)
    policy = plugin.policy().eval()
    pipeline = plugin.adapter.pipeline
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(args.batch)]
    extra_row = {} if image is None else {"image": str(inputs / "input.png")}
    batch = PromptBatch(
        rows=[{"prompt": prompt, **extra_row} for prompt in prompts],
        group_ids=torch.zeros(args.batch, dtype=torch.long), group_size=args.batch, seeds=torch.arange(args.batch),
        generator=torch.Generator(), training=True,
    )
    # The adapters' conditioning keys are the pipelines' own keyword arguments (prompt_embeds and
    # pooled_prompt_embeds or prompt_embeds_mask), and the negative ones the same names with "negative_" in front.
    embeds = dict(plugin.sampler.conditioning(prompts))
    if plugin.cfg:
        for key, value in plugin.sampler.negative_conditioning().items():
            embeds[f"negative_{key}"] = value.expand(args.batch, *value.shape[1:])
    kwargs: dict[str, Any] = {"guidance_scale": plugin.guidance_scale}
    if args.kind in ("sd3", "wan", "wan_i2v") and not plugin.cfg:
        kwargs["guidance_scale"] = 1.0  # the SD3 and Wan pipelines run CFG whenever guidance_scale > 1
    if args.kind in VIDEO_KINDS:
        from mmrl.plugins.flow.adapters.wan import euler_scheduler_for

        # The same sampler on both sides: Wan ships UniPC; the adapter samples with the flow-shifted Euler scheduler.
        pipeline.scheduler = euler_scheduler_for(pipeline.scheduler)
        kwargs["num_frames"] = args.frames
    if args.kind == "flux_kontext":  # the input image at the run's size, the output at height × width
        kwargs.update(image=image, _auto_resize=False, max_area=args.height * args.width)
    if args.kind == "wan_i2v":
        kwargs["image"] = image
    if args.kind == "qwen_image":  # true CFG runs when true_cfg_scale > 1 and negative embeddings are given
        kwargs = {"true_cfg_scale": plugin.guidance_scale if plugin.cfg else 1.0}
    if args.kind == "z_image":  # ragged captions (each prompt's real tokens), CFG whenever guidance_scale > 0
        for key in [key for key in embeds if key.endswith("prompt_embeds")]:
            mask = embeds.pop(key + "_mask").bool()
            embeds[key] = [row[keep] for row, keep in zip(embeds[key], mask, strict=True)]
        kwargs["guidance_scale"] = plugin.guidance_scale if plugin.cfg else 0.0

    def plugin_rollout() -> Any:
        with torch.no_grad():
            return plugin.rollout(policy, batch)

    def plain_pipeline() -> Any:
        generators = [torch.Generator().manual_seed(k) for k in range(args.batch)]
        with torch.no_grad(), plugin.runtime.autocast():
            return pipeline(prompt_embeds=embeds["prompt_embeds"], **{k: v for k, v in embeds.items()
                                                                      if k != "prompt_embeds"},
                            height=args.height, width=args.width, num_inference_steps=args.steps,
                            generator=generators, output_type="pt", **kwargs)[0]  # images, or Wan's frames

    results: dict[str, Any] = {
        "kind": args.kind, "size": args.size, "device": str(device), "dtype": args.dtype, "batch": args.batch,
        "steps": args.steps, "height": args.height, "width": args.width, "frames": args.frames or 1, "cfg": plugin.cfg,
        "threads": torch.get_num_threads(),
        "transformer_parameters": sum(p.numel() for p in policy.parameters()),
        "trained_steps": plugin.max_actions(),
    }
    pipeline_times, rollout_times = [], []
    for _ in range(args.warmup):
        plain_pipeline()
        plugin_rollout()
    for _ in range(args.repeats):  # interleaved, so that a change of machine load hits both sides
        pipeline_times.append(seconds(plain_pipeline, device))
        rollout_times.append(seconds(plugin_rollout, device))
    results["pipeline_seconds"] = statistics.median(pipeline_times)
    results["rollout_seconds"] = statistics.median(rollout_times)
    # The median of the ratios of back-to-back calls: robust to load that drifts during the run.
    results["time_ratio"] = statistics.median(r / p for r, p in zip(rollout_times, pipeline_times, strict=True))
    results["time_ratio_of_fastest"] = min(rollout_times) / min(pipeline_times)
    results["pipeline_peak_bytes"] = peak_bytes(plain_pipeline, device)
    results["rollout_peak_bytes"] = peak_bytes(plugin_rollout, device)
    return results


def table(rows: list[dict[str, Any]]) -> str:
    """The results of each kind run, a row each."""
    memory = "CUDA max_memory_allocated above the weights" if rows[0]["device"].startswith("cuda") \
        else "peak live torch tensors (profiler)"
    header = ("| model | device | dtype | batch x steps | height x width | frames | CFG | plain pipeline "
              f"| rollout with log-probs | time ratio | peak memory, pipeline | peak memory, rollout |\n|{'---|' * 12}")
    return "\n".join([header, *map(table_row, rows)]) + f"\n\nMemory: {memory}."


def table_row(results: dict[str, Any]) -> str:
    mib = 2**20
    return (f"| {results['kind']} {results['size']} | {results['device']} ({results['threads']} threads) | "
           f"{results['dtype']} | {results['batch']} x {results['steps']} | "
           f"{results['height']} x {results['width']} px | "
           f"{results['frames']} | "
           f"{'on' if results['cfg'] else 'off'} | {results['pipeline_seconds']:.3f} s | "
           f"{results['rollout_seconds']:.3f} s | {results['time_ratio']:.3f} | "
           f"{results['pipeline_peak_bytes'] / mib:.1f} MiB | {results['rollout_peak_bytes'] / mib:.1f} MiB |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for kind in args.kind:
        rows.append(run(argparse.Namespace(**{**vars(args), "kind": kind})))
        if len(args.kind) > 1:  # progress: a long run shows each kind as it finishes
            print(table_row(rows[-1]), flush=True)
    print(table(rows))
    if args.json:  # one kind: its dict, as before several kinds could be given; several: the list
        args.json.write_text(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
