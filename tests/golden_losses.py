"""Golden loss curves: every recipe's first steps on gpt_tiny (CPU, emulated backend), stored in the repo.

The stored curves (`tests/assets/losses/<name>_tiny_cpu.txt`, one `step loss` line per step, the loss
in full `repr` precision) are the safety net of every refactor: `tests/test_golden_losses.py` trains
each case again through `harness.train.run` and requires the same losses bit for bit.

Rule: a refactor never regenerates them. A change that alters numerics on purpose regenerates them in a
commit of its own that says why:

    python -m tests.golden_losses            # all cases
    python -m tests.golden_losses nvfp4      # one case

The run is fixed here, not in the test, so the test and the generator cannot drift apart: 8 steps of
2 micro-batches (accumulation on), logged every step, no eval, no checkpoint, one thread.

The CPU's matrix units change the last bits: on a CPU with AMX (Sapphire Rapids and later) oneDNN's
bf16 GEMMs round differently from the AVX-512 kernels, so such a machine has curves of its own,
`<name>_tiny_cpu.amx.txt`, made from the same code as the plain ones (`platform()` picks the file). A
CPU without AVX-512 (torch's capability AVX2) runs torch's own bf16 GEMM instead of oneDNN's and has
`<name>_tiny_cpu.avx2.txt`, made on an AVX2-only AMD EPYC from the code of `aaf3799`.
The MoE cases' AMX curves were made on an AMX Xeon (torch 2.11) that reproduced every stored dense
`.amx` curve bit for bit in the same call.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from tests.helpers import tiny_cpu_run

ASSETS = Path(__file__).resolve().parent / "assets" / "losses"
STEPS = 8
RUN = tiny_cpu_run(STEPS, 4, 8, log_interval=1, eval_interval=0, eval_tokens=0, checkpoint_interval=-1)
# name -> the overrides that make it; the recipe cases plus two that reach the per-module plan and the
# precision-aware optimizer's FP8 states, so refactors of those paths are covered too
CASES: dict[str, list[str]] = {
    "bf16": ["recipe=bf16"],
    "delayed": ["recipe=delayed"],
    "tensorwise": ["recipe=tensorwise"],
    "blockwise": ["recipe=blockwise"],
    "mxfp8": ["recipe=mxfp8"],
    "nvfp4": ["recipe=nvfp4"],
    "nvfp4_4over6": ["recipe=nvfp4", "recipe.nvfp4_4over6=weights"],  # TE 2.20: weights only (no RHT/SR)
    "int4_qat": ["recipe=int4_qat"],
    "nvfp4_mixed": [
        "recipe=nvfp4",
        "stability.fp8_wgrad=false",
        "+stability.overrides=[{pattern:'blocks.0.*',recipe:tensorwise},{pattern:'*.fc2',recipe:bf16}]",
    ],
    "delayed_fp8_states": ["recipe=delayed", "stability.fp8_margin=1", "optimizer=fp8_states"],
    "tensorwise_dequantized_backward": ["recipe=tensorwise", "recipe.backward_override=dequantized"],
}
# the same run on the tiny MoE presets: every recipe on qwen3_moe_tiny's routed experts (INT4 QAT on
# them alone, miles' scope), and mixtral_tiny under delayed scaling with a sigmoid router, its expert
# bias and Megatron's router padding (per-expert histories, bias updates, routed padding rows)
MOE = ["model=qwen3_moe_tiny"]
CASES |= {f"moe_{name}": [*MOE, f"recipe={name}"] for name in ("bf16", "delayed", "tensorwise", "blockwise")}
CASES |= {f"moe_{name}": [*MOE, f"recipe={name}"] for name in ("mxfp8", "nvfp4")}
CASES["moe_int4_qat"] = [*MOE, "recipe=int4_qat", "recipe.int4_scope=routed_experts"]
CASES["moe_mixtral_delayed_bias_routed"] = [
    "model=mixtral_tiny",
    "recipe=delayed",
    "model.moe_router_score_function=sigmoid",
    "model.moe_router_enable_expert_bias=true",
    "model.moe_router_padding_for_quantization=true",
]
# masked diffusion (harness.model.objective) under every recipe: bidirectional attention, the mask token
# past the markov source's 255 ids, and a quarter of the micro-batches cut to a random length
DLM = ["objective=masked_diffusion", "data.vocab_size=255", "objective.difflm_varilen_prob=0.25"]
DLM_RECIPES = ("bf16", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat")
CASES |= {f"dlm_{name}": [*DLM, f"recipe={name}"] for name in DLM_RECIPES}


def overrides(name: str) -> list[str]:
    """The run of case `name`: RUN with the case's overrides (its model in place of gpt_tiny)."""
    case = CASES[name]
    own_model = any(o.startswith("model=") for o in case)
    return [o for o in RUN if not (own_model and o.startswith("model="))] + case


def baseline(name: str) -> str | None:
    """The BF16 case on the same model, which a recipe that fell back to BF16 would reproduce (None:
    no BF16 case of that model)."""
    if name in ("bf16", "moe_bf16", "dlm_bf16") or name.startswith("moe_mixtral"):
        return None
    return next((f"{p}_bf16" for p in ("moe", "dlm") if name.startswith(f"{p}_")), "bf16")


def platform() -> str:
    """The curves' variant for this CPU: "amx" where bf16 GEMMs run on AMX tiles, "avx2" where torch's
    CPU kernels stop at AVX2 (no AVX-512: oneDNN's bf16 GEMM is not used, torch's own is), else ""
    (the reference, AVX-512)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    if " amx_bf16" in flags:
        return "amx"
    return "avx2" if torch.backends.cpu.get_cpu_capability() == "AVX2" else ""


def path_of(name: str, where: str | None = None) -> Path:
    where = platform() if where is None else where
    return ASSETS / (f"{name}_tiny_cpu.{where}.txt" if where else f"{name}_tiny_cpu.txt")


def curve(name: str) -> list[tuple[int, float]]:
    """Train case `name` and return its (step, train loss) pairs."""
    import json

    from harness.train import run
    from tests.helpers import compose_cfg

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions split over threads may round differently
    try:
        with tempfile.TemporaryDirectory() as d:
            summary = run(compose_cfg(*overrides(name)), Path(d))
            rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    finally:
        torch.set_num_threads(threads)
    if summary.status != "completed":
        raise RuntimeError(f"{name}: run {summary.status}: {summary.error or summary.divergence_cause}")
    return [(r["step"], r["loss/train"]) for r in rows if "loss/train" in r]


def format_curve(points: list[tuple[int, float]]) -> str:
    return "".join(f"{step} {loss!r}\n" for step, loss in points)


def read_curve(name: str, where: str | None = None) -> list[tuple[int, float]]:
    pairs = (line.split() for line in path_of(name, where).read_text().splitlines() if line.strip())
    return [(int(s), float(v)) for s, v in pairs]


def main(names: list[str]) -> None:
    ASSETS.mkdir(parents=True, exist_ok=True)
    for name in names or list(CASES):
        if name not in CASES:
            sys.exit(f"error: unknown case {name!r}; choose from {sorted(CASES)}")
        path_of(name).write_text(format_curve(curve(name)))
        print(f"wrote {path_of(name)}")


if __name__ == "__main__":
    main(sys.argv[1:])
