"""One expert group run on two of the emulator's paths (reference or fast GEMMs, CPU or CUDA) and
every quantized copy its GEMMs multiply, compared bit for bit (docs/numerics_grouped.md §7).

Each case feeds a group the rows Megatron hands it: per-expert counts padded to the recipe's
alignment (an empty expert, a one-token expert, unaligned counts before padding), the padding either
+0.0 rows after each expert's real rows (TE's Fp8Padding) or, as under
`moe_router_padding_for_quantization`, real tokens at probability 0, which reach fc2 as signed
zeros. Every expert's magnitudes differ by powers of two, so each has scales of its own.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from harness.backends import build_backend
from harness.numerics import QuantizedLinear
from harness.train import backend_spec
from tests.helpers import compose_cfg

BF16 = torch.bfloat16
RUN = ["model=qwen3_moe_tiny", "backend=emulated", "hardware=cpu", "logger=none", "data.num_tokens=20000"]
COUNTS = [3, 0, 17, 40, 1, 0, 37, 5]  # tokens per expert before padding (8 experts)
RECIPES = {  # name: overrides (NVFP4's CPU and CUDA random numbers differ: round-to-nearest grads)
    "delayed": [],
    "tensorwise": [],
    "tensorwise_pow2": ["recipe.power_2_scales=true"],
    "blockwise": [],
    "mxfp8": [],
    "nvfp4": ["recipe.disable_stochastic_rounding=true"],
}
ALIGN = {"mxfp8": 32, "nvfp4": 128}  # else 16 (Megatron's get_align_size_for_quantization)


def build(recipe: str, device: str, fast: bool):
    """(backend, model) of qwen3_moe_tiny under `recipe` on `device`, fast GEMMs or the reference's;
    the same initial weights on every device."""
    name = recipe.removesuffix("_pow2")
    cfg = compose_cfg(*RUN, f"recipe={name}", *RECIPES[recipe])
    torch.manual_seed(0)
    backend = build_backend(backend_spec(cfg), torch.device(device))
    backend.fast_paths = fast
    return backend, backend.build_model()


def record_codes(backend) -> dict[tuple[str, str], list]:
    """Every (rowwise, columnwise) pair each expert GEMM's quantizers return, by (module, role), in
    call order; filled as the backend's modules run."""
    seen: dict[tuple[str, str], list] = defaultdict(list)
    for name, quant in backend.modules.items():
        if not isinstance(quant, QuantizedLinear):
            continue
        for role in ("input", "weight", "grad"):
            method = getattr(quant, f"quantize_{role}")

            def recorded(*args, _method=method, _key=(name, role)):
                out = _method(*args)
                seen[_key].append(out)
                return out

            setattr(quant, f"quantize_{role}", recorded)
    return seen


def case_inputs(recipe: str, group, routed: bool, steps: int = 2, seed: int = 1):
    """(m_splits, [(x, dy)] per step) for `group`: the padded counts and each step's rows."""
    align = ALIGN.get(recipe.removesuffix("_pow2"), 16)
    splits = [-(-c // align) * align for c in COUNTS]
    g = torch.Generator().manual_seed(seed)
    m = sum(splits)
    spread = torch.cat([torch.full((r, 1), 2.0**e) for e, r in enumerate(splits)])  # (M, 1)
    real = torch.cat([torch.arange(r) < c for r, c in zip(splits, COUNTS)])  # (M,) a token's row
    out = []
    for _ in range(steps):
        x = torch.randn(m, group.in_features, generator=g) * spread
        dy = torch.randn(m, group.out_features, generator=g) * spread / 64
        if routed:  # real tokens at probability 0: x * 0 keeps each element's sign
            x = torch.where(real[:, None], x, x * 0)
        else:  # zero rows, and Fp8Unpadding hands them a zero gradient
            x, dy = x * real[:, None], dy * real[:, None]
        out.append((x.to(BF16), dy.to(BF16)))
    return splits, out


def run_group(backend, group, splits, steps, device: str):
    """Forward and backward of `group` per step, an optimizer step between (the weights quantized
    again): [(y, dx, dW)] on the CPU, and the quantized copies by (module, role)."""
    codes = record_codes(backend)
    outs = []
    for x, dy in steps:
        x = x.to(device).requires_grad_(True)
        group.weight.grad = None
        backend.numerics.weights_changed()
        with backend.autocast():
            y = group(x, splits)
        y.backward(dy.to(device))
        outs.append([t.detach().cpu().float() for t in (y, x.grad, group.weight.grad)])
    return outs, codes


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().cpu()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype)
    if view is not None:
        return t.view(view)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def _differ(a, b) -> str | None:
    a, b = _bits(a), _bits(b)
    if (a is None) != (b is None):
        return "present on one path only"
    if a is None:
        return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    n = int((a != b).sum())
    return f"{n} of {a.numel()} differ" if n else None


def code_mismatches(want: dict, got: dict) -> list[str]:
    """Where two recordings differ: each copy's codes (`.data`), scales (`.scale_inv`) and GEMM
    operand (values, post scale), bit for bit (-0.0 and +0.0 differ; NaN codes compare as bits)."""
    bad = [f"{key}: recorded on one path only" for key in set(want) ^ set(got)]
    for key in sorted(set(want) & set(got)):
        if len(want[key]) != len(got[key]):
            bad.append(f"{key}: {len(want[key])} vs {len(got[key])} calls")
            continue
        for call, (pair_w, pair_g) in enumerate(zip(want[key], got[key])):
            for orient, qw, qg in zip(("rowwise", "columnwise"), pair_w, pair_g):
                if (qw is None) != (qg is None):
                    bad.append(f"{key} call {call} {orient}: made on one path only")
                    continue
                if qw is None:
                    continue
                (vw, pw), (vg, pg) = qw.gemm_operand(), qg.gemm_operand()
                for what, a, b in (("codes", qw.data, qg.data), ("scale_inv", qw.scale_inv, qg.scale_inv),
                                   ("GEMM operand", vw, vg), ("post scale", pw, pg)):  # fmt: skip
                    if (why := _differ(a, b)) is not None:
                        bad.append(f"{key} call {call} {orient} {what}: {why}")
    return bad


def state_mismatches(want_backend, got_backend) -> list[str]:
    """Delayed scaling: every expert's amax histories and scales, bit for bit."""
    bad = []
    for kind in ("forward_states", "backward_states"):
        want, got = getattr(want_backend.numerics, kind), getattr(got_backend.numerics, kind)
        for name in sorted(set(want) | set(got)):
            if name not in want or name not in got:
                bad.append(f"{kind} {name}: on one path only")
                continue
            for field in ("amax_history", "scale"):
                if (why := _differ(getattr(want[name], field), getattr(got[name], field))) is not None:
                    bad.append(f"{kind} {name} {field}: {why}")
    return bad


def beyond_gemm_bound(want, got, k: int) -> int:
    """Elements of `got` outside the fp32 accumulation-order bound of `want` (plus one bf16
    rounding): K * 2^-22 * max|want| + 2^-7 |want|, as for dense linears."""
    bound = 2.0**-7 * want.abs() + k * 2.0**-22 * want.abs().max()
    return int(((want - got).abs() > bound).sum())
