"""The statistics on run directories whose seed-to-seed noise is real.

`data/real_gpt_tiny/` holds nine real runs of the harness (BF16 seeds 0-5, emulated tensorwise seeds
0-2; gpt_tiny, markov, 60 steps), made by

    python -m harness.train -m model=gpt_tiny data=markov backend=emulated hardware=cpu steps=60 \\
        micro_batch_size=8 global_batch_size=8 log_interval=5 eval_interval=20 eval_tokens=4096 \\
        telemetry_interval=0 logger=none recipe=bf16 seed=0,1,2,3,4,5    (and recipe=tensorwise seed=0,1,2)

keeping run.json, metrics.jsonl and summary.json. A planted gap of twice the stated minimum detectable
gap must be called worse with an interval excluding 0; an unchanged copy must be indistinguishable.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pandas")
pytest.importorskip("scipy")

from scipy import stats as st

import analysis
from analysis import stats as S

REAL = Path(__file__).parent / "data" / "real_gpt_tiny"


def copy_run(src: Path, dst: Path, *, recipe: str | None = None, scale: float = 1.0) -> Path:
    """A copy of a real run dir, optionally renamed to another recipe and with every loss x `scale`."""
    shutil.copytree(src, dst)
    rj = json.loads((dst / "run.json").read_text())
    summ = json.loads((dst / "summary.json").read_text())
    if recipe:
        rj["config"]["recipe"]["name"] = recipe
        summ["recipe"] = recipe
    for k in ("final_train_loss", "final_eval_loss"):
        if summ.get(k) is not None:
            summ[k] *= scale
    rows = [json.loads(ln) for ln in (dst / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    for r in rows:
        for k in ("loss/train", "loss/eval"):
            if r.get(k) is not None:
                r[k] *= scale
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (dst / "run.json").write_text(json.dumps(rj))
    (dst / "summary.json").write_text(json.dumps(summ))
    return dst


def arm(table, recipe: str):
    (row,) = table[table["recipe"] == recipe].to_dict("records")
    return row


def test_real_fixture_is_what_the_docstring_says() -> None:
    runs = analysis.load(REAL)
    assert sorted(zip(runs.runs["recipe"], runs.runs["seed"], strict=True)) == [
        *[("bf16", s) for s in range(6)],
        *[("tensorwise", s) for s in range(3)],
    ]
    assert set(runs.runs["status"]) == {"completed"} and set(runs.runs["steps"]) == {60}


def test_unpaired_copy_is_indistinguishable_and_planted_gap_is_worse(tmp_path: Path) -> None:
    """Baseline: real BF16 seeds 0-2. Arms: real BF16 seeds 3-5 (other seeds: Welch t), unchanged or
    with the loss raised by twice the minimum detectable gap the analysis states for the copy."""
    sweep = tmp_path / "sweep"
    for s in range(3):
        shutil.copytree(REAL / f"bf16_{s}_bf16_s{s}", sweep / f"bf16_s{s}")
    for s in range(3, 6):
        copy_run(REAL / f"bf16_{s}_bf16_s{s}", sweep / f"copy_s{s}", recipe="copy")
    copy = arm(analysis.compare(analysis.load(sweep)), "copy")
    assert copy["interval"] == "Welch t, 95%, n=3" and copy["pairing"].startswith("unpaired")
    assert copy["verdict"] == "indistinguishable", copy["verdict_text"]
    assert copy["gap_rel_lo"] < 0 < copy["gap_rel_hi"]
    mde = copy["mde_rel"]
    assert 0 < mde < 0.2 and f"would detect >= {100 * mde:.2f}%" in copy["verdict_text"]
    for s in range(3, 6):
        copy_run(REAL / f"bf16_{s}_bf16_s{s}", sweep / f"planted_s{s}", recipe="planted", scale=1 + 2 * mde)
    table = analysis.compare(analysis.load(sweep))
    planted = arm(table, "planted")
    assert planted["verdict"] == "worse", planted["verdict_text"]
    assert planted["gap_rel_lo"] > 0 and planted["verdict_text"].startswith("worse than BF16 by")
    assert arm(table, "copy")["verdict"] == "indistinguishable"
    assert planted["rank"] > arm(table, "copy")["rank"]  # ranked below the indistinguishable one


def test_paired_planted_gap_is_worse(tmp_path: Path) -> None:
    """Real tensorwise seeds 0-2 paired with real BF16 seeds 0-2 (paired t on the per-seed
    differences); the same runs with the loss raised by twice their stated MDE are called worse."""
    sweep = tmp_path / "sweep"
    for s in range(3):
        shutil.copytree(REAL / f"bf16_{s}_bf16_s{s}", sweep / f"bf16_s{s}")
        shutil.copytree(REAL / f"tensorwise_{s}_tensorwise_s{s}", sweep / f"tw_s{s}")
    tw = arm(analysis.compare(analysis.load(sweep)), "tensorwise")
    assert tw["interval"] == "paired t, 95%, n=3" and tw["pairing"] == "paired by seed"
    mde = tw["mde_rel"]
    assert mde > 0
    for s in range(3):
        copy_run(
            REAL / f"tensorwise_{s}_tensorwise_s{s}", sweep / f"pl_s{s}", recipe="planted", scale=1 + 2 * mde
        )
    planted = arm(analysis.compare(analysis.load(sweep)), "planted")
    assert planted["verdict"] == "worse" and planted["gap_rel_lo"] > 0, planted["verdict_text"]


def test_gap_band_along_tokens_uses_the_same_interval(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for s in range(3):
        shutil.copytree(REAL / f"bf16_{s}_bf16_s{s}", sweep / f"bf16_s{s}")
        shutil.copytree(REAL / f"tensorwise_{s}_tensorwise_s{s}", sweep / f"tw_s{s}")
    runs = analysis.load(sweep)
    gaps = analysis.frames.gap_curves(runs.comparison)
    ev = gaps[(gaps["recipe"] == "tensorwise") & (gaps["metric"] == "loss/eval")]
    last = ev[ev["tokens"] == ev["tokens"].max()].iloc[0]
    tw = arm(analysis.compare(runs), "tensorwise")
    # the last point of the eval band is the final eval gap and its interval
    assert last["gap_rel"] == pytest.approx(tw["eval_gap_rel"], rel=1e-6)
    assert last["gap_rel_lo"] == pytest.approx(tw["eval_gap_rel_lo"], rel=1e-6)


def test_intervals_match_scipy() -> None:
    x = np.array([0.012, -0.004, 0.009, 0.001])
    iv = S.one_sample(x)
    ref = st.ttest_1samp(x, 0).confidence_interval(0.95)
    assert (iv.lo, iv.hi) == pytest.approx((ref.low, ref.high))
    a, b = np.array([3.1, 3.3, 3.2]), np.array([3.0, 3.05, 2.9, 3.1])
    w = S.welch(a, b)
    ref = st.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (w.lo, w.hi) == pytest.approx((ref.low, ref.high))
    # MDE: the gap found with 80% power, (t_.975 + t_.80) * SE
    assert iv.mde == pytest.approx((st.t.ppf(0.975, 3) + st.t.ppf(0.8, 3)) * x.std(ddof=1) / 2)


def test_verdict_words() -> None:
    worse = S.Interval(0.02, 0.01, 0.03, 0.005, 2, 3, "paired t", 0.015)
    assert S.verdict(worse) == ("worse", "worse than BF16 by 2.00% [+1.00, +3.00]%, material, >= 0.25%")
    better = S.Interval(-0.02, -0.03, -0.01, 0.005, 2, 3, "paired t", 0.015)
    assert S.verdict(better)[0] == "better" and "better than BF16 by 2.00%" in S.verdict(better)[1]
    same = S.Interval(0.001, -0.01, 0.012, 0.005, 2, 3, "paired t", 0.015)
    assert S.verdict(same)[1].startswith("indistinguishable from BF16 at this budget (would detect >= 1.50%")
    assert S.verdict(same, "at step 40 (seed 1; 1/3 seeds diverged)")[0] == "diverged"
    one = S.one_sample([0.01])
    assert math.isnan(one.lo) and S.verdict(one)[0] == "one seed"
