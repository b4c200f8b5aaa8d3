"""TE 2.20.2's LayerNorm forward in its own order of fp32 operations.

TE's tuned kernel (common/normalization/layernorm/ln_fwd_kernels.cuh, compiled by NVRTC with default
options: FMA contraction on, precise division) computes each row as follows. A thread loads
``NUM_ELTS = BYTES_PER_LDG / 2`` bf16 values per load, ``LDGS`` loads a row, at vector
``it * THREADS_PER_ROW + thread``. It then does this:

- **mean:** sums its values in load order. A butterfly of warp shuffles (xor 1, 2, 4, 8, 16) adds the
  partial sums. The result is multiplied by ``rn = 1/COLS``.
- **sum of squares:** accumulates ``(x - mean)^2`` the same way; the butterfly adds them.
- **more than one warp per row** (``WARPS_N > 1``, hidden 3072 to 10240): each warp does the two steps
  above with its own mean. Chan's update then merges the warps' (n, mean, M2).
- **output:** ``rs = rsqrtf(rn * M2 + eps)``, ``y = rs * (x - mean)``, ``out = gamma * y + beta``.

torch's ``layer_norm`` reduces in another order. Its output differs from TE's by one fp32 ulp in some
elements, which flips a bf16 rounding now and then: 2 of 524,288 on gpt_small, which then changed 2
tensorwise FP8 codes. This module repeats TE's order with tensor ops. An FMA is computed as
fp32(fp64(a) * fp64(b) + fp64(c)): the product is exact in fp64, so only a double rounding, about 2^-29
per operation, can differ from a fused FMA. ``rsqrtf`` is torch's CUDA rsqrt (the same libdevice
function). On a CPU, torch's rsqrt is correctly rounded and so not TE's: there the function is close,
not bit-exact.

Covered (`kernel_layout`): the tuned kernels with one CTA per row (bf16 input, hidden 768 to 10240
but 3840) and the general kernel's one-warp buckets (hidden up to 2048, e.g. gpt_small's 256). On the
H200 the tuned path matched TE bit for bit at 768, 1024, 2048 and 4096
(benchmarks/fidelity/layernorm_probe.py).
The general kernel has the same loop bodies; it has not yet been checked on a GPU. Elsewhere
`kernel_layout` returns None and callers keep torch's layer_norm.
"""

from __future__ import annotations

import functools

import torch

from harness.numerics import fast, te_layernorm_triton

# hidden -> (WARPS_M, WARPS_N, BYTES_PER_LDG), CTAS_PER_ROW = 1: ln_fwd_cuda_kernel.cu's tuned launchers
# for a bf16 input (bf16 or fp8 output, fp32 compute). 3840 (BYTES_PER_LDG 4) is left out: its means
# did not match TE's on the H200 (te_layernorm_probe.json), so torch's layer_norm serves it.
TUNED_BF16 = {
    768: (4, 1, 16),
    1024: (4, 1, 16),
    1536: (4, 1, 16),
    2048: (4, 1, 16),
    2304: (4, 1, 16),
    3072: (1, 4, 16),
    4096: (1, 4, 16),
    5120: (1, 4, 16),
    6144: (1, 4, 16),
    8192: (1, 4, 16),
    10240: (1, 4, 16),
}
# The general kernel's buckets (TE takes the smallest >= hidden) with one warp per row; the 8192
# bucket (four warps, a shared-memory reduction) is not covered.
GENERAL_BF16 = {128: (4, 1, 8), 512: (4, 1, 16), 1024: (4, 1, 16), 2048: (4, 1, 16)}

# Where NVRTC contracts a multiply and an add into an FMA. "m2": M2 += d * d; "rs": rn * M2 + eps;
# "out": gamma * y + beta. Settled on the H200 by the LayerNorm probe, which passes its own candidate
# sites through the `fma` argument of the functions below.
FMA_SITES = frozenset({"m2", "rs", "out"})


