"""Where a step's GPU time goes: a torch.profiler trace's kernels in named categories.

    python -m benchmarks.kernel_breakdown TRACE.json [--steps N]

Reads the Chrome trace torch.profiler exports (`prof.export_chrome_trace`) and sums kernel time per
category, per step. A kernel is classified by the CPU ops that launched it (the ops open on the
launching thread when its runtime call ran, linked by the trace's correlation ids), then by its name:

- `lm_head`: GEMMs launched under aten::mm / aten::addmm / aten::matmul. On the TE path the blocks'
  GEMMs go through TE's own extension (no aten op), so these are the LM head's (its forward and its
  two backward GEMMs); on a plain PyTorch model every GEMM would land here.
- `optimizer`: anything under an `Optimizer.step` op, and multi-tensor/Adam kernels;
- `qkv_select_backward`: the zero fills, copies and adds of autograd's SelectBackward (q, k, v taken
  from TE's packed QKV one by one: what backend.packed_qkv_grad removes);
- `loss`: the cross entropy (log-softmax, NLL, TE's Triton kernel) and its fp32 casts;
- then by kernel name: `gemm_fp8`, `gemm_bf16` (lowp's Triton grouped wgrad too), `attention`, `norm`,
  `cast_quantize`, `activation`, `embedding`, `elementwise_other`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

CATEGORIES = (
    "gemm_fp8",
    "gemm_bf16",
    "lm_head",
    "attention",
    "norm",
    "cast_quantize",
    "activation",
    "loss",
    "optimizer",
    "qkv_select_backward",
    "embedding",
    "elementwise_other",
)

_GEMM = re.compile(
    r"nvjet|gemm|cutlass|xmma|cublas|sm\d+_.*(mma|gmma)|s\d+gemm|ampere_.*gemm|_wgrad_kernel", re.I
)
_GEMM_FP8 = re.compile(r"nvjet_sm\d+_q|e4m3|e5m2|fp8|f8f6f4|qgmma", re.I)
_BY_NAME = (  # (category, pattern), first match wins
    ("attention", re.compile(r"fmha|flash|sdpa|fused_attn|attn|cudnn_generated", re.I)),
    ("loss", re.compile(r"cross_entropy|log_softmax|logsoftmax|nll_loss|softmax", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    ("norm", re.compile(r"layernorm|layer_norm|rmsnorm|rms_norm|ln_fwd|ln_bwd|norm_fwd|norm_bwd", re.I)),
    ("cast_quantize", re.compile(r"cast|quantiz|transpose|amax|compute_scale|fp8|cvt_", re.I)),
    ("activation", re.compile(r"gelu|swiglu|silu|geglu|relu|dact|act_", re.I)),
    ("embedding", re.compile(r"embedding|index_select|indexing_backward", re.I)),
)
_LM_HEAD_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm")
_LOSS_OPS = ("aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax", "aten::nll_loss")
_LOSS_OPS += ("aten::_log_softmax_backward_data", "aten::nll_loss_backward", "CrossEntropyFunction")


def classify(kernel: str, ops: list[str]) -> str:
    """The category of one kernel launched while the CPU ops `ops` (outermost first) were open."""
    if any(o.startswith("Optimizer.step") or o.startswith("Optimizer.zero_grad") for o in ops):
        return "optimizer"
    if any("SelectBackward" in o or o == "aten::select_backward" for o in ops):
        return "qkv_select_backward"
    if any(o in _LOSS_OPS or "CrossEntropy" in o or "NllLoss" in o or "LogSoftmax" in o for o in ops):
        return "loss"
    if _BY_NAME[0][1].search(kernel):  # cuDNN's attention kernels also say wgmma
        return "attention"
    if _GEMM.search(kernel):
        if any(o in _LM_HEAD_OPS or o.startswith("MmBackward") for o in ops):
            return "lm_head"
        return "gemm_fp8" if _GEMM_FP8.search(kernel) else "gemm_bf16"
    for cat, pat in _BY_NAME:
        if pat.search(kernel):
            return cat
    return "elementwise_other"


def _launch_stacks(events: list[dict]) -> dict[int, list[str]]:
    """correlation id -> names of the CPU ops open on the launching thread at the runtime call."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    launches: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e.get("pid"), e.get("tid"))
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            by_thread[key].append(e)
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {}):
            launches[key].append(e)
    out: dict[int, list[str]] = {}
    for key, calls in launches.items():
        # one sweep in time order: ops on one thread nest, so the open ones form a stack
        ops = sorted(by_thread.get(key, []), key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[tuple[float, str]] = []  # (end, name)
        j = 0
        for call in sorted(calls, key=lambda e: e["ts"]):
            ts = call["ts"]
            while j < len(ops) and ops[j]["ts"] <= ts:
                while stack and stack[-1][0] < ops[j]["ts"]:
                    stack.pop()
                stack.append((ops[j]["ts"] + ops[j].get("dur", 0), ops[j]["name"]))
                j += 1
            while stack and stack[-1][0] < ts:
                stack.pop()
            out[call["args"]["correlation"]] = [name for end, name in stack if end >= ts]
    return out


def breakdown(trace: dict, steps: int, top: int = 10) -> dict:
    """ms per step per category (every category present, zeros included), the total, and the
    `top` longest kernels by name, from a Chrome trace of `steps` train steps."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    stacks = _launch_stacks(events)
    per_cat: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0) / 1e3
        ops = stacks.get((e.get("args") or {}).get("correlation"), [])
        per_cat[classify(e.get("name", ""), ops)] += ms
        per_kernel[e.get("name", "")[:90]] += ms
    longest = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "steps": steps,
        "ms_per_step": {k: v / steps for k, v in per_cat.items()},
        "gpu_total_ms_per_step": sum(per_cat.values()) / steps,
        "top_kernels_ms_per_step": {k: v / steps for k, v in longest},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", type=Path, help="Chrome trace JSON from torch.profiler")
    p.add_argument("--steps", type=int, default=1, help="train steps the trace covers")
    args = p.parse_args(argv)
    print(json.dumps(breakdown(json.loads(args.trace.read_text()), args.steps), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
