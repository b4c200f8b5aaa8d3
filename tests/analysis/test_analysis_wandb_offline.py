"""Runs read back from real W&B offline run directories (`wandb.init(mode="offline")`).

Every test reads the .wandb files stored in `data/wandb_offline/` (logged once by the real client,
`tests/analysis/wandb_runs.py`); the slow lane also reads files logged now by the installed client.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wandb")
pytest.importorskip("pandas")
pytest.importorskip("scipy")
pytest.importorskip("jinja2")

from analysis import keys as K
from analysis import report
from analysis.pairing import compare
from analysis.reader import RunWarning, load_runs
from analysis.wandb_offline import find_offline_runs, iter_records, read_offline_run
from tests.analysis.wandb_runs import TOKENS_PER_STEP

REPO = Path(__file__).resolve().parents[2]
STORED = Path(__file__).parent / "data" / "wandb_offline"


@pytest.fixture(scope="module", params=["stored", pytest.param("fresh", marks=pytest.mark.slow)])
def wandb_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(root, {recipe: run id}): root/wandb/offline-run-*/run-*.wandb of a BF16 and a tensorwise run.

    `stored`: the files in data/wandb_offline. `fresh`: logged now by a process of its own, as a
    training job logs them: the wandb client's process-wide state (its service, settings and active
    run) left by earlier tests in this process cannot reach them."""
    root = tmp_path_factory.mktemp(f"wandb_{request.param}")
    if request.param == "stored":
        shutil.copytree(STORED, root / "wandb", ignore=shutil.ignore_patterns("ids.json"))
        return root, json.loads((STORED / "ids.json").read_text())
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-m", "tests.analysis.wandb_runs", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return root, json.loads(out.stdout.strip().splitlines()[-1])


def test_offline_runs_are_read_back(wandb_root) -> None:
    root, ids = wandb_root
    files = find_offline_runs(root)
    assert len(files) == 2
    runs = {r.recipe: r for r in load_runs(root)}
    assert set(runs) == {"bf16", "tensorwise"}
    bf16, tw = runs["bf16"], runs["tensorwise"]
    assert bf16.source == "wandb_offline" and bf16.wandb["run_id"] == ids["bf16"]
    assert bf16.wandb["group"] == "sweep-1" and bf16.wandb["job_type"] == "bf16"
    assert bf16.status == K.COMPLETED and tw.status == K.COMPLETED  # tw: from its exit code
    assert bf16.backend == "emulated" and bf16.hardware == "cpu" and bf16.seed == 0
    np.testing.assert_allclose(tw.train[K.TOKENS], np.arange(10, 101, 10) * TOKENS_PER_STEP)
    np.testing.assert_allclose(tw.train[K.LOSS_TRAIN], 5.0 - 0.01 * np.arange(10, 101, 10) + 0.02)
    np.testing.assert_allclose(tw.eval[K.LOSS_EVAL], [4.62, 4.12])
    assert bf16.token_budget == tw.token_budget == 100 * TOKENS_PER_STEP


def test_offline_runs_compare_like_run_dirs(wandb_root) -> None:
    root, _ = wandb_root
    c = compare(load_runs(root), smooth_frac=1e-9)
    (row,) = [r for r in c.rows if r["recipe"] == "tensorwise"]
    assert row["pairing"] == "paired by seed"
    assert row["eval_gap_abs"] == pytest.approx(0.02)
    assert row["speed_note"] == "n/a (emulated)"


def test_run_dir_and_its_offline_run_are_one_run(wandb_root, tmp_path: Path, run_writer) -> None:
    root, ids = wandb_root
    shutil.copytree(root / "wandb", tmp_path / "wandb")
    run_writer(tmp_path / "multirun", "0_bf16_s0", wandb_run_id=ids["bf16"])
    runs = load_runs(tmp_path)
    assert sorted((r.recipe, r.source) for r in runs) == [
        ("bf16", "run_dir"),
        ("tensorwise", "wandb_offline"),
    ]


