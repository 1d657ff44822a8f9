"""XLA with stateful layers (BatchNormalization, Dropout): one training.

    xla_stateful.py MODE OUT [--no-xla] [--no-dropout]

MODE: plain (Keras, no strategy), dp (data parallel, one replica per
process; a functional model whose layers add losses inside the compiled
call: an activity regularizer, a helper function's `add_loss()`), pp (2 stages, one per process, `keras-smp launch -n 2`), local
(2 stages on 2 logical CPUs of one process). Pipelines use 1 microbatch,
so BatchNormalization normalises over the whole batch as plain Keras does.
Rank 0 writes OUT/MODE[-noxla].npz: the weights (moving statistics
included) and the losses.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_DETERMINISTIC_OPS"] = "0"  # Keras refuses XLA otherwise
mode, out = sys.argv[1], sys.argv[2]
xla = "--no-xla" not in sys.argv
dropout = "--no-dropout" not in sys.argv

import tensorflow as tf  # noqa: E402

if mode == "local":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = None
if mode != "plain":
    import keras_smp

    strategy = (keras_smp.SMPStrategy() if mode == "dp" else
                keras_smp.SMPStrategy(
                    partitions=2, microbatches=1,
                    local_devices=2 if mode == "local" else None))

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = np.random.RandomState(1).randn(64, 1).astype("float32")
keras.utils.set_random_seed(0)

def functional_with_added_losses():
    """Data parallel: a functional model (whose own `add_loss` Keras does
    not implement) with losses added inside the compiled call: an activity
    regularizer and a layer's `add_loss()` from a helper function."""
    from added_losses import HelperPenalty

    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu",
                           activity_regularizer=keras.regularizers.L2(0.01))(
        inputs)
    h = keras.layers.BatchNormalization()(h)
    if dropout:
        h = keras.layers.Dropout(0.25)(h)
    h = HelperPenalty()(keras.layers.Dense(16, activation="tanh")(h))
    return keras.Model(inputs, keras.layers.Dense(1)(h))


with strategy.scope() if strategy else contextlib.nullcontext():
    model = functional_with_added_losses() if mode == "dp" else (
        keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
             keras.layers.BatchNormalization()]
            + ([keras.layers.Dropout(0.25)] if dropout else [])
            + [keras.layers.Dense(16, activation="tanh"),
               keras.layers.Dense(1)]))
    if mode in ("pp", "local"):
        model = keras_smp.DistributedModel(model, split_points=[
            model.layers[3 if dropout else 2].name])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  jit_compile=xla)
history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
weights = model.get_weights()  # a collective: every process calls it
if strategy is None or strategy.topology.rank == 0:
    np.savez(os.path.join(out, mode + ("" if xla else "-noxla") + ".npz"),
             loss=np.array(history.history["loss"]),
             **{f"w{i}": w for i, w in enumerate(weights)})
