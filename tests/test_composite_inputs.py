"""Sparse and ragged model inputs train, evaluate and predict under an
SMPStrategy as plain Keras does on one device (tests/workers/
composite_inputs.py): a data-parallel model (it failed to build:
TensorFlow's reduction of a sample batch has no sparse or ragged kernel),
2 pipelines of 2 stages in one process and one stage per process (the
batch failed to split into microbatches), with a partial last batch, and
SMP's `@smp.step` custom loop. Ids a `Lambda` computes (int32, where
Keras' graph says float32) looked up on the next stage, and returned as
a model output by `predict` (with one stage per process the ranks'
collectives disagreed on the dtype). A
sparse input used on a later stage is a clear error (a stage boundary
carries dense tensors), and so is a string input across processes.

Bounds: the suite's float32 bounds (conftest), `RTOL |ref| + ATOL *
max|ref|` for each compared quantity (weights, `History`, `evaluate`,
predictions): the same batches differ only by the order of summation
across replicas and microbatches. Shapes must be equal.
"""

import json
import os
import re

import pytest

from conftest import ATOL
from conftest import RTOL
from conftest import WORKERS
from conftest import launch
from conftest import run_python

WORKER = os.path.join(WORKERS, "composite_inputs.py")


def _check(report, pipelined, names=("evaluation", "history",
                                     "predictions", "weights"),
           processes=False):
    if pipelined:  # a sparse input used on the second stage
        assert re.search(
            r"The sparse tensor input 'b' is used on a later pipeline stage "
            r"than 0 \(by layer\(s\) \['late'\]\): a stage boundary "
            r"carries dense tensors only.*split_points",
            report.pop("crossing")), report
        # ... and a string input: handed on in one process, an error
        # across processes
        strings = report.pop("strings")
        assert (re.search(
            r"The string tensor input 'words' is used on a later pipeline "
            r"stage than 0 \(by layer\(s\) \['lookup'\]\): stage "
            r"processes exchange numeric tensors only", strings)
            if processes else strings == "wrapped"), strings
        # An int32 model output that Keras' graph calls float32 (a
        # Lambda's argmax): predict's outputs as plain Keras', int32.
        row = report.pop("int_output")
        assert row["dtypes"] == ["int32", "int32"], row
        assert row["diff"] <= (RTOL + ATOL) * max(1.0, row["scale"]), row
    assert sorted(report) == ["ints", "ragged", "sparse"], report
    for kind, rows in report.items():
        assert sorted(rows) == sorted(names), rows
        for name, row in rows.items():
            assert row["shapes"][0] == row["shapes"][1], (kind, name, row)
            assert row["diff"] <= (RTOL + ATOL) * max(1.0, row["scale"]), (
                kind, name, row)


@pytest.mark.parametrize("mode", ["dp", "pp_dp"])
def test_sparse_and_ragged_inputs_in_one_process(mode, tmp_path):
    run_python([WORKER, mode, str(tmp_path)])
    with open(tmp_path / "rank0.json") as f:
        _check(json.load(f), mode == "pp_dp")


def test_sparse_and_ragged_inputs_in_an_smp_custom_loop(tmp_path):
    # @smp.step splits them into microbatches along their rows (it failed
    # in `tf.convert_to_tensor`); each step's loss, the last predictions
    # and the weights against a tape.
    run_python([WORKER, "custom_loop", str(tmp_path)])
    with open(tmp_path / "rank0.json") as f:
        _check(json.load(f), False, ("history", "predictions", "weights"))


def test_sparse_and_ragged_inputs_with_one_stage_per_process(tmp_path):
    launch(2, [WORKER, "mp", str(tmp_path)])
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            _check(json.load(f), True, processes=True)
