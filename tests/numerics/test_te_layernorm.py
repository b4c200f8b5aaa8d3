"""TE's LayerNorm order (harness.numerics.te_layernorm) against a thread-by-thread simulation of the
kernel in numpy float32, and against torch's layer_norm. Bit-exactness with TE itself is checked on
the H200 (benchmarks/fidelity/layernorm_probe.py, tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.numerics.te_layernorm import TUNED_BF16, kernel_layout, te_layer_norm, te_rsigma
from tests.helpers import in_triton_interpreter

f32 = np.float32


def fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def simulate_row(x: np.ndarray, eps: float, rows: int = 4) -> tuple[float, float]:
    """TE's forward kernel for one row, thread by thread (WARPS_N = 1, or a merge over warps)."""
    hidden = x.size
    _, wn, ne, ldgs = kernel_layout(hidden, rows)
    threads = 32 * wn
    cols = [[(it * threads + t) * ne + jt for it in range(ldgs) for jt in range(ne)] for t in range(threads)]
    elts = [[x[c] for c in row if c < hidden] for row in cols]  # a lane loads only inside the row

    def butterfly(vals):
        vals = list(vals)
        for k in (1, 2, 4, 8, 16):
            vals = [f32(vals[i] + vals[i ^ k]) for i in range(32)]
        return vals[0]

    def warp(ts, rn):
        sums = []
        for t in ts:
            s = f32(0)
            for v in elts[t]:
                s = f32(s + v)
            sums.append(s)
        m = f32(butterfly(sums) * rn)
        m2s = []
        for t in ts:
            acc = f32(0)
            for v in elts[t]:
                d = f32(v - m)
                acc = fma(d, d, acc)
            m2s.append(acc)
        return m, butterfly(m2s)

    rn = f32(1.0 / hidden)
    if wn == 1:
        mu, m2 = warp(range(32), rn)
    else:
        n = f32(len(elts[0]) * 32)
        stats = [warp(range(w * 32, w * 32 + 32), f32(1.0) / n) for w in range(wn)]
        ns = [n] * wn
        step = wn // 2
        while step:
            for i in range(step):
                (ma, m2a), (mb, m2b), na, nb = stats[i], stats[i + step], ns[i], ns[i + step]
                nab = f32(na + nb)
                rnab = f32(f32(1.0) / nab)
                delta = f32(ma - mb)
                m2ab = f32(f32(m2a + m2b) + f32(f32(f32(f32(delta * delta) * na) * nb) * rnab))
                mab = f32(f32(f32(na * ma) + f32(nb * mb)) * rnab)
                stats[i], ns[i] = (mab, m2ab), nab
            step //= 2
        mu, m2 = stats[0]
    return mu, fma(rn, m2, f32(eps))


