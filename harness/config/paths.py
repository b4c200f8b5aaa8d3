"""Where lowp's config tree and named sweeps live: beside the package in a checkout, inside it when installed.

A checkout (or an editable install) keeps `conf/` and `sweeps/` at the top of the repository; a wheel
ships them as package data under `harness/conf` and `harness/sweeps` (pyproject.toml, package-dir), so an
installed lowp runs on a node without a checkout.
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]  # the harness package


def data_dir(name: str) -> Path:
    """`conf` or `sweeps`: the installed copy if this is a wheel install, else the checkout's folder."""
    installed = _PKG / name
    return installed if installed.is_dir() else _PKG.parent / name


CONF_DIR = data_dir("conf")
SWEEPS_DIR = data_dir("sweeps")
