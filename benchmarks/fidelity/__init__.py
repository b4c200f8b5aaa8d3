"""Fidelity of the emulator against Transformer Engine on a GPU: quantizers bit for bit (quantizers),
the TE-order LayerNorm (layernorm_probe), and whole models from the same weights: step-0 operands,
gradients and loss curves (te_vs_emulated, with operands, grads and common)."""
