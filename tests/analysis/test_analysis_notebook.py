"""The notebook is stored without outputs, is parameterised, and runs top to bottom on a fixture sweep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("nbformat")

import nbformat

import analysis

NOTEBOOK = Path(analysis.__file__).parent / "notebooks" / "compare_recipes.ipynb"


def test_notebook_is_stored_without_outputs_and_has_a_parameters_cell() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and "SWEEP_DIR =" in tagged[0].source


@pytest.mark.slow
def test_notebook_executes_on_a_sweep(
    sweep_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    papermill = pytest.importorskip("papermill")
    repo = NOTEBOOK.parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "executed.ipynb"
    params = {"SWEEP_DIR": str(sweep_dir)}
    papermill.execute_notebook(
        str(NOTEBOOK), str(out), parameters=params, cwd=str(NOTEBOOK.parent), progress_bar=False
    )
    nb = nbformat.read(out, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    n_runs = len(list(sweep_dir.rglob("run.json")))
    assert f"{n_runs} runs in " in text
    assert "verdict_text" in html and ("worse than BF16" in html or "indistinguishable" in html)
    assert "Welch t" in html or "paired t" in html
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3
