"""The benchmarks on the CPU: every module imports and answers --help, every spec file parses, names
only existing options and config fields, and composes; the throughput anchor shape comes from
conf/model. The GPU runs themselves are in benchmarks/RESULTS.md."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from pathlib import Path

import pytest

import benchmarks
from benchmarks import specs
from benchmarks.throughput import anchor_shape
from tests.helpers import compose_cfg

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")
    if hasattr(importlib.import_module(m.name), "main")
)


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_answers_help(name, capsys):
    mod = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    first_line = " ".join((mod.__doc__ or "").split("\n\n")[0].split())
    assert out.startswith("usage: python -m ") and first_line in " ".join(out.split())  # rewrapped or not


def test_the_runner_lists_every_spec(capsys):
    assert importlib.import_module("benchmarks.__main__").main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == specs.names() and len(listed) >= 15


@functools.cache
def composes(overrides: tuple[str, ...]) -> bool:
    """Compose (unknown groups and keys fail) and, for fixed hardware presets, validate as the GPU run
    will (backend.te_version stands in for TE); hardware=auto resolves to this CPU, so compose only.
    Cached: the fidelity specs share most of their configs."""
    (specs.compose_only if "hardware=auto" in overrides else specs.load_config)(list(overrides))
    return True


@pytest.mark.parametrize("name", specs.names())
def test_every_spec_names_existing_options_and_config_fields(name):
    spec = specs.load_spec(name)
    mod = specs.module(spec.benchmark)
    opts = specs.options_for(mod.Options, spec.options, f"spec {name}")
    for label, overrides in mod.plan(spec, opts).items():
        assert label and composes(tuple(overrides))
    assert spec.description


def test_bad_specs_fail_in_one_line_naming_the_fix(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("benchmark: throughput\nruns: {a: [recipe=bf16]}\nextra: 1\n")
    with pytest.raises(specs.SpecError, match=r"unknown key\(s\) \['extra'\]"):
        specs.load_spec(path)
    path.write_text("benchmark: throughput\noptions: {bare_loop: false}\n")
    spec = specs.load_spec(path)
    with pytest.raises(specs.SpecError, match=r"unknown option\(s\) \['bare_loop'\].*'bare'"):
        specs.options_for(importlib.import_module("benchmarks.throughput").Options, spec.options, "spec bad")
    path.write_text("benchmark: throughput\nruns: {a: [recipe=bf16, optimizer.nope=1]}\n")
    spec = specs.load_spec(path)
    opts = importlib.import_module("benchmarks.throughput").Options()
    with pytest.raises(specs.SpecError, match="spec bad, run a: Could not override 'optimizer.nope'"):
        specs.check(spec, opts, validate=False)
    with pytest.raises(specs.SpecError, match="no such file"):
        specs.load_spec("no_such_spec")


def test_a_spec_from_the_command_line_runs_with_its_module_only(capsys, tmp_path):
    assert (
        importlib.import_module("benchmarks.curves").main(["--spec", "anchor_1b", "--out", str(tmp_path)])
        == 2
    )
    assert "for benchmarks.throughput" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_command_line_flags_win_over_the_spec():
    mod = importlib.import_module("benchmarks.throughput")
    parser = __import__("argparse").ArgumentParser()
    specs.add_arguments(parser, mod.Options)
    args = parser.parse_args(["--spec", "fusedadam_1b", "--bare", "--recipes", "bf16", "steps=4"])
    spec, opts = specs.from_args(args, mod.Options, "throughput")
    assert opts.bare is True and opts.recipes == ("bf16",) and opts.anchor == ""
    assert spec.overrides[-1] == "steps=4"
    assert spec.run_overrides()["tw_fp8states_fp32g"][-2:] == ["recipe=tensorwise", "optimizer=fp8_states"]


def test_anchor_shape_is_read_from_conf_model():
    cfg = compose_cfg("experiment=h200_1b")
    assert anchor_shape(cfg) == (50304, 2048, 24, 16, 8192, 2048, 8)  # anchors.md's 1.4B row
    cfg = compose_cfg("experiment=h200_8b_slice")
    assert anchor_shape(cfg) == (50304, 4096, 6, 32, 16384, 4096, 2)
    assert anchor_shape(compose_cfg("model=gpt_tiny", "model.activation=swiglu")) is None


def test_emulator_overhead_runs_on_the_cpu(tmp_path):
    import json

    from benchmarks import emulator_overhead as eo

    argv = ["--out", str(tmp_path), "--model", "gpt_tiny", "--batch", "2", "--steps", "2", "--warmup", "1"]
    assert eo.main([*argv, "--recipes", "tensorwise"]) == 0
    (path,) = tmp_path.glob("emulator_overhead_cpu_*.json")
    res = json.loads(path.read_text())
    assert list(res["rows"]) == ["bf16", "tensorwise"] and res["rows"]["bf16"]["wall_ratio"] == 1.0
    assert res["rows"]["tensorwise"]["wall_s"] > 0 and res["_meta"]["options"]["model"] == "gpt_tiny"


def test_curves_trains_and_collects_each_run_a_failing_one_too(tmp_path):
    import json

    from tests.helpers import TINY

    spec = tmp_path / "tiny_curves.yaml"
    runs = {
        "bf16": ["recipe=bf16"],
        "bad": ["recipe=tensorwise", "data=memmap", "data.path=/no/such/file.bin"],
    }
    overrides = [*TINY, "steps=4", "eval_interval=4"]
    spec.write_text(json.dumps({"benchmark": "curves", "overrides": overrides, "runs": runs}))  # JSON is YAML
    code = importlib.import_module("benchmarks.curves").main(
        ["--spec", str(spec), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    )
    assert code == 0
    (path,) = (tmp_path / "out").glob("tiny_curves_cpu_*.json")
    res = json.loads(path.read_text())
    assert res["runs"]["bf16"]["summary"]["status"] == "completed" and len(res["runs"]["bf16"]["train"]) == 2
    assert (tmp_path / "work" / "runs" / "bf16" / "summary.json").exists()
    assert list(res["errors"]) == ["bad"] and "no such file" in res["errors"]["bad"]  # and bf16 kept


@pytest.mark.slow
def test_throughput_runs_the_harness_row_on_the_cpu(tmp_path, capsys):
    import json

    from benchmarks import throughput
    from tests.helpers import TINY

    argv = [
        "--out",
        str(tmp_path),
        "--work",
        str(tmp_path / "w"),
        "--no-bare",
        "--recipes",
        "bf16,tensorwise",
    ]
    assert (
        throughput.main(
            [*argv, *TINY, "steps=3", "data.num_tokens=20000", "eval_tokens=512", "backend=emulated"]
        )
        == 0
    )
    (path,) = tmp_path.glob("throughput_cpu_*.json")
    runs = json.loads(path.read_text())["runs"]
    assert list(runs) == ["bf16", "tensorwise"] and runs["tensorwise"]["summary"]["status"] == "completed"
    assert runs["bf16"]["anchor"] is None and "error" not in runs["tensorwise"]
    assert "1.00x" in capsys.readouterr().out  # BF16 against itself in the table


def test_quantizer_cases_are_accepted_by_lowp():
    """Every case's lowp kwargs quantize (on the CPU here; on the GPU they are compared with TE)."""
    import torch

    from benchmarks.fidelity import quantizers as q

    gen = torch.Generator().manual_seed(0)
    for name, kind, te_kw, recipe, kw in q.cases():
        x = q.make_input("outliers", (300, 200), gen)
        scale = q.delayed_scale(x, te_kw, gen) if kind == "delayed" else None
        got = q.valid_region(q.lowp_quantize(recipe, kw, x, scale), kind, te_kw, tuple(x.shape))
        assert q.mismatches(got, got) == dict.fromkeys(got, 0), name


