"""metrics.jsonl read by pyarrow gives the same columns and issues as the row-by-row reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from analysis import columns as C
from analysis import reader as R

ROW = '{{"step": {s}, "tokens": {t}, "loss/train": {v}, "optim/lr": 0.0003, "time/step_ms": 12}}\n'
CASES = {
    # (text, read by pyarrow?)
    "plain": (
        "".join(ROW.format(s=s, t=64 * s, v=3 - s / 100) for s in range(1, 301))
        + "".join(f'{{"step": {s}, "tokens": {64 * s}, "loss/eval": 2.5}}\n' for s in (100, 200)),
        True,
    ),  # fmt: skip
    "nan_inf": (
        '{"step": 1, "tokens": 10, "loss/train": NaN}\n{"step": 2, "tokens": 20, "loss/train": '
        'Infinity}\n{"step": 2, "tokens": 20, "loss/eval": 2.5}\n',
        True,
    ),  # fmt: skip
    "resumed": (
        '{"step": 1, "tokens": 10, "loss/train": 3.0}\n{"step": 2, "tokens": 20, "loss/train": 2}\n'
        '{"step": 2, "tokens": 20, "loss/train": 1.9, "x": 1}\n{"step": 1, "tokens": 10, '
        '"loss/train": 3.1}\n',
        True,
    ),  # fmt: skip
    "no_step_and_numerics": (
        '{"tokens": 10, "loss/train": 3.0}\n{"step": 2, "tokens": 20, "loss/train": 2.0,'
        ' "loss/eval": 2.1}\n{"step": 3, "tokens": 30, "numerics/a/b": 0.5}\n\n',
        True,
    ),
    "null_eval": (
        '{"step": 1, "tokens": 10, "loss/train": 3.0}\n{"step": 1, "tokens": 10, "loss/eval": null}\n',
        False,
    ),  # fmt: skip
    "string": ('{"step": 1, "tokens": 10, "loss/train": 3.0, "note": "x"}\n', False),
    "bool": ('{"step": 1, "tokens": 10, "loss/train": 3.0, "flag": true}\n', False),
    "bad_line": ('{"step": 1, "tokens": 10, "loss/train": 3.0}\n{"step": 2, "tok\n', False),
    "not_object": ('{"step": 1, "tokens": 10, "loss/train": 3.0}\n[1, 2]\n', False),
    "empty": ("", False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_arrow_path_matches_row_path(tmp_path: Path, case: str) -> None:
    text, fast = CASES[case]
    p = tmp_path / "metrics.jsonl"
    p.write_text(text)
    assert (R._arrow_columns(p.read_bytes()) is not None) == fast
    got_issues: list[str] = []
    want_issues: list[str] = []
    got = R.read_metrics(p, got_issues)
    want = C.rows_to_columns(R.parse_jsonl(p, want_issues), p.name, want_issues)
    assert got_issues == want_issues
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)
        for k in g:
            assert g[k].dtype == w[k].dtype and np.array_equal(g[k], w[k], equal_nan=True), k
