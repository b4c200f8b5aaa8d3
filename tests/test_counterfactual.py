"""Counterfactual telemetry (telemetry.candidates): rows per layer, role and candidate on the
emulated backend (a routed expert group's rows per group, each expert quantized on its own), training
unchanged to the bit (a dense and an MoE preset), candidates refused with one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from analysis import keys as A
from harness.numerics import counterfactual as C
from harness.numerics import telemetry as T
from harness.numerics.quantizers import make_quantizer
from harness.train import run
from tests.helpers import TINY, compose_cfg

CANDIDATES = "telemetry.candidates=[mxfp8,nvfp4,{name:blockwise,w_block_dim:1},int4_qat]"
RUN = [*TINY, "steps=3", "log_interval=1", "eval_interval=0", "checkpoint_interval=0", "backend=emulated",
       "hardware=cpu", "telemetry_interval=2"]  # fmt: skip


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def nvfp4_pair(tmp_path_factory):
    """An NVFP4 run (stochastic rounding: the run's own generator) with and without candidates."""
    out = {}
    for tag, extra in (("plain", []), ("cf", [CANDIDATES])):
        d = tmp_path_factory.mktemp(tag)
        assert run(compose_cfg(*RUN, "recipe=nvfp4", *extra), d).status == "completed"
        out[tag] = d
    return out


MOE_CANDIDATES = "telemetry.candidates=[mxfp8,tensorwise,int4_qat]"
GROUPS = [f"blocks.{i}.mlp.experts.fc{k}" for i in range(2) for k in (1, 2)]


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """qwen3_moe_tiny under NVFP4 (experts padded to 128 rows, stochastic rounding), 2 steps with
    and without candidates: the routed expert groups' operands go to the candidates too."""
    out = {}
    for tag, extra in (("plain", []), ("cf", [MOE_CANDIDATES])):
        d = tmp_path_factory.mktemp(f"moe_{tag}")
        cfg = compose_cfg(*RUN, "steps=2", "model=qwen3_moe_tiny", "recipe=nvfp4", *extra)
        assert run(cfg, d).status == "completed"
        out[tag] = d
    return out


@pytest.mark.parametrize(("pair", "steps"), [("nvfp4_pair", 3), ("moe_pair", 2)])
def test_candidates_leave_training_unchanged_to_the_bit(pair, steps, request):
    dirs = request.getfixturevalue(pair)
    curves = {
        tag: [(r["step"], r[A.LOSS_TRAIN], r.get(A.GRAD_NORM)) for r in _jsonl(d / A.METRICS_JSONL)
              if A.LOSS_TRAIN in r]
        for tag, d in dirs.items()
    }  # fmt: skip
    assert len(curves["plain"]) == steps
    assert curves["plain"] == curves["cf"]
    own = [r for r in _jsonl(dirs["cf"] / A.NUMERICS_JSONL) if A.TELEMETRY_CANDIDATE not in r]
    assert own == _jsonl(dirs["plain"] / A.NUMERICS_JSONL)  # the run's own rows, as they were


def test_expert_groups_get_rows_per_group(moe_pair):
    """One row per (expert group, role or GEMM, candidate), named as a stability override names the
    group; never one per expert. Tensorwise scales each expert on its own: the group's spread > 0."""
    rows = [r for r in _jsonl(moe_pair["cf"] / A.NUMERICS_JSONL) if A.TELEMETRY_CANDIDATE in r]
    got = {(r[A.TELEMETRY_LAYER], r[A.TELEMETRY_TENSOR], r[A.TELEMETRY_CANDIDATE]) for r in rows}
    for group in GROUPS:
        for c in ("mxfp8", "tensorwise"):
            assert {(group, t, c) for t in (*A.TELEMETRY_TENSORS, *A.TELEMETRY_GEMMS)} <= got
        assert (group, "weight", "int4_qat") in got and (group, "input", "int4_qat") not in got
    assert not [r for r in rows if T.EXPERT.match(r[A.TELEMETRY_LAYER])]  # no per-expert candidate row
    by = {(r[A.TELEMETRY_LAYER], r[A.TELEMETRY_TENSOR], r[A.TELEMETRY_CANDIDATE]): r for r in rows}
    assert by[("blocks.0.mlp.experts.fc1", "weight", "tensorwise")][A.TELEMETRY_SCALE_SPREAD] > 0
    assert all(0 <= r[A.TELEMETRY_REL_ERR] < 0.5 for r in rows if A.TELEMETRY_REL_ERR in r)


def test_expert_rows_quantize_each_expert_on_its_own():
    """forward_experts/backward_experts: each expert's rows and weight quantized with their own scale
    (as TE's GroupedLinear), the group's row over all experts' elements; an expert without rows casts
    no input and no gradient."""
    g = torch.Generator().manual_seed(1)
    sizes = ((24, 1.0), (0, 1.0), (8, 1e4))  # (rows, magnitude) per expert
    xs = [torch.randn(m, 64, generator=g).mul(s).to(torch.bfloat16) for m, s in sizes]
    ws = [torch.randn(16, 64, generator=g).mul(0.02).to(torch.bfloat16) for _ in xs]
    dys = [torch.randn(x.shape[0], 16, generator=g).to(torch.bfloat16) for x in xs]
    (cand,) = C.parse(["tensorwise"])
    cf = C.Counterfactual([cand])
    with cf.collect([]) as rows:
        cf.forward_experts("blocks.0.mlp.experts.fc1", xs, ws)
        cf.backward_experts("blocks.0.mlp.experts.fc1", dys)
    by = {r[T.TENSOR]: r for r in rows}
    assert {r[T.LAYER] for r in rows} == {"blocks.0.mlp.experts.fc1"} and len(rows) == 6
    quant = lambda role, t: make_quantizer(cand.recipe, role).quantize(t)  # noqa: E731 - one scale each
    qx = [quant("input", x) for x in xs if x.numel()]
    deq = torch.cat([q.dequantize().reshape(-1) for q in qx])
    src = torch.cat([x.float().reshape(-1) for x in xs])
    assert by["input"][T.SQNR_DB] == T.sqnr_db(src, deq)
    assert by["input"][T.SCALE] == float(qx[1].telemetry_scale())  # the expert holding the amax
    assert by["input"][T.SCALE_SPREAD] == pytest.approx(math.log2(float(qx[1].scale_inv / qx[0].scale_inv)))
    qw = [quant("weight", w).dequantize() for w in ws]
    live = zip((q.dequantize() for q in qx), (qw[0], qw[2]))  # the experts with rows
    ys = torch.cat([(x.float() @ w.t()).reshape(-1) for x, w in live])
    ref = torch.cat([(x.float() @ w.float().t()).reshape(-1) for x, w in zip(xs, ws)])
    assert by["fprop"][T.REL_ERR] == C.rel_err(ys, ref)
    one = C.Counterfactual([cand])  # a whole tensor per-tensor scaled would flush the small expert
    with one.collect([]) as whole:
        one.forward("blocks.0.mlp.fc1", torch.cat(xs), ws[0])
    assert whole[0][T.UNDERFLOW] > by["input"][T.UNDERFLOW] == 0.0


def test_rows_per_layer_role_and_candidate(nvfp4_pair):
    rows = [r for r in _jsonl(nvfp4_pair["cf"] / A.NUMERICS_JSONL) if A.TELEMETRY_CANDIDATE in r]
    layers = {f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    cands = {"mxfp8", "nvfp4", "blockwise + w_block_dim=1", "int4_qat"}
    assert {r[A.TELEMETRY_CANDIDATE] for r in rows} == cands
    assert {r["step"] for r in rows} == {1, 3}  # telemetry steps only
    got = {(r[A.TELEMETRY_LAYER], r[A.TELEMETRY_TENSOR], r[A.TELEMETRY_CANDIDATE]) for r in rows}
    for layer in layers:
        for c in cands:
            roles = ("weight",) if c == "int4_qat" else A.TELEMETRY_TENSORS
            assert {(layer, t, c) for t in (*roles, *A.TELEMETRY_GEMMS)} <= got
    for r in rows:
        if r[A.TELEMETRY_TENSOR] in A.TELEMETRY_GEMMS:
            assert 0 <= r[A.TELEMETRY_REL_ERR] < 0.5, r
        else:
            assert set(A.TELEMETRY_STATS) | {A.TELEMETRY_SCALE_SPREAD} <= set(r)
    by = {(r[A.TELEMETRY_TENSOR], r[A.TELEMETRY_CANDIDATE]): r for r in rows if r["step"] == 1
          and r[A.TELEMETRY_LAYER] == "blocks.0.mlp.fc1"}  # fmt: skip
    assert by[("fprop", "mxfp8")][A.TELEMETRY_REL_ERR] < by[("fprop", "nvfp4")][A.TELEMETRY_REL_ERR]
    assert by[("wgrad", "int4_qat")][A.TELEMETRY_REL_ERR] == 0.0  # INT4 QAT: bf16 x and dy
    assert by[("weight", "mxfp8")][A.TELEMETRY_SCALE_SPREAD] > 0


def test_candidate_rows_match_the_emulator():
    """A candidate's rows are the quantizer's own: SQNR as tensor_row reads it, the fprop error of
    the dequantized operands' product; dgrad from W's columnwise copy."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(32, 128, generator=g) * 0.02).to(torch.bfloat16)
    dy = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    (cand,) = C.parse(["blockwise"])
    cf = C.Counterfactual([cand])
    with cf.collect([]) as rows:
        cf.forward("blocks.0.mlp.fc1", x, w)
        cf.backward("blocks.0.mlp.fc1", dy)
    by = {r[T.TENSOR]: r for r in rows}
    qx = make_quantizer(cand.recipe, "input").quantize(x)
    qw = make_quantizer(cand.recipe, "weight").quantize(w)
    assert by["input"][T.SQNR_DB] == T.tensor_row("l", "input", x, qx)[T.SQNR_DB]
    ref = x.float() @ w.float().t()
    assert by["fprop"][T.REL_ERR] == C.rel_err(qx.dequantize() @ qw.dequantize().t(), ref)
    wc = make_quantizer(cand.recipe, "weight").quantize(w, True).dequantize()
    assert by["dgrad"][T.REL_ERR] == C.rel_err(
        make_quantizer(cand.recipe, "grad").quantize(dy).dequantize() @ wc, dy.float() @ w.float()
    )
    assert by["weight"][T.SCALE_SPREAD] == 0.0  # 128x128 tiles: one block here
    assert by["input"][T.SCALE_SPREAD] > 0 and math.isfinite(by["input"][T.SCALE_SPREAD])


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("delayed", "use tensorwise"),
        ("bf16", "quantizes nothing"),
        ("fp9", "give a recipe name"),
        ({"name": "nvfp4", "bogus": 1}, "unknown recipe field"),
    ],
)
def test_bad_candidates_are_refused_in_one_line(entry, says):
    with pytest.raises(ValueError, match=says) as e:
        C.parse(["mxfp8", entry])
    assert "telemetry.candidates[1]" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("candidates", "says"),
    [
        ("[mxfp8],[delayed]", "telemetry.candidates[0]=delayed: its scale needs the amax history"),
        ("[mxfp8],[mxfp8,mxfp8]", "telemetry.candidates: ['mxfp8', 'mxfp8'] names a candidate twice"),
    ],
)
def test_bad_candidates_are_refused_before_any_job_runs(candidates, says, tmp_path, capsys):
    """Validation parses telemetry.candidates: a multirun whose second job lists a bad one exits 2
    with one line before its first job starts (no sweep directory), as `lowp-train` does for any rule."""
    from harness.train import main
    from tests.helpers import run_main

    args = ["-m", "model=gpt_tiny", "steps=1", "logger=none", "backend=emulated", "hardware=cpu",
            "telemetry_interval=1", f"telemetry.candidates=choice({candidates})",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    code, err = run_main(capsys, main, "harness.train", *args)
    (line,) = err.strip().splitlines()
    assert code == 2 and line.startswith("error: job 1 (") and says in line, err
    assert not (tmp_path / "sweep").exists()


def test_candidates_without_telemetry_steps_warn():
    from harness.config.errors import ConfigWarning
    from harness.validation import load

    with pytest.warns(ConfigWarning, match="telemetry.candidates is set but telemetry_interval=0"):
        load([*TINY, "backend=emulated", "hardware=cpu", "telemetry.candidates=[mxfp8]"])


def test_a_failing_candidate_gemm_warns_and_never_breaks_the_step():
    (cand,) = C.parse(["mxfp8"])
    cf = C.Counterfactual([cand])
    x, w = torch.ones(64, 128), torch.ones(32, 64)  # K mismatch: the candidate GEMM cannot run
    with pytest.warns(C.CounterfactualWarning, match="1 GEMM\\(s\\) gave no rows, first: RuntimeError"):
        with cf.collect([]) as rows:
            cf.forward("blocks.0.mlp.fc1", x, w)
            cf.backward("blocks.0.mlp.fc1", torch.ones(64, 32))  # nothing saved for it: no row, no error
    assert [r for r in rows if r[T.TENSOR] == "fprop"] == []
