"""Resuming across upgrades and moves: checkpoints written by earlier lowp versions
(tests/assets/checkpoints/) resume and end as the lowp that wrote them would have; the upgrade table
declares every field added since; removed options and recipe names; data found by its content
wherever its files are; the printed resume command for any run directory path. All in-process,
through `harness.train`'s main."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from harness import train as T
from harness.config import schema, upgrades
from harness.config.errors import ConfigError
from harness.lifecycle import resume as R
from tests.golden_losses import platform
from tests.helpers import REPO, TINY, run_main

ASSETS = REPO / "tests" / "assets" / "checkpoints"
STORED = sorted(p.name for p in ASSETS.iterdir() if (p / "run.json").is_file())
TIMING = {"time/step_ms", "throughput/tokens_per_s", "throughput/tokens_per_s_per_gpu"}
TIMING |= {"throughput/tflops", "throughput/mfu"}
# the rows a resume of each stored checkpoint must end with, on each kind of CPU (golden_losses.platform:
# AMX's bf16 GEMMs round differently); where a kind has none, the rows up to the checkpoint are checked
REFERENCE = {
    ("main_7cfb666_delayed_tiny", "amx"): "metrics.jsonl",  # its uninterrupted run, made on AMX
    ("main_7cfb666_delayed_tiny", ""): "metrics_resumed_plain.jsonl",  # 7cfb666 resuming it without AMX
    ("main_4bfca9b_delayed_tiny", ""): "metrics.jsonl",
    ("main_6970445_tensorwise_tiny", ""): "metrics.jsonl",
}


def cli(capsys, *args: str) -> tuple[int, str]:
    return run_main(capsys, T.main, "harness.train", *args)


def the_error(code: int, err: str) -> str:
    """The one `error:` line of a refused run (exit 2, no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def stored_config(name: str) -> dict:
    (ckpt,) = (ASSETS / name / "checkpoints").iterdir()
    return json.loads((ckpt / "state.json").read_text())["tree"]["config"]


def command_of(run_dir: Path) -> list[str]:
    """The overrides the run was started with (run.json), as its user gives them again."""
    argv = json.loads((run_dir / "run.json").read_text())["provenance"]["argv"][1:]
    return [a for a in argv if not a.startswith("hydra.run.dir=")]


def rows(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING}
        for line in path.read_text().splitlines()
    ]


def last(rows_: list[dict], key: str):
    return [r[key] for r in rows_ if key in r][-1]


# -- the upgrade table: a contract every new field signs -----------------------------------------------


def schema_default(field: str):
    cls, name = field.split(".")
    value = getattr(getattr(schema, cls)(), name)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


@pytest.mark.parametrize("name", STORED)
def test_every_field_a_stored_config_lacks_is_declared_at_its_default(name):
    """A field added to the schema fails this until ADDED says what it was before (its default)."""
    config = stored_config(name)
    undeclared = sorted(set(upgrades.absent_fields(config)) - set(upgrades.ADDED))
    assert not undeclared, f"add these to harness/config/upgrades.py ADDED: {undeclared}"
    unknown = sorted(set(upgrades.extra_keys(config)) - set(upgrades.REMOVED))
    assert not unknown, f"add these to harness/config/upgrades.py REMOVED: {unknown}"
    upgraded, refusals = upgrades.upgrade(config)
    assert refusals == [] and upgrades.absent_fields(upgraded) == upgrades.extra_keys(upgraded) == []


def test_added_fields_default_to_the_old_behaviour_and_removed_ones_are_gone():
    for field, change in upgrades.ADDED.items():
        default = schema_default(field)
        if isinstance(change.value, dict) and isinstance(default, dict):  # a group: its fields of then
            default = {k: default[k] for k in change.value}
        assert change.value == default, (field, change.value, default)
        assert change.why and change.since, field
    for field, change in upgrades.REMOVED.items():
        cls, name = field.split(".")
        assert name not in {f.name for f in dataclasses.fields(getattr(schema, cls))}, field
        assert change.why and change.since, field
    # the oldest stored checkpoint lacks every field ADDED declares: each one is proven by a resume
    # (fields of groups that checkpoint lacks whole are proven by the group's own entry)
    assert set(upgrades.absent_fields(stored_config("main_4bfca9b_delayed_tiny"))) | {
        "ModuleOverride.fields",
        "TelemetryConfig.candidates",
    } == set(upgrades.ADDED)


