"""A split `Embedding` whose ids repeat in the batch, trained with Adam and
`global_clipnorm` (used by tests/test_tensor_parallel.py).

Keras' `clip_by_global_norm` makes the embedding's sparse gradient dense,
and Adam's update from a dense gradient is not its update from the sparse
rows of an id repeated in the batch: keras-smp's tensor-parallel clip kept
the gradient sparse, and one step moved weights by up to 1.9 learning
rates (plain Keras: at most 1). Prints `WEIGHTS {json}` (rank 0 of a job).

    tensor_sparse_clip.py plain|tp
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

mode = sys.argv[1]
strategy = (keras_smp.SMPStrategy(tensor_parallel_degree=2)
            if mode == "tp" else None)

import keras  # noqa: E402
import numpy as np  # noqa: E402


def build():
    keras.utils.set_random_seed(1)
    ids = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(16, 8, name="emb")(ids)
    out = keras.layers.Dense(4, name="head")(keras.layers.Flatten()(h))
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.01),
                  loss="mse")
    return model


if strategy is not None:
    with strategy.scope(), keras_smp.tensor_parallelism():
        model = build()
else:
    model = build()
rng = np.random.RandomState(0)
x = rng.randint(0, 16, (16, 4)).astype("int32")  # ids repeat in the batch
y = rng.randn(16, 4).astype("float32")
model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
weights = [w.tolist() for w in model.get_weights()]
if keras_smp.rank() == 0:
    print("WEIGHTS " + json.dumps(weights), flush=True)
