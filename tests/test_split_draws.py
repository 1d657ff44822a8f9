"""A split batch's parts draw their rows of the whole batch's random numbers.

`keras_smp.runtime.split_draws` routes Keras' TensorFlow `uniform`,
`normal` and `dropout` draws: inside `part(offset, rows)` a draw whose
first dimension is the part's rows starts Philox's counter at the part's
first element of the whole batch's draw. Here, in one process: the parts
of a batch, drawn one by one (offsets that are not a multiple of Philox's
4-element block included, nested parts as a replica's microbatches), put
together equal the whole batch's draw bit for bit, for every float dtype
Keras trains in; XLA's uniform draws too (its normal draws depend on the
whole shape: they stay the part's own); draws of another first dimension
are the whole batch's; outside a part nothing changes. Exact equality:
the same numbers from the same generator, no arithmetic in another order.
The pipelines and replicas that use it are tested against plain Keras in
tests/test_pipeline_model.py ("random") and tests/test_model_zoo.py
("dropout").
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_smp.runtime import split_draws

split_draws.install()

# Rows of a batch of 9, as (offset, rows): 3 x 5 = 15 elements per
# part row, so the parts start inside Philox blocks of 4 (and 2).
PARTS = [(0, 4), (4, 1), (5, 4)]


def _draws(dtype):
    """name -> (draw(rows_tensor, seed) of a [rows, 5, 3] input, batch
    dimension?)."""
    return {
        "dropout": lambda x, s: keras.random.dropout(x, 0.3, seed=s),
        "dropout_noise_shape": lambda x, s: keras.random.dropout(
            x, 0.4, noise_shape=(None, 1, 3), seed=s),
        "uniform": lambda x, s: keras.random.uniform(
            tf.shape(x), -2.0, 3.0, dtype=dtype, seed=s),
        "normal": lambda x, s: keras.random.normal(
            keras.ops.shape(x), 1.0, 2.0, dtype=dtype, seed=s),
    }


def _whole_and_parts(x, draw, parts, seed=11):
    whole = draw(x, seed)
    got = []
    for offset, rows in parts:
        with split_draws.part(offset, rows):
            got.append(draw(x[offset:offset + rows], seed))
    return whole, tf.concat(got, 0)


def _as_array(t):
    return t.numpy().astype("float64")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16",
                                   "float64"])
@pytest.mark.parametrize("xla", [False, True])
def test_parts_draw_their_rows_of_the_whole_batch(dtype, xla):
    x = tf.cast(tf.random.stateless_normal([9, 5, 3], seed=[1, 2]), dtype)

    @tf.function(jit_compile=xla)
    def run():
        return {name: _whole_and_parts(x, draw, PARTS)
                for name, draw in _draws(dtype).items()}

    for name, (whole, parts) in run().items():
        if xla and name == "normal":
            # XLA's normal values depend on the whole shape: each part
            # draws for its own (as before), first rows included.
            assert not np.array_equal(_as_array(whole), _as_array(parts))
            continue
        np.testing.assert_array_equal(_as_array(parts), _as_array(whole),
                                      err_msg=f"{name} {dtype} xla={xla}")
        assert np.std(_as_array(whole)) > 0.1, name  # a real draw


def test_parts_inside_parts_add_their_offsets():
    # A replica's microbatches: replica 1 of 2 holds rows 6..11 of 12, in
    # microbatches of 2.
    x = tf.random.stateless_normal([12, 7], seed=[3, 4])
    whole = keras.random.dropout(x, 0.5, seed=5)
    got = []
    with split_draws.part(6, 6):
        for mb in range(3):
            with split_draws.part(2 * mb, 2):
                got.append(keras.random.dropout(
                    x[6 + 2 * mb:8 + 2 * mb], 0.5, seed=5))
    np.testing.assert_array_equal(tf.concat(got, 0).numpy(),
                                  whole[6:].numpy())


def test_draws_of_another_first_dimension_are_the_whole_batchs():
    # A fixed shape (not the part's rows), a mask broadcast over the batch.
    x = tf.ones([6, 4])
    fixed = keras.random.uniform((7,), seed=3)
    shared = keras.random.dropout(x, 0.5, noise_shape=(1, 4), seed=3)
    with split_draws.part(2, 2):
        np.testing.assert_array_equal(
            keras.random.uniform((7,), seed=3).numpy(), fixed.numpy())
        np.testing.assert_array_equal(
            keras.random.dropout(x[2:4], 0.5, noise_shape=(1, 4),
                                 seed=3).numpy(), shared[2:4].numpy())


def test_outside_a_part_keras_draws_as_it_does():
    x = tf.random.stateless_normal([5, 3], seed=[5, 6])
    seed = tf.constant([9, 0])
    np.testing.assert_array_equal(
        keras.random.dropout(x, 0.3, seed=9).numpy(),
        tf.nn.experimental.stateless_dropout(x, 0.3, seed=seed).numpy())
    np.testing.assert_array_equal(
        keras.random.normal((5, 3), seed=9).numpy(),
        tf.random.stateless_normal((5, 3), seed=seed).numpy())
    assert split_draws.current() is None


def test_a_seed_generator_advances_once_per_draw_in_a_part():
    gen = keras.random.SeedGenerator(1)
    with split_draws.part(0, 2):
        keras.random.dropout(tf.ones([2, 2]), 0.5, seed=gen)
    assert gen.state.numpy().tolist() == [1, 1]


def test_the_counter_carries_into_its_high_word():
    low = tf.constant(-1, tf.int64)  # 2**64 - 1 as an unsigned word
    counter = tf.bitcast(tf.stack([low, tf.constant(5, tf.int64)]),
                         tf.uint64)
    moved = tf.bitcast(split_draws.counter_plus(counter, tf.constant(
        3, tf.int64)), tf.int64).numpy().tolist()
    assert moved == [2, 6]
    same = tf.bitcast(split_draws.counter_plus(counter, tf.constant(
        0, tf.int64)), tf.int64).numpy().tolist()
    assert same == [-1, 5]
