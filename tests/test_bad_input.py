"""The bad-input matrix: each wrong input through the real entry point (`python -m harness.train`'s
`main`, run in this process), each a one-line message naming the option and the fix, the exit code
(2: lowp's configuration errors; 1: runtime errors and Hydra's own composition errors, whose message
Hydra keeps), no traceback for a user error, and nothing written earlier lost.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import train as T
from harness.lifecycle import checkpoint as C
from harness.lifecycle.runlock import RunLock
from tests import faults
from tests.faults import read_only, tmpfs
from tests.helpers import REPO, TINY, run_main, start_train
from tests.test_data import random_docs, write_megatron

FAST = [*TINY, "steps=4", "eval_interval=0", "log_interval=2"]


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run the entry point in-process; (exit code, stderr)."""
    return run_main(capsys, T.main, "harness.train", *args)


def refused(capsys, run_dir: Path, *args: str, code: int = 2, match: str | tuple = ()) -> str:
    """The run is refused with `code` and one error line holding every string of `match`; a config
    refused in a new run directory leaves none behind (not even Hydra's .hydra/ and train.log)."""
    existed = run_dir.exists()
    got, err = cli(capsys, *FAST, f"hydra.run.dir={run_dir}", *args)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert got == code, err
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for needle in (match,) if isinstance(match, str) else match:
        assert needle in lines[0], lines[0]
    if code == 2 and not existed:
        assert not run_dir.exists(), f"a refused run left {sorted(p.name for p in run_dir.iterdir())}"
    return lines[0]


