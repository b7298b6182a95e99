"""The notebooks in notebooks/ run from top to bottom without an error, and are stored without
outputs (so a diff shows only what someone wrote)."""

import os
import time
from pathlib import Path

import pytest

import decoderlm

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
# the slowest cell trains a small model: seconds on an idle CPU core, minutes on a busy one
# (a timeout is a hang guard, not a speed check)
CELL_TIMEOUT_S = 900


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"wikitext2_char.ipynb", "lens_tour.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_stored_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "a notebook without code"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_runs_without_an_error(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    # kernel "python3" is this interpreter's ipykernel: a kernelspec written for it, found
    # first on JUPYTER_PATH (ahead of any python3 kernel installed for another Python)
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # the kernel imports the decoderlm under test and uses one thread
    src = str(Path(decoderlm.__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    started = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError, naming the cell, on any error
    print(f"{path.name}: {time.perf_counter() - started:.1f} s")
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert errors == []