def kernel_layout(hidden: int, rows: int) -> tuple[str, int, int, int] | None:
    """(kernel, WARPS_N, NUM_ELTS, LDGS) of the forward kernel TE picks, or None where not covered.

    TE runs the tuned kernel when one is registered for the hidden size and the row count is a
    multiple of 4 (NormalizationPlanRegistry: is_tuned = is_aligned && batch_size % 4 == 0), else the
    general kernel of the smallest bucket >= hidden. A thread's values sit at vectors
    ``it * THREADS_PER_ROW + thread``, ``it < LDGS``, in both."""
    if rows % 4 == 0 and hidden in TUNED_BF16:
        _, wn, bytes_per_ldg = TUNED_BF16[hidden]
        ne = bytes_per_ldg // 2
        return "tuned", wn, ne, hidden // (ne * 32 * wn)
    bucket = min((h for h in GENERAL_BF16 if h >= hidden), default=None)
    if bucket is None:
        return None
    ne = GENERAL_BF16[bucket][2] // 2
    if hidden % ne:
        return None
    return "general", 1, ne, -(-hidden // (32 * ne))  # the last loads of high lanes may be past the row


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double() + c.double()).float()


def _mul_add(a, b, c, site: str, fma: frozenset) -> torch.Tensor:
    return _fma(a, b, c) if site in fma else a * b + c


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """__shfl_xor_sync all-reduce over the last dim (32 lanes): v += v[lane ^ k], k = 1, 2, 4, 8, 16."""
    lanes = torch.arange(32, device=v.device)
    for k in (1, 2, 4, 8, 16):
        v = v + v[..., lanes ^ k]
    return v


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _warp_stats(xv: torch.Tensor, valid: torch.Tensor, rn: float, fma: frozenset):
    """Stats<T, 1, WARPS_M, 1>::compute on [..., 32 lanes, N values]: (mean, M2), both [...].

    ``valid`` [32, N] marks the values a lane really loads (the general kernel's last loads can fall
    past the row); the others are zeros here, which add nothing to the sums."""
    s = torch.zeros(xv.shape[:-1], dtype=torch.float32, device=xv.device)
    for i in range(xv.shape[-1]):
        s = s + xv[..., i]
    m = _butterfly(s)[..., 0] * rn
    d = (xv - m[..., None, None]) * valid
    m2 = torch.zeros_like(s)
    for i in range(xv.shape[-1]):
        di = d[..., i]
        m2 = _mul_add(di, di, m2, "m2", fma)
    return m, _butterfly(m2)[..., 0]


def _chan_merge(m: torch.Tensor, m2: torch.Tensor, n: float) -> tuple[torch.Tensor, torch.Tensor]:
    """warp_chan_upd_dynamic over WARPS_N lanes (a power of two here), as lane 0 ends up with it.

    Every warp has the same n, a power of two, so n_a * n_b / n_ab and n_a * m_a are exact: where
    NVRTC puts FMAs makes no difference to these two formulas."""
    wn = m.shape[-1]
    na = torch.full_like(m, n)
    step = wn // 2
    while step > 0:
        ma, mb = m[..., :step], m[..., step : 2 * step]
        m2a, m2b = m2[..., :step], m2[..., step : 2 * step]
        nb = na[..., step : 2 * step]
        na_ = na[..., :step]
        n_ab = na_ + nb
        rn_ab = 1.0 / n_ab
        delta = ma - mb
        m2 = m2a + m2b + delta * delta * na_ * nb * rn_ab
        m = (na_ * ma + nb * mb) * rn_ab
        na = n_ab
        step //= 2
    return m[..., 0], m2[..., 0]


@functools.lru_cache(maxsize=64)
def _value_columns(
    hidden: int, wn: int, ne: int, ldgs: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[WARPS_N, 32, LDGS * NUM_ELTS] column of each thread's values in load order (past the row: the
    index of a zero column appended to x), and whether the thread really loads it."""
    threads = 32 * wn
    it, t, jt = torch.meshgrid(torch.arange(ldgs), torch.arange(threads), torch.arange(ne), indexing="ij")
    col = ((it * threads + t) * ne + jt).permute(1, 0, 2).reshape(wn, 32, ldgs * ne)
    valid = col < hidden
    return torch.where(valid, col, hidden).to(device), valid.to(device)


@torch.no_grad()
def te_layer_norm_stats(
    x: torch.Tensor, fma: frozenset = FMA_SITES, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, M2) per row of a [rows, hidden] tensor of bf16 values, reduced in TE's order.

    `fused`: the same operations in one Triton kernel on CUDA (harness.numerics.te_layernorm_triton),
    elsewhere through torch.compile (a few kernels instead of several hundred launches). The same
    numbers: tests/numerics/test_te_layernorm.py checks them on a CPU, test_fast_path_gpu.py on CUDA."""
    rows, hidden = x.shape
    layout = kernel_layout(hidden, rows)
    if layout is None:
        raise ValueError(
            f"LayerNorm of {rows} rows x {hidden}: TE's kernel for it is not emulated; use layer_norm"
        )
    _, wn, ne, ldgs = layout
    n = ldgs * ne * 32  # values per warp
    rn = _f32(1.0 / hidden) if wn == 1 else _f32(1.0 / n)
    if fused and x.is_cuda and te_layernorm_triton.available():
        return _triton_or_compiled(x, wn, ne, ldgs, n, rn, fma)
    return _gathered_stats(x, wn, ne, ldgs, n, rn, fma, fused)


