"""Where a pipelined model's variables and ops live (used by tests).

2 model replicas x 2 stages on 4 logical CPUs (or PARTITIONS stages on
PARTITIONS CPUs; with PIPELINE zb_v, 2 model stages per rank). Fits one
step with TensorFlow's placement log on: prints one JSON object with the
placement of every variable copy and of every compute op placed in a
graph (where TensorFlow put it, inside function calls too), grouped by
(replica, stage, forward/backward), and the
variables created while the model was built and then thrown away
("discarded": a weight first made on another device, then moved).
"""

import ctypes
import json
import os
import re
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's placer prints where it places each op of a graph function,
# nested functions' bodies included (a stage traced once runs as a function
# call), on the process's stdout (C level): captured in a file until the
# result is printed. (Must be on before TensorFlow's context starts.)
PLACED = tempfile.TemporaryFile(mode="w+")
sys.stdout.flush()
STDOUT = os.dup(1)
os.dup2(PLACED.fileno(), 1)
import tensorflow as tf  # noqa: E402

tf.debugging.set_log_device_placement(True)
import keras_smp  # noqa: E402

PARTITIONS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
DEVICES = int(sys.argv[2]) if len(sys.argv) > 2 else 4
PIPELINE = sys.argv[3] if len(sys.argv) > 3 else "1f1b"  # zb_v: 2 per rank
strategy = keras_smp.SMPStrategy(
    partitions=PARTITIONS, microbatches=2, local_devices=DEVICES,
    pipeline=PIPELINE)

import keras  # noqa: E402
import numpy as np  # noqa: E402

COMPUTE = {"MatMul", "BiasAdd", "BiasAddGrad", "Tanh", "TanhGrad", "Relu",
           "ReluGrad", "Conv2D", "Conv2DBackpropFilter",
           "Conv2DBackpropInput"}

created = []


def log_creation(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    for part in getattr(variable, "values", (variable,)):
        created.append(part)
    return variable


with strategy.scope(), tf.variable_creator_scope(log_creation):
    model = keras_smp.DistributedModel(keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(2),
    ]), split_points=(["dense", "dense_1", "dense_2"] if PIPELINE == "zb_v"
                      else None))  # (every model stage computes something)
    model.compile(optimizer="adam", loss="mse")

x = np.random.RandomState(0).randn(32, 8, 8, 1).astype("float32")
y = np.random.RandomState(1).randn(32, 2).astype("float32")
model.fit(x, y, batch_size=16, epochs=1, verbose=0)

graph = model.staged_graph
home = graph.home_stage()
variables = []
for stage in range(graph.num_stages):
    for w in graph.stage_weights(stage):
        variables.append({
            "path": w.path, "stage": home[id(w)],
            "devices": [v.device for v in w.value.values]})
for w in model.optimizer.variables:
    parts = getattr(w.value, "values", (w.value,))
    variables.append({"path": "optimizer/" + w.path, "stage": None,
                      "devices": [v.device for v in parts]})

ops = {}
unscoped = []
# Split backwards (zb_v) run as `i_mb` (input gradients) and `w_mb`. A
# placed op's name holds the names of the function calls it was inlined
# from (Keras' step function, a stage's forward, its gradient).
pattern = re.compile(
    r"^(?:.*?replica_(\d+)/)?.*?stage(\d+)/(fwd|bwd|i|w)_mb\d+/")
line = re.compile(r"^(\S+): \((\w+)\): (\S+)$")
ctypes.CDLL(None).fflush(None)
os.dup2(STDOUT, 1)
PLACED.seek(0)
for text in PLACED.read().splitlines():
    found = line.match(text.strip())
    if not found or found.group(2) not in COMPUTE:
        continue
    name, device = found.group(1), found.group(3)
    match = pattern.match(name)
    if not match:
        unscoped.append(name)
        continue
    replica = int(match.group(1) or 0)
    kind = "fwd" if match.group(3) == "fwd" else "bwd"
    key = f"{replica}/{match.group(2)}/{kind}"
    ops.setdefault(key, set()).add(device)
kept = {id(part) for w in model.variables + model.optimizer.variables
        for part in getattr(w.value, "values", (w.value,))}
discarded = [{"device": v.device, "shape": list(v.shape)} for v in created
             if id(v) not in kept and v.shape.num_elements() > 1]
print(json.dumps({
    "discarded": discarded,
    "stage_devices": strategy.stage_devices,
    # The pipeline rank (column of stage_devices) of each model stage.
    "rank_of": [model.schedule.rank_of(s) for s in range(graph.num_stages)],
    "variables": variables,
    "ops": {k: sorted(v) for k, v in ops.items()},
    "unscoped": unscoped,
}))
