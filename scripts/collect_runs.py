"""Collect every run directory under DIR into one JSON (summary + loss curves): for shipping results
off a machine that returns few files.   python scripts/collect_runs.py DIR OUT.json"""

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def main(root: str, out: str) -> None:
    result = {}
    for run_json in sorted(Path(root).rglob("run.json")):
        d = run_json.parent
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
        metrics = rows(d / "metrics.jsonl")
        cfg = json.loads(run_json.read_text())
        result[str(d.relative_to(root))] = {
            "summary": summary,
            "provenance": {
                k: cfg["provenance"].get(k)
                for k in ("backend", "recipe_repr", "te", "torch", "gpu_name", "git_sha", "hardware")
            },
            "train": [[r["step"], r["loss/train"]] for r in metrics if "loss/train" in r],
            "eval": [[r["step"], r["loss/eval"]] for r in metrics if "loss/eval" in r],
        }
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"collected {len(result)} runs into {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
