"""Data-parallel processes train every row once per epoch when `fit`
shuffles NumPy arrays, seeded or not (tests/workers/data_order.py, 2
processes under `keras-smp launch`; `runtime.data_order`).

Each process reads every global batch and keeps its replica's share. Before
keras-smp agreed on the order, unseeded processes each shuffled their own
way: measured on this worker, 70-71 of the 96 rows trained in an epoch
(the others twice or not at all), and with `shuffle="batch"` 22-25 distinct
rows in a step of 32. Now the shares of a step are disjoint, an epoch
trains each row once, and each epoch has a new order (as unseeded Keras);
ranks seeded differently (or some not) fail before the first step, naming
each rank's order. A `tf.data` dataset cannot be reseeded: shuffled without
a seed, `fit` and `evaluate` fail before their first step naming the fix
(they trained and counted each rank's share of its own order), and so
does a `fit` whose `validation_data` is (before its first step, not at its
first validation), unless
auto-sharding is off (each rank reads its own data). A `PyDataset` Keras
shuffles draws its order from Python's `random`: unseeded, `fit` fails
before its first step.
"""

import json
import os

import pytest

from conftest import WORKERS
from conftest import launch

STEPS, ROWS, N = 3, 32, 96  # per epoch, in the worker


def _steps(reports, case):
    """Each step's rows: `[(rank 0's share, rank 1's share)]`."""
    return list(zip(reports[0][case], reports[1][case]))


def _check_every_row_once(steps, batch_blocks=False):
    assert len(steps) == 2 * STEPS, len(steps)
    for index, (a, b) in enumerate(steps):
        assert len(a) == len(b) == ROWS // 2, (index, a, b)
        assert not set(a) & set(b), (index, sorted(set(a) & set(b)))
        if batch_blocks:  # shuffle="batch": the batches keep their rows
            first = ROWS * (index % STEPS)
            assert set(a) | set(b) == set(range(first, first + ROWS)), index
    for epoch in range(2):
        rows = [r for a, b in steps[epoch * STEPS:(epoch + 1) * STEPS]
                for r in a + b]
        assert sorted(rows) == list(range(N)), (epoch, sorted(rows))


@pytest.mark.slow
def test_data_parallel_processes_shuffle_arrays_alike(tmp_path):
    launch(2, [os.path.join(WORKERS, "data_order.py"), str(tmp_path)],
           timeout=240)
    reports = []
    for rank in range(2):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            reports.append(json.load(f))

    unseeded = _steps(reports, "unseeded")
    _check_every_row_once(unseeded)
    # A new order each epoch, as Keras unseeded (same odds as two random
    # permutations of 96 rows agreeing: none).
    assert unseeded[:STEPS] != unseeded[STEPS:]
    _check_every_row_once(_steps(reports, "unseeded_batch"),
                          batch_blocks=True)
    # A fit after one that left its pass unfinished: still alike.
    _check_every_row_once(_steps(reports, "after_unfinished"),
                          batch_blocks=True)
    # Seeded alike: Keras' own permutation, the same on both ranks, and
    # the one Keras on one device seeded alike trains (each step's rows).
    alike = _steps(reports, "seeded_alike")
    _check_every_row_once(alike)
    one_device = reports[0]["plain_seeded"]
    assert [sorted(a + b) for a, b in alike] == [
        sorted(rows) for rows in one_device], (alike, one_device)

    # A dataset shuffled with a seed: every row once, a new order each
    # epoch (TensorFlow reshuffles each iteration).
    seeded = _steps(reports, "dataset_seeded")
    _check_every_row_once(seeded)
    assert seeded[:STEPS] != seeded[STEPS:]
    # Auto-sharding off: each rank reads its own half (rank 0 the even
    # rows), shuffled its own way: no error.
    for rank, report in enumerate(reports):
        rows = [r for step in report["dataset_own_half"] for r in step]
        assert rows and all(r % 2 == rank for r in rows), (rank, rows)

    # Files (sharded by file: each rank its own, in its own order) and a
    # PyDataset Keras does not shuffle (unknown length) train, no error.
    # Rank r reads files r and r + 2 (of 24 rows each), each row once per
    # epoch of 6 steps of 8 rows.
    for rank, report in enumerate(reports):
        steps = report["from_files"]
        own = sorted(list(range(rank * 24, rank * 24 + 24))
                     + list(range((rank + 2) * 24, (rank + 3) * 24)))
        assert len(steps) == 12, steps
        for epoch in (steps[:6], steps[6:]):
            assert sorted(r for step in epoch for r in step) == own, epoch
    assert all(len(report["py_dataset_forever"]) == STEPS
               for report in reports)

    # A PyDataset seeded alike: its batches (blocks of rows) in one order.
    blocks = _steps(reports, "py_dataset_seeded_alike")
    _check_every_row_once(blocks)
    for a, b in blocks:
        first = min(a + b)
        assert first % ROWS == 0 and set(a + b) == set(
            range(first, first + ROWS)), (a, b)

    label = "order of the shuffled arrays"
    for report in reports:
        message = report["py_dataset_unseeded"]
        assert message is not None and (
            "order of the PyDataset's shuffle (call keras.utils."
            "set_random_seed") in message, message
        assert message.count("Python's random state") == 2, message
        for case in ("dataset_unseeded", "evaluate_unseeded"):
            message = report[case]
            assert message is not None and (
                "order of the dataset's shuffle (give Dataset.shuffle, or "
                "the utility that made the dataset, a seed") in message, (
                    case, message)
            assert ("unseeded, rank 0's own order on rank 0; unseeded, "
                    "rank 1's own order on rank 1") in message, message
        # Validation data shuffled without a seed: the fit fails before
        # its first step (it failed at its first validation, after an
        # epoch's training); seeded, it trains its 2 epochs.
        validation = report["validation_unseeded"]
        message = validation["error"]
        assert message is not None and (
            "order of the validation data's shuffle (give Dataset.shuffle a "
            "seed") in message, message
        assert ("unseeded, rank 0's own order on rank 0; unseeded, "
                "rank 1's own order on rank 1") in message, message
        assert validation["steps"] == 0, validation
        assert report["validation_seeded"] == {
            "error": None, "steps": 2 * STEPS}, report["validation_seeded"]
        # One rank shuffles, the other reads in order (its record said
        # nothing: the fit trained each rank's share of another order).
        mixed = report["shuffled_or_not"]
        assert mixed is not None and label in mixed, mixed
        assert ("Keras' own, tf.random seed 5, shuffle=True on rank 0; in "
                "order (shuffle=False) on rank 1") in mixed, mixed
        half = report["half_seeded"]
        assert half is not None and label in half, half
        assert ("keras-smp's, alike on every rank (no seed set), "
                "shuffle=True, dataset 5 on rank 0; Keras' own, tf.random "
                "seed 3, shuffle=True on rank 1") in half, half
        apart = report["seeded_apart"]
        assert apart is not None and label in apart, apart
        assert ("Keras' own, tf.random seed 1, shuffle=True on rank 0; "
                "Keras' own, tf.random seed 2, shuffle=True on rank 1"
                ) in apart, apart
        assert "keras.utils.set_random_seed" in apart, apart
