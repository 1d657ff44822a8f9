"""One pipeline runtime for every transport.

An action list written out in tests/workers/runtime_actions.py (an order
that is neither GPipe nor 1F1B) runs through `execute` twice: with
`LocalTransport` (2 stages on 2 logical CPUs of one process) and with
`CollectiveTransport` (one stage per process, 2 real worker processes
started by `keras-smp launch`). Both must give the whole-batch gradients
and loss of a plain GradientTape.

Bound: |diff| <= 1e-6 x max(1, largest reference gradient), float32
rounding of the same sums over 3 microbatches taken in another order
(observed ~3e-8 at gradients of ~0.5).
"""

import json
import os

import pytest

from conftest import WORKERS
from conftest import launch
from conftest import run_python

SCRIPT = os.path.join(WORKERS, "runtime_actions.py")


def _results(stdout):
    return [json.loads(line.split("RESULT ", 1)[1])
            for line in stdout.splitlines() if "RESULT " in line]


def _check_fidelity(row):
    bound = 1e-6 * max(1.0, row["grad_scale"])
    diffs = {k: v for k, v in row.items() if k.startswith("grad_diff_")}
    assert diffs, row
    assert all(v <= bound for v in diffs.values()), row
    if "loss_diff" in row:
        assert row["loss_diff"] <= 1e-6, row


@pytest.mark.parametrize("split", [False, True])
def test_action_list_runs_in_one_process_with_local_transport(split):
    # split: the list runs backwards as I then W (see SPLIT_PLAN there).
    extra = {"SPLIT_PLAN": "1"} if split else None
    (row,) = _results(run_python([SCRIPT, "local"], extra_env=extra).stdout)
    assert row["held"] == [0, 1]
    assert sorted(k for k in row if k.startswith("grad_diff_")) == [
        "grad_diff_w0", "grad_diff_w1", "grad_diff_w2"]
    _check_fidelity(row)
    # Each stage's forward and backward ops on its own device.
    assert row["placement"] == {
        "0/fwd": ["/device:CPU:0"], "0/grad": ["/device:CPU:0"],
        "1/fwd": ["/device:CPU:1"], "1/grad": ["/device:CPU:1"]}, row
    assert row["sends"] == row["recvs"] == 0  # no collectives in-process
    # A receive without its send is refused with the blocked actions named.
    assert "cannot run" in row["broken_error"], row
    assert "1RECV_F1" in row["broken_error"], row


def test_split_backward_equals_the_whole_backward():
    # I (input gradients and the gradients reaching each weight's op) then
    # W (each op's weight gradient, carried back to the variables) against
    # one tf.gradients of the whole stage, on Keras models with biases,
    # LayerNorm, Dropout (its seed read and assigned in the forward), a
    # layer applied twice, Embedding (sparse) + attention, Conv2D +
    # BatchNorm; an op taking one weight twice and its cast. The same math
    # in another order: float32 rounding at most (1e-6 of the largest
    # gradient).
    rows = {r["model"]: r for r in _results(run_python(
        [os.path.join(WORKERS, "split_backward.py")]).stdout)}
    assert sorted(rows) == ["conv", "embed", "learned", "mlp", "nested",
                            "tied", "twice"], rows
    for row in rows.values():
        assert row["diff"] <= 1e-6 * max(1.0, row["scale"]), row
        assert row["nonzero"], row
    assert {"MatMul", "BiasAdd"} <= set(rows["tied"]["meetings"])
    assert "GatherV2" in rows["embed"]["meetings"], rows["embed"]
    assert "Conv2D" in rows["conv"]["meetings"], rows["conv"]
    # A weight read inside a nested tf.function, or a stage output made of
    # weights alone: not split (None; the stage runs its whole backward).
    assert rows["nested"]["meetings"] is None
    assert rows["learned"]["meetings"] is None
    # The embedding's gradient stays sparse (IndexedSlices) through W.
    assert rows["embed"]["sparse"], rows["embed"]


@pytest.mark.slow
def test_same_action_list_runs_across_processes_with_collectives():
    proc = launch(2, [SCRIPT, "collective"], timeout=240)
    rows = sorted(_results(proc.stdout), key=lambda r: r["held"])
    assert [r["held"] for r in rows] == [[0], [1]], proc.stdout
    assert set(rows[0]) >= {"grad_diff_w0", "grad_diff_w1"}
    assert set(rows[1]) >= {"grad_diff_w2", "loss_diff"}
    for row in rows:
        _check_fidelity(row)
        # 3 microbatches: activations one way, their gradients the other.
        assert row["sends"] == 3 and row["recvs"] == 3, row