# -- every lowp configuration rule that a user can trip: exit 2, one line, option and fix -------------
CONFIG_CASES = {
    "fp8_without_format": (["recipe=delayed", "recipe.fp8=null"], ("recipe=delayed", "recipe.fp8=e4m3")),
    "fp8_and_fp4": (["recipe=delayed", "recipe.fp4=e2m1"], ("mutually exclusive", "null")),
    "nvfp4_format": (["recipe=nvfp4", "recipe.fp4=null"], "recipe.fp4=e2m1"),
    "bf16_with_fp8": (["recipe.fp8=e4m3"], ("recipe=bf16", "recipe.fp8=null")),
    "custom_no_factory": (["recipe=custom", "recipe.quantizer_factory=null"], "recipe.quantizer_factory"),
    "first_last_delayed": (["recipe=delayed", "stability.first_last_layers_bf16=true"], "recipe=tensorwise"),
    "first_last_too_many": (
        [
            "recipe=tensorwise",
            "stability.first_last_layers_bf16=true",
            "stability.num_layers_at_start_in_bf16=5",
        ],
        "model.num_layers",
    ),
    "amax_history": (["recipe=delayed", "recipe.fp8_amax_history_len=0"], "recipe.fp8_amax_history_len=0"),
    "block_dim": (["recipe=blockwise", "recipe.x_block_dim=3"], ("recipe.x_block_dim=3", "use 1")),
    "int4_group": (["recipe=int4_qat", "recipe.int4_group_size=0"], "recipe.int4_group_size=0"),
    "low_states_need_pao": (["optimizer.exp_avg_dtype=bf16"], "use_precision_aware_optimizer=true"),
    "offload_tensorwise": (["recipe=tensorwise", "optimizer.optimizer_cpu_offload=true"], "recipe=delayed"),
    "fp8_param_bf16": (["optimizer.fp8_param=true"], "optimizer.fp8_param=false"),
    "no_master_emulated": (["optimizer.master_weights=false"], "optimizer.master_weights=true"),
    "batch_multiple": (["global_batch_size=6"], ("global_batch_size=6", "micro_batch_size=4")),
    "micro_batch_zero": (["micro_batch_size=0", "global_batch_size=0"], "micro_batch_size=0"),
    "heads_divide": (["model.num_attention_heads=3"], ("model.hidden_size", "num_attention_heads")),
    "rope_odd_head": (
        ["model.position_embedding=rope", "model.hidden_size=24", "model.num_attention_heads=8"],
        "even head size",
    ),
    "layers_zero": (["model.num_layers=0"], "model.num_layers=0"),
    "loss_chunks": (["model.lm_head_loss_chunks=-1"], "model.lm_head_loss_chunks=-1"),
    "steps_zero": (["steps=0"], "steps=0"),
    "lr_negative": (["optimizer.lr=-1"], ("optimizer.lr=-1", "positive learning rate")),
    "lr_inf": (["optimizer.lr=inf"], ("optimizer.lr=inf", "positive learning rate")),
    "init_std_negative": (["model.init_method_std=-1"], ("model.init_method_std=-1", "init_method_std=0.02")),
    "init_std_nan": (["model.init_method_std=nan"], "model.init_method_std=nan"),
    "min_lr_above_lr": (["optimizer.min_lr=1"], ("optimizer.min_lr=1", "min_lr <= lr")),
    "warmup_negative": (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps=-1"),
    "betas": (["optimizer.betas=[0.9,1.5]"], "optimizer.betas"),
    "log_interval_zero": (["log_interval=0"], "log_interval=0"),
    "eval_interval_negative": (["eval_interval=-1"], "eval_interval=-1"),
    "checkpoint_interval": (["checkpoint_interval=-2"], ("checkpoint_interval=-2", "null (every 10%)")),
    "checkpoint_keep": (["checkpoint_keep=0"], "checkpoint_keep=0"),
    "divergence_patience": (["divergence.patience=0"], "divergence.patience=0"),
    "spike_factor": (["divergence.loss_spike_factor=0.5"], "divergence.loss_spike_factor=0.5"),
    "resume_mode": (["resume=sometimes"], ("resume=sometimes", "auto")),
    "unknown_name_value": (["model.activation=relu"], ("model.activation=relu", "gelu")),
    "unknown_top_key": (["+stepz=10"], ("stepz: no such config field", "check the spelling")),
    "unknown_nested_key": (["+optimizer.learning_rate=1"], ("optimizer.learning_rate", "in optimizer")),
    "te_on_cpu": (["backend=te"], ("backend=te with hardware=cpu", "backend=emulated")),
    "data_vocab_too_big": (["data.vocab_size=300"], ("data.vocab_size=300", "model.vocab_size=256")),
    "too_few_tokens": (["data.num_tokens=40"], ("only", "tokens", "seq_length")),
    "too_many_tokens": (  # 2 PB: more than any address space, so the allocation fails everywhere
        ["data.num_tokens=1000000000000000"],
        ("data.num_tokens=1000000000000000", "does not fit", "lower data.num_tokens"),
    ),
    "eval_tokens_too_many": (["data.num_tokens=3000", "eval_tokens=100000"], ("eval_tokens=100000", "lower")),
    "factory_import": (
        ["recipe=custom", "recipe.fp8=e4m3", "recipe.quantizer_factory=no_such_module:f"],
        ("recipe.quantizer_factory", "cannot import"),
    ),
    "factory_wrong_return": (
        ["recipe=custom", "recipe.fp8=e4m3", "recipe.quantizer_factory=builtins:slice"],
        ("returned slice", "quantize(x, columnwise)"),
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_error(case, tmp_path, capsys):
    overrides, match = CONFIG_CASES[case]
    refused(capsys, tmp_path / "run", *overrides, match=match)  # and no run dir left


# -- an unknown preset: one line with the closest names, exit 2 (before Hydra looks for it) ---------
@pytest.mark.parametrize(
    "override,line",
    [
        ("recipe=fp7", "error: recipe=fp7: no such preset; recipe presets: bf16, blockwise,"),
        ("model=gpt_huge", "error: model=gpt_huge: no such preset; model presets: gpt_125m,"),
        (
            "hardware=h2000",
            "error: hardware=h2000: no such preset; did you mean h200? hardware presets: a100,",
        ),
    ],
)
def test_unknown_preset(override, line, tmp_path, capsys):
    code, err = cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", override)
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# -- Hydra's own composition errors keep Hydra's message and exit code 1 ------------------------------
@pytest.mark.parametrize(
    "override,match",
    [
        ("steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        ("optimizer.lr=fast", "could not be converted to Float"),
    ],
)
def test_hydra_composition_error(override, match, tmp_path, capsys):
    code, err = cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", override)
    assert code == 1 and match in err, err


# -- data files ------------------------------------------------------------------------------------
def memmap(path: Path, tokens, dtype=np.uint16) -> Path:
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


DATA = ["data=memmap", "data.eval_fraction=0.1", "eval_tokens=256"]


def test_missing_data_file(tmp_path, capsys):
    refused(
        capsys, tmp_path / "r", *DATA, f"data.path={tmp_path}/nope.bin", match=("data.path=", "no such file")
    )


def test_refused_data_opens_no_wandb_run(tmp_path, capsys):
    """The default logger (W&B offline) is opened only once the trainer is built: a refused data
    file leaves no W&B run, hence no run directory (before: a crashed offline run in wandb/)."""
    refused(
        capsys, tmp_path / "r", *DATA, f"data.path={tmp_path}/nope.bin", "logger=wandb",
        "logger.wandb.mode=offline", match=("data.path=", "no such file"),
    )  # fmt: skip


def test_empty_data_file(tmp_path, capsys):
    (tmp_path / "e.bin").write_bytes(b"")
    refused(capsys, tmp_path / "r", *DATA, f"data.path={tmp_path}/e.bin", match="the file is empty")


def test_wrong_dtype_data_file(tmp_path, capsys):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03\x00")  # 6 bytes: no whole uint32 tokens
    refused(
        capsys, tmp_path / "r", *DATA, f"data.path={tmp_path}/odd.bin", "data.token_dtype=uint32",
        match=("not a whole number of uint32 tokens", "data.token_dtype"),
    )  # fmt: skip


def test_directory_without_train_bin(tmp_path, capsys):
    refused(capsys, tmp_path / "r", *DATA, f"data.path={tmp_path}", match="directory has no train.bin")


def test_unreadable_data_file(tmp_path, capsys):
    path = memmap(tmp_path / "t.bin", np.arange(5000) % 200)
    path.chmod(0)
    with faults.file_modes_enforced():  # root reads any file; without CAP_DAC_OVERRIDE it cannot
        with pytest.raises(PermissionError):
            path.open("rb")
        refused(capsys, tmp_path / "r", *DATA, f"data.path={path}", code=2, match="data.path")


def test_too_few_tokens_for_one_batch(tmp_path, capsys):
    path = memmap(tmp_path / "t.bin", np.arange(50) % 200)
    refused(capsys, tmp_path / "r", *DATA, f"data.path={path}", match=("only", "tokens", "model.seq_length"))


def test_vocab_smaller_than_data(tmp_path, capsys):
    path = memmap(tmp_path / "t.bin", np.arange(5000) % 300)
    refused(
        capsys, tmp_path / "r", *DATA, f"data.path={path}", match=("does not fit model.vocab_size=256", "300")
    )


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_corrupted_megatron_index(damage, tmp_path, capsys):
    prefix = str(tmp_path / "ds")
    write_megatron(prefix, random_docs(np.random.default_rng(0), 20, 200), np.uint16)
    idx = Path(prefix + ".idx")
    raw = idx.read_bytes()
    idx.write_bytes(b"XXXXXXXXX" + raw[9:] if damage == "magic" else raw[:40])
    match = "not a Megatron MMIDIDX index" if damage == "magic" else "is truncated"
    refused(capsys, tmp_path / "r", "data=megatron", f"data.path={prefix}", match=(match, "data.path"))


def test_multirun_checks_every_jobs_data_before_the_first(tmp_path, capsys):
    good = memmap(tmp_path / "good.bin", np.arange(5000) % 200)
    code, err = cli(
        capsys,
        "-m",
        *FAST,
        *DATA,
        f"data.path={good},{tmp_path}/missing.bin",
        f"hydra.sweep.dir={tmp_path}/s",
    )
    assert code == 2 and "error: job 1" in err and "no such file" in err, err
    assert not list((tmp_path / "s").glob("*/metrics.jsonl"))  # not even job 0 ran


# -- runtime problems: exit 1, one line, earlier files intact ----------------------------------------
def test_two_processes_on_one_run_dir(tmp_path, capsys):
    with RunLock(tmp_path):
        line = refused(capsys, tmp_path, code=1, match=(f"pid {os.getpid()}", "another directory"))
    assert "hydra.run.dir" in line


def job_log(run_dir: Path) -> str:
    """The run's log file (Hydra's job logging writes one per run dir)."""
    return "".join(p.read_text() for p in run_dir.glob("*.log"))


def test_stale_lock_of_dead_process_is_taken_over(tmp_path, capsys):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone", "since": "then"}))
    code, _ = cli(capsys, *FAST, f"hydra.run.dir={tmp_path}")
    assert code == 0 and "taking over the stale lock of pid 999999" in job_log(tmp_path)


def test_checkpoint_of_another_config_is_refused(tmp_path, capsys):
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}")[0] == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    refused(
        capsys, tmp_path, "optimizer.lr=1e-3", "seed=3",
        match=("another config", "optimizer.lr: 0.003 -> 0.001", "seed: 0 -> 3", "resume=never"),
    )  # fmt: skip
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_log_only_keys_may_change_on_resume(tmp_path, capsys):
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "steps=4")[0] == 0
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "log_interval=1", "name=x")[0] == 0


