"""Checks of `keras_smp.runtime.split_draws` in one process (used by
tests/test_split_draws.py, whose docstring says what they show).

Usage: split_draws.py. Runs every check; prints one line per check,
"ROW " + JSON {"check": name, "error": null or the failure's message}.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import RTOL  # noqa: E402
from conftest import scaled_atol  # noqa: E402
from keras_smp.runtime import split_draws  # noqa: E402

split_draws.install()
CHECKS = {}


def check(name):
    def add(fn):
        CHECKS[name] = fn
        return fn
    return add

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


def parts_draw_their_rows_of_the_whole_batch(dtype, xla):
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


@check("parts_inside_parts_add_their_offsets")
def parts_inside_parts_add_their_offsets():
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


@check("draws_of_another_first_dimension_are_the_whole_batchs")
def draws_of_another_first_dimension_are_the_whole_batchs():
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


@check("outside_a_part_keras_draws_as_it_does")
def outside_a_part_keras_draws_as_it_does():
    x = tf.random.stateless_normal([5, 3], seed=[5, 6])
    seed = tf.constant([9, 0])
    np.testing.assert_array_equal(
        keras.random.dropout(x, 0.3, seed=9).numpy(),
        tf.nn.experimental.stateless_dropout(x, 0.3, seed=seed).numpy())
    np.testing.assert_array_equal(
        keras.random.normal((5, 3), seed=9).numpy(),
        tf.random.stateless_normal((5, 3), seed=seed).numpy())
    assert split_draws.current() is None


@check("a_seed_generator_advances_once_per_draw_in_a_part")
def a_seed_generator_advances_once_per_draw_in_a_part():
    gen = keras.random.SeedGenerator(1)
    with split_draws.part(0, 2):
        keras.random.dropout(tf.ones([2, 2]), 0.5, seed=gen)
    assert gen.state.numpy().tolist() == [1, 1]


@check("the_counter_carries_into_its_high_word")
def the_counter_carries_into_its_high_word():
    low = tf.constant(-1, tf.int64)  # 2**64 - 1 as an unsigned word
    counter = tf.bitcast(tf.stack([low, tf.constant(5, tf.int64)]),
                         tf.uint64)
    moved = tf.bitcast(split_draws.counter_plus(counter, tf.constant(
        3, tf.int64)), tf.int64).numpy().tolist()
    assert moved == [2, 6]
    same = tf.bitcast(split_draws.counter_plus(counter, tf.constant(
        0, tf.int64)), tf.int64).numpy().tolist()
    assert same == [-1, 5]


@check("a_layer_built_inside_a_part_initializes_as_outside")
def a_layer_built_inside_a_part_initializes_as_outside():
    # Its initializer runs lifted out of the traced function (init_scope),
    # where the part's tensors cannot be read; and a weight's draw is no
    # row of the batch (its first dimension, 8, is the part's rows here).
    def dense():
        return keras.layers.Dense(4, kernel_initializer=(
            keras.initializers.RandomNormal(seed=9)))

    built = dense()
    built.build((None, 8))
    lazy = dense()

    @tf.function
    def first_call(x, offset):
        with split_draws.part(offset, 8):
            return lazy(x)

    first_call(tf.ones([8, 8]), tf.constant(8))
    np.testing.assert_array_equal(lazy.kernel.numpy(), built.kernel.numpy())


@check("a_part_of_one_row_keeps_a_mask_broadcast_over_the_batch")
def a_part_of_one_row_keeps_a_mask_broadcast_over_the_batch():
    x = tf.random.stateless_normal([4, 6], seed=[1, 1])
    whole = keras.random.dropout(x, 0.5, noise_shape=(1, 6), seed=4)

    @tf.function(input_signature=[tf.TensorSpec([None, 6]),
                                  tf.TensorSpec([], tf.int32)])
    def one_row(rows, offset):
        with split_draws.part(offset, 1):
            return keras.random.dropout(rows, 0.5, noise_shape=(1, 6),
                                        seed=4)

    got = tf.concat([one_row(x[i:i + 1], tf.constant(i)) for i in range(4)],
                    0)
    np.testing.assert_array_equal(got.numpy(), whole.numpy())


@check("draws_a_part_cannot_take_as_rows_differ_between_parts")
def draws_a_part_cannot_take_as_rows_differ_between_parts():
    # Every microbatch starts from the same generator state: a draw not
    # offset (XLA's normal, Keras' other draws) takes a seed folded with
    # the part's offset, not the first part's numbers again.
    x = tf.ones([6, 5])

    @tf.function(jit_compile=True)
    def xla_normal(t, offset):
        with split_draws.part(offset, 3):
            return keras.random.normal(tf.shape(t), seed=2)

    @tf.function
    def others(t, offset):
        with split_draws.part(offset, 3):
            return (keras.random.randint(tf.shape(t), 0, 1000, seed=2),
                    keras.random.truncated_normal(tf.shape(t), seed=2),
                    keras.random.shuffle(tf.range(6), seed=2))

    a, b = (xla_normal(x[:3], tf.constant(o)) for o in (0, 3))
    assert not np.array_equal(a.numpy(), b.numpy())
    for p, q in zip(others(x[:3], tf.constant(0)),
                    others(x[:3], tf.constant(3))):
        assert not np.array_equal(p.numpy(), q.numpy())
    # ... and outside a part Keras' own
    np.testing.assert_array_equal(
        keras.random.randint((3, 5), 0, 1000, seed=2).numpy(),
        tf.random.stateless_uniform((3, 5), seed=tf.constant([2, 0]),
                                    minval=0, maxval=1000,
                                    dtype=tf.int32).numpy())


LAYERS = {
    "Dropout": lambda: keras.layers.Dropout(0.4, seed=3),
    "SpatialDropout1D": lambda: keras.layers.SpatialDropout1D(0.4, seed=3),
    "GaussianNoise": lambda: keras.layers.GaussianNoise(0.5, seed=3),
    "GaussianDropout": lambda: keras.layers.GaussianDropout(0.3, seed=3),
    "AlphaDropout": lambda: keras.layers.AlphaDropout(0.2, seed=3),
    "LSTM": lambda: keras.layers.LSTM(4, dropout=0.3, recurrent_dropout=0.3,
                                      return_sequences=True, seed=3),
    "GRU": lambda: keras.layers.GRU(4, dropout=0.3, seed=3),
}


def keras_random_layer_called_on_parts_gives_the_whole_batchs_rows(make):
    # Each part called with the generator's state before the whole batch's
    # call (what the pipeline step gives each microbatch's forward).
    layer = make()
    x = tf.random.stateless_normal([7, 5, 3], seed=[7, 8])
    layer.build(x.shape)
    states = [v for v in layer.non_trainable_variables if "seed" in v.path]
    assert states, layer
    before = [v.numpy() for v in states]
    whole = layer(x, training=True)
    after = [v.numpy() for v in states]
    got = []
    for offset, rows in [(0, 3), (3, 4)]:
        for v, value in zip(states, before):
            v.assign(value)
        with split_draws.part(offset, rows):
            got.append(layer(x[offset:offset + rows], training=True))
    # The same masks and noise: equal, except that an RNN multiplies
    # matrices of other row counts per part (float32 rounding of the same
    # sums: observed 9e-8 on outputs below 1; bound 1e-6, conftest's).
    np.testing.assert_allclose(tf.concat(got, 0).numpy(), whole.numpy(),
                               rtol=RTOL, atol=scaled_atol(whole.numpy()))
    for v, value in zip(states, after):  # advanced as by the whole call
        np.testing.assert_array_equal(v.numpy(), value)
    assert not np.allclose(whole.numpy(), layer(x, training=False).numpy())


for _dtype in ("float32", "float16", "bfloat16", "float64"):
    for _xla in (False, True):
        CHECKS[f"parts_draw_their_rows[{_dtype}, xla={_xla}]"] = (
            lambda d=_dtype, x=_xla:
            parts_draw_their_rows_of_the_whole_batch(d, x))
for _name, _make in LAYERS.items():
    CHECKS[f"layer_on_parts[{_name}]"] = (
        lambda m=_make:
        keras_random_layer_called_on_parts_gives_the_whole_batchs_rows(m))

if __name__ == "__main__":
    for name, fn in CHECKS.items():
        try:
            fn()
            error = None
        except Exception:  # reported, with its traceback, by the test
            error = traceback.format_exc()[-3000:]
        print("ROW " + json.dumps({"check": name, "error": error}),
              flush=True)
