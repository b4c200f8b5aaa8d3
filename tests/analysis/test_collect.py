"""analysis.collect packs a tree of run directories into one JSON file, torn rows and all."""

from __future__ import annotations

import json
from pathlib import Path

from analysis import collect


def test_collect_packs_every_run_with_its_curves(tmp_path: Path, run_writer) -> None:
    root = tmp_path / "runs"
    run_writer(root / "a", "bf16_s0", steps=100, log_interval=10, eval_interval=50)
    run_writer(root, "tw_s0", recipe="tensorwise", steps=100, corrupt=True, summary=False)
    out = tmp_path / "out" / "curves.json"
    assert collect.main([str(root), str(out)]) == 0
    got = json.loads(out.read_text())
    assert sorted(got) == ["a/bf16_s0", "tw_s0"]
    bf16 = got["a/bf16_s0"]
    assert [s for s, _ in bf16["train"]] == list(range(10, 101, 10))
    assert [s for s, _ in bf16["eval"]] == [50, 100]
    assert bf16["summary"]["status"] == "completed" and bf16["provenance"]["backend"] == "emulated"
    rows = [json.loads(line) for line in (root / "a/bf16_s0/metrics.jsonl").read_text().splitlines()]
    assert bf16["train"][0] == [10, rows[0]["loss/train"]]
    torn = got["tw_s0"]  # no summary yet; the torn and non-JSON lines are skipped, the rest kept
    assert torn["summary"] is None and len(torn["train"]) == 10


def test_collect_refuses_a_missing_directory(tmp_path: Path, capsys) -> None:
    assert collect.main([str(tmp_path / "nope"), str(tmp_path / "x.json")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
