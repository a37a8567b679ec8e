"""Packaging (issue 23 item 6): the LICENSE file is the license pyproject names."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The first words of each license text that pyproject may name (SPDX identifier -> title line words).
LICENSE_TITLES = {"Apache-2.0": ("Apache License", "Version 2.0"), "MIT": ("MIT License",)}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_file_is_the_license_pyproject_names():
    spdx = _pyproject()["project"]["license"]["text"]
    assert spdx in LICENSE_TITLES, f"pyproject names {spdx!r}; add its title words to LICENSE_TITLES"
    head = " ".join((ROOT / "LICENSE").read_text().split()[:12])
    for words in LICENSE_TITLES[spdx]:
        assert words in head, f"LICENSE does not start as the {spdx} text ({head!r})"

