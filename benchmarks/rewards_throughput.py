"""Reward throughput at tiny sizes, and asynchronous against synchronous scoring in a rollout-plus-reward loop.

1. Throughput: images per second of every image reward on a batch of random images, with the tiny random models
   the tests use (saved to a temporary folder and loaded through the rewards' own loading code; nothing is
   downloaded). ``remote`` scores ``jpeg_incompressibility`` through a localhost ``RewardServer`` (PNG + JSON +
   HTTP overhead included). The median of ``--repeats`` timed calls after one warm-up call.

2. Async vs sync: ``--chunks`` rollout chunks, each followed by scoring with clip_score + jpeg_compressibility
   (by default each simulated rollout lasts as long as scoring one chunk, so overlapping can at best halve the
   time).
   Synchronous: rollout, score, rollout, score, ...; asynchronous: ``RewardScorer.submit`` after each rollout and
   the results collected at the end, so scoring chunk k overlaps rollout k+1. Two simulated rollouts: ``sleep``
   (the host waits, as for GPU sampling) and ``compute`` (CPU matrix products, competing with the reward for the
   same cores). The scores of both schedules are checked to be identical.

Prints markdown tables; ``--json`` also writes ``settings`` (the arguments and torch's thread count),
``throughput`` (per reward: ``reward``, ``seconds_per_batch``, ``images_per_second``) and ``async_vs_sync`` (per
simulated rollout: ``rollout``, ``rollout_seconds``, ``reward_seconds``, ``sync_seconds``, ``async_seconds``,
``speedup``). Examples::

    python benchmarks/rewards_throughput.py            # CPU; what docs/rewards.md reports
    # the smallest run (what tests/benchmarks/test_smoke.py does): 2 images of 32 px, one timed call, one chunk
    python benchmarks/rewards_throughput.py --batch 2 --resolution 32 --repeats 1 --chunks 1 --workers 1 \
        --rollout-seconds 0 --threads 1 --json rewards.json
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

PROMPTS = ["a photo of a cat", "a red car on a street", "a painting of a house", "a dog in the snow"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="Images per reward call.")
    parser.add_argument("--resolution", type=int, default=64, help="Image side in pixels.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per reward.")
    parser.add_argument("--chunks", type=int, default=6, help="Rollout chunks in the async-vs-sync loop.")
    parser.add_argument("--rollout-seconds", type=float, default=None,
                        help="Duration of one simulated rollout (default: the measured scoring time of one chunk, "
                        "where overlapping can at best halve the loop's time).")
    parser.add_argument("--workers", type=int, default=2, help="num_workers of the asynchronous scorer.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    return parser.parse_args(argv)


def make_batch(n: int, resolution: int, seed: int = 0) -> Any:
    from mmrl.reward import RewardInput

    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, resolution, resolution, generator=generator)
    rows = [{"prompt": PROMPTS[i % len(PROMPTS)]} for i in range(n)]
    return RewardInput(rows=rows, payload={"images": images}, group_ids=torch.arange(n) // 4)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def build_rewards(folder: Path) -> dict[str, Any]:
    from mmrl.reward import build_reward
    from tests.rewards.conftest import save_tiny_open_clip, save_tiny_pickscore

    config, weights, _, hps, mlp = save_tiny_open_clip(folder)
    pickscore = save_tiny_pickscore(folder / "pickscore")
    specs = {
        "clip_score": {"model": config, "pretrained": weights},
        "pickscore": {"model": pickscore, "processor": pickscore},
        "hpsv2": {"model": config, "checkpoint": hps},
        "aesthetic": {"model": config, "pretrained": weights, "mlp_weights": mlp},
        "jpeg_compressibility": {},
        "jpeg_incompressibility": {},
        "pref_winrate": {"judge_args": {"reward": "jpeg_incompressibility"}},
    }
    return {name: build_reward(name, args) for name, args in specs.items()}


def throughput(rewards: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, float, float]]:
    from mmrl.reward import RewardScorer
    from mmrl.rewards.remote import RemoteReward
    from mmrl.rewards.server import RewardServer

    batch = make_batch(args.batch, args.resolution)
    results = []
    for name, reward in rewards.items():
        scorer = RewardScorer([name], [reward], [1.0])  # group-wise rewards are called per group, as in training
        seconds = median_seconds(lambda scorer=scorer: scorer.score(batch), args.repeats)
        results.append((name, seconds, args.batch / seconds))
    server = RewardServer({"jpeg_incompressibility": rewards["jpeg_incompressibility"]}, port=0).start()
    try:
        remote = RewardScorer(["remote"], [RemoteReward(url=server.url)], [1.0])
        seconds = median_seconds(lambda: remote.score(batch), args.repeats)
        results.append(("remote (jpeg_incompressibility over localhost HTTP)", seconds, args.batch / seconds))
    finally:
        server.close()
    return results


def simulated_rollout(kind: str, seconds: float, index: int, args: argparse.Namespace) -> Any:
    if kind == "sleep":
        time.sleep(seconds)
    else:
        a = torch.randn(256, 256)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            a = torch.tanh(a @ a.T / 16)
    return make_batch(args.batch, args.resolution, seed=1000 + index)


def async_vs_sync(rewards: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    from mmrl.reward import RewardScorer, ScoredBatch

    names = ["clip_score", "jpeg_compressibility"]
    functions = [rewards[name] for name in names]
    reward_seconds = median_seconds(lambda: RewardScorer(names, functions, [1.0, 1.0]).score(
        make_batch(args.batch, args.resolution)), args.repeats)
    rollout_seconds = args.rollout_seconds if args.rollout_seconds is not None else reward_seconds
    rows = []
    for kind in ("sleep", "compute"):
        sync_scorer = RewardScorer(names, functions, [1.0, 1.0])
        started = time.perf_counter()
        sync_parts = []
        for k in range(args.chunks):
            batch = simulated_rollout(kind, rollout_seconds, k, args)
            sync_parts.append(sync_scorer.score(batch))
        sync_time = time.perf_counter() - started

        with RewardScorer(names, functions, [1.0, 1.0], num_workers=args.workers) as async_scorer:
            started = time.perf_counter()
            futures = []
            for k in range(args.chunks):
                batch = simulated_rollout(kind, rollout_seconds, k, args)
                futures.append(async_scorer.submit(batch))
            async_parts = [future.result() for future in futures]
            async_time = time.perf_counter() - started
        same = torch.equal(ScoredBatch.concat(sync_parts).scores, ScoredBatch.concat(async_parts).scores)
        if not same:
            raise SystemExit("asynchronous scores differ from synchronous scores")
        rows.append((kind, rollout_seconds, reward_seconds, sync_time, async_time))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        rewards = build_rewards(Path(folder))
        rates = throughput(rewards, args)
        loops = async_vs_sync(rewards, args)
    print(f"### Reward throughput (CPU, torch threads: {torch.get_num_threads()}, batch {args.batch}, "
          f"{args.resolution}×{args.resolution} images, tiny random models)\n")
    print("| reward | s / batch | images / s |")
    print("|---|---:|---:|")
    for name, seconds, rate in rates:
        print(f"| {name} | {seconds:.4f} | {rate:,.0f} |")
    print(f"\n### Async vs sync scoring ({args.chunks} chunks of {args.batch} images, rewards clip_score + "
          f"jpeg_compressibility, {args.workers} workers)\n")
    print("| rollout | rollout s / chunk | reward s / chunk | sync s | async s | speed-up | scores identical |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for kind, rollout_seconds, reward_seconds, sync_time, async_time in loops:
        print(f"| {kind} | {rollout_seconds:.3f} | {reward_seconds:.3f} | {sync_time:.2f} | {async_time:.2f} | "
              f"{sync_time / async_time:.2f}× | yes |")
    if args.json:
        results = {
            "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                         "torch_threads": torch.get_num_threads()},
            "throughput": [{"reward": name, "seconds_per_batch": seconds, "images_per_second": rate}
                           for name, seconds, rate in rates],
            # async_vs_sync raises when the two schedules' scores differ, so every row here had identical scores
            "async_vs_sync": [{"rollout": kind, "rollout_seconds": rollout_seconds, "reward_seconds": reward_seconds,
                               "sync_seconds": sync_time, "async_seconds": async_time,
                               "speedup": sync_time / async_time}
                              for kind, rollout_seconds, reward_seconds, sync_time, async_time in loops],
        }
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