# -- stored checkpoints of earlier lowp versions ---------------------------------------------------------


@pytest.mark.parametrize("name", STORED)
def test_stored_checkpoint_resumes_and_ends_as_the_lowp_that_wrote_it(name, tmp_path, capsys):
    run_dir = tmp_path / name
    shutil.copytree(ASSETS / name, run_dir)
    code, err = cli(capsys, *command_of(run_dir), f"hydra.run.dir={run_dir}")
    assert code == 0, err
    assert json.loads((run_dir / "run.json").read_text())["attempts"][-1]["resumed_from_step"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    got, reference = rows(run_dir / "metrics.jsonl"), REFERENCE.get((name, platform()))
    if reference is None:  # rows made on another kind of CPU: those up to the checkpoint are kept
        assert got[:3] == rows(ASSETS / name / "metrics.jsonl")[:3]
        return
    want = rows(ASSETS / name / reference)
    assert got == want  # losses, learning rates and gradient norms, bit for bit
    final = (summary["final_train_loss"], summary["final_eval_loss"])
    assert final == (last(want, "loss/train"), last(want, "loss/eval"))


def rewrite_state(checkpoint: Path, edit) -> None:
    """Change a checkpoint's state.json with `edit(tree)`, its manifest made to agree (as a lowp
    that stored that value would have written it)."""
    state = json.loads((checkpoint / "state.json").read_text())
    edit(state["tree"])
    data = json.dumps(state).encode()
    (checkpoint / "state.json").write_bytes(data)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    manifest["files"]["state.json"] = [len(data), zlib.crc32(data)]
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_removed_option_set_otherwise_is_refused_naming_it_and_nothing_is_written(tmp_path, capsys):
    name = "main_7cfb666_delayed_tiny"
    run_dir = tmp_path / name
    shutil.copytree(ASSETS / name, run_dir)
    rewrite_state(
        run_dir / "checkpoints" / "step_00000002", lambda t: t["config"]["recipe"].update(fp8_lm_head=True)
    )
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    line = the_error(*cli(capsys, *command_of(run_dir), f"hydra.run.dir={run_dir}"))
    assert "recipe.fp8_lm_head=true" in line and "resume=never" in line, line
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name in before}
    assert after == before and not (run_dir / "summary.json").exists()


def test_removed_recipe_names_are_their_family_and_fields():
    config = stored_config("main_7cfb666_delayed_tiny")
    fast = json.loads(json.dumps(config))
    fast["recipe"].update(name="tensorwise_fastacc", fp8_fast_accumulation="all")
    fast["stability"]["overrides"] = [{"pattern": "blocks.0.*", "recipe": "tensorwise_fastacc"}]
    got = R.stored_config(fast, Path("d"))
    assert got["recipe"]["name"] == "tensorwise" and got["recipe"]["fp8_fast_accumulation"] == "all"
    assert got["stability"]["overrides"] == [
        {"pattern": "blocks.0.*", "recipe": "tensorwise", "fields": {"fp8_fast_accumulation": "all"}}
    ]
    head = json.loads(json.dumps(config))
    head["recipe"].update(name="tensorwise_fp8headbwd", fp8_lm_head=True, fp8_lm_head_fprop=False)
    with pytest.raises(
        ConfigError, match=r"sets recipe\.fp8_lm_head=true, recipe\.fp8_lm_head_fprop=false, which"
    ):
        R.stored_config(head, Path("d"))


# -- data identified by its content -------------------------------------------------------------------

DATA_RUN = [*TINY, "steps=3", "checkpoint_interval=1", "checkpoint_keep=3", "log_interval=1"]
DATA_RUN += ["eval_interval=0", "eval_tokens=256", "data=memmap"]