def _gathered_stats(x, wn, ne, ldgs, n, rn, fma, fused=True):
    col, valid = _value_columns(x.shape[1], wn, ne, ldgs, str(x.device))
    stats = fast.compiled(_stats, x.device.type) if fused else _stats
    return stats(x, col, valid, wn, n, rn, tuple(sorted(fma)))


def _triton_stats(x, wn, ne, ldgs, n, rn, fma):
    mw, m2w = te_layernorm_triton.warp_stats(x, wn, ne, ldgs, rn, "m2" in fma)
    return (mw[:, 0], m2w[:, 0]) if wn == 1 else _chan_merge(mw, m2w, float(n))


_triton_or_compiled = fast.first_working(_triton_stats, _gathered_stats)


def _stats(x, col, valid, wn: int, n: int, rn: float, fma) -> tuple[torch.Tensor, torch.Tensor]:
    """One warp's statistics (WARPS_N = 1), or each warp's merged by Chan's update; rn = 1/values."""
    rows = x.shape[0]
    xp = torch.cat([x.float(), x.new_zeros(rows, 1, dtype=torch.float32)], dim=1)
    xv = xp[:, col]  # (rows, WARPS_N, 32, LDGS * NUM_ELTS)
    if wn == 1:
        return _warp_stats(xv[:, 0], valid[0], rn, fma)
    mw, m2w = _warp_stats(xv, valid, rn, fma)
    return _chan_merge(mw, m2w, float(n))


def _output(x2, mu, rs, weight, bias, fma) -> torch.Tensor:
    y = rs[:, None] * (x2 - mu[:, None])
    g = weight.float().expand_as(y)
    b = torch.zeros_like(y) if bias is None else bias.float().expand_as(y)
    return _mul_add(g, y, b, "out", fma)


def _output_bf16(x2, mu, rs, weight, bias, fma) -> torch.Tensor:
    return _output(x2, mu, rs, weight, bias, fma).to(torch.bfloat16)


@torch.no_grad()
def te_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    fma: frozenset = FMA_SITES,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    fused: bool = False,
    bf16_output: bool = False,
) -> torch.Tensor:
    """TE's fp32 norm output (before its bf16 or FP8 cast) for x [..., hidden] of bf16 values.

    ``stats``: (mu, rsigma) to use instead of computing them (the probe isolates the output step).
    ``fused``: the statistics and the output step through torch.compile (te_layer_norm_stats).
    ``bf16_output``: that output's bf16 cast too, in the same pass (TE's bf16 LayerNormLinear)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    mu, rs = te_rsigma(x2, eps, fma, fused) if stats is None else (s.reshape(-1).float() for s in stats)
    fn = _output_bf16 if bf16_output else _output
    out = fast.compiled(fn, x.device.type) if fused else fn
    return out(x2, mu, rs, weight, bias, tuple(sorted(fma))).reshape(shape)


def te_rsigma(
    x: torch.Tensor, eps: float, fma: frozenset = FMA_SITES, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, rsigma) of x [rows, hidden], as TE's layernorm_fwd returns them. rsqrt stays eager in
    the fused path too: torch's CUDA rsqrt is the function matched against TE's rsqrtf."""
    mu, m2 = te_layer_norm_stats(x, fma, fused)
    rn = torch.full_like(m2, _f32(1.0 / x.shape[-1]))
    return mu, torch.rsqrt(_mul_add(rn, m2, torch.full_like(m2, _f32(eps)), "rs", fma))
