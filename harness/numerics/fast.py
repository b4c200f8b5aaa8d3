"""The emulator's fast paths on a GPU: the reference path's codes and scales, faster GEMMs and kernels.

1. `mm`: GEMMs on operands whose values are exact in bf16, as bf16 tensor-core GEMMs with fp32
   output (cuBLAS accumulates in fp32). A product of two bf16 values has at most 16 significant
   bits, exact in fp32, so the result equals the fp32 GEMM on the same values up to the order of
   accumulation. On a CPU the same call runs torch's fp32 GEMM on those values: identical to the
   reference there, which is what the CPU tests check.
2. `gemm_operand(q)` (harness.numerics.qtensor): each quantized copy as (values, post_scale) with
   values @ other * post_scale its GEMM. Which dequantized values are exact in bf16 (8 significant
   bits, fp32's exponent range):
   - FP8 codes x a power-of-two scale (blockwise's default pow2 scales, MXFP8's E8M0, tensorwise with
     power_2_scales): 4 (E4M3) or 3 (E5M2) significant bits -> exact, as long as the value is not
     below 2^-126 with bits under bf16's subnormal step 2^-133, i.e. the block's scale_inv is at
     least 2^-124 (E4M3) / 2^-117 (E5M2): only blocks with amax below about 2^-115 miss that.
   - E2M1 x its E4M3 block scale: at most 2 x 4 = 6 significant bits, magnitude 2^-10..2688 -> exact.
   - Not exact, folded into `post_scale` instead: a tensorwise fp32 scale_inv (any non-pow2 scale;
     the GEMM then runs on the FP8 codes themselves) and NVFP4's global factor amax / 2688. This is
     the order TE's GEMM applies them (cuBLAS alpha), not the reference path's, which rounds each
     dequantized element to fp32 first: those two recipes' outputs differ from the reference by
     that rounding, not only by accumulation order (docs/emulated_gpu.md has the table).
3. `compiled(fn)`: torch.compile of a kernel-emulating function (the TE-order LayerNorm, the fused
   casts below); eager with one warning where triton or a compiler is missing or compiling fails.
"""

from __future__ import annotations

import functools
import warnings

import torch

from harness.numerics import triton_random

BF16 = torch.bfloat16


