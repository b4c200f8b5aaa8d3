"""The parallel group without processes: where a rank sits (torchrun, Slurm, plain python), the rules
checked before any process group starts, the Megatron flags that match, and the ZeRO-1 split."""

from __future__ import annotations

import pytest
import torch

from harness.parallel import process as D
from harness.validation.rules import ConfigError
from tests.helpers import compose_cfg


def test_launch_env_torchrun_slurm_and_plain():
    assert D.launch_env({}) == D.Launch()
    tr = D.launch_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29"}
    )
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port, tr.launcher) == (
        3,
        4,
        1,
        "h",
        29,
        "torchrun",
    )
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08,10],cpu1",
        "SLURM_JOB_ID": "123456",
    }
    s = D.launch_env(slurm)
    assert (s.rank, s.world_size, s.local_rank, s.master_addr, s.launcher) == (5, 8, 1, "gpu07", "slurm")
    assert s.master_port == 20000 + 123456 % 20000
    # srun torchrun: torchrun's variables win; a one-task Slurm job is one process
    assert D.launch_env({**slurm, "RANK": "0", "WORLD_SIZE": "2"}).launcher == "torchrun"
    assert D.launch_env({**slurm, "SLURM_NTASKS": "1"}) == D.Launch()
    assert D.launch_env({**slurm, "SLURM_STEP_NUM_TASKS": "2"}).world_size == 2  # the step's tasks
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        D.launch_env({"RANK": "0", "WORLD_SIZE": "two"})


def test_expand_nodelist():
    assert D.expand_nodelist("n1") == ["n1"]
    assert D.expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert D.expand_nodelist("a[9-11]") == ["a9", "a10", "a11"]


def _validate(monkeypatch, world: int, *overrides: str):
    from harness.validation import prepare

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    if world > 1:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    return prepare(compose_cfg("model=gpt_tiny", "logger=none", *overrides))


@pytest.mark.parametrize(
    "world, overrides, match",
    [
        (2, ["micro_batch_size=4", "global_batch_size=4", "parallel=ddp"], "micro_batch_size=4 x 2 ranks"),
        (2, ["parallel=none", "micro_batch_size=4"], "parallel=none with 2 ranks"),
        (1, ["parallel=ddp", "parallel.timeout_s=0"], "parallel.timeout_s=0"),
        (1, ["parallel=ddp", "parallel.backend=nccl"], "parallel.backend=nccl with hardware=cpu"),
        (
            1,
            [
                "parallel=fsdp2",
                "recipe=delayed",
                "optimizer=bf16_states",
                "optimizer.optimizer_cpu_offload=true",
            ],
            "parallel=fsdp2 with",
        ),
        (1, ["parallel=fsdp2", "optimizer=bf16_states"], "precision-aware optimizer on backend=emulated"),
        (
            1,
            ["recipe=tensorwise", "optimizer.fp8_param=true"],
            "needs optimizer.use_distributed_optimizer=true: Megatron refuses",
        ),
    ],
)
def test_parallel_rules_refuse_before_any_work(monkeypatch, world, overrides, match):
    with pytest.raises(ConfigError, match=match):
        _validate(monkeypatch, world, *overrides)


def test_fp8_param_accepts_fsdp2_or_the_distributed_optimizer(monkeypatch):
    _validate(
        monkeypatch,
        2,
        "parallel=fsdp2",
        "recipe=tensorwise",
        "optimizer.fp8_param=true",
        "micro_batch_size=4",
    )
    _validate(
        monkeypatch,
        1,
        "recipe=tensorwise",
        "optimizer.fp8_param=true",
        "optimizer.use_distributed_optimizer=true",
    )
    _validate(monkeypatch, 4, "parallel=ddp", "micro_batch_size=2", "global_batch_size=8")


def test_megatron_export_prints_the_data_parallel_flags(monkeypatch):
    from harness.interop.megatron import megatron_args, render

    cfg = _validate(
        monkeypatch,
        2,
        "parallel=fsdp2",
        "recipe=delayed",
        "parallel.tp_only_amax_red=true",
        "optimizer.use_distributed_optimizer=true",
        "micro_batch_size=2",
        "global_batch_size=8",
    )
    text = render(cfg)
    for flag in ("--use-torch-fsdp2", "--ckpt-format torch_dist"):
        assert flag in text, flag
    # Megatron refuses the distributed optimizer under FSDP2 and has no --tp-only-amax-red flag
    # (tests/test_megatron_parallel.py holds the FSDP2 export)
    argv = megatron_args(cfg)[0]
    assert "--use-distributed-optimizer" not in argv and "--tp-only-amax-red" not in argv
    assert "torchrun --nproc-per-node 2" in text
    assert "2 micro-batch(es) of 2 per rank" in text
    one = render(_validate(monkeypatch, 1, "recipe=delayed"))
    assert "torchrun --nproc-per-node 1" in one and "--use-torch-fsdp2" not in one


def test_zero1_owners_balance_and_cover():
    from harness.optim.sharded import owners

    params = [torch.empty(n) for n in (100, 10, 60, 50, 5, 5)]
    out = owners(params, 2)
    load = [sum(p.numel() for p, r in zip(params, out) if r == k) for k in (0, 1)]
    assert sorted(load) == [115, 115] and set(out) == {0, 1}  # 100+10+5 | 60+50+5
    assert owners(params, 1) == [0] * 6


def test_train_stream_shards_one_stream_over_ranks():
    from harness.config.schema import DataConfig
    from harness.data import build_data

    data = build_data(DataConfig(name="synthetic", num_tokens=20000), vocab_size=256, seq_length=16)
    whole = [x for x, _ in (next(s) for s in [data.train_batches(2, seed=0)] * 8)]
    ranks = [data.train_batches(2, seed=0, rank=r, world=2) for r in (0, 1)]
    got = [next(ranks[i % 2])[0] for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(got, whole))
    assert ranks[0].position == ranks[1].position == 8  # global micro-batches: resumable at any world size
    later = data.train_batches(2, seed=0, start=4, rank=1, world=2)
    assert torch.equal(next(later)[0], whole[5])
