"""MoE presets and sweeps: the H200 slices have the released models' layer shapes and validate,
moe_matrix is the Hopper matrix on the Qwen3-30B-A3B slice and its --dry-run lists every job with a
verdict, and the CPU sweep runs end to end with its MoE report (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.backends import build_backend
from harness.model.gpt import count_params
from harness.multirun import launch as S
from harness.multirun.spec import build_jobs, key_of
from harness.train import backend_spec
from harness.validation.load import prepare
from tests.helpers import compose_cfg, run_cli

SLICES = {  # (layers, hidden, heads, kv groups, head size, experts, top-k, expert width, vocab), params
    "qwen3_30b_a3b_slice": ((6, 2048, 32, 4, 128, 128, 8, 768, 151936), 4.361e9),
    "mixtral_8x7b_slice": ((3, 4096, 32, 8, 128, 8, 2, 14336, 32000), 4.616e9),
}


@pytest.mark.parametrize("name", SLICES)
def test_the_moe_slices_have_the_released_layer_shapes_and_validate(name):
    shape, params = SLICES[name]
    cfg = prepare(compose_cfg(f"experiment=h200_{name}", "backend=emulated"))
    m = cfg.model
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels,
            m.num_moe_experts, m.moe_router_topk, width, m.vocab_size) == shape  # fmt: skip
    assert (m.seq_length, cfg.micro_batch_size) == (4096, 1)
    with torch.device("meta"):  # the parameters the memory estimate of docs/moe.md counts
        model = build_backend(backend_spec(cfg), torch.device("meta")).build_model()
    assert count_params(model)["total"] == pytest.approx(params, rel=1e-3)


def _values(job, key):
    return [o.split("=", 1)[1] for o in job.overrides if key_of(o) == key]


def test_moe_matrix_dry_run_lists_its_jobs_with_verdicts(capsys, tmp_path):
    jobs, _ = build_jobs("moe_matrix", [])
    assert {(_values(j, "backend")[0], _values(j, "recipe")[0]) for j in jobs} == {
        ("te", r) for r in ("bf16", "delayed", "tensorwise", "blockwise")
    } | {("emulated", "mxfp8"), ("emulated", "nvfp4")}
    assert {_values(j, "model")[0] for j in jobs} == {"qwen3_30b_a3b_slice"} and len(jobs) == 18
    # one seed and a smaller markov stream than the file's (the data check builds it): 6 verdicts
    small = ["seed=0", "data.num_tokens=400000", "eval_tokens=8192", f"hydra.sweep.dir={tmp_path / 's'}"]
    code = S.main(["moe_matrix", "--dry-run", *small])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    verdicts = {}
    for name in (
        "0_bf16_s0",
        "1_delayed_s0",
        "2_tensorwise_s0",
        "3_blockwise_s0",
        "4_mxfp8_s0",
        "5_nvfp4_s0",
    ):
        (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
        verdicts[name] = line[len(name) :].strip()
    assert verdicts["4_mxfp8_s0"] == "ok" and verdicts["5_nvfp4_s0"].startswith("ok; warning: recipe=nvfp4")
    hopper = ("bf16", "delayed", "tensorwise", "blockwise")
    te = [v for n, v in verdicts.items() if n[2:].split("_")[0] in hopper]
    assert te == ["ok"] * 4 and code == 0, te  # MoE blocks run on TE
    assert "6 jobs (0 finished, 6 to run" in text and not (tmp_path / "s").exists()


@pytest.mark.slow
def test_the_cpu_moe_sweep_runs_end_to_end_with_its_report(tmp_path):
    """moe_matrix_cpu cut to one seed and one step (every arm, with telemetry): 6 jobs, run one after
    the other in one process (Hydra's basic launcher, one thread: the model is tiny), and the report."""
    out = tmp_path / "sweep"
    small = ["seed=0", "steps=1", "log_interval=1", "telemetry_interval=1", "eval_interval=0",
             "eval_tokens=0", "data.num_tokens=20000", "logger=none", "hydra/launcher=basic",
             f"hydra.sweep.dir={out}"]  # fmt: skip
    args = ["-m", "harness.sweep", "moe_matrix_cpu", *small]
    proc = run_cli(args, timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    statuses = [json.loads((d / "summary.json").read_text())["status"] for d in out.glob("*_s0")]
    assert statuses == ["completed"] * 6
    md = (out / "report" / "report.md").read_text()
    assert "### MoE: load balance and experts" in md and "tokens per expert max/mean" in md
    assert "nvfp4 (emulated): worst expert blocks." in md
    assert "-- MoE load balance" in proc.stdout
