"""CUDA graphs of the TE blocks (`backend.cuda_graphs`): TE's `make_graphed_callables`.

Each `te.TransformerLayer` is captured once, forward and backward, with TE's own quantization state
inside the graph; a step then replays one graph per block instead of launching its ~100 kernels from
Python (the FP8 path's host time is close to its GPU time). The embeddings, final norm, LM head,
loss and optimizer stay eager, outside the graphs: the optimizer step updates the parameters in
place, so the graphs read the new weights at the addresses they captured, and with fp32 main grads
TE's wgrad GEMMs write into the same `main_grad` buffers every step (MainGrads zeroes them in place).

What that needs, checked by validation (harness.backends.te_options): static shapes (one micro-batch
a step: no accumulation, so TE quantizes the weights every forward and `is_first_microbatch` stays
None), one recipe for every block (no per-block autocast), and no RoPE tensor argument. Capture runs
after the optimizer exists (main grads allocated), on random inputs; its warm-up passes are undone:
gradients zeroed, and delayed scaling's amax histories and scales reset to TE's initial state.
"""

from __future__ import annotations

import torch
import torch.nn as nn

WARMUP_ITERS = 3  # TE's default warm-up passes before capture


def capture_blocks(te, blocks: nn.ModuleList, sample_shape: tuple[int, ...], recipe, optimizer) -> None:
    """Replace each block's `te.TransformerLayer` forward by its graphed replay (in place)."""
    layers = tuple(block.layer for block in blocks)
    device = next(layers[0].parameters()).device
    samples = tuple(
        (torch.randn(sample_shape, dtype=torch.bfloat16, device=device, requires_grad=True),) for _ in layers
    )
    # TE refuses modules with hooks at capture; lowp's probes (verify_active) go back on afterwards
    hooks = [dict(layer._forward_pre_hooks) for layer in layers]
    for layer in layers:
        layer._forward_pre_hooks.clear()
    try:
        _capture(te, layers, samples, recipe)
    finally:
        for layer, saved in zip(layers, hooks):
            layer._forward_pre_hooks.update(saved)
    optimizer.zero_grad()  # the warm-up's gradients (main grads zeroed in place)
    reset_scaling_state(layers)
    torch.cuda.synchronize()


def _capture(te, layers, samples, recipe) -> None:
    te.make_graphed_callables(
        layers,
        samples,
        num_warmup_iters=WARMUP_ITERS,
        # fused wgrad accumulation returns no weight grad (it went into main_grad)
        allow_unused_input=True,
        enabled=recipe is not None,
        recipe=recipe,
        cache_quantized_params=False,
    )


@torch.no_grad()
def reset_scaling_state(layers) -> None:
    """Delayed scaling's amax histories to zero and scales to one, as TE makes them: the warm-up
    passes ran on random inputs and must not steer the first real steps' scales."""
    for layer in layers:
        for m in layer.modules():
            meta = getattr(m, "fp8_meta", None) or {}
            for key in ("scaling_fwd", "scaling_bwd"):
                state = meta.get(key)
                if state is None:
                    continue
                for attr, value in (("amax_history", 0.0), ("scale", 1.0)):
                    t = getattr(state, attr, None)
                    if isinstance(t, torch.Tensor):
                        t.fill_(value)
