"""GPU test of harness.numerics.te_layernorm against TE's own LayerNorm kernel, to the bit."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import needs_cuda, needs_te

pytestmark = pytest.mark.gpu


@needs_cuda
@needs_te
@pytest.mark.parametrize(
    ("hidden", "rows"), [(768, 2048), (2048, 2048), (4096, 2048), (256, 2048), (768, 2047)]
)
def test_te_order_layernorm_is_te_layernorm_to_the_bit(hidden, rows):
    """harness.numerics.te_layernorm on CUDA against TE's own LayerNorm (bf16 in and out): the tuned
    kernel (rows % 4 == 0) and the general one (gpt_small's 256; an odd row count)."""
    from transformer_engine.pytorch.module._common import apply_normalization

    from harness.numerics.te_layernorm import te_layer_norm

    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 2 + 0.3).bfloat16()
    w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    want = apply_normalization(x, None, w, b, 1e-5, None, torch.bfloat16, "LayerNorm", 0, False)[0]
    got = te_layer_norm(x.float(), w.float(), b.float(), 1e-5).bfloat16()
    assert int((got.view(torch.int16) != want.view(torch.int16)).sum()) == 0
