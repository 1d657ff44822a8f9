"""The notebooks in notebooks/ run top to bottom (as in CI), in a fresh kernel.

Each notebook asserts its own claims (pipelined training equals one device,
workers' results, equal sums of both all-reduce algorithms); a failing cell
fails the test with its traceback.
"""

import os
import shutil

import pytest

from conftest import ROOT

NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, "notebooks"))
                   if f.endswith(".ipynb"))


def test_there_are_three_notebooks():
    assert NOTEBOOKS == ["01_quickstart.ipynb", "02_multi_worker.ipynb",
                         "03_hierarchical_allreduce.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    for k in ("TF_CONFIG", "SMP_CONFIG", "SMP_HOST_MAP"):
        monkeypatch.delenv(k, raising=False)
    shutil.copy(os.path.join(ROOT, "notebooks", name), tmp_path / name)
    nb = nbformat.read(tmp_path / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    if name == "01_quickstart.ipynb":
        for picture in ("planned_1f1b.png", "executed_1f1b.png"):
            assert (tmp_path / picture).stat().st_size > 1000