def test_a_stage_traced_once_equals_the_stage_built_inline():
    # tests/workers/trace_once.py: a stage's forward on 3 microbatches in
    # one step, traced once (`tracing.once_per_shape`) and built inline.
    # Bound: 1e-6 x the largest value compared (float32 rounding of the
    # same ops, fused or ordered differently across a function call;
    # observed <= 5e-8 x).
    proc = run_python([os.path.join(WORKERS, "trace_once.py")], timeout=300)
    rows = {r["check"]: r for r in (
        json.loads(line.split("ROW ", 1)[1])
        for line in proc.stdout.splitlines() if line.startswith("ROW "))}
    assert sorted(rows) == sorted([
        "dense", "batchnorm_dropout", "activity_regularizer",
        "seeded_tf_random", "assigns_a_weight"]), proc.stdout
    for row in rows.values():
        assert row["inline_runs"] == 3, row
        assert row["diff"] <= 1e-6 * max(1.0, row["scale"]), row
        assert row["draws"] == 3, row  # microbatches differ
    # Traced once, gradients, state (moving statistics, dropout seeds)
    # and added losses as inline.
    for check in ("dense", "batchnorm_dropout", "activity_regularizer"):
        assert rows[check]["runs"] == 1, rows[check]
        assert rows[check]["grads"] > 0, rows[check]
    assert rows["batchnorm_dropout"]["state_moved"] > 1e-3, rows
    assert rows["activity_regularizer"]["added"] > 1e-3, rows
    # Run inline after one dropped trace: seeded TensorFlow random ops
    # (one trace would draw the same noise for every microbatch) and a
    # layer assigning a weight that is not state (counted 3 calls).
    assert rows["seeded_tf_random"]["runs"] == 4, rows
    assert rows["assigns_a_weight"]["runs"] == 4, rows
    assert rows["assigns_a_weight"]["counted"] == [3.0], rows


def test_tensors_of_unknown_shape_use_keys_no_other_transfer_uses():
    # A tensor whose length changes from batch to batch crosses processes
    # as a shape header, then its values padded to a size bucket, each
    # bucket under its own instance key (TensorFlow keeps one shape per
    # key). Those keys must meet no other collective's in the same group,
    # and fit in int32.
    import numpy as np
    import tensorflow as tf

    from keras_smp.pipeline import transport
    from keras_smp.pipeline.transport import StageLinks as L

    buckets = transport._BUCKETS
    assert L.DYNAMIC_STRIDE >= 1 + len(buckets)  # header + one per bucket
    # The smallest bucket holding each size, padding under 25%.
    sizes = [0, 1, 3, 4, 5, 9, 17, 33, 1000, 123_457, 2**30 + 1, 2**31 - 2]
    got = [[int(v) for v in transport._bucket(tf.constant(n, tf.int32))]
           for n in sizes]
    for n, (index, size) in zip(sizes, got):
        assert size == buckets[index] >= n, (n, index, size)
        assert index == 0 or buckets[index - 1] < n, (n, index, size)
        assert size <= max(1, 1.25 * n), (n, size)
    # Pair groups (transfers only): below the batched keys, one range per
    # transfer position.
    top = L._position("B", 298, 99)
    assert L._pair_dynamic_keys(top)(len(buckets)) < L.BATCHED_BASE
    assert L._pair_dynamic_keys(1)(0) >= L.DYNAMIC_PAIR_BASE
    # The replica group: positions above every static share's.
    static = [L.SHARE_DATA + 298 * 100 + 99, L.SHARE_TRACKED + 999]
    assert min(L.SHARE_DYNAMIC_DATA, L.SHARE_DYNAMIC_OUTPUTS) > max(static)
    assert L.SHARE_DYNAMIC_DATA + 100 <= L.SHARE_DYNAMIC_OUTPUTS
    assert L.SHARE_DYNAMIC_OUTPUTS + 500 <= L.SHARE_DYNAMIC_SPLIT_OUTPUTS
    assert L.SHARE_DYNAMIC_SPLIT_OUTPUTS + 500 <= L.ROWS_STRIDE
    assert L._shared_dynamic_keys(L.ROWS_STRIDE - 1)(
        len(buckets)) < np.iinfo(np.int32).max


def test_position_lookups_are_told_from_lookups_with_a_row_per_sample():
    # tests/workers/sparse_ids.py: a model (inputs of unknown length)
    # looking tables up at ids of every kind. Only ids computed from
    # constants and shapes, as many at any batch size, are added position
    # by position over microbatches (one device's gradient holds them
    # once, rows summed over the batch): arange(length), arange // 2 (its
    # repeats kept), a constant arange(3). Not: token ids, positions
    # broadcast over the batch, zeros of the batch's shape, random ids (a
    # seed generator's: new in every microbatch, which add_rows' check
    # would stop), a position table read with ops.take in a layer holding
    # no Embedding (not traced).
    proc = run_python([os.path.join(WORKERS, "sparse_ids.py")], timeout=300)
    rows = [json.loads(line.split("ROW ", 1)[1])
            for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    assert len(rows) == 1, proc.stdout
    row = rows[0]
    assert row["batch_free"] == ["constant", "pairs", "positions"], row
    assert row["cached"], row
    # Ids that differ between microbatches are an error naming the
    # gradient, not a silent sum.
    assert row["error"] and "the ids of the gradient of t differ" in \
        row["error"], row
    assert row["examples"] == 1, row