def test_torn_wandb_file_reads_up_to_the_tear(wandb_root, tmp_path: Path) -> None:
    root, ids = wandb_root
    (src,) = [f for f in find_offline_runs(root) if ids["tensorwise"] in f.name]
    torn = tmp_path / "offline-run-x" / src.name
    torn.parent.mkdir()
    data = src.read_bytes()
    # a cut at 2/3 of the file; moved on byte by byte where it happens to fall between two records
    # (the file's bytes, so the record boundaries, differ from one W&B run to the next)
    for cut in range(len(data) * 2 // 3, len(data) * 2 // 3 + 256):
        torn.write_bytes(data[:cut])
        issues: list[str] = []
        n = sum(1 for _ in iter_records(torn, issues))
        if issues:
            break
    assert n > 3
    assert issues and "torn" in issues[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RunWarning)
        runs = load_runs(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("torn record" in m for m in messages) and any("no exit record" in m for m in messages)
    (run,) = runs
    assert 0 < len(run.train[K.LOSS_TRAIN]) <= 10
    assert run.status == K.INCOMPLETE  # no exit record survived


def test_not_a_wandb_file(tmp_path: Path) -> None:
    f = tmp_path / "run-abc.wandb"
    f.write_bytes(json.dumps({"x": 1}).encode())
    run = read_offline_run(f)
    assert "not a W&B transaction log" in run.issues[0]


@pytest.mark.slow  # the wandb client starts its service process
def test_report_goes_to_wandb_as_table_artifact_and_run_verdicts(wandb_root, tmp_path: Path) -> None:
    """Real wandb client, offline: the analysis run holds the comparison table and the report artifact,
    and each training run gets its arm's verdict in its summary (a resumed offline run of the same id)."""
    root, ids = wandb_root
    shutil.copytree(root / "wandb", tmp_path / "sweep" / "wandb")
    out = tmp_path / "report"
    assert report.main([str(tmp_path / "sweep"), "--out", str(out), "--no-plots", "--wandb"]) == 0
    (analysis_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    recs = list(iter_records(analysis_file))
    arts = [r.artifact for r in recs if r.WhichOneof("record_type") == "artifact"]
    assert Counter(a.type for a in arts)["report"] == 1  # (the table is logged as its own run_table)
    (art,) = [a for a in arts if a.type == "report"]
    assert art.type == "report" and {"report.html", "comparison.csv"} <= {
        e.path for e in art.manifest.contents
    }
    history = [it for r in recs if r.WhichOneof("record_type") == "history" for it in r.history.item]
    table = {
        it.nested_key[1]: json.loads(it.value_json) for it in history if it.nested_key[:1] == ["comparison"]
    }
    assert table["_type"] == "table-file" and table["nrows"] == 2  # one row per arm
    rows = json.loads((analysis_file.parent / "files" / table["path"]).read_text())
    assert "verdict_text" in rows["columns"] and len(rows["data"]) == 2
    run_info = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    assert run_info.run_group == "sweep-1" and run_info.job_type == "analysis"
    summary = {}
    for r in recs:
        if r.WhichOneof("record_type") == "summary":
            summary.update(
                {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in r.summary.update}
            )
    assert any(k.startswith("verdict/tensorwise") for k in summary)
    resumed = [f for f in find_offline_runs(tmp_path / "sweep")
               if ids["tensorwise"] in f.name and "latest-run" not in f.parts]  # fmt: skip
    assert len(resumed) == 2  # the original and the resumed offline run of the same id
    verdicts = {}
    for f in resumed:
        for r in iter_records(f):
            if r.WhichOneof("record_type") == "summary":
                verdicts.update({it.key: json.loads(it.value_json) for it in r.summary.update})
    assert verdicts["verdict"] == "one seed" and "gap" in verdicts["verdict_text"]
    # reading the sweep again still gives one run per id (the resumed file adds no second run)
    assert sorted(r.recipe for r in load_runs(tmp_path / "sweep")) == ["bf16", "tensorwise"]
