"""A split batch's parts draw their rows of the whole batch's random numbers.

`keras_smp.runtime.split_draws` routes Keras' TensorFlow `uniform`,
`normal` and `dropout` draws: inside `part(offset, rows)` a draw whose
first dimension is the part's rows starts Philox's counter at the part's
first element of the whole batch's draw. Checked in one process
(tests/workers/split_draws.py):

- the parts of a batch, drawn one by one (offsets that are not a multiple
  of Philox's 4-element block included) and put together, equal the whole
  batch's draw bit for bit, for every float dtype Keras trains in
  (float32, float16, bfloat16, float64): dropout (also with a mask
  broadcast over a dimension), uniform, normal; under XLA too, except
  normal draws (XLA's normal values depend on the whole shape: they stay
  the part's own, checked as such);
- nested parts (a replica's microbatches) add their offsets; each
  data-parallel replica's part (2 processes x 2 local replicas, real
  worker processes) starts at its first row of the global batch;
- draws of another first dimension (a fixed shape, a mask broadcast over
  the batch) are the whole batch's; outside a part Keras draws exactly as
  `tf.random` / `tf.nn.experimental` do; a seed generator advances once
  per draw; the 128-bit counter carries into its high word; a layer
  built by its first call inside a part (in a traced function) draws its
  initial weights as outside any part; parts of one row keep a mask
  broadcast over the batch (`noise_shape=(1, n)`); draws a part cannot
  take as its rows of the whole batch's (XLA's normal draws; `randint`,
  `truncated_normal`, `shuffle`) differ between parts (a seed folded with
  the offset: each microbatch starts from the same generator state);
- Keras' random layers (Dropout, SpatialDropout1D, GaussianNoise,
  GaussianDropout, AlphaDropout, LSTM and GRU with dropout) called on the
  parts, each from the generator's state before the whole batch's call,
  give the whole batch's rows and leave the state as one call does.

Bounds: exact (the same numbers from the same generator, no arithmetic
in another order), except the RNNs' outputs, which multiply matrices of
other row counts per part: conftest's float32 bound (observed 9e-8 on
outputs below 1). The pipelines and replicas that use it are tested
against plain Keras in tests/test_pipeline_model.py ("random") and
tests/test_model_zoo.py ("dropout").
"""

import json
import os

import pytest

from conftest import WORKERS
from conftest import launch
from conftest import run_python

CHECKS = (
    [f"parts_draw_their_rows[{d}, xla={x}]"
     for d in ("float32", "float16", "bfloat16", "float64")
     for x in (False, True)]
    + ["parts_inside_parts_add_their_offsets",
       "draws_of_another_first_dimension_are_the_whole_batchs",
       "outside_a_part_keras_draws_as_it_does",
       "a_seed_generator_advances_once_per_draw_in_a_part",
       "the_counter_carries_into_its_high_word",
       "a_layer_built_inside_a_part_initializes_as_outside",
       "a_part_of_one_row_keeps_a_mask_broadcast_over_the_batch",
       "draws_a_part_cannot_take_as_rows_differ_between_parts"]
    + [f"layer_on_parts[{n}]" for n in (
        "Dropout", "SpatialDropout1D", "GaussianNoise", "GaussianDropout",
        "AlphaDropout", "LSTM", "GRU")])


def test_each_replicas_part_starts_at_its_first_row_of_the_global_batch():
    # 2 processes x 2 local replicas: TensorFlow gives local replica l of
    # process d the global batch's share l * 2 + d (process 0 holds shares
    # 0 and 2); each replica's part must start where its rows do (it was
    # taken as d * 2 + l: shares 1 and 2 swapped).
    out = launch(2, [os.path.join(WORKERS, "split_draws_replicas.py")],
                 timeout=240).stdout
    rows = [json.loads(line.split("PARTS ", 1)[1])
            for line in out.splitlines() if "PARTS " in line]
    assert len(rows) == 8, out[-3000:]  # 4 batches on each process
    starts = sorted(part[1] for row in rows for part in row)
    assert starts == [0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6], rows
    for row in rows:
        for offset, first, rows_, held in row:
            assert offset == first and rows_ == held == 2, row


@pytest.fixture(scope="module")
def results():
    proc = run_python([os.path.join(WORKERS, "split_draws.py")],
                      timeout=300)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines()
            if line.startswith("ROW ")]
    return {row["check"]: row for row in rows}


@pytest.mark.parametrize("name", CHECKS)
def test_split_draws(results, name):
    assert sorted(results) == sorted(CHECKS)
    assert results[name]["error"] is None, results[name]["error"]
