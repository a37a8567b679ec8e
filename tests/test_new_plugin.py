"""``mmrl new-plugin NAME``: the scaffolded package installs, registers its plugin through the entry point, passes its
own conformance test (mmrl.testing.check_plugin) and trains through ``mmrl train``; bad names and existing folders
are refused in one line.

The package is installed with ``pip install --target`` into a scratch folder (as tests/test_install.py installs
mmrl), and used by child interpreters that see that folder on PYTHONPATH, so this environment is never changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.cli import main


def _run(args: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a pip install and three child interpreters: 12-23 s on the shared 2-core machine
def test_the_scaffold_installs_passes_its_conformance_test_and_trains(tmp_path, capsys):
    package = tmp_path / "pkg"
    assert main(["new-plugin", "my_modality", "--dir", str(package)]) == 0
    assert f"wrote plugin 'my_modality' to {package}" in capsys.readouterr().out
    assert {str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()} == {
        "pyproject.toml", "README.md", "mmrl_my_modality/__init__.py", "mmrl_my_modality/plugin.py",
        "configs/my_modality.yaml", "tests/test_plugin.py"}

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--target", str(site), str(package)], check=True, capture_output=True, timeout=300)

    tests = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], package, site)
    assert tests.returncode == 0, tests.stdout[-2000:] + tests.stderr[-2000:]
    assert "2 passed" in tests.stdout  # check_plugin, and the recipe loads through the entry point

    listed = _run(["-m", "mmrl", "list"], package, site)
    assert listed.returncode == 0 and "  my_modality\n" in listed.stdout, listed.stderr

    run = tmp_path / "run"
    trained = _run(["-m", "mmrl", "train", "configs/my_modality.yaml", f"run.output_dir={run}", "run.max_steps=3",
                    "run.progress=false", "eval.every=0"], package, site)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "done: 3 steps" in trained.stdout
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [line for line in steps if "loss/total" in line]
    assert len(train_steps) == 3
    assert all(abs(line["loss/first_step_ratio_deviation"]) < 1e-5 for line in train_steps)


@pytest.mark.parametrize("name", ["MyModality", "my-modality", "2d", "class", "my_", "x" * 41, "toy"])
def test_bad_names_are_refused_in_one_line(tmp_path, capsys, name):
    assert main(["new-plugin", name, "--dir", str(tmp_path / "pkg")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"mmrl: new-plugin: plugin name {name!r} is ") and error.count("\n") == 1
    assert ("taken by an installed plugin" if name == "toy" else "lowercase Python identifier") in error
    assert not (tmp_path / "pkg").exists()


def test_an_existing_folder_is_refused_and_left_alone(tmp_path, capsys):
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    assert main(["new-plugin", "my_modality", "--dir", str(folder)]) == 2
    error = capsys.readouterr().err
    assert error == f"mmrl: new-plugin: {folder} already exists: choose another --dir (new-plugin never writes into " \
                    "an existing folder)\n"
    assert [p.name for p in folder.iterdir()] == ["keep.txt"]


def test_the_default_folder_is_named_after_the_distribution(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["new-plugin", "my_modality"]) == 0
    pyproject = (tmp_path / "mmrl-my-modality" / "pyproject.toml").read_text()
    assert 'name = "mmrl-my-modality"' in pyproject
    assert 'my_modality = "mmrl_my_modality.plugin:MyModalityPlugin"' in pyproject