def test_resume_never_moves_the_old_run_aside(tmp_path, capsys):
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}")[0] == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "seed=5", "resume=never")[0] == 0
    (aside,) = tmp_path.glob("replaced_*")
    assert (aside / "metrics.jsonl").read_text() == before and (aside / "checkpoints").is_dir()


def test_starting_over_without_a_checkpoint_keeps_the_earlier_files(tmp_path, capsys):
    """A run dir with an earlier run but no checkpoint (killed before its first one, or
    checkpoint_interval=-1): the new run starts over and the earlier files move aside, not
    overwritten (before: metrics.jsonl and summary.json were rewritten)."""
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "checkpoint_interval=-1")[0] == 0
    before = {n: (tmp_path / n).read_text() for n in ("metrics.jsonl", "summary.json")}
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "checkpoint_interval=-1", "seed=1")[0] == 0
    (aside,) = tmp_path.glob("replaced_*")
    assert {n: (aside / n).read_text() for n in before} == before
    assert json.loads((tmp_path / "summary.json").read_text())["seed"] == 1


def test_resume_must_without_checkpoint(tmp_path, capsys):
    refused(capsys, tmp_path, "resume=must", match=("resume=must", "no usable checkpoint"))


def test_corrupted_checkpoints(tmp_path, capsys):
    assert (
        cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "checkpoint_interval=2", "checkpoint_keep=3")[0] == 0
    )
    newest, older = C.candidates(tmp_path)[:2]
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-7])
    # the newest is skipped with a warning, the run resumes from the one before it
    assert (
        cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", "checkpoint_interval=2", "checkpoint_keep=3")[0] == 0
    )
    assert "step_00000004 is unusable" in job_log(tmp_path) and "falling back" in job_log(tmp_path)
    attempts = json.loads((tmp_path / "run.json").read_text())["attempts"]
    assert attempts[-1]["resumed_from_step"] == 2
    for path in C.candidates(tmp_path):  # then every checkpoint broken: refused, nothing overwritten
        (path / C.MANIFEST).unlink()
    before = (tmp_path / "metrics.jsonl").read_text()
    refused(capsys, tmp_path, code=1, match=("none is usable", "resume=never"))
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_full_disk_at_a_checkpoint_keeps_earlier_files(tmp_path, capsys):
    """A real full disk: a tmpfs with room for one checkpoint of gpt_tiny (1.8 MB) and the files."""
    with tmpfs(tmp_path / "run", 2_600_000) as run_dir:
        line = refused(
            capsys, run_dir, "checkpoint_interval=2", code=1,
            match=("cannot write checkpoint 4", str(run_dir / "checkpoints"), "No space left on device",
                   "disk is full", "free space", "restart to resume"),
        )  # fmt: skip
        assert [p.name for p in C.candidates(run_dir)] == ["step_00000002"]
        assert C.load_latest(run_dir)[1] == 2 and not list((run_dir / "checkpoints").glob(".tmp*"))
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss/train" in r] == [1, 2, 4]  # all logged before the failure
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and "No space left" in (run_dir / "error.txt").read_text()
        assert line in job_log(run_dir)