@pytest.mark.slow
@pytest.mark.slow
def test_fidelity_parts_run_on_the_emulated_backend():
    """The emulated half of the TE comparison (the TE half needs a GPU): a curve from given weights,
    step-0 gradients, the 1-ulp bump and the band-free judgement."""
    import torch

    from benchmarks.fidelity import common, grads, te_vs_emulated
    from tests.helpers import TINY

    small = ("data.num_tokens=20000", "eval_tokens=512", "eval_interval=2")
    setup = common.Setup(overrides=(*common.BASE, *TINY, *small), run_dir=Path("."))
    em, sd = common.emulated_start(setup, "tensorwise")
    assert all(torch.equal(v, v.to(torch.bfloat16).to(v.dtype)) for v in sd.values() if v.is_floating_point())
    ov = ["recipe=tensorwise", "backend=emulated"]
    a, b = common.curve(setup, ov, 3, sd), common.curve(setup, ov, 3, sd)
    assert a["train"] == b["train"] and a["eval"] == b["eval"] and not a["errors"]  # same weights, same curve
    g = grads.step0_grads(setup, ov, sd)
    assert set(g["grads"]) == set(sd) and g["loss"] > 0
    bumped = grads.bump_ulps(sd, frac=0.5)
    w = "blocks.0.mlp.fc1.weight"
    assert 0 < int((bumped[w] != sd[w]).sum()) < sd[w].numel() and torch.equal(
        bumped["ln_f.weight"], sd["ln_f.weight"]
    )
    judged = te_vs_emulated.judge(a, b, [])
    assert judged["train"]["max_pair_diff"] == 0.0


def test_a_missing_anchor_script_stops_before_any_run(tmp_path, capsys, monkeypatch):
    # the spec's anchor path is relative to the working directory: run from one without .gpu/
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    (tmp_path / "out").mkdir()
    tmp_path = tmp_path / "out"
    argv = ["anchor_1b", "fusedadam_1b", "--out", str(tmp_path)]
    assert importlib.import_module("benchmarks.__main__").main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "option anchor=.gpu/anchor_gpt.py: no such file" in err
    assert not list(tmp_path.iterdir())


def test_operand_check_knows_every_hopper_recipe_s_te_quantizer():
    """te_vs_emulated's operand part maps each FP8 recipe TE runs on Hopper to TE's quantizer kind."""
    from benchmarks.fidelity.operands import te_kind
    from harness.numerics import resolve_recipe

    names = ("delayed", "tensorwise", "blockwise")
    kinds = {name: te_kind(resolve_recipe(name), "input")[0] for name in names}
    assert kinds == {"delayed": "delayed", "tensorwise": "current", "blockwise": "block"}
