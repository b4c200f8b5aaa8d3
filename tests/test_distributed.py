"""Data parallel on CPU with gloo: 2 and 4 real processes, started by the tests.

One spawned group runs many cases (the process group is started once, `run` joins it), so the
start-up cost is paid once per world size. What is compared, and why the tolerances are what they
are (docs/distributed.md):

- DDP, 2 ranks x 1 micro-batch vs 1 process x 2 micro-batches of the same sequences: bit-identical
  for every recipe whose casts do not depend on the micro-batch's position in the window
  (bf16, blockwise, nvfp4 without stochastic rounding): the 1-process gradient is g0/2 + g1/2 accumulated
  in that order, the 2-rank one g0/2 + g1/2 summed by gloo; fp addition of two terms is commutative.
- delayed scaling is compared against 1 process x 1 micro-batch of the whole global batch: the
  history advances once per micro-batch, so the 1-process, 2-micro-batch run uses a different scale
  for its second micro-batch. Its amaxes (MAX over the ranks) equal the whole batch's exactly.
- FSDP2 computes the gradient norm from the shards' partial sums (a different summation order):
  the norm differs in the last bits, so the clip coefficient and the weights do too. Losses then
  agree to REL = 1e-5 over these few steps (measured: < 3e-7; the bound leaves room for other BLAS).
- 4 ranks: gloo sums 4 partial gradients in its own order, against ((g0+g1)+g2)+g3: same REL.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch

from harness.validation import load
from tests.helpers import REPO, free_port, run_cli, serve_cases

pytestmark = pytest.mark.slow

BASE = [
    "model=gpt_tiny",
    "backend=emulated",
    "logger=none",
    "log_interval=1",
    "eval_interval=0",
    "eval_tokens=1024",
    "data.num_tokens=100000",
    "checkpoint_interval=-1",
    "micro_batch_size=2",
    "global_batch_size=4",
    "steps=3",
]
RECIPES = {
    "bf16": ["recipe=bf16"],
    "delayed": ["recipe=delayed"],
    "blockwise": ["recipe=blockwise"],
    "nvfp4": ["recipe=nvfp4", "recipe.disable_stochastic_rounding=true"],
}
REL = 1e-5
DELAYED_REL = 1e-4
"""Measured 1.8e-5 after 2 steps (gpt_tiny, lr warm-up); FP8 rounding boundaries amplify last-bit
differences of the gradient, so the bound is 5x the measurement, not derived from the bits."""


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _curve(run_dir: Path, key: str = "loss/train") -> list[float]:
    return [r[key] for r in _rows(run_dir) if r.get(key) is not None]


_SINGLE: dict[tuple, Path] = {}


def _single(tmp: Path, name: str, overrides: list[str]) -> Path:
    """A 1-process reference run in this process (once per config: DDP and FSDP2 share it)."""
    from harness.train import run

    key = tuple(overrides)
    if key not in _SINGLE:
        out = tmp / f"single-{name}"
        run(load(BASE + overrides), out)
        _SINGLE[key] = out
    return _SINGLE[key]


# -- the spawned group -------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, cases: list, report: str) -> None:
    serve_cases(rank, world, port, cases, report, CASES, "gloo")


def _case_run(overrides, run_dir):
    from harness.train import run

    summary = run(load(BASE + overrides), run_dir)
    return {"status": summary.status, "error": summary.error}


def _case_amax(overrides, run_dir):
    """One step; every rank's delayed-scaling state after it (forward and backward histories)."""
    from harness.parallel import process as D
    from harness.train import Trainer

    cfg = load(BASE + overrides)
    dist = D.Dist(D.launch_env(), cfg.parallel.strategy, None, "gloo")
    trainer = Trainer(cfg, run_dir, dist=dist)
    trainer.train_step(0)
    return _delayed(trainer)


def _delayed(trainer) -> dict:
    """{module: {forward|backward: (last amaxes, scales)}}: one update rolled the amaxes to [-1]."""
    st = trainer.backend.numerics.state_dict()["delayed"]
    return {
        name: {
            d: (e[d]["amax_history"][-1].tolist(), e[d]["scale"].tolist()) for d in ("forward", "backward")
        }
        for name, e in st.items()
    }


def _case_resume(overrides, run_dir):
    """Run to the end with a checkpoint at step 2, then again from that checkpoint."""
    from harness.train import run

    cfg = load(BASE + overrides + ["steps=4", "checkpoint_interval=2"])
    run(cfg, run_dir)
    again = Path(f"{run_dir}-resumed")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(run_dir, again)
        shutil.rmtree(again / "checkpoints" / "step_00000004")
    torch.distributed.barrier()
    run(load(BASE + overrides + ["steps=4", "checkpoint_interval=2"]), again)
    return {"status": "completed"}