def test_read_only_checkpoint_dir_keeps_earlier_checkpoints(tmp_path, capsys):
    """A real read-only directory (a read-only bind mount: root ignores file modes): checkpoint 4 of
    a resumed run cannot be written; checkpoint 2 and the rows stay, the run dir records the failure."""
    args = ("checkpoint_interval=2", "checkpoint_keep=3")
    assert cli(capsys, *FAST, f"hydra.run.dir={tmp_path}", *args)[0] == 0
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")  # as if the run had stopped after step 2
    with read_only(tmp_path / "checkpoints"):
        refused(
            capsys, tmp_path, *args, code=1,
            match=("cannot write checkpoint 4", "Read-only file system", "make it writable", "to resume"),
        )  # fmt: skip
    assert [p.name for p in C.candidates(tmp_path)] == ["step_00000002"] and C.load_latest(tmp_path)[1] == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss/train" in r] == [1, 2, 4]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert "Read-only file system" in (tmp_path / "error.txt").read_text()


def test_run_dir_on_a_read_only_file_system(tmp_path, capsys):
    """Hydra writes .hydra/ before the job starts: the run dir is checked first (one line, not
    Hydra's traceback)."""
    with read_only(tmp_path / "ro") as ro:
        refused(
            capsys, ro / "run", code=1,
            match=(f"hydra.run.dir={ro / 'run'}", "read-only file system", "use another hydra.run.dir"),
        )  # fmt: skip


