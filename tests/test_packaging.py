"""The wheel is enough: built from this checkout, installed in a fresh venv outside it, it trains.

The venv reuses this environment's installed dependencies (torch is a large download) through a .pth
line naming their site-packages directory; a plain path line does not run the .pth files there, so the
checkout's editable install stays invisible and lowp comes from the wheel only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def sh(*cmd, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    sh(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        REPO,
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        tmp / "dist",
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("lowp-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(
        sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    sh(
        sys.executable,
        "-m",
        "pip",
        "--python",
        py,
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        wheel,
        cwd=tmp,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{env_dir / 'bin'}:{env['PATH']}", WANDB_SILENT="true")
    return {"py": py, "bin": env_dir / "bin", "site": site, "tmp": tmp, "env": env, "wheel": wheel}


def test_wheel_ships_conf_sweeps_and_the_launcher_plugin(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert {
        "harness/conf/config.yaml",
        "harness/conf/hydra/launcher/slurm.yaml",
        "harness/sweeps/hopper_matrix.yaml",
        "hydra_plugins/lowp_launcher/launcher.py",
        "analysis/report.py",
    } <= names
    assert not any(n.startswith("harness/conf/local/") for n in names)  # site settings stay on the machine
    out = sh(
        installed["py"],
        "-c",
        "import harness, harness.config.paths as p; print(harness.__file__, p.CONF_DIR)",
        cwd=installed["tmp"],
        env=installed["env"],
    ).stdout
    assert out.startswith(str(installed["site"])) and str(REPO) not in out


def test_installed_lowp_trains_three_steps_outside_the_checkout(installed):
    run_dir = installed["tmp"] / "run"
    sh(
        installed["bin"] / "lowp-train",
        "model=gpt_tiny",
        "steps=3",
        "log_interval=1",
        "eval_interval=0",
        "eval_tokens=512",
        "micro_batch_size=4",
        "global_batch_size=4",
        "data.num_tokens=20000",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        cwd=installed["tmp"],
        env=installed["env"],
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    listing = sh(installed["bin"] / "lowp-sweep", "--list", cwd=installed["tmp"], env=installed["env"]).stdout
    assert "hopper_matrix" in listing and "tiny_matrix" in listing
    dry = sh(
        installed["bin"] / "lowp-sweep",
        "tiny_matrix",
        "--dry-run",
        cwd=installed["tmp"],
        env=installed["env"],
    )
    assert "4 jobs" in dry.stdout
    for script in ("lowp-report", "lowp-megatron", "lowp-prepare", "lowp-export"):
        assert (installed["bin"] / script).exists()
    sh(installed["bin"] / "lowp-report", "--help", cwd=installed["tmp"], env=installed["env"])
