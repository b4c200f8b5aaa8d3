"""Test helpers shared by the test modules (compose like the entry point does, run the CLI)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# keep CPU runs reproducible and polite on a 2-core CI box
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("WANDB_SILENT", "true")


def compose_cfg(*overrides: str):
    """The typed Config for these overrides (hardware=auto resolves to this machine)."""
    from harness.validation.load import compose

    return OmegaConf.to_object(compose(list(overrides)))


TINY = [
    "model=gpt_tiny",
    "steps=12",
    "log_interval=4",
    "eval_interval=6",
    "eval_tokens=2048",
    "logger=none",
    "micro_batch_size=4",
    "global_batch_size=4",
    "data.num_tokens=200000",
]


def tiny_cpu_run(steps: int, micro_batch_size: int, global_batch_size: int, **fields) -> list[str]:
    """The short deterministic CPU run of the golden losses and the resume tests: gpt_tiny on the
    emulated backend, no logger, 20k markov tokens, 2 warm-up steps; `fields` (log_interval=1,
    checkpoint_interval=-1, ...) are added as `key=value` overrides."""
    base = ["model=gpt_tiny", "backend=emulated", "hardware=cpu", "logger=none", f"steps={steps}"]
    base += [f"{k}={v}" for k, v in fields.items()]
    base += [f"micro_batch_size={micro_batch_size}", f"global_batch_size={global_batch_size}"]
    return base + ["data.num_tokens=20000", "optimizer.warmup_steps=2"]


def run_main(capsys, main, prog: str, *args: str) -> tuple[int, str]:
    """An entry point's `main()` run in this process with sys.argv = [prog, *args], as `python -m
    prog` calls it: (exit code, what it wrote to stderr)."""
    argv = sys.argv
    sys.argv = [prog, *args]
    try:
        ret = main()
        code = ret if isinstance(ret, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return code, capsys.readouterr().err


def run_cli(args: list[str], cwd: Path = REPO, timeout: int = 300, env: dict | None = None):
    """A fresh Python running `args` (tests that use it are marked slow: the fast lane starts no
    process)."""
    import subprocess

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def start_train(*args: str):
    """`python -m harness.train ARGS` started, not waited for (to be signalled or killed), its
    stdout and stderr together in one pipe (slow tests only)."""
    import subprocess

    return subprocess.Popen(
        [sys.executable, "-m", "harness.train", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# GPU tests (marked `gpu`, next to their subjects): skipped without CUDA / Transformer Engine
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TE")
GPU_TINY_MODEL = [  # the tiny model the GPU tests share, on this machine's hardware
    "model=gpt_tiny",
    "model.hidden_size=128",
    "model.ffn_hidden_size=512",
    "model.num_attention_heads=2",
    "hardware=auto",
]
GPU_TINY = [
    *GPU_TINY_MODEL,
    "logger=none",
    "data=markov",
    "micro_batch_size=8",
    "global_batch_size=8",
    "eval_tokens=4096",
    "eval_interval=0",
    "log_interval=10",
    "checkpoint_interval=-1",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a test process group's master port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cases(
    rank: int, world: int, port: int, cases: list, report: str, kinds: dict, backend: str
) -> None:
    """A spawned rank of a test process group: joins it (torchrun's variables, `backend`), runs each
    case (name, kind, overrides, run dir) as `kinds[kind](overrides, run_dir)` with a barrier after
    each, and writes {name: result} to `report.<rank>`; a case that raises records its traceback and
    the next one still runs."""
    import datetime
    import json
    import traceback

    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        kwargs["device_id"] = torch.device("cuda", rank)
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=120), **kwargs)
    results = {}
    try:
        for name, kind, overrides, run_dir in cases:
            try:
                results[name] = kinds[kind](overrides, Path(run_dir))
            except Exception:  # noqa: BLE001 - reported to the test; the next case goes on
                results[name] = {"error": traceback.format_exc()[-3000:]}
            torch.distributed.barrier()
    finally:
        Path(f"{report}.{rank}").write_text(json.dumps(results))
        torch.distributed.destroy_process_group()


def in_triton_interpreter(code: str) -> None:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (Triton's CPU interpreter; triton reads
    the variable when it builds a kernel's definition, at import: hence a new process); skip without
    triton, fail with the child's traceback."""
    import subprocess

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
