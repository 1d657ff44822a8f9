"""SMP's custom-loop API: `smp.init`, `@smp.step`, `StepOutput`."""

import json

import numpy as np
import pytest

from conftest import WORKERS
from conftest import run_python


@pytest.mark.parametrize("grads", ["get_gradients", "tape"])
def test_step_training_matches_full_batch_training(grads):
    # partitions=2, microbatches=4: gradients accumulated over microbatches
    # inside @smp.step equal the whole batch's, with SGD + momentum.
    out = run_python([f"{WORKERS}/custom_loop_fit.py", grads]).stdout
    r = json.loads(out.split("RESULT ", 1)[1])
    assert r["stages"] == 2 and r["microbatches"] == 4
    assert r["moved"] > 1e-3
    assert r["weight_diff"] <= 1e-6, r
    assert r["logit_diff"] <= 1e-5, r
    np.testing.assert_allclose(r["losses"], r["plain_losses"], rtol=1e-5)


@pytest.fixture
def tf_smp():
    import tensorflow as tf

    import keras_smp as smp
    from keras_smp import state

    smp.init({"partitions": 2, "microbatches": 4})
    yield tf, smp
    state.reset()


def test_step_output_methods_match_direct_computation(tf_smp):
    tf, smp = tf_smp
    rng = np.random.RandomState(0)
    parts = [rng.randn(3, 2).astype("float32") for _ in range(4)]
    out = smp.StepOutput([tf.constant(p) for p in parts])
    np.testing.assert_allclose(out.reduce_sum(), np.sum(parts, axis=0),
                               rtol=1e-6)
    np.testing.assert_allclose(out.reduce_mean(), np.mean(parts, axis=0),
                               rtol=1e-6)
    np.testing.assert_array_equal(out.concat(), np.concatenate(parts))
    np.testing.assert_array_equal(out.concat(axis=1),
                                  np.concatenate(parts, axis=1))
    np.testing.assert_array_equal(out.stack(), np.stack(parts))
    for method in ("variable", "add_n", "accumulate_n"):
        np.testing.assert_allclose(out.accumulate(method),
                                   np.mean(parts, axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown method='sum'"):
        out.accumulate("sum")
    assert smp.StepOutput([None, None]).accumulate() is None


def test_merge_restores_the_original_sample_order(tf_smp):
    tf, smp = tf_smp

    @smp.step
    def identity(x, scale):
        return x * scale, tf.reduce_sum(x)

    x = np.arange(32, dtype="float32").reshape(16, 2)
    rows, sums = identity(x, 1.0)
    assert len(rows.outputs) == 4 and rows.outputs[0].shape == (4, 2)
    np.testing.assert_array_equal(rows.merge(), x)
    np.testing.assert_allclose(sums.reduce_sum(), x.sum())


def test_non_split_inputs_and_split_axes(tf_smp):
    tf, smp = tf_smp

    @smp.step(non_split_inputs=["table"], input_split_axes={"x": 1})
    def f(x, table):
        return x * 2.0, tf.shape(table)[0]

    x = np.arange(16, dtype="float32").reshape(2, 8)  # batch along axis 1
    cols, table_rows = f(x, np.ones((5, 3), "float32"))
    np.testing.assert_array_equal(table_rows.stack(), [5, 5, 5, 5])
    assert cols.outputs[0].shape == (2, 2)  # 8 columns / 4 microbatches
    np.testing.assert_array_equal(cols.merge(), x * 2.0)  # merged on axis 1


def test_step_rejects_a_batch_not_divisible_by_microbatches(tf_smp):
    tf, smp = tf_smp

    @smp.step
    def f(x):
        return x

    with pytest.raises(ValueError, match=r"'x' has 10 rows.*microbatches=4"):
        f(np.zeros((10, 2), "float32"))
    with pytest.raises(ValueError, match=r"\['nope'\].*not arguments"):
        smp.step(f.python_function, non_split_inputs=["nope"])


def test_get_gradients_outside_a_step_says_what_to_use(tf_smp):
    tf, smp = tf_smp
    import keras

    opt = keras.optimizers.SGD()
    v = keras.Variable(1.0)
    with pytest.raises(RuntimeError, match="GradientTape"):
        opt.get_gradients(v * 2.0, [v])
