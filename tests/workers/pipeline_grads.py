"""Pipelined gradients vs whole-batch gradients, and op placement.

Runs the pipeline runtime (`execute` with a `LocalTransport`) on 2
logical CPU devices for every schedule and
microbatch count given, prints one JSON line per case with the largest
differences to a plain GradientTape over the whole batch, and the devices
of the ops belonging to each stage's layers (forward and backward).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_smp.pipeline.runtime import Stage  # noqa: E402
from keras_smp.pipeline.runtime import execute  # noqa: E402
from keras_smp.pipeline.schedule import get_schedule  # noqa: E402
from keras_smp.pipeline.transport import LocalTransport  # noqa: E402

keras.utils.set_random_seed(0)
layers = [keras.layers.Dense(16, activation="tanh", name=f"stage0_d{i}")
          for i in range(2)] + [
          keras.layers.Dense(16, activation="tanh", name="stage1_d0"),
          keras.layers.Dense(3, name="stage1_d1")]
model = keras.Sequential([keras.Input((8,))] + layers)
stages = [layers[:2], layers[2:]]
devices = ["/device:CPU:0", "/device:CPU:1"]
rng = np.random.RandomState(1)
x = tf.constant(rng.randn(16, 8).astype("float32"))
y = tf.constant(rng.randint(0, 3, size=16))
loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def stage_fn(stage_layers):
    def fn(inputs):
        h = inputs[0]
        for layer in stage_layers:
            h = layer(h)
        return [h]
    return fn


with tf.GradientTape() as tape:
    ref_loss = loss_obj(y, model(x))
ref_grads = tape.gradient(ref_loss, model.trainable_variables)

for name in sys.argv[1].split(","):
    for m in [int(v) for v in sys.argv[2].split(",")]:
        schedule = get_schedule(name, 2, m)

        @tf.function
        def step(x, y):
            xs = tf.split(x, m)
            ys = tf.split(y, m)
            result = execute(
                {s: schedule.actions(s) for s in range(2)},
                {s: Stage(s, stage_fn(layers_s),
                          [v for l in layers_s for v in l.trainable_variables],
                          devices[s])
                 for s, layers_s in enumerate(stages)},
                LocalTransport(), 2, [[t] for t in xs],
                lambda out, mb: loss_obj(ys[mb], out[0]) / m)
            return result.losses, result.outputs, [result.grads[0],
                                                   result.grads[1]]

        losses, outputs, grads = step(x, y)
        flat = [g for gs in grads for g in gs]
        graph = step.get_concrete_function(x, y).graph
        placement = {}
        for op in graph.get_operations():
            for s in (0, 1):
                if f"stage{s}_" in op.name and op.type in ("MatMul", "Tanh",
                                                           "TanhGrad", "BiasAddGrad"):
                    key = "grad" if "gradients" in op.name else "fwd"
                    placement.setdefault(f"{s}/{key}", set()).add(op.device)
        print(json.dumps({
            "schedule": name, "m": m,
            "loss_diff": abs(float(tf.add_n(losses)) - float(ref_loss)),
            "grad_diff": max(float(tf.reduce_max(tf.abs(a - b)))
                             for a, b in zip(flat, ref_grads)),
            "grad_scale": max(float(tf.reduce_max(tf.abs(b))) for b in ref_grads),
            "placement": {k: sorted(v) for k, v in placement.items()},
        }), flush=True)
