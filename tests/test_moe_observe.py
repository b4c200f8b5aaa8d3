"""What an MoE user looks at: the load metrics of each MoE layer and step (tokens per expert max/mean,
experts without tokens, router entropy, dropped tokens, the router losses per layer), the telemetry
rows of each layer's worst experts with the others summed up, and the report's MoE part (the worst
expert, the load balance against BF16's seed band). All in-process."""

from __future__ import annotations

import json
import math

import pytest
import torch

from analysis import frames, report
from analysis import moe as AM
from harness import train as T
from harness.lifecycle import metrics as M
from harness.model.moe import load_metrics, routing_stats
from harness.numerics import telemetry as TM
from harness.train import run
from tests.analysis.conftest import write_run
from tests.helpers import compose_cfg, run_main

RUN = ["backend=emulated", "hardware=cpu", "logger=none", "eval_interval=0", "eval_tokens=512"]
RUN += ["data.num_tokens=20000", "optimizer.warmup_steps=1", "checkpoint_interval=-1"]


def _map(rows: list[list[int]], experts: int) -> torch.Tensor:
    m = torch.zeros(len(rows), experts, dtype=torch.bool)
    for t, chosen in enumerate(rows):
        m[t, chosen] = True
    return m


# -- the load metrics ------------------------------------------------------------------------------------


def test_load_metrics_of_a_hand_built_routing():
    # 4 tokens, top-2 of 4 experts: counts [4, 3, 1, 0] routed; capacity keeps [2, 2, 1, 0]
    routed = _map([[0, 1], [0, 1], [0, 2], [0, 1]], 4)
    kept = _map([[0, 1], [0, 1], [2], []], 4)
    uniform = torch.zeros(4, 4)  # softmax: every token's scores uniform, entropy ln 4
    peaked = torch.tensor([[30.0, 0, 0, 0]] * 4)  # all on expert 0: entropy ~0
    stats = torch.stack([
        routing_stats(uniform, routed, kept, "softmax"),
        routing_stats(peaked, routed, routed, "softmax"),
    ])  # fmt: skip
    assert stats[0, :4].tolist() == [2, 2, 1, 0] and stats[0, 4:8].tolist() == [4, 3, 1, 0]
    got = {k: v.item() for k, v in load_metrics(stats, [1, 3], dropping=True).items()}
    assert got["tokens_per_expert_max_mean_layer_1"] == pytest.approx(2 / (5 / 4))  # max 2, mean 5 / 4
    assert got["tokens_per_expert_max_mean_layer_3"] == 4 / 2  # max 4, mean 8 / 4
    assert got["experts_without_tokens_layer_1"] == got["experts_without_tokens_layer_3"] == 0.25
    assert got["router_entropy_layer_1"] == pytest.approx(math.log(4), rel=1e-6)
    assert got["router_entropy_layer_3"] == pytest.approx(0.0, abs=1e-9)
    assert got["dropped_tokens_layer_1"] == pytest.approx(1 - 5 / 8) and got["dropped_tokens_layer_3"] == 0
    for name in ("tokens_per_expert_max_mean", "experts_without_tokens", "router_entropy", "dropped_tokens"):
        assert got[name] == pytest.approx((got[f"{name}_layer_1"] + got[f"{name}_layer_3"]) / 2)
    assert "dropped_tokens" not in load_metrics(stats, [1, 3], dropping=False)
    # sigmoid scores are normalized over the experts before the entropy: equal logits, ln 4 again
    sig = routing_stats(torch.full((4, 4), 3.0), routed, routed, "sigmoid")
    assert sig[-2].item() / sig[-1].item() == pytest.approx(math.log(4), rel=1e-6)


