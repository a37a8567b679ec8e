"""benchmarks/flow_credit.py's bookkeeping without training: the reward unit of the table, and ``--merge`` of runs
made in parallel (one seed per process) into one table whose means and ranges are computed by hand here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("flow_credit", ROOT / "benchmarks" / "flow_credit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(strategy: str, seed: int, rewards: list[float]) -> dict:
    steps = [{"step": i + 1, "seconds": 2.0 * (i + 1), "evaluations": 10.0 * (i + 1),
              "forward_equivalents": 30.0 * (i + 1), "train_reward": 0.0, "ratio_deviation": 0.0} for i in range(4)]
    evals = [{"step": 2 * i, "seconds": 4.0 * i, "evaluations": 20.0 * i, "forward_equivalents": 60.0 * i,
              "reward": value} for i, value in enumerate(rewards)]
    return {"strategy": strategy, "seed": seed, "prompts_per_step": 3, "steps": steps, "evals": evals}


def test_reward_unit(bench):
    assert bench.reward_unit({"rewards": {"functions": [{"name": "jpeg_compressibility"}]}})[0] == "bytes/image"
    assert bench.reward_unit({"rewards": {"functions": [{"name": "shapes"}]}}) == ("reward", 1.0, 3)


def test_merge_pools_the_seeds_of_parallel_runs(bench, tmp_path):
    config = ROOT / "configs" / "flow" / "shapes.yaml"
    files = []
    for seed, (step_rewards, branch_rewards) in enumerate([([0.40, 0.42, 0.46], [0.40, 0.45, 0.50]),
                                                           ([0.42, 0.41, 0.40], [0.42, 0.44, 0.44])]):
        result = {"args": {"config": str(config)}, "calibration": {"step": 30.0, "branch": 20.0},
                  "rows": [{"strategy": "step"}, {"strategy": "branch"}],
                  "records": [record("step", seed, step_rewards), record("branch", seed, branch_rewards)]}
        path = tmp_path / f"s{seed}.json"
        path.write_text(json.dumps(result))
        files.append(path)
    out = tmp_path / "merged"
    assert bench.main(["--merge", *map(str, files), "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())
    rows = {row["strategy"]: row for row in merged["rows"]}
    # step: gains +0.06 and -0.02 -> mean +0.02; branch: +0.10 and +0.02 -> mean +0.06; best: max over evals 1..
    assert rows["step"]["gain"] == pytest.approx(0.02) and rows["step"]["gain_min"] == pytest.approx(-0.02)
    assert rows["branch"]["gain"] == pytest.approx(0.06) and rows["branch"]["gain_max"] == pytest.approx(0.10)
    assert rows["branch"]["best_gain"] == pytest.approx((0.10 + 0.02) / 2)
    assert rows["step"]["seconds_per_step"] == pytest.approx(2.0)
    assert merged["args"]["config"] == str(config)
    table = bench.markdown_table(merged["rows"], 2, bench.reward_unit({"rewards": {"functions": ["shapes"]}}))
    assert "| branch | 3 | 10 | 30 | 2.00 | 0.410 | 0.470 | +0.060 [+0.020, +0.100] | +0.060 |" in table
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(files[0].read_text()), "args": {"config": "configs/toy.yaml"}}))
    with pytest.raises(SystemExit, match="one recipe"):
        bench.main(["--merge", str(files[0]), str(other), "--out", str(out)])


def test_calibration_steps_spread_over_the_run(bench):
    assert bench.calibration_steps(50) == [0, 12, 25, 37]
    assert bench.calibration_steps(3) == [0, 1, 2]
    assert bench.calibration_steps(1) == [0]


def test_calibration_averages_a_moving_window_over_the_run(bench, tmp_path):
    """MixGRPO on the tiny SD3 recipe (S = 6 steps, G = 4): a window of W = 2 SDE steps at l costs l ODE steps before
    it, W steps, ⌈0.5·(S − l − W)⌉ DPM-Solver steps after it and 3·W for training, per sample. The window stays in
    MixGRPO's range, steps 0..S − 3 (3 positions); over 10 steps it moves every ⌈10 / 3⌉ = 4 steps, so the
    calibration steps 0, 2, 5, 7 see l = 0, 0, 1, 1: 10, 10, 11, 11 forward equivalents, 10.5 on average, 42 per
    prompt. Measured at step 0 alone it would be 40. Flow-GRPO's step credit costs S + 3·5 trained steps = 21 per
    sample whatever the step."""
    from mmrl.config.loader import apply_overrides, read_yaml

    base = read_yaml(ROOT / "configs" / "flow" / "tiny_sd3.yaml")
    apply_overrides(base, ["rollout.batch_size=null", "plugin.transformer_batch_size=null"])
    bench.ensure_pipeline(base, tmp_path)
    assert bench.calibrate(base, "sliding_window", tmp_path, 1, steps=10) == pytest.approx(42.0)
    assert bench.calibrate(base, "sliding_window", tmp_path, 1, steps=1) == pytest.approx(40.0)
    assert bench.calibrate(base, "step", tmp_path, 1, steps=10) == pytest.approx(84.0)