@pytest.fixture(scope="module")
def memmap_run(tmp_path_factory):
    """A finished 3-step run on a memmap file, and its rows: (run dir, data file, rows)."""
    root = tmp_path_factory.mktemp("memmap")
    data = root / "home" / "train.bin"
    data.parent.mkdir()
    np.random.default_rng(0).integers(0, 256, 30_000, dtype=np.uint16).tofile(data)
    run_dir = root / "run"
    assert T.run(_cfg(data), run_dir).status == "completed"
    return run_dir, data, rows(run_dir / "metrics.jsonl")


def _cfg(data: Path):
    from tests.helpers import compose_cfg

    return compose_cfg(*DATA_RUN, f"data.path={R.hydra_value(str(data))}")


def staged(memmap_run, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run killed after its step-2 checkpoint, and its data file copied to 'scratch'
    under a path Hydra must be given quoted."""
    run_dir, data, _ = memmap_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000003")
    (copy / "summary.json").unlink()
    scratch = tmp_path / "node scratch, ü [1]" / "train.bin"
    scratch.parent.mkdir()
    shutil.copy(data, scratch)
    return copy, scratch


def test_moved_data_files_resume_by_their_content(memmap_run, tmp_path, capsys):
    run_dir, scratch = staged(memmap_run, tmp_path)
    args = [*DATA_RUN, f"data.path={R.hydra_value(str(scratch))}", f"hydra.run.dir={run_dir}"]
    code, err = cli(capsys, *args)
    assert code == 0, err
    assert json.loads((run_dir / "run.json").read_text())["attempts"][-1]["resumed_from_step"] == 2
    assert rows(run_dir / "metrics.jsonl") == memmap_run[2]  # as if the files had never moved


def test_changed_data_is_refused_before_anything_is_written(memmap_run, tmp_path, capsys):
    """Re-running a completed run after its data file changed in place leaves its files as they were
    (the summary still says completed)."""
    run_dir, data, _ = memmap_run
    original = data.read_bytes()
    tokens = np.frombuffer(original, dtype=np.uint16).copy()
    tokens[100:200] = (tokens[100:200] + 1) % 256  # same size, other tokens
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    try:
        tokens.tofile(data)
        code, err = cli(
            capsys, *DATA_RUN, f"data.path={R.hydra_value(str(data))}", f"hydra.run.dir={run_dir}"
        )
    finally:
        data.write_bytes(original)  # the module's other tests use it
    line = the_error(code, err)
    assert "other data" in line and "fingerprint" in line and str(data) in line, line
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name in before}
    assert after == before


# -- the printed resume command --------------------------------------------------------------------------

AWKWARD = [
    "plain",
    "with space",
    "space at the end ",
    "comma,sep",
    "brackets[0]{a}(b)",
    'quote\'s "double"',
    "key=value",
    "ünïcödé 日本",
    "back\\slash\\'",
    "dollar ${x} $HOME",
]


@pytest.mark.parametrize("tail", AWKWARD)
def test_resume_command_gives_back_the_run_dir_through_shell_and_hydra(tail, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from harness.config.paths import CONF_DIR

    run_dir = tmp_path / tail
    cmd = R.resume_command(
        run_dir, ["recipe=delayed", "data.path='/a b/c'", "hydra.run.dir=old", "resume=never"]
    )
    argv = shlex.split(cmd)  # as the shell splits it
    head = R.train_command()  # lowp-train, or python -m harness.train
    assert argv[: len(head)] == head
    argv = argv[len(head) :]
    overrides = OverridesParser.create().parse_overrides(argv)  # as Hydra parses it
    assert [o.key_or_group for o in overrides] == ["recipe", "data.path", "hydra.run.dir"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=argv, return_hydra_config=True)
    assert OmegaConf.select(cfg, "hydra.run.dir") == str(run_dir.resolve())  # and as its config resolves it
    GlobalHydra.instance().clear()
