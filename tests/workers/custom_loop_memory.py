"""Peak resident memory of an SMP custom loop with many microbatches.

`smp.init`'s default layout (2 stages on logical devices of this one
process), or with `--stages` one stage per process (`local_devices=1`,
run by `keras-smp launch -n 2`); 8 microbatches, 4 x Dense(2048) without
biases (64 MB of float32 weights), SGD, a batch of 16 rows (activations
are small): the weights' gradients dominate what a step adds. `--keep`
decorates the step with `sum_gradients=False` (every microbatch's
gradient returned, as before keras-smp summed them inside the step) and
runs the training step eagerly (all of them held until summed).

Each process prints `RESULT {json}`: its rank; its peak resident set
(VmHWM, MB) once a forward step has made its weights and after 2 training
steps; the size of its weights; the losses; each trained weight's sum and
sum of magnitudes.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import keras_smp as smp

# VmHWM, read as the memory benchmarks read it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from measure import peak_mb  # noqa: E402

WIDTH, LAYERS, MICROBATCHES = 2048, 4, 8


def main():
    keep = "--keep" in sys.argv[1:]
    stages = "--stages" in sys.argv[1:]
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    smp.init({"partitions": 2, "microbatches": MICROBATCHES,
              **({"local_devices": 1} if stages else {})})
    import keras

    keras.utils.set_random_seed(0)
    model = smp.DistributedModel(keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, use_bias=False, activation="tanh")
           for _ in range(LAYERS)]))
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.RandomState(0)
    x = rng.randn(16, WIDTH).astype("float32")
    y = rng.randn(16, WIDTH).astype("float32")

    @smp.step(sum_gradients=not keep)
    def grads(x, y):
        loss = keras.ops.mean((model(x, training=True) - y) ** 2)
        return opt.get_gradients(loss, model.trainable_variables), loss

    def train(x, y):
        g, loss = grads(x, y)
        opt.apply_gradients(zip([t.accumulate() for t in g],
                                model.trainable_variables))
        return loss.reduce_mean()

    # The control (`--keep`) runs `train` eagerly: the step's outputs, every
    # microbatch's gradient, are held in Python until `accumulate()` adds
    # them. Traced into one graph, TensorFlow may free each as soon as it
    # is added, before the next microbatch's gradient exists, or not,
    # depending on the order its executor runs them (with one stage per
    # process: on when the other stage's gradients arrive): measured 3.9x
    # to 10.8x the weights on one stage process (AMD EPYC), too variable
    # to show what the measurement sees.
    if not keep:
        train = tf.function(train)

    @smp.step
    def forward(x):
        return model(x, training=False)

    forward(x)  # the weights (this process's), before a training step
    built = peak_mb()
    losses = [float(train(x, y)) for _ in range(2)]
    # This process's weights (with one stage per process: its stage's).
    # (Another stage's weight has no elements here.)
    weights = [v.numpy() for v in model.trainable_variables
               if v.value.shape.num_elements()]
    print("RESULT " + json.dumps({
        "rank": smp.rank(), "built_mb": built, "peak_mb": peak_mb(),
        "losses": losses,
        "weights_mb": sum(w.nbytes for w in weights) / 2**20,
        "digest": [float(np.sum(w, dtype="float64")) for w in weights],
        "abs_sum": [float(np.sum(np.abs(w), dtype="float64"))
                    for w in weights]}),
        flush=True)


if __name__ == "__main__":
    main()