@pytest.mark.parametrize(
    ("hidden", "rows"), [(768, 4), (2048, 4), (4096, 4), (256, 4), (64, 4), (384, 4), (768, 3)]
)
def test_matches_a_thread_by_thread_simulation_of_the_kernel(hidden, rows):
    """tuned (rows % 4 == 0) and general kernels (gpt_small's 256, gpt_tiny's 64, a partial last load)."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3 + 0.5).bfloat16().float()
    mu, rs = te_rsigma(x, 1e-5)
    for r in range(rows):
        want_mu, want_var = simulate_row(x[r].numpy(), 1e-5, rows)
        assert mu[r].item() == float(want_mu)
        assert rs[r].item() == float(torch.rsqrt(torch.tensor(want_var)))


def test_kernel_choice_follows_te():
    assert kernel_layout(768, 4096)[0] == "tuned" and kernel_layout(768, 4095)[0] == "general"
    assert kernel_layout(256, 4096) == ("general", 1, 8, 1)  # the 512 bucket
    assert kernel_layout(64, 8) == ("general", 1, 4, 1)  # the 128 bucket: 8-byte loads
    assert kernel_layout(3840, 4096) is None and kernel_layout(2560, 4096) is None  # not covered


@pytest.mark.parametrize("hidden", sorted(TUNED_BF16) + [64, 256, 384])
def test_close_to_torch_layer_norm(hidden):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, hidden, generator=g) * 2).bfloat16().float()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16().float()
    b = (0.1 * torch.randn(hidden, generator=g)).bfloat16().float()
    ours = te_layer_norm(x, w, b, 1e-5)
    exact = F.layer_norm(x.double(), (hidden,), w.double(), b.double(), 1e-5)
    assert (ours.double() - exact).abs().max() < 4e-6 * exact.abs().max()


def test_gpt_trains_with_the_te_order_norm(monkeypatch):
    """The emulated model's LayerNorm takes TE's order where te_order_norm says so (CUDA); forced here
    on a CPU, forward values come from te_layer_norm and gradients from torch's layer_norm."""
    import harness.backends.emulated as emulated_mod
    from harness.backends import build_backend
    from harness.train import backend_spec
    from tests.helpers import compose_cfg

    overrides = ("model=gpt_tiny", "model.hidden_size=768", "model.ffn_hidden_size=1536")
    cfg = compose_cfg(*overrides)
    torch.manual_seed(0)
    gpt = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    ref = gpt(x).float()
    calls = []
    monkeypatch.setattr(emulated_mod, "te_order_norm", lambda t: True)
    counted = lambda *a, **k: calls.append(1) or te_layer_norm(*a, **k)  # noqa: E731
    monkeypatch.setattr(emulated_mod, "te_layer_norm", counted)
    out = gpt(x).float()
    assert len(calls) == 2 * cfg.model.num_layers + 1  # ln1, ln2 per block, ln_f
    assert torch.allclose(out, ref, atol=2e-2)  # a different order of the same arithmetic
    out.square().mean().backward()
    grads = [p.grad for p in gpt.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_uncovered_shape_is_refused_in_one_line():
    with pytest.raises(ValueError, match="3840: TE's kernel for it is not emulated"):
        te_rsigma(torch.zeros(4, 3840), 1e-5)


def _triton_matches_reference(hidden: int, rows: int) -> None:
    from harness.numerics import te_layernorm as ln
    from harness.numerics import te_layernorm_triton

    _, wn, ne, ldgs = ln.kernel_layout(hidden, rows)
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3 + 1).bfloat16().float()
    col, valid = ln._value_columns(hidden, wn, ne, ldgs, "cpu")
    xv = torch.cat([x, x.new_zeros(rows, 1)], 1)[:, col]
    rn = ln._f32(1.0 / hidden) if wn == 1 else ln._f32(1.0 / (ldgs * ne * 32))
    for fma in (ln.FMA_SITES, frozenset()):
        ref = ln._warp_stats(xv, valid, rn, fma)
        got = te_layernorm_triton.warp_stats(x, wn, ne, ldgs, rn, "m2" in fma)
        assert torch.equal(got[0], ref[0].reshape(rows, wn)), (hidden, sorted(fma), "mean")
        assert torch.equal(got[1], ref[1].reshape(rows, wn)), (hidden, sorted(fma), "M2")


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_triton_statistics_are_the_reference_in_triton_s_interpreter():
    """The CUDA fast path's Triton kernel (te_layernorm_triton) run by Triton's CPU interpreter
    (TRITON_INTERPRET=1, read when triton compiles a kernel's definition: hence a fresh process):
    per-warp (mean, M2) equal the reference's to the bit, with and without the M2 FMA, for one
    warp, four warps, and the general kernel with loads past the row. Needs triton (a GPU extra);
    the same check runs compiled on CUDA in test_fast_path_gpu.py."""
    shapes = [(2048, 8), (4096, 4), (768, 8), (1000, 5), (128, 3)]
    code = "from tests.numerics.test_te_layernorm import _triton_matches_reference as f\n"
    in_triton_interpreter(code + "".join(f"f({h}, {r})\n" for h, r in shapes))


def test_te_order_norm_backward_is_layer_norm_s_on_the_forward_statistics():
    """_TEOrderLayerNorm's backward: torch's layer_norm backward on TE's mu and rsigma (no second
    forward); close to layer_norm's gradients in fp64 (the statistics differ by fp32 ulps)."""
    from harness.backends.emulated import _TEOrderLayerNorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 768, generator=g) * 2 + 0.5).bfloat16().float().requires_grad_(True)
    w = (1 + 0.1 * torch.randn(768, generator=g)).bfloat16().float().requires_grad_(True)
    b = (0.1 * torch.randn(768, generator=g)).bfloat16().float().requires_grad_(True)
    gy = torch.randn(6, 768, generator=g)
    _TEOrderLayerNorm.apply(x, w, b, 1e-5, frozenset(), False, False).backward(gy)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    F.layer_norm(leaves[0], (768,), leaves[1], leaves[2], 1e-5).backward(gy.double())
    for ours, exact in zip((x.grad, w.grad, b.grad), (t.grad for t in leaves)):
        assert (ours.double() - exact).abs().max() < 1e-5 * exact.abs().max()
