"""Reference helpers the numerics tests (and the GPU fidelity benchmarks) share: test inputs and TE's
own quantizers behind one call. Laid out as TransformerEngine's tests/pytorch/references/."""