def test_unwritable_checkpoint_dir_keeps_earlier_files(tmp_path, capsys):
    """A run whose checkpoints cannot be written fails in one line; the rows it logged stay."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "checkpoints").write_text("a file where the checkpoint directory should be")
    refused(
        capsys,
        tmp_path,
        "checkpoint_interval=2",
        code=1,
        match=("cannot write checkpoint 2", "File exists (a file is in the way)", "restart to resume"),
    )
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_unique_run_dir_when_two_start_in_one_second():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.store import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        first, second = (
            str(compose("config", ["logger=none"], return_hydra_config=True).hydra.run.dir) for _ in range(2)
        )
    assert first != second and first.rsplit("/", 1)[0] == second.rsplit("/", 1)[0]


# -- crashes and refusals while a run starts ----------------------------------------------------------
FACTORY = """
import sys

def raises(role, recipe):
    raise RuntimeError("factory exploded")

def exits(role, recipe):
    sys.exit(3)
"""


@pytest.fixture
def factory(tmp_path, monkeypatch, request) -> str:
    """An importable module of quantizer factories that fail (a unique name per test)."""
    name = f"bad_factory_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


CUSTOM = ["recipe=custom", "recipe.fp8=e4m3"]


@pytest.mark.parametrize("fn", ["raises", "exits"])
def test_crash_while_the_trainer_is_built_is_recorded(fn, factory, tmp_path, capsys):
    """User code that raises or calls sys.exit while the trainer is built: exit 1, one line that
    points to error.txt, and the run dir says `failed` (before: no files, or the process just ended)."""
    run_dir = tmp_path / "run"
    line = refused(capsys, run_dir, *CUSTOM, f"recipe.quantizer_factory={factory}:{fn}", code=1)
    assert f"(traceback in {run_dir / 'error.txt'})" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    expected = "factory exploded" if fn == "raises" else "sys.exit(3)"
    assert summary["status"] == "failed" and expected in summary["error"]
    assert expected in (run_dir / "error.txt").read_text() and line in job_log(run_dir)


@pytest.mark.slow  # wandb.init asks git for the code's repository (a process)
def test_wandb_online_without_credentials_is_refused(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    refused(
        capsys, tmp_path / "run", "logger=wandb", "logger.wandb.mode=online",
        match=("logger.wandb.mode=online", "wandb login", "logger.wandb.mode=offline"),
    )  # fmt: skip


def test_refusal_after_the_lock_leaves_no_run_dir(tmp_path, capsys):
    refused(capsys, tmp_path / "run", "resume=must", match="no usable checkpoint")


def test_completed_run_started_again_on_changed_data_keeps_its_files(tmp_path, capsys):
    """A refusal before the attempt wrote anything leaves the earlier run's files as they were."""
    path = memmap(tmp_path / "t.bin", np.arange(20000) % 200)
    args = (*DATA, f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert cli(capsys, *FAST, *args)[0] == 0
    before = {n: (tmp_path / "run" / n).read_text() for n in ("summary.json", "run.json", "metrics.jsonl")}
    memmap(path, (np.arange(20000) * 7) % 200)  # the same file, other tokens
    code, err = cli(capsys, *FAST, *args)
    assert code == 2 and "trained on other data" in err and err.count("error:") == 1, err
    assert {n: (tmp_path / "run" / n).read_text() for n in before} == before
    assert not (tmp_path / "run" / "error.txt").exists()


def test_jobs_run_in_their_own_processes_reach_the_multirun_exit_code(tmp_path, capsys):
    """Under lowp's serial/local_parallel/slurm launchers a job's callbacks run in the job's process,
    so the launcher hands each returned status to the driver's callback: a failed or missing job
    makes the multirun exit non-zero, as under Hydra's in-process launcher."""
    from types import SimpleNamespace

    from hydra.core.utils import JobReturn, JobStatus

    from harness.multirun.callbacks import ValidateSweep
    from hydra_plugins.lowp_launcher.launcher import LowpLauncher, Planned

    callback = ValidateSweep()
    callback.jobs = 3
    launcher = LowpLauncher()
    launcher.hydra_context = SimpleNamespace(callbacks=SimpleNamespace(callbacks=[callback]))
    plans = [Planned(i, [], tmp_path / f"{i}_bf16_s0", f"{i}_bf16_s0") for i in range(3)]
    returns = [
        JobReturn(status=JobStatus.COMPLETED, _return_value=s) for s in ("completed", "failed", "missing")
    ]
    launcher._tell_driver(plans, returns)
    with pytest.raises(SystemExit) as exit_:
        callback.on_multirun_end(config=None)
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("error: 2 of 3 jobs failed (1_bf16_s0, 2_bf16_s0)")


# -- failures never stop a sweep; divergence is a clean end ------------------------------------------
def test_failing_job_does_not_stop_the_sweep(factory, tmp_path, capsys):
    """Job 0 fails, job 1 still runs; the multirun then exits 1 naming the failed job, whose
    train.log holds its error line."""
    factories = f"recipe.quantizer_factory={factory}:raises,harness.numerics.custom:tensorwise_factory"
    code, err = cli(capsys, "-m", *FAST, *CUSTOM, factories, f"hydra.sweep.dir={tmp_path}")
    assert code == 1, err
    (job0,) = tmp_path.glob("0_*")
    (job1,) = tmp_path.glob("1_*")
    assert json.loads((job0 / "summary.json").read_text())["status"] == "failed"
    assert "factory exploded" in (job0 / "error.txt").read_text()
    assert "Traceback" in (job0 / "error.txt").read_text()
    assert "error: RuntimeError: factory exploded" in job_log(job0)
    assert json.loads((job1 / "summary.json").read_text())["status"] == "completed"
    assert err.splitlines()[-1].startswith(f"error: 1 of 2 jobs failed ({job0.name})"), err


def test_divergence_ends_cleanly_with_exit_0(tmp_path, capsys):
    code, _ = cli(
        capsys, *FAST, "steps=8", "log_interval=1", "optimizer.lr=1e6", "optimizer.clip_grad=0",
        "optimizer.warmup_steps=0", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    s = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0 and s["status"] == "diverged" and s["diverged_step"] and s["divergence_cause"]


# -- by hand: the real CLI, SIGTERM, restart ---------------------------------------------------------
@pytest.mark.slow  # a real `python -m harness.train` to signal, and its restart: 200 steps
def test_cli_sigterm_then_restart_resumes(tmp_path):
    """`python -m harness.train` stopped with SIGTERM checkpoints, says how to resume, exits 143;
    the printed command resumes it to the same end as an uninterrupted run."""
    # long enough that the signal lands mid-run on an idle machine too (it is sent after 3 steps)
    args = [*TINY, "steps=200", "checkpoint_interval=5000", "log_interval=1", "eval_interval=0"]
    args += ["data.num_tokens=200000", "eval_tokens=512", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = start_train(*args)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    err = proc.stdout.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "preempted" and 3 <= summary["steps"] < 200
    assert C.load_latest(tmp_path)[1] == summary["steps"]  # checkpointed at the step boundary
    (command,) = [
        line.split("to resume this run: ")[1] for line in err.splitlines() if "to resume this run" in line
    ]
    assert f"hydra.run.dir={tmp_path}" in command
    argv = shlex.split(command)
    argv = argv[3:] if argv[:3] == ["python", "-m", "harness.train"] else argv[1:]  # or lowp-train
    res = subprocess.run(
        [sys.executable, "-m", "harness.train", *argv], cwd=REPO, env=env, capture_output=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "loss/train" in x]
    assert steps == list(range(1, 201))  # continued, no row lost or repeated
    state = C.load_latest(tmp_path)[2]
    assert state["data"]["position"] == 200 and torch.is_tensor(state["model"]["wte.weight"])
