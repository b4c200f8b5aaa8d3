"""The notebook is stored without outputs and runs top to bottom on a fixture sweep."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import analysis

NOTEBOOK = Path(analysis.__file__).parent / "notebooks" / "compare_recipes.ipynb"


def test_notebook_is_stored_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_notebook_executes_on_a_sweep(sweep_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = NOTEBOOK.parents[2]
    monkeypatch.setenv("LOWP_SWEEP_DIR", str(sweep_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "gap vs BF16" in text and "group(s)" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4