def _case_moe_empty_expert(overrides, run_dir):
    """One forward and backward of block 0's fc1 experts (delayed scaling) in which expert 1 has
    rows on rank 0 only: every rank's history rows and scales of experts 0 and 1 afterwards."""
    from harness.parallel import process as D
    from harness.train import Trainer

    cfg = load(BASE + overrides)
    dist = D.Dist(D.launch_env(), cfg.parallel.strategy, None, "gloo")
    trainer = Trainer(cfg, run_dir, dist=dist)
    group = next(m for n, m in trainer.model.named_modules() if n.endswith("blocks.0.mlp.experts.fc1"))
    rank = torch.distributed.get_rank()
    splits = [16, 16 if rank == 0 else 0] + [0] * (group.num_gemms - 2)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(sum(splits), group.in_features, generator=g) * (rank + 1)).to(torch.bfloat16)
    x.requires_grad_(True)
    numerics = trainer.backend.numerics
    with numerics.autocast():
        y = group(x, splits)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return {
        str(e): {
            d: (states[f"{group.name}.{e}"].amax_history.tolist(), states[f"{group.name}.{e}"].scale.tolist())
            for d, states in (("forward", numerics.forward_states), ("backward", numerics.backward_states))
        }
        for e in (0, 1)
    }


CASES = {"run": _case_run, "amax": _case_amax, "resume": _case_resume, "moe_empty": _case_moe_empty_expert}


