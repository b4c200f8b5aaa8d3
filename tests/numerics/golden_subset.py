"""The in-repo slice of the TE golden vectors (`tests/assets/golden/`), cut from the full set.

The full set (`../shared/golden/te-2.20.2-h200/`, 20 MB: 4 inputs of 256x512 bf16, 12 quantizer
configs) stays out of git. Every clone checks the slice instead: per input one aligned 128x128 tile,
the one holding the input's largest magnitude, so the tile's own amax is the tensor's and per-tensor
scales come out as on the whole tensor; 128 is TE's block edge, so 1x128 blocks and 128x128 tiles of
the tile are blocks and tiles of the whole. Kept per case: both copies' codes and their scale_inv on
the tile, and (input `normal`) the first DEQ_ROWS rows of TE's dequantization in bf16, which is exact
(TE's nominal dtype there). Regenerate only if the full set changes:

    python -m tests.numerics.golden_subset
"""

from __future__ import annotations

from pathlib import Path

import torch

FULL = Path(__file__).resolve().parents[2].parent / "shared/golden/te-2.20.2-h200"
SUBSET = Path(__file__).resolve().parents[1] / "assets/golden/te-2.20.2-h200-subset.pt"
INPUTS = ("normal", "outliers", "tiny", "decades")
TILE, DEQ_ROWS = 128, 32


def tile_of(x: torch.Tensor) -> tuple[int, int]:
    """Top-left corner of the aligned TILE x TILE tile holding x's largest magnitude."""
    idx = int(x.float().abs().argmax())
    r, c = divmod(idx, x.shape[1])
    return r // TILE * TILE, c // TILE * TILE


def _scales(te: dict, r0: int, c0: int, kind: str) -> dict:
    """scale_inv of the tile from TE's layouts (docs/numerics.md section 3; valid region only for 2D)."""
    rb, cb = r0 // TILE, c0 // TILE
    row, col = te["_rowwise_scale_inv"], te["_columnwise_scale_inv"]
    if kind == "block1d":  # (column blocks, rows) rowwise; (row blocks, columns) columnwise
        row, col = row[cb : cb + 1, r0 : r0 + TILE], col[rb : rb + 1, c0 : c0 + TILE]
    else:  # 128x128: one tile each way
        row, col = row[rb : rb + 1, cb : cb + 1], col[cb : cb + 1, rb : rb + 1]
    return {"row_scale_inv": row, "col_scale_inv": col}


def cut_case(te: dict, r0: int, c0: int) -> dict:
    rows, cols = slice(r0, r0 + TILE), slice(c0, c0 + TILE)
    if "_data" in te:
        case = {
            "row_data": te["_data"][rows, cols],
            "col_data": te["_transpose"][cols, rows],
            "row_scale_inv": te["_scale_inv"],
            "col_scale_inv": te["_scale_inv"],
        }
        if "scale" in te:
            case["scale"] = te["scale"]
    else:
        kind = "block1d" if te["_rowwise_scale_inv"].shape[1] > 8 else "block2d"
        case = {
            "row_data": te["_rowwise_data"][rows, cols],
            "col_data": te["_columnwise_data"][cols, rows],
            **_scales(te, r0, c0, kind),
        }
    if "dequantized" in te:
        deq = te["dequantized"][r0 : r0 + DEQ_ROWS, cols]
        assert torch.equal(deq.bfloat16().float(), deq)
        case["dequantized"] = deq.bfloat16()
    return {k: v.clone().contiguous() for k, v in case.items()}


def cut(full: Path = FULL) -> dict:
    out = {}
    for name in INPUTS:
        g = torch.load(full / f"te-golden-bf16-{name}.pt")
        r0, c0 = tile_of(g["input"])
        out[name] = {
            "corner": (r0, c0),
            "input": g["input"][r0 : r0 + TILE, c0 : c0 + TILE].clone(),
            "quantized": {cfg: cut_case(te, r0, c0) for cfg, te in g["quantized"].items()},
        }
    return out


if __name__ == "__main__":
    SUBSET.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cut(), SUBSET)
    print(f"wrote {SUBSET} ({SUBSET.stat().st_size / 2**20:.2f} MiB)")
