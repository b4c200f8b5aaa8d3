"""What pyproject.toml promises a user: version ranges that fit a container's own Hydra and TE 2.20.x,
extras that are used, JupyterLab for the notebook, the license; and the warning of a TE other than
the one the emulated backend reproduces."""

from pathlib import Path

import pytest

from harness.config.schema import TE_EXACT_VERSION
from harness.training.job import te_version_note

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pins_are_ranges():
    assert "hydra-core>=1.3.2,<1.4" in PROJECT["dependencies"]
    assert PROJECT["optional-dependencies"]["gpu"] == ["transformer-engine[pytorch]>=2.20,<2.21"]


def test_extras_are_used_and_complete():
    extras = PROJECT["optional-dependencies"]
    assert "slurm" not in extras  # lowp's own launcher (hydra_plugins/lowp_launcher) runs submitit
    assert not any("hydra-submitit-launcher" in d for deps in extras.values() for d in deps)
    assert any(d.startswith("jupyterlab") for d in extras["notebook"])  # the README says `jupyter lab`


def test_license():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_te_version_note():
    assert te_version_note(TE_EXACT_VERSION) is None
    assert te_version_note(None) is None  # the emulated backend records no te_version
    note = te_version_note("2.20.3")
    assert note.startswith("Transformer Engine 2.20.3: emulated-versus-native comparisons are exact only")
    assert TE_EXACT_VERSION in note