def _mm_out_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 @ bf16 -> fp32 on CUDA: torch.mm(out_dtype=) where this torch has it, else TF32 on the
    fp32 upcasts (bf16 values are exact in TF32's 10-bit mantissa), scoped to this one call."""
    if _has_out_dtype():
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except RuntimeError:  # a layout this torch's out_dtype GEMM refuses: the TF32 route below
            pass
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return a.float() @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@functools.cache
def _has_out_dtype() -> bool:
    try:
        a = torch.ones(16, 16, dtype=BF16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(a @ b) * alpha + bias in fp32, for 2-D a (M, K), b (K, N) whose values are exact in their dtype.

    Two bf16 operands on CUDA: a bf16 tensor-core GEMM with fp32 output. Otherwise torch's fp32
    GEMM on the same values (with bias and no alpha, the reference path's addmm). `alpha`: a
    one-element fp32 tensor applied to the fp32 result (the scales `gemm_operand` folds)."""
    if a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        y = _mm_out_fp32(a, b)
    elif bias is not None and alpha is None:
        return torch.addmm(bias.float(), a.float(), b.float())
    else:
        y = a.float() @ b.float()
    if alpha is not None:
        y = y.mul_(alpha)
    if bias is not None:
        y = y.add_(bias.float())
    return y


def mm_bf16(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    fp32_storage: bool = False,
) -> torch.Tensor:
    """bf16(mm(a, b, alpha, bias)): the GEMM's fp32 result scaled, biased and rounded to bf16 in one
    pass after the GEMM on CUDA (the eager `mul_`, `add_` and `.to(bf16)` were three, a fifth of
    the emulated tensorwise step at 1.4B). The same operations in the same order: fp32(y * alpha)
    (computed as an fp64 product rounded to fp32, which keeps the compiler from fusing it with the
    bias add into one FMA), + bias in fp32, round to bf16. `fp32_storage`: the bf16 values in an
    fp32 tensor (QuantizedLinear's fp32_output)."""
    if not (a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16):
        y = mm(a, b, alpha, bias).to(BF16)
        return y.float() if fp32_storage else y
    fn = compiled(_epilogue(alpha is not None, bias is not None, fp32_storage), "cuda", True)
    return fn(_mm_out_fp32(a, b), alpha, bias)


@functools.cache
def _epilogue(has_alpha: bool, has_bias: bool, fp32_storage: bool):
    def epilogue(y, alpha, bias):
        if has_alpha:
            y = (y.double() * alpha.double()).float()  # == fp32 y * alpha: the product is exact in fp64
        if has_bias:
            y = y + bias.float()
        return bf16_round(y) if fp32_storage else y.to(BF16)

    return epilogue


def alpha_of(*scales: torch.Tensor | None) -> torch.Tensor | None:
    """The product of the operands' post scales (None where none has one)."""
    out = None
    for s in scales:
        if s is not None:
            out = s if out is None else out * s
    return out


def operand(q, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values (rows, -1), post_scale) of a quantized copy, or of a plain tensor (bf16 stays bf16)."""
    if isinstance(q, torch.Tensor):
        t = q.reshape(rows, -1)
        return (t if t.dtype == torch.bfloat16 else t.float()), None
    gemm_operand = getattr(q, "gemm_operand", None)
    if gemm_operand is None:  # a custom quantizer's result: its fp32 dequantization
        return q.dequantize().reshape(rows, -1).float(), None
    vals, post = gemm_operand()
    return vals.reshape(rows, -1), post


_WARNED: set[str] = set()


def compile_available(device_type: str) -> tuple[bool, str]:
    """Whether torch.compile can build kernels for this device, and why not."""
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton is not installed"
    return True, ""


def compiled(fn, device_type: str, dynamic: bool | None = None):
    """torch.compile(fn) for tensors on `device_type`, or fn itself with one warning when no
    compiler is available there or compiling fails. `dynamic`: torch.compile's (None: a second
    shape recompiles with dynamic sizes; True: one kernel for every shape from the start, for the
    elementwise casts, whose per-element operations do not depend on the sizes)."""
    ok, why = compile_available(device_type)
    if not ok:
        _warn_once(fn, device_type, why)
        return fn
    return _compiled(fn, device_type, dynamic)


def first_working(kernel, fallback, device_type: str = "cuda", failure: str = "failed", instead: str = ""):
    """kernel(*args), or fallback(*args) from kernel's first failure on, with one warning; the two
    compute the same numbers (a Triton kernel that this triton or GPU cannot build; a function that
    torch.compile cannot compile, whose fallback is the eager function)."""
    failed: list[str] = []
    instead = instead or f"using {fallback.__name__} (same numbers)"

    @functools.wraps(kernel)
    def run(*args):
        if not failed:
            try:
                return kernel(*args)
            except Exception as e:  # noqa: BLE001 - a kernel build failure must not stop a run
                failed.append(f"{failure} ({type(e).__name__}: {str(e)[:200]})")
                _warn_once(kernel, device_type, failed[0], instead)
        return fallback(*args)

    return run


EAGER = "running it eagerly (same numbers, slower)"


def _warn_once(fn, device_type: str, why: str, instead: str = EAGER) -> None:
    key = f"{fn.__name__}:{device_type}"
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{fn.__name__}: {why}; {instead}", stacklevel=3)


RECOMPILE_LIMIT = 64  # formats x orientations x shapes of a run: more variants than dynamo's default 8


def _limit_patch():
    import torch._dynamo.config as cfg

    key = "recompile_limit" if "recompile_limit" in cfg._config else "cache_size_limit"
    return cfg.patch(**{key: RECOMPILE_LIMIT})


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to bf16, kept in fp32 storage: x.to(bf16).float(), computed on the bits
    (round to nearest even; NaN passes). For compiled functions: Inductor's graph passes fold a
    cast to bf16 followed by one back to fp32 into nothing (its emulate_precision_casts does not
    stop that on every torch), which would skip exactly the rounding being emulated."""
    b = x.view(torch.int32)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000
    return torch.where(torch.isnan(x), x, r)


@functools.cache
def _compiled(fn, device_type: str, dynamic: bool | None = None):
    inner = torch.compile(fn, fullgraph=True, dynamic=dynamic)

    @functools.wraps(fn)
    def compiled_fn(*args):
        with _limit_patch():  # scoped to these calls: the user's compiled code keeps its own
            return inner(*args)

    return first_working(compiled_fn, fn, device_type, "torch.compile failed", EAGER)


# ----------------------------------------------------------------------------------------------
# Fused casts: the quantizers' elementwise stage (scale, saturate, round) and the GEMM operand in
# one pass. The amax reductions and scale arithmetic before them stay the reference's own code;
# each function here repeats the reference's operations in its order (tests check the bits).


@functools.cache
def _block_cast(dtype: torch.dtype, fmax: float):
    def block_cast(blocks, scale, dec):
        """(Mr, br, Kc, bc) values, (Mr, Kc) scale and dequantization factor -> FP8 codes and the
        dequantized values in bf16 (exact for power-of-two factors)."""
        v = blocks.float() * scale[:, None, :, None]  # fp32(x) * scale
        q = v.clamp(-fmax, fmax).to(dtype)  # satfinite RNE (the clamp keeps NaN and -0.0)
        return q, (q.float() * dec[:, None, :, None]).to(BF16)

    return block_cast


def cast_blocks(blocks: torch.Tensor, scale: torch.Tensor, dec: torch.Tensor, fmt):
    """Fused blockwise/MXFP8 cast: (codes in blocks' shape, dequantized bf16 values)."""
    return compiled(_block_cast(fmt.dtype, fmt.max), blocks.device.type, True)(blocks, scale, dec)


@functools.cache
def _tensor_cast(dtype: torch.dtype, fmax: float):
    def tensor_cast(x2, scale):
        """(M, K) values and a one-element scale -> FP8 codes and the codes in bf16."""
        q = (x2.float() * scale).clamp(-fmax, fmax).to(dtype)
        return q, q.to(BF16)

    return tensor_cast


def cast_tensor(x2: torch.Tensor, scale: torch.Tensor, fmt):
    """Fused per-tensor cast: (codes (M, K), the codes as bf16)."""
    return compiled(_tensor_cast(fmt.dtype, fmt.max), x2.device.type, True)(x2, scale)


@functools.cache
def _e2m1_cast(has_nan: bool, stochastic: bool):
    def e2m1_cast(blocks, k, sf32, u):
        """formats.e2m1_round of fp32(x * k), operation by operation, and (value x block scale) in
        bf16. `u`: U[0, 1) per element for stochastic rounding (drawn by the caller)."""
        v = blocks.float() * k[:, None, :, None]
        if has_nan:
            v = v.nan_to_num(nan=6.0)
        v = v.clamp(-6.0, 6.0)
        expo = (v.view(torch.int32) & 0x7F800000).clamp(min=0x3F800000)
        step = (expo - (1 << 23)).view(torch.float32)  # 2^(e-1): the grid spacing at |v|
        r = v / step  # exact: a power of two
        r = (r + u).floor() if stochastic else r.round()
        q = r * step
        return q, (q * sf32[:, None, :, None]).to(BF16)

    return e2m1_cast


def cast_e2m1(blocks, k, sf32, has_nan: bool, generator=None, stochastic: bool = False):
    """Fused NVFP4 element cast: (grid values in blocks' shape, fp32; value x E4M3 scale in bf16).
    Stochastic rounding draws the CUDA reference's uniforms (harness.numerics.triton_random)."""
    u = triton_random.uniforms(blocks.shape, generator, blocks.device) if stochastic else None
    fn = compiled(_e2m1_cast(has_nan, stochastic), blocks.device.type, True)
    return fn(blocks, k, sf32, u)
