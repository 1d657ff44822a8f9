"""The pipeline runtime in one process: pipelined gradients equal whole-batch ones.

Runs tests/workers/pipeline_grads.py (2 logical CPU devices, a 4-layer MLP
split into 2 stages) for both schedules and 1, 2, 4, 8 microbatches.
"""

import json
import os

import pytest

from conftest import WORKERS
from conftest import run_python


@pytest.fixture(scope="module")
def cases():
    proc = run_python([os.path.join(WORKERS, "pipeline_grads.py"),
                       "gpipe,1f1b", "1,2,4,8"])
    rows = [json.loads(l) for l in proc.stdout.splitlines()
            if l.startswith("{")]
    assert len(rows) == 8, proc.stdout
    return rows


def test_pipelined_gradients_match_whole_batch(cases):
    for row in cases:
        # Microbatch gradients summed in another order: float32 rounding.
        assert row["grad_diff"] <= 1e-6 + 1e-5 * row["grad_scale"], row
        assert row["loss_diff"] <= 1e-6, row


def test_forward_and_backward_ops_run_on_their_stage_device(cases):
    for row in cases:
        assert row["placement"] == {
            "0/fwd": ["/device:CPU:0"], "0/grad": ["/device:CPU:0"],
            "1/fwd": ["/device:CPU:1"], "1/grad": ["/device:CPU:1"]}, row
