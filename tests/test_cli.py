"""The command line as a user meets it: `--help` lists the groups, their presets and a line each (no
schema `base_*` nodes); a mistyped preset gets one line with the closest names and exit code 2;
`--help` and tab completion never import torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness import train
from harness.config.store import GROUPS
from tests.helpers import run_cli, run_main


def test_help_lists_groups_presets_and_their_lines(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lowp-train", "recipe=tensorwise", "--help"])
    train.main()
    out = capsys.readouterr().out
    assert "is powered by Hydra" not in out and "base_" not in out
    for group in (*GROUPS, "experiment", "hydra/launcher"):
        assert f"\n  {group} " in out
    assert "What each GEMM operand becomes" in out  # RecipeConfig's docstring
    assert "[tensorwise]" in out and "[gpt_small]" in out  # the choice, with the override applied
    assert "--multirun,-m" in out  # Hydra's flags


@pytest.mark.parametrize(
    "override, line",
    [
        ("recipe=tensorwse", "recipe=tensorwse: no such preset; did you mean tensorwise?"),
        ("model=gpt_tiny,gpt_smal", "model=gpt_smal: no such preset; did you mean gpt_small?"),  # a sweep
        ("hydra/launcher=slrum", "hydra/launcher=slrum: no such preset; did you mean slurm?"),
    ],
)
def test_mistyped_preset_is_one_line_and_exit_2(capsys, override, line):
    code, err = run_main(capsys, train.main, "lowp-train", override, "steps=3")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {line} ") and " presets: " in err


def test_valid_overrides_are_not_refused():
    ok = ["recipe=bf16,tensorwise", "+experiment=hopper_fp8", "model=choice(gpt_tiny,gpt_small)", "~logger"]
    assert train.unknown_preset([*ok, "recipe.fp8=e4m3", "steps=3", "experiment=null"]) is None


@pytest.mark.slow
def test_help_and_completion_do_not_import_torch():
    """What a tab press costs is what `-sc query` imports: torch (2-4 s) only once a run starts. And a
    tab press offers the presets, not the schema's `base_<group>` nodes."""
    probe = "import sys, runpy; sys.argv = {argv!r}; runpy.run_module('harness.train', run_name='__main__')"
    tail = "\nassert 'torch' not in sys.modules, 'torch imported'"
    outs = []
    for argv in (["lowp-train", "--help"], ["lowp-train", "-sc", "query=bash"]):
        code = f"try:\n    {probe.format(argv=argv)}\nexcept SystemExit:\n    pass{tail}"
        res = run_cli(["-c", code], env={"COMP_LINE": "lowp-train recipe="})
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout)
    assert "== Config groups" in outs[0]
    assert outs[1].split() == [f"recipe={n}" for n in train.presets("recipe")]  # no recipe=base_recipe


@pytest.mark.parametrize("launcher", ["serial", "local_parallel"])
def test_local_launchers_keep_one_job_files_folder(launcher):
    """submitit's local executor makes its folder as given: `.submitit/%j` left a literal `%j` folder."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from harness.config.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    folder = OmegaConf.to_container(cfg.hydra.launcher)["submitit_folder"]
    assert folder == "${hydra.sweep.dir}/.submitit"


@pytest.mark.slow
def test_console_script_multirun_on_lowps_launcher(tmp_path):
    """`lowp-train -m hydra/launcher=serial` from any directory: Hydra finds lowp's launcher (an
    editable install's import hook hid it), and the sweep dir holds no literal `.submitit/%j`."""
    script = Path(sys.executable).with_name("lowp-train")
    if not script.exists():
        pytest.skip("lowp-train is not installed beside this Python")
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=serial", "model=gpt_tiny", "steps=2", "logger=none", "eval_tokens=256"]
    res = subprocess.run(
        [str(script), *args, "seed=0,1", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.parent.name for p in sweep.glob("*/summary.json")) == ["0_bf16_s0", "1_bf16_s1"]
    assert not list(sweep.rglob("*%j*"))
