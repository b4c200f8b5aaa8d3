"""analysis.seed_band: BF16 seeds make the band, every other run is judged against its own seed's BF16 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis import seed_band

STEPS = (50, 100, 150)
BAND_EVALS = [(4.0, 3.5, 3.2), (4.1, 3.6, 3.3), (4.2, 3.4, 3.1)]


def run(recipe: str, seed: int, ev, status: str = "completed") -> dict:
    return {
        "summary": {"status": status, "recipe": recipe, "seed": seed},
        "eval": [[s, v] for s, v in zip(STEPS, ev, strict=True)],
        "train": [[s, v + 0.01] for s, v in zip(STEPS, ev, strict=True)],
    }


def write(path, runs: dict) -> str:
    path.write_text(json.dumps({"_meta": {}, "runs": runs}))
    return str(path)


@pytest.fixture
def files(tmp_path):
    band = {
        "bf16_s0": run("bf16", 0, (4.0, 3.5, 3.2)),
        "bf16_s1": run("bf16", 1, (4.1, 3.6, 3.3)),
        "bf16_s2": run("bf16", 2, (4.2, 3.4, 3.1)),
    }
    # mean pairwise gaps: (.1 + .2 + .1) / 3 = .1333 at 50; (.1 + .1 + .2) / 3 at 100 and 150
    other = {
        "bf16_s0": run("bf16", 0, (9.0, 9.0, 9.0)),  # a seed seen before: the first file's run is kept
        "close_s0": run("close", 0, (4.05, 3.55, 3.25)),
        "close_s1": run("close", 1, (4.0, 3.6, 3.3)),
        "far_s0": run("far", 0, (4.0, 3.5, 3.4)),
        "far_s1": run("far", 1, (4.1, 3.6, 3.3)),
        "far_s7": run("far", 7, (4.0, 3.5, 3.2)),
        "dead_s0": run("dead", 0, (9.0, 9.0, 9.0), status="failed"),
    }
    return write(tmp_path / "band.json", band), write(tmp_path / "other.json", other)


def test_each_run_is_judged_against_the_bf16_run_of_its_seed(files):
    result = seed_band.judge(seed_band.load_runs(files))
    assert result["bf16_seeds"] == [0, 1, 2] and result["band_files"] == ["band.json"]
    assert [g for _, g in result["mean_pairwise_gap"]] == pytest.approx([0.4 / 3, 0.4 / 3, 0.4 / 3])
    close, far = result["recipes"]["close"], result["recipes"]["far"]
    assert close["holds"] and [x["violations"]["eval"] for x in close["runs"]] == [[], []]
    assert [x["seed"] for x in close["runs"]] == [0, 1]
    assert not far["holds"] and far["runs"][0]["violations"]["eval"] == [150]
    assert far["runs"][1]["violations"] == {"eval": [], "train": []}
    assert far["unpaired"] == ["far_s7"] and "dead" not in result["recipes"]
    assert far["runs"][0]["signed"]["eval"][2] == [150, pytest.approx(0.2)]
    assert far["runs"][0]["final"]["eval"] == 3.4


def test_cli_prints_the_verdicts_and_writes_them(files, tmp_path, capsys):
    out = tmp_path / "verdicts.json"
    assert seed_band.main([*files, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "close" in text and "holds on eval at 2 seed(s)" in text
    assert "far                          FAILS on eval at 2 seed(s)" in text and "far_s7" in text
    assert json.loads(out.read_text())["recipes"]["far"]["holds"] is False


def test_cli_errors_name_the_fix(files, tmp_path, capsys):
    assert seed_band.main([str(tmp_path / "nope.json")]) == 2
    assert "no such result file" in capsys.readouterr().err
    one = write(tmp_path / "one.json", {"bf16_s0": run("bf16", 0, (4.0, 3.5, 3.2))})
    assert seed_band.main([one]) == 2
    err = capsys.readouterr().err
    assert "1 BF16 seed(s)" in err and "at least two seeds" in err and err.count("\n") == 1
    short = run("close", 0, (4.0, 3.5, 3.2))
    short["eval"] = short["eval"][:2]
    mixed = write(tmp_path / "mixed.json", {"short_s0": short})
    assert seed_band.main([files[0], mixed]) == 2
    err = capsys.readouterr().err
    assert "run short_s0 (mixed.json) logs eval at other steps" in err and "eval_interval" in err


def test_a_field_override_is_its_own_arm():
    from analysis.seed_band import _arm

    old = "tensorwise_fp8headbwd_fastacc"
    assert _arm("tensorwise_fp8headbwd_fastacc_e4m3grad_s0", {"recipe": old}) == (
        "tensorwise + FP8 LM head backward + fast accumulation + e4m3grad"
    )
    assert _arm("tensorwise_fastacc_s2", {"recipe": "tensorwise_fastacc"}) == "tensorwise + fast accumulation"
    assert _arm("tensorwise", {"recipe": "tensorwise"}) == "tensorwise"
    assert _arm("bf16_s3", {"recipe": "bf16"}) == "bf16"
    assert _arm("nvfp4_nornht_s0", {"recipe": "nvfp4"}) == "nvfp4 + nornht"  # a family's field override
    # a run with a label says its fields itself; its name adds nothing
    new = {"recipe": "tensorwise", "recipe_label": "tensorwise + fast accumulation"}
    assert _arm("tensorwise_fastacc_s0", new) == "tensorwise + fast accumulation"
    assert _arm("bf16_s0", {"recipe": "bf16", "variant": "none+bf16_states"}) == "bf16 [none+bf16_states]"


def test_a_name_from_before_the_families_joins_its_label(files, tmp_path):
    """tensorwise_fastacc (before the families) and tensorwise labelled `+ fast accumulation` are one
    arm, judged against the band like any other."""
    new = run("tensorwise", 1, (4.15, 3.65, 3.35))
    new["summary"]["recipe_label"] = "tensorwise + fast accumulation"
    mixed = {
        "tensorwise_fastacc_s0": run("tensorwise_fastacc", 0, (4.05, 3.55, 3.25)),
        "tensorwise_fastacc_s1": new,
        "tensorwise_s0": run("tensorwise", 0, (4.0, 3.5, 3.2)),
    }
    result = seed_band.judge(seed_band.load_runs([files[0], write(tmp_path / "mixed.json", mixed)]))
    assert set(result["recipes"]) == {"tensorwise + fast accumulation", "tensorwise"}
    fastacc = result["recipes"]["tensorwise + fast accumulation"]
    assert [(x["label"], x["seed"]) for x in fastacc["runs"]] == [
        ("tensorwise_fastacc_s0", 0),
        ("tensorwise_fastacc_s1", 1),
    ]
    assert fastacc["holds"]


def test_real_result_files_group_by_family_and_label(capsys):
    """Two result files of the 8B slice (benchmarks/results, copied to tests/analysis/data/seed_band):
    BF16 seeds 0, 2, 3, 4 and runs named before the families (tensorwise_fastacc, tensorwise_fp8head,
    tensorwise_fp8head_fastacc) beside plain tensorwise."""
    data = Path(__file__).parent / "data" / "seed_band"
    paths = [
        data / "markov_300_8b_band_h200_2026-12-01.json",
        data / "markov_300_8b_fastacc_h200_2026-12-01.json",
    ]
    assert seed_band.main([str(p) for p in paths]) == 0
    text = capsys.readouterr().out
    result = seed_band.judge(seed_band.load_runs(paths))
    assert result["bf16_seeds"] == [0, 2, 3, 4]
    assert set(result["recipes"]) == {
        "tensorwise",
        "tensorwise + fast accumulation",
        "tensorwise + FP8 LM head",
        "tensorwise + FP8 LM head + fast accumulation",
    }
    fastacc = result["recipes"]["tensorwise + fast accumulation"]
    assert [x["seed"] for x in fastacc["runs"]] == [0, 2] and fastacc["unpaired"] == ["tensorwise_fastacc_s1"]
    assert "tensorwise + fast accumulation               FAILS on eval at 2 seed(s)" in text
    assert "tensorwise_fastacc " not in text  # the old name appears only as a run's label


def test_a_rerun_of_bf16_is_the_control_for_nondeterminism(files, tmp_path, capsys):
    band, other = files
    same = write(
        tmp_path / "same.json", {f"bf16_s{s}": run("bf16", s, ev) for s, ev in enumerate(BAND_EVALS)}
    )
    assert seed_band.main([band, other, "--rerun", same]) == 0
    out = capsys.readouterr().out
    assert "bf16 rerun                      0" in out and "bf16 rerun                   holds" in out
    assert "note:" not in out  # a deterministic rerun: the criterion can separate recipes here
    moved = [(4.0, 3.7, 3.2), (4.1, 3.6, 3.3), (4.2, 3.4, 3.1)]  # seed 0 leaves its trajectory at 100
    rerun = write(tmp_path / "rerun.json", {f"bf16_s{s}": run("bf16", s, ev) for s, ev in enumerate(moved)})
    assert seed_band.main([band, other, "--rerun", rerun, "--out", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "bf16 rerun                   FAILS on eval at 3 seed(s)" in out
    assert "note: BF16 against its own rerun FAILS at 3 seed(s) (evals [100])" in out
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["recipes"]["bf16 rerun"]["mean_abs_gap"][1] == [100, pytest.approx(0.2 / 3)]
    assert v["recipes"]["far"]["mean_abs_gap"][2] == [150, pytest.approx(0.1)]  # (0.2 + 0) / 2
    assert v["recipes"]["far"]["holds"] is False  # verdicts stay the criterion's


def test_a_rerun_without_bf16_runs_is_refused(files, tmp_path, capsys):
    band, other = files
    assert seed_band.main([band, "--rerun", other]) == 0  # other holds a bf16_s0: it is the rerun
    none = write(tmp_path / "none.json", {"close_s0": run("close", 0, (4.0, 3.5, 3.2))})
    assert seed_band.main([band, "--rerun", none]) == 2
    assert "--rerun" in capsys.readouterr().err


def test_seed_averaged_criterion_is_one_sided_and_keeps_a_penalty_every_seed_pays(files, tmp_path, capsys):
    band, _ = files
    # band 0.1333 at every eval; each arm's gaps per seed at 50, 100, 150
    arms = {
        "scatter": [(0.2, -0.2, 0.0), (-0.2, 0.2, 0.0), (0.0, 0.0, 0.1)],  # each seed leaves; no bias
        "biased": [(0.0, 0.15, 0.0), (0.0, 0.14, 0.0), (0.0, 0.12, 0.0)],  # every seed worse at 100
        "lower": [(-0.3, -0.3, -0.3)] * 3,  # better than BF16 everywhere
    }
    runs = {
        f"{arm}_s{s}": run(arm, s, tuple(b + g for b, g in zip(BAND_EVALS[s], gaps, strict=True)))
        for arm, per_seed in arms.items()
        for s, gaps in enumerate(per_seed)
    }
    other = write(tmp_path / "arms.json", runs)
    paired = seed_band.judge(seed_band.load_runs([band, other]))
    mean = seed_band.judge(seed_band.load_runs([band, other]), by="mean")
    assert [paired["recipes"][a]["holds"] for a in arms] == [False, False, False]
    assert [mean["recipes"][a]["holds"] for a in arms] == [True, False, True]
    assert mean["recipes"]["biased"]["mean_violations"] == [100]
    assert mean["recipes"]["biased"]["mean_gap"][1] == [100, pytest.approx(0.41 / 3)]
    assert mean["recipes"]["scatter"]["holds_paired"] is False and mean["criterion"] == "mean"
    assert seed_band.main([band, other, "--criterion", "mean"]) == 0
    out = capsys.readouterr().out
    assert "biased                       FAILS on eval at 3 seed(s) by the mean criterion" in out
    assert "(paired: FAILS, seed-averaged: holds)" in out
