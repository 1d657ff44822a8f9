"""Runs hand-written per-stage action lists through the pipeline runtime.

    runtime_actions.py local        2 stages on 2 logical CPUs of this
                                    process (LocalTransport)
    runtime_actions.py collective   one stage per process, under
                                    `keras-smp launch -n 2` (CollectiveTransport)

The action lists are written out below (not taken from a schedule class):
an order that is neither GPipe nor 1F1B. A 3-layer model (Dense 8->16
tanh, Dense 16->16 tanh | Dense 16->3) is split into 2 stages; every
process creates the same weights from a seed, so the reference (a
GradientTape over the whole batch of 12 rows, mean loss) can be computed
everywhere. Prints one `RESULT {json}` line: loss and gradient differences
to the reference, the largest reference gradient, and the devices of the
stages' ops.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
MODE = sys.argv[1]
if MODE == "collective":
    import keras_smp

    # Starts TensorFlow's collective runtime across the launched workers.
    strategy = keras_smp.SMPStrategy()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if MODE == "local":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from keras_smp.pipeline.runtime import Stage  # noqa: E402
from keras_smp.pipeline.runtime import execute  # noqa: E402
from keras_smp.pipeline.schedule import Action  # noqa: E402
from keras_smp.pipeline.schedule import post_receives  # noqa: E402
from keras_smp.pipeline.transport import CollectiveTransport  # noqa: E402
from keras_smp.pipeline.transport import LocalTransport  # noqa: E402
from keras_smp.pipeline.transport import PipelineKeys  # noqa: E402
from keras_smp.pipeline.transport import StageLinks  # noqa: E402

# Stage 0 runs two forwards ahead, then alternates; stage 1 runs its
# backward of microbatch 0 only after the forward of microbatch 1.
PLAN = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 "
       "0RECV_B2 0B2",
    1: "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1RECV_F2 1F2 1B1 1SEND_B1 "
       "1B2 1SEND_B2",
}
# SPLIT_PLAN=1: backwards split into I (input gradients) and W (weight
# gradients), W deferred and out of microbatch order, mixed with a whole B
# (stage 1, microbatch 2) in the same list.
SPLIT_PLAN = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0I0 0RECV_B1 0I1 "
       "0W0 0RECV_B2 0I2 0W2 0W1",
    1: "1RECV_F0 1F0 1RECV_F1 1F1 1I0 1SEND_B0 1RECV_F2 1F2 1I1 1SEND_B1 "
       "1W0 1B2 1SEND_B2 1W1",
}
if os.environ.get("SPLIT_PLAN"):
    PLAN = SPLIT_PLAN
ACTIONS = {s: [Action.parse(a) for a in text.split()]
           for s, text in PLAN.items()}
POSTED = post_receives(ACTIONS)
M, ROWS = 3, 12

rng = np.random.RandomState(0)
shapes = [(8, 16), (16, 16), (16, 3)]
weights = [tf.Variable(rng.randn(*s).astype("float32") * 0.5, name=f"w{i}")
           for i, s in enumerate(shapes)]
x = tf.constant(rng.randn(ROWS, 8).astype("float32"))
y = tf.constant(rng.randint(0, 3, size=ROWS))
STAGE_VARS = [weights[:2], weights[2:]]


def stage0(t):
    with tf.name_scope("stage0_ops"):
        return [tf.tanh(tf.tanh(t[0] @ weights[0]) @ weights[1])]


def stage1(t):
    with tf.name_scope("stage1_ops"):
        return [t[0] @ weights[2]]


def loss_of(logits, labels):
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


with tf.GradientTape() as tape:
    ref_loss = loss_of(stage1(stage0([x]))[0], y)
ref_grads = tape.gradient(ref_loss, weights)
FNS = [stage0, stage1]


def loss_fn(out, mb):
    return loss_of(out[0], tf.split(y, M)[mb]) / M


if MODE == "local":
    devices = ["/device:CPU:0", "/device:CPU:1"]
    held = [0, 1]

    @tf.function
    def step(x):
        stages = {s: Stage(s, FNS[s], STAGE_VARS[s], devices[s]) for s in held}
        result = execute(ACTIONS, stages, LocalTransport(), 2,
                         [[t] for t in tf.split(x, M)], loss_fn)
        return result.losses, result.grads
else:
    from keras_smp import ranks

    s = ranks.rank()
    held = [s]
    keys = PipelineKeys(num_replicas=1, num_stages=2)
    links = StageLinks(2, s, 0, keys, timeout_seconds=60)
    rows = ROWS // M
    # (direction, receiving stage): stage 1 receives activations, stage 0
    # their gradients.
    specs = {("F", 1): [((rows, 16), tf.float32)],
             ("B", 0): [((rows, 16), tf.float32)]}

    @tf.function
    def step(x):
        # Between processes a send waits until its receive is posted, and
        # a receive is posted where the list puts it: move the receives
        # early enough (`post_receives`, the same for every rank).
        result = execute({s: POSTED[s]}, {s: Stage(s, FNS[s], STAGE_VARS[s])},
                         CollectiveTransport(links, specs, rows), 2,
                         [[t] for t in tf.split(x, M)], loss_fn)
        with tf.control_dependencies([result.done]):
            grads = {k: [tf.identity(g) for g in v]
                     for k, v in result.grads.items()}
            losses = [None if l is None else tf.identity(l)
                      for l in result.losses]
        return losses, grads

losses, grads = step(x)
out = {"held": held, "grad_scale": max(float(tf.reduce_max(tf.abs(g)))
                                        for g in ref_grads)}
for s in held:
    for i, g in enumerate(grads[s]):
        w = [id(v) for v in weights].index(id(STAGE_VARS[s][i]))
        out[f"grad_diff_w{w}"] = float(tf.reduce_max(tf.abs(g - ref_grads[w])))
if 1 in held:
    out["loss_diff"] = abs(float(tf.add_n(losses)) - float(ref_loss))
graph = step.get_concrete_function(x).graph
placement = {}
for op in graph.get_operations():
    for s in (0, 1):
        if f"stage{s}_ops" in op.name and op.type in ("MatMul", "Tanh",
                                                        "TanhGrad"):
            key = "grad" if "gradients" in op.name else "fwd"
            placement.setdefault(f"{s}/{key}", set()).add(op.device)
out["placement"] = {k: sorted(v) for k, v in placement.items()}
out["sends"] = sum(op.type == "CollectiveBcastSendV2"
                   for op in graph.get_operations())
out["recvs"] = sum(op.type == "CollectiveBcastRecvV2"
                   for op in graph.get_operations())
if MODE == "local":
    # A list whose receive has no send: a clear error, not a hang.
    broken = dict(ACTIONS)
    broken[0] = [a for a in ACTIONS[0] if str(a) != "0SEND_F1"]

    @tf.function
    def bad(x):
        stages = {s: Stage(s, FNS[s], STAGE_VARS[s]) for s in held}
        return execute(broken, stages, LocalTransport(), 2,
                       [[t] for t in tf.split(x, M)], loss_fn).losses

    try:
        bad(x)
        out["broken_error"] = None
    except ValueError as e:
        out["broken_error"] = str(e)
print("RESULT " + json.dumps(out), flush=True)
