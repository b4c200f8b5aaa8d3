"""How close two training curves (or two gradients) are, judged against the spread of BF16 seeds.

The test behind TE-vs-emulated fidelity (benchmarks/fidelity/te_vs_emulated.py): per logged step,
|a - b| against |seed0 - seed1| (the literal two-seed test; it is near 0 wherever two BF16 curves
cross) and against the mean |seed_i - seed_j| over all pairs of N seeds (the expected two-seed gap, a
steadier estimate). Curves are {"train": [[step, loss], ...], "eval": [...]}, as the benchmark writes
them. Pure Python: nothing here imports the harness or torch.
"""

from __future__ import annotations


def criterion(a: dict, b: dict, seeds: list[dict], key: str) -> dict:
    """|a - b| at every logged step of `key` ("train" or "eval") against the BF16 seeds' gaps.
    The curves must share their logged steps."""
    if len(seeds) < 2:
        raise ValueError(f"criterion needs at least 2 BF16 seed curves, got {len(seeds)}")
    curves = [a[key], b[key], *(s[key] for s in seeds)]
    rows = []
    for points in zip(*curves, strict=True):
        step, va, vb, *vs = points[0][0], *(v for _, v in points)
        pairs = [abs(x - y) for i, x in enumerate(vs) for y in vs[i + 1 :]]
        rows.append([step, abs(va - vb), abs(vs[0] - vs[1]), sum(pairs) / len(pairs)])
    bad = [r[0] for r in rows if not r[1] < r[2]]
    bad_mean = [r[0] for r in rows if not r[1] < r[3]]
    return {
        "holds": bool(rows) and not bad,
        "violating_steps": bad,
        "holds_vs_mean_pairwise": bool(rows) and not bad_mean,
        "violating_steps_vs_mean_pairwise": bad_mean,
        "bf16_seeds": len(seeds),
        "max_pair_diff": max((r[1] for r in rows), default=None),
        "min_seed_diff": min((r[2] for r in rows), default=None),
        "rows": rows,  # [step, |a - b|, |seed0 - seed1|, mean |seed_i - seed_j|]
    }


def criterion_free(a: dict, b: dict, key: str) -> dict:
    """a - b per logged step, its largest magnitude and its signed mean, without a BF16 band
    (a persistent sign says one side sits above the other)."""
    rows = [[s, va - vb] for (s, va), (_, vb) in zip(a[key], b[key], strict=True)]
    if not rows:
        raise ValueError(f"criterion_free: no logged {key!r} points")
    mean = sum(d for _, d in rows) / len(rows)
    return {"max_pair_diff": max(abs(d) for _, d in rows), "mean_signed": mean, "rows": rows}


def rel(a, b) -> float:
    """|a - b| / |b| of two tensors (anything with `-`, `.norm()` and `.clamp_min`), 0-safe."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