def _spawn(world: int, cases: list, tmp: Path) -> dict:
    report = str(tmp / "report")
    # forkserver with this module preloaded: the workers fork from a process that has imported
    # harness but never computed (a plain fork of this process, whose OpenMP pool has run, can
    # deadlock in the child; spawn would import everything again in each worker)
    multiprocessing.set_forkserver_preload([__name__])
    ctx = torch.multiprocessing.start_processes(
        _worker, args=(world, free_port(), cases, report), nprocs=world, join=True, start_method="forkserver"
    )
    assert ctx is None or ctx.join()
    results = [json.loads(Path(f"{report}.{r}").read_text()) for r in range(world)]
    for name, out in results[0].items():
        assert "error" not in out or out["error"] is None, f"{name}: {out['error']}"
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank case in one spawned group: (results per rank, their run dirs)."""
    tmp = tmp_path_factory.mktemp("dist2")
    cases, dirs = [], {}
    for recipe, ov in RECIPES.items():
        for strategy in ("ddp", "fsdp2"):
            name = f"{strategy}-{recipe}"
            dirs[name] = tmp / name
            cases.append((name, "run", [f"parallel={strategy}", *ov], str(dirs[name])))
    for name, ov in {
        "amax": ["parallel=ddp", "recipe=delayed"],
        "amax-local": ["parallel=ddp", "recipe=delayed", "parallel.tp_only_amax_red=true"],
    }.items():
        dirs[name] = tmp / name
        cases.append((name, "amax", ov, str(dirs[name])))
    dirs["resume"] = tmp / "resume"
    cases.append(("resume", "resume", ["parallel=fsdp2", "recipe=delayed"], str(dirs["resume"])))
    dirs["zero"] = tmp / "zero"
    zero = ["parallel=ddp", "optimizer=bf16_states", "recipe=bf16"]
    cases.append(("zero", "run", zero, str(dirs["zero"])))
    for strategy in ("ddp", "fsdp2"):
        name = f"{strategy}-moe"
        dirs[name] = tmp / name
        cases.append((name, "run", [f"parallel={strategy}", *MOE], str(dirs[name])))
    dirs["moe-empty"] = tmp / "moe-empty"
    empty = ["parallel=ddp", "model=qwen3_moe_tiny", "recipe=delayed", "recipe.fp8_amax_history_len=4"]
    cases.append(("moe-empty", "moe_empty", empty, str(dirs["moe-empty"])))
    return _spawn(2, cases, tmp), dirs, tmp


MOE = ["model=qwen3_moe_tiny", "recipe=tensorwise", "model.moe_router_score_function=sigmoid"]
MOE += ["model.moe_router_enable_expert_bias=true", "model.moe_z_loss_coeff=1e-3"]
"""An MoE under a quantized recipe with every router term that crosses ranks: the expert bias is
updated from token counts summed over the ranks, the router losses from the whole batch."""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "nvfp4"])
def test_two_ranks_match_one_process(two_ranks, strategy, recipe):
    """2 ranks x 1 micro-batch == 1 process x 2 micro-batches (the same 4 sequences per step)."""
    _, dirs, tmp = two_ranks
    ref = _single(tmp, recipe, RECIPES[recipe])
    got, want = _curve(dirs[f"{strategy}-{recipe}"]), _curve(ref)
    assert len(got) == len(want) == 3
    if strategy == "ddp":
        assert got == want  # bit-identical (module doc)
        assert _curve(dirs[f"{strategy}-{recipe}"], "optim/grad_norm") == _curve(ref, "optim/grad_norm")
    else:
        assert got[0] == want[0]  # the first loss only depends on the (same) initial weights
        assert got == pytest.approx(want, rel=REL)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_moe_two_ranks_match_one_process(two_ranks, strategy):
    """Experts are replicated (DDP) or sharded (FSDP2) like any weight: the losses, router losses
    and, under DDP, the gradient norms are those of one process, as for a dense model."""
    _, dirs, tmp = two_ranks
    ref, got = _single(tmp, "moe", MOE), dirs[f"{strategy}-moe"]
    for key in ("loss/train", "moe/load_balancing_loss", "moe/z_loss"):
        assert len(_curve(got, key)) == len(_curve(ref, key)) == 3, key
        if strategy == "ddp":
            assert _curve(got, key) == _curve(ref, key), key
        else:
            assert _curve(got, key) == pytest.approx(_curve(ref, key), rel=REL), key
    if strategy == "ddp":
        assert _curve(got, "optim/grad_norm") == _curve(ref, "optim/grad_norm")


def test_an_expert_empty_on_one_rank_rolls_on_both(two_ranks):
    """docs/numerics_grouped.md §7: the ranks' amaxes are reduced (MAX) before each update, so an
    expert that saw tokens on rank 0 only rolls its input and grad histories on rank 1 too, to rank
    0's amax (alone it would neither roll nor rescale: tests/test_moe_recipes.py); both ranks end
    with the same histories and scales."""
    results, _, _ = two_ranks
    mine, theirs = results[0]["moe-empty"], results[1]["moe-empty"]
    assert mine == theirs
    for e in ("0", "1"):
        (fwd_hist, fwd_scale), (bwd_hist, bwd_scale) = mine[e]["forward"], mine[e]["backward"]
        assert fwd_hist[-1][0] > 0 and fwd_hist[-1][1] > 0 and bwd_hist[-1][0] > 0  # input, weight, grad
        assert fwd_hist[-2] == [0.0, 0.0] and fwd_scale[0] != 1.0 and bwd_scale[0] != 1.0
    assert mine["0"]["forward"][0][-1][0] != mine["1"]["forward"][0][-1][0]  # each expert its own amax


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_delayed_two_ranks_match_one_whole_micro_batch(two_ranks, strategy):
    """Delayed scaling: 2 ranks x 1 micro-batch of 2 vs 1 process x 1 micro-batch of 4: the same
    scales every step (MAX over the ranks == the whole batch's amax). The wgrad GEMM sums the batch
    in another grouping (4 rows vs 2 + 2), so gradients differ in their last bits, and an FP8 cast
    turns a last-bit change of a weight into a whole E4M3 step now and then: DELAYED_REL."""
    _, dirs, tmp = two_ranks
    ref = _single(tmp, "delayed-whole", RECIPES["delayed"] + ["micro_batch_size=4"])
    got, want = _curve(dirs[f"{strategy}-delayed"]), _curve(ref)
    assert got[0] == pytest.approx(want[0], rel=1e-7)
    assert got == pytest.approx(want, rel=DELAYED_REL)


def test_reduced_amax_is_the_whole_batch_amax(two_ranks, tmp_path):
    """After one step every rank holds the same delayed-scaling histories, and they are those of
    one process that saw the whole global batch in one micro-batch; with tp_only_amax_red (no
    tensor parallelism) each rank keeps its own, and the whole batch's amax is their maximum."""
    from harness.train import Trainer

    results, dirs, _ = two_ranks
    cfg = load(BASE + RECIPES["delayed"] + ["micro_batch_size=4"])
    single = Trainer(cfg, tmp_path / "t")
    single.train_step(0)
    whole = json.loads(json.dumps(_delayed(single)))  # tuples as lists, as the workers report
    assert results[0]["amax"] == results[1]["amax"]
    assert results[0]["amax"] == whole  # forward amaxes exact; backward too (power-of-two loss scales)
    local = [results[r]["amax-local"] for r in (0, 1)]
    assert local[0] != local[1]
    for name, entry in whole.items():
        for d in ("forward", "backward"):
            got = torch.maximum(torch.tensor(local[0][name][d][0]), torch.tensor(local[1][name][d][0]))
            assert torch.equal(got, torch.tensor(entry[d][0])), (name, d)


def test_rank_zero_writes_the_run_dir(two_ranks):
    _, dirs, _ = two_ranks
    run_dir = dirs["ddp-bf16"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["provenance"]["parallel"]["world_size"] == 2
    assert run["provenance"]["grad_accumulation"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(summary["tokens_per_s"] / 2)
    assert summary["tokens"] == 3 * 4 * 64  # the global batch's tokens
    rows = _rows(run_dir)
    assert len([r for r in rows if "loss/train" in r]) == 3  # one row per step, not one per rank
    assert not list(run_dir.glob("error*"))


def test_sharded_checkpoint_resumes_exactly(two_ranks, tmp_path):
    """FSDP2 writes one DCP shard file per rank; resumed at 2 ranks the rows are the same to the
    bit; resumed in one process (another world size) the run continues from the same state."""
    from harness.train import run

    _, dirs, _ = two_ranks
    first, again = dirs["resume"], Path(f"{dirs['resume']}-resumed")
    ckpt = first / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    def clean(rows):  # timings differ from run to run
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]

    assert clean(_rows(again)) == clean(_rows(first))
    one = tmp_path / "one"
    shutil.copytree(first, one)
    shutil.rmtree(one / "checkpoints" / "step_00000004")
    summary = run(load(BASE + ["parallel=fsdp2", "recipe=delayed", "steps=4", "checkpoint_interval=2"]), one)
    assert summary.status == "completed"
    assert _curve(one)[:2] == _curve(first)[:2]
    # one process runs each step as 2 micro-batches: its delayed history advances twice per step
    assert _curve(one) == pytest.approx(_curve(first), rel=DELAYED_REL)


def test_zero1_sharded_states_match_replicated(two_ranks, tmp_path):
    """optimizer.use_distributed_optimizer with DDP shards the precision-aware optimizer's states
    (bf16 moments, each parameter's whole on its owner): the numbers of one unsharded process."""
    results, dirs, tmp = two_ranks
    run = json.loads((dirs["zero"] / "run.json").read_text())
    assert run["provenance"]["parallel"]["sharded_optimizer_states"] is True
    ref = _single(tmp, "zero", ["optimizer=bf16_states", "recipe=bf16"])
    assert _curve(dirs["zero"]) == pytest.approx(_curve(ref), rel=REL)


def test_four_ranks_fsdp2(tmp_path):
    """4 ranks x 1 micro-batch vs 1 process x 4 micro-batches (bf16, FSDP2: 4 shards each)."""
    ov = ["recipe=bf16", "micro_batch_size=1", "parallel=fsdp2"]
    _spawn(4, [("fsdp2", "run", ov, str(tmp_path / "fsdp2"))], tmp_path)
    ref = _single(tmp_path, "bf16-4", ov)
    got, want = _curve(tmp_path / "fsdp2"), _curve(ref)
    assert len(got) == 3
    assert got[0] == pytest.approx(want[0], rel=1e-7)
    assert got == pytest.approx(want, rel=REL)
    assert sorted(p.name for p in (tmp_path / "fsdp2").glob("error*")) == []


def failing_factory(role, recipe):
    """recipe=custom's factory for the failure test: rank 1 raises in its third quantized forward."""
    from harness.numerics.custom import tensorwise_factory

    inner = tensorwise_factory(role, recipe)

    class Failing:
        def quantize(self, x, columnwise):
            _CALLS[0] += 1  # all quantizers together: about 24 casts per micro-batch
            if os.environ.get("RANK") == "1" and _CALLS[0] > 40:
                raise ValueError("injected failure on rank 1")
            return inner.quantize(x, columnwise)

    return Failing()


_CALLS = [0]


def test_a_failing_rank_ends_the_job_failed_and_named(tmp_path):
    """Under torchrun: rank 1 raises mid-run; the job ends (no hang: collective timeout 30 s), the
    run dir's summary says failed, naming rank 1 and its error, and rank 1's traceback is kept."""
    run_dir = tmp_path / "run"
    args = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "harness.train",
        *BASE,
        "steps=6",
        "parallel=ddp",
        "parallel.timeout_s=30",
        "recipe=custom",
        "recipe.fp8=e4m3",
        "recipe.quantizer_factory=tests.test_distributed:failing_factory",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_cli(args, cwd=REPO, timeout=150, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert summary["failed_rank"] == 1, summary
    assert "rank 1 of 2" in summary["error"] and "injected failure on rank 1" in summary["error"]
    assert "injected failure" in (run_dir / "error.rank1.txt").read_text()