def test_a_moe_run_logs_each_layers_load_and_the_worst_experts_telemetry(tmp_path):
    """Two micro-batches in the step, a capacity factor, telemetry with 1 expert kept whole."""
    cfg = compose_cfg("model=qwen3_moe_tiny", *RUN, "recipe=tensorwise", "steps=1", "log_interval=1",
                      "micro_batch_size=2", "global_batch_size=4", "telemetry_interval=1",
                      "telemetry.moe_experts_per_layer=1", "model.moe_expert_capacity_factor=1.0",
                      "eval_tokens=0")  # fmt: skip
    assert run(cfg, tmp_path).status == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if M.LOSS_TRAIN in r]
    E = cfg.model.num_moe_experts
    for r in train:
        for key in (M.MOE_TOKENS_PER_EXPERT_MAX_MEAN, M.MOE_EXPERTS_WITHOUT_TOKENS, M.MOE_ROUTER_ENTROPY,
                    M.MOE_DROPPED_TOKENS, M.MOE_LOAD_BALANCING_LOSS):  # fmt: skip
            per_layer = [r[M.moe_layer_key(key, i)] for i in (0, 1)]
            assert r[key] == pytest.approx(sum(per_layer) / 2, rel=1e-6), key
        assert all(1 <= r[M.moe_layer_key(M.MOE_TOKENS_PER_EXPERT_MAX_MEAN, i)] <= E for i in (0, 1))
        assert 0 < r[M.MOE_ROUTER_ENTROPY] <= math.log(E) + 1e-6
        assert 0 <= r[M.MOE_DROPPED_TOKENS] < 1 and 0 <= r[M.MOE_EXPERTS_WITHOUT_TOKENS] < 1
    numerics = [json.loads(line) for line in (tmp_path / "numerics.jsonl").read_text().splitlines()]
    step1 = [r for r in numerics if r["step"] == 1]
    for layer in (0, 1):
        experts = {r["layer"] for r in step1 if r["layer"].startswith(f"blocks.{layer}.mlp.experts.")}
        whole = {name.rsplit(".", 1)[1] for name in experts if name.rsplit(".", 1)[1].isdigit()}
        assert len(whole) == 1, experts  # one expert kept whole, in fc1 and fc2
        assert experts - {f"blocks.{layer}.mlp.experts.{fc}.{e}" for fc in ("fc1", "fc2") for e in whole} == {
            f"blocks.{layer}.mlp.experts.{fc}.{how}" for fc in ("fc1", "fc2") for how in TM.OTHERS
        }
    assert any(r["layer"] == "blocks.0.attn.qkv" for r in step1)  # dense rows as they were


def test_a_negative_experts_per_layer_is_refused(capsys):
    code, err = run_main(capsys, T.main, "harness.train", "model=qwen3_moe_tiny", *RUN,
                         "telemetry.moe_experts_per_layer=-1")  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "telemetry.moe_experts_per_layer=-1: out of range" in lines[0]


# -- the telemetry rows of the experts -------------------------------------------------------------------


def _expert_rows(layer: int, sqnr: dict[int, float]) -> list[dict]:
    """Rows of each expert's fc1/fc2 operands; an expert with SQNR None had no tokens (weight rows only)."""
    rows = []
    for fc in ("fc1", "fc2"):
        for e, q in sqnr.items():
            for tensor in ("input", "weight", "grad"):
                if q is None and tensor != "weight":
                    continue
                value = (q if q is not None else 40.0) + (1.0 if tensor == "weight" else 0.0)
                rows.append({TM.LAYER: f"blocks.{layer}.mlp.experts.{fc}.{e}", TM.TENSOR: tensor,
                             TM.AMAX: float(e), TM.SCALE: 1.0, TM.UNDERFLOW: 0.01 * e, TM.SATURATION: None,
                             TM.SQNR_DB: value})  # fmt: skip
    return rows


def test_expert_rows_keep_the_worst_experts_and_sum_up_the_others():
    dense = {TM.LAYER: "blocks.0.attn.qkv", TM.TENSOR: "input", TM.SQNR_DB: 30.0}
    layer0 = _expert_rows(0, {0: 25.0, 1: 20.0, 2: 30.0, 3: 20.0, 4: None, 5: 28.0})
    layer1 = _expert_rows(1, {0: 35.0, 1: 10.0, 2: 31.0})
    rows = [dense, *layer0, *layer1]
    out = TM.expert_rows(rows, 2)
    assert out[0] is dense
    kept0 = {r[TM.LAYER] for r in out if r[TM.LAYER].startswith("blocks.0.") and r[TM.LAYER][-1].isdigit()}
    assert kept0 == {f"blocks.0.mlp.experts.{fc}.{e}" for fc in ("fc1", "fc2") for e in (1, 3)}  # tie: lower
    others = {(r[TM.LAYER], r[TM.TENSOR]): r for r in out if not r[TM.LAYER][-1].isdigit()}
    # layer 0's others are experts 0, 2, 4, 5: input SQNR 25, 30, 28 (expert 4 had no tokens)
    assert others[("blocks.0.mlp.experts.fc1.max", "input")][TM.SQNR_DB] == 30.0
    assert others[("blocks.0.mlp.experts.fc1.median", "input")][TM.SQNR_DB] == 28.0
    assert others[("blocks.0.mlp.experts.fc2.median", "weight")][TM.SQNR_DB] == (29.0 + 31.0) / 2
    assert others[("blocks.0.mlp.experts.fc1.max", "weight")][TM.UNDERFLOW] == 0.05
    assert others[("blocks.0.mlp.experts.fc1.max", "grad")][TM.SATURATION] is None
    assert {k for k in others if k[0].startswith("blocks.1.")} == {
        (f"blocks.1.mlp.experts.{fc}.{how}", t) for fc in ("fc1", "fc2") for how in TM.OTHERS
        for t in ("input", "weight", "grad")
    }  # fmt: skip
    assert len(out) == 1 + (2 * 2 * 3) * 2 + (2 * 3 * 2) * 2  # dense, 2 experts x 2 fc x 3, others
    assert TM.expert_rows(rows, 6) == rows  # every expert whole: nothing to sum up
    only = TM.expert_rows(rows, 0)
    assert all(not r[TM.LAYER][-1].isdigit() for r in only[1:]) and len(only) == 1 + 2 * 12


