"""A `BatchNormalization` layer called in two pipeline stages (used by
tests).

Run under `keras-smp launch -n 2` (one pipeline stage per process, 1
microbatch). The model: d1, bn, d2, bn (the same layer again), d3, head.
Cases, each printing one line per process, "ROW " and JSON {"case",
"rank", "type", "message", "iterations", "diff", "scale"} ("scale": the
largest value compared):

- `across`: split at d2, so bn is called on both ranks: fit must fail
  before a step (each rank would update only its own copy of the moving
  statistics); `predict` (no update) still runs (`diff`: its largest
  difference from plain Keras on the same weights);
- `frozen`: the same with bn frozen (`trainable=False`: no update): fit
  trains; `diff`: the largest difference of the weights and predictions
  from plain Keras trained in this process;
- `one_stage`: split at d3, both calls on rank 0: fit trains; `diff` as
  for `frozen`;
- `unfrozen`: as `across`, bn frozen when the model is built (the plan
  set) and unfrozen before `compile`: fit must fail as for `across`.

A refused fit's row also holds "evaluate" (the loss `evaluate` returns
afterwards).
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_smp  # noqa: E402

X = np.random.RandomState(0).randn(64, 8).astype("float32")
Y = np.random.RandomState(1).randint(0, 2, size=64)


def build(frozen):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    bn = keras.layers.BatchNormalization(name="bn", trainable=not frozen)
    h = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="d2")(bn(h))
    h = keras.layers.Dense(8, activation="tanh", name="d3")(bn(h))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


def trained(model):
    model.compile(optimizer="sgd", loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return model.get_weights(), model.predict(X, verbose=0)


def largest(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
               for u, v in zip(a, b))


strategy = keras_smp.SMPStrategy(partitions=2, microbatches=1,
                                 collective_timeout_seconds=120)
for case, frozen, split in (("across", False, "d2"), ("frozen", True, "d2"),
                            ("one_stage", False, "d3"),
                            ("unfrozen", True, "d2")):
    with strategy.scope():
        model = keras_smp.DistributedModel(build(frozen), split_points=[split])
        if case == "unfrozen":  # frozen when the plan was set
            model.build((None, 8))
            model.get_layer("bn").trainable, frozen = True, False
    row = {"case": case, "rank": strategy.topology.rank, "type": None,
           "message": ""}
    try:
        weights, pred = trained(model)
    except Exception as e:  # noqa: BLE001 - reported to the test
        row.update(type=type(e).__name__, message=str(e))
        weights, pred = None, model.predict(X, verbose=0)
        row["evaluate"] = float(model.evaluate(X, Y, verbose=0))
    row["iterations"] = int(model.optimizer.iterations.numpy())
    plain = build(frozen)
    if weights is None:  # the same (initial) weights, predict only
        plain.set_weights(model.get_weights())
        got, ref = [pred], [plain.predict(X, verbose=0)]
    else:
        ref_weights, ref_pred = trained(plain)
        got, ref = weights + [pred], ref_weights + [ref_pred]
    row["diff"] = largest(got, ref)
    row["scale"] = max(float(np.max(np.abs(v))) for v in ref)
    print("ROW " + json.dumps(row), flush=True)
