"""The SMP usage patterns in examples/, and the SMP-API docstring examples.

Each example runs to completion with 2 pipeline stages, in one process and
with `keras-smp launch -n 2` (2 data-parallel replicas), and its loss must
go down. The Horovod example runs in the Horovod environment (.venv-hvd,
built by `make test` through scripts/horovod-env.sh).
"""

import inspect
import os
import re
import sys
import textwrap

import pytest

from conftest import HVD_PYTHON
from conftest import ROOT
from conftest import hvd_env_or_skip
from conftest import launch
from conftest import run_python



def _losses(stdout):
    m = re.search(r"LOSS ([0-9.]+) -> ([0-9.]+)", stdout)
    assert m, stdout[-3000:]
    return float(m.group(1)), float(m.group(2))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("script", ["smp_custom_loop.py", "smp_manual_split.py"])
def test_smp_example_trains(script, workers, tmp_path):
    path = os.path.join(ROOT, "examples", script)
    extra = {"EPOCHS": "3", "CKPT_DIR": str(tmp_path)}
    if workers == 1:
        out = run_python([path], extra_env=extra, lean=False).stdout
    else:
        out = launch(2, [path], timeout=240, extra_env=extra,
                     lean=False).stdout
        assert "replicas 2" in out or "[0]" in out
    first, last = _losses(out)
    assert last < 0.7 * first, out[-2000:]
    if script == "smp_custom_loop.py":
        # CheckpointManager kept the last 2 of 3 saves.
        assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".index")) \
            == ["ckpt-2.index", "ckpt-3.index"]


@pytest.mark.slow
def test_smp_example_trains_with_one_stage_per_process(tmp_path):
    # The same script, SMP's layout chosen from outside (SMP_CONFIG
    # overrides the script's config): each of 2 processes runs one stage;
    # each stage checkpoints its own sub-folder.
    path = os.path.join(ROOT, "examples", "smp_custom_loop.py")
    out = launch(2, [path], timeout=240, lean=False, extra_env={
        "EPOCHS": "3", "CKPT_DIR": str(tmp_path),
        "SMP_CONFIG": '{"local_devices": 1}'}).stdout
    assert "stages 2, replicas 1" in out, out[-2000:]
    first, last = _losses(out)
    assert last < 0.7 * first, out[-2000:]
    for stage in ("pp_rank_0", "pp_rank_1"):
        assert sorted(p for p in os.listdir(tmp_path / stage)
                      if p.endswith(".index")) == ["ckpt-2.index",
                                                   "ckpt-3.index"]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_smp_hybrid_horovod_example_trains(workers):
    hvd_env_or_skip()
    path = os.path.join(ROOT, "examples", "smp_hybrid_horovod.py")
    extra = {"EPOCHS": "3"}
    if workers == 1:
        out = run_python([path], extra_env=extra, python=HVD_PYTHON,
                         lean=False).stdout
        assert "horovod size 1" in out
    else:
        out = launch(2, [path], timeout=240, extra_env=extra,
                     python=HVD_PYTHON, launcher_args=("--horovod",),
                     lean=False).stdout
        assert "horovod size 2" in out
    assert "max weight difference to rank 0 0\n" in out, out[-2000:]
    first, last = _losses(out)
    assert last < 0.7 * first, out[-2000:]




@pytest.mark.parametrize("name", ["keras_smp.smp.custom_loop", "init",
                                  "keras_smp.smp.comms",
                                  "keras_smp.smp.checkpoint",
                                  "keras_smp.pipeline.shards",
                                  "keras_smp.runtime.sparse",
                                  "keras_smp.distribute.compression",
                                  "keras_smp.runtime.malloc",
                                  "keras_smp.runtime.loss_shares (all)",
                                  "keras_smp.pipeline.microbatch (all)",
                                  "save_model",
                                  "save_weights", "save(", "export(",
                                  "compile", "get_layer", "__getattr__",
                                  "set_activation_checkpointing"])
def test_smp_api_docstring_examples_run(name, tmp_path):
    # Imported here by source text only: the pytest process stays TF-free.
    # The examples' tempfile.mkdtemp() directories go under tmp_path.
    if name in ("save_model", "save_weights", "save(", "export(", "compile",
                "get_layer", "__getattr__"):
        src = open(os.path.join(ROOT, "keras_smp", "pipeline", "model.py")).read()
        doc = src.split(f"def {name}", 1)[1].split('"""')[1]
    elif name == "init":  # smp.init
        src = open(os.path.join(ROOT, "keras_smp", "smp", "setup.py")).read()
        doc = src.split(f"def {name}", 1)[1].split('"""')[1]
    elif name == "set_activation_checkpointing":
        src = open(os.path.join(ROOT, "keras_smp", "pipeline",
                                "recompute.py")).read()
        doc = src.split(f"def {name}", 1)[1].split('"""')[1]
    elif name.endswith(" (all)"):  # every docstring of the module
        path = os.path.join(ROOT, *name.split()[0].split(".")) + ".py"
        doc = "\n".join(textwrap.dedent(block) for block in re.findall(
            r"^( *```python\n.*?```)", open(path).read(), flags=re.S | re.M))
    else:
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        doc = open(path).read().split('"""')[1]
    blocks = re.findall(r"```python\n(.*?)```", inspect.cleandoc(doc), flags=re.S)
    assert blocks, name
    if name.endswith(" (all)"):  # one process: each block in turn
        blocks = ["\n".join(blocks)]
    for code in blocks:
        run_python(["-c", code], extra_env={"TMPDIR": str(tmp_path)},
                   lean=False)