# -- the report ------------------------------------------------------------------------------------------


def _moe_sweep(root, load: dict[str, list[float]]) -> None:
    """Completed MoE runs: per recipe, one run per seed whose tokens-per-expert max/mean is the given
    value (the others constant), and for the low-precision recipes expert telemetry where expert 3 of
    layer 1 is the worst under nvfp4."""
    for recipe, values in load.items():
        for seed, value in enumerate(values):
            d = write_run(root, f"{recipe}_s{seed}", recipe=recipe, seed=seed, model="qwen3_moe_tiny",
                          telemetry=False)  # fmt: skip
            path = d / "metrics.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            for r in rows:
                if "loss/train" in r:
                    r.update({AM.LOAD: value, "moe/experts_without_tokens": 0.0, "moe/router_entropy": 1.9})
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            if recipe == "bf16":
                continue
            with open(d / "numerics.jsonl", "w") as f:
                for step in (50, 100, 150):
                    for e, q in ((3, 9.0 if recipe == "nvfp4" else 29.0), (5, 21.0)):
                        f.write(json.dumps({"step": step, "layer": f"blocks.1.mlp.experts.fc2.{e}",
                                            "tensor": "grad", "sqnr_db": q}) + "\n")  # fmt: skip
                    f.write(json.dumps({"step": step, "layer": "blocks.1.mlp.experts.fc2.median",
                                        "tensor": "grad", "sqnr_db": 24.0}) + "\n")  # fmt: skip


def test_the_report_names_the_worst_expert_and_warns_when_load_balance_leaves_the_bf16_band(tmp_path):
    _moe_sweep(tmp_path / "sweep", {
        "bf16": [1.20, 1.22, 1.21], "tensorwise": [1.21, 1.22, 1.20], "nvfp4": [1.50, 1.55, 1.52],
    })  # fmt: skip
    runs = frames.load([str(tmp_path / "sweep")])
    comparison = frames.comparison_of(runs)
    (g,) = comparison.groups
    section = AM.moe_section(g, runs.numerics)
    rows = {r["recipe"]: r for r in section["rows"]}
    nv, tw = rows["nvfp4 (emulated)"], rows["tensorwise (emulated)"]
    assert nv["departs"] and not tw["departs"]
    assert nv[AM.LOAD] == pytest.approx((1.50 + 1.55 + 1.52) / 3)
    assert nv["verdict"].startswith("less balanced than BF16 by 25.")  # (1.523 - 1.21) / 1.21
    assert tw["verdict"].startswith("indistinguishable from BF16") and tw["interval"] == "paired t"
    (warning,) = section["warnings"]
    assert warning.startswith("nvfp4 (emulated): load balance departs from BF16's seed band")
    experts = "\n".join(section["experts"])
    assert "nvfp4 (emulated): worst expert blocks.1.mlp.experts.3: fc2 grad SQNR 9.0 dB" in experts
    assert "9 of 9 telemetry steps" in experts and "the other experts' median 24.0 dB" in experts
    assert "tensorwise (emulated): worst expert blocks.1.mlp.experts.5: fc2 grad SQNR 21.0 dB" in experts
    report.write_report(runs, comparison, tmp_path / "out", ["sweep"], figures=False)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "### MoE: load balance and experts" in md and warning in md and "worst expert blocks.1" in md
    assert "tokens per expert max/mean" in (tmp_path / "out" / "report.html").read_text()
    assert (tmp_path / "out" / "moe.csv").read_text().count("\n") == 4  # header + 3 arms
    assert "warning: nvfp4 (emulated): load balance departs" in report.terminal_table(
        comparison, runs.numerics
    )


def test_a_dense_group_has_no_moe_section(tmp_path):
    write_run(tmp_path, "bf16_s0", telemetry=False)
    runs = frames.load([str(tmp_path)])
    (g,) = frames.comparison_of(runs).groups
    assert AM.moe_section(g, runs.numerics) is None
