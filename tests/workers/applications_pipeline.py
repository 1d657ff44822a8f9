"""A keras.applications backbone in a pipeline (used by tests).

VGG16 (32x32 inputs, random weights: no download) called with
training=False under a pooling + Dense head, as in Keras' transfer
learning guide; trained for 2 steps by a 2-stage pipeline in one process
(2 microbatches) and by plain Keras on one device. (A MobileNetV2 with
random weights is no fair comparison: its BatchNormalization layers over
2x2 feature maps make it chaotic, a relative 2e-7 change of the initial
weights moving plain Keras' weights by 1e-3 in one step, measured.) Prints one JSON object: the largest differences, which nested
models were placed layer by layer, and the backbone layers on each stage.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_smp  # noqa: E402

rng = np.random.RandomState(0)
X = rng.rand(32, 32, 32, 3).astype("float32")
Y = rng.randint(0, 5, 32)


def build():
    keras.utils.set_random_seed(0)
    base = keras.applications.VGG16(
        input_shape=(32, 32, 3), include_top=False, weights=None)
    inputs = keras.Input((32, 32, 3))
    h = keras.layers.GlobalAveragePooling2D()(base(inputs, training=False))
    return keras.Model(inputs, keras.layers.Dense(5)(h)), base


def train(model):
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    history = model.fit(X, Y, batch_size=16, epochs=1, verbose=0,
                        shuffle=False)
    return ([w.numpy() for w in model.weights if "seed" not in w.path],
            np.array(history.history["loss"]), model.predict(X, verbose=0))


def diff(a, b):
    return float(np.max(np.abs(a - b) - 1e-5 * np.abs(b)))


ref_model, _ = build()
ref = train(ref_model)
strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)
with strategy.scope():
    model, base = build()
    model = keras_smp.DistributedModel(model)
got = train(model)
graph = model.staged_graph
backbone = {layer.name for layer in base.layers}
print(json.dumps({
    "weights": max(diff(a, b) for a, b in zip(got[0], ref[0])),
    "num_weights": [len(got[0]), len(ref[0])],
    "loss": diff(got[1], ref[1]),
    "predict": diff(got[2], ref[2]),
    "expanded": graph.expanded,
    "backbone_layers_per_stage": [
        sum(n.operation.name in backbone for n in graph.stage_nodes(s))
        for s in range(graph.num_stages)],
}))
