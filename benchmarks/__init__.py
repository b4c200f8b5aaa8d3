"""lowp's benchmarks: throughput, emulator overhead, TE-vs-emulated fidelity, analysis load speed.

Each module runs on its own (`python -m benchmarks.throughput --help`) or by named spec files
(`benchmarks/specs/*.yaml`, read by `benchmarks.specs`); `python -m benchmarks SPEC...` runs several
specs in one call, each writing OUT/<spec>_<machine>_<date>.json. The current figures and the specs
that reproduce them are in benchmarks/RESULTS.md.
"""
