"""Ranks that make different fit / evaluate / predict calls (used by tests).

Run under `keras-smp launch -n 2 -- python calls_differ.py MODE TMPDIR`, MODE
"dp" (data parallel, one replica per process) or "pp" (2 stages, one per
process). In order, each rank prints `ROW {json}` per scenario: whether
its call raised, the message, and the seconds the call took:

1. "rows": fit on 64 rows on rank 0, 48 on rank 1 (4 and 3 steps);
2. "call": rank 0 evaluates where rank 1 predicts;
3. "validation": the same training data, validation data of 32 rows on
   rank 0 and 16 on rank 1 (the check comes at the first validation);
4. "unknown_length", "unknown_length_predict": fit (after fits on data
   of the same spec, infinite and of a known length), then
   predict, on data of unknown length (a filtered dataset), 4 batches on
   rank 0 and 3 on rank 1: with one stage per process every rank fails at
   rank 1's end, at once, naming it (before, rank 1 went on to its next
   call while rank 0 waited); data parallel, TensorFlow gives rank 1 an
   empty batch and both run 4 steps;
5. "infinite_on_one_rank": fit with `steps_per_epoch=3` on infinite data
   (`repeat()`) on rank 0, on finite data of unknown length on rank 1:
   refused before the first step (rank 0's steps skip the per-step
   agreement on whether each rank has a batch: with one stage per
   process rank 1 waited in it until the timeout; data parallel, both
   failed in TensorFlow's "Graph execution error ...
   CollectiveReduceV2");
6. "histograms_on_one_rank": a fit with `TensorBoard(histogram_freq=1)`
   on rank 0 only: with one stage per process refused before the first
   step (each histogram epoch gathers the model from every rank: rank 0
   waited in the gather); data parallel, it runs;
7. "save_weights_paths", "save_paths": `save_weights` and `save` to a
   path with the rank in it: with one stage per process refused on every
   rank before anything is written (the index named shards written
   elsewhere); data parallel, rank 0 writes;
8. "agree": the same fit (with validation, and a callback predicting at
   the start of each epoch: calls within the fit, before its validation),
   evaluate and predict on both ranks: they run, and give the same results
   (the refused calls before left nothing behind); rank 0 then says which
   calls' keys the coordination service still holds;
9. "ended": rank 1's script ends; rank 0 evaluates once more, as
   `if rank == 0: model.evaluate(...)` would.

With `collective_timeout_seconds=120`, every refusal must come well
before it: the check runs before the first step of each call.
"""

import json
import os
import sys
import time

import numpy as np

import keras_smp

mode = sys.argv[1]
options = dict(collective_timeout_seconds=120)
if mode == "pp":
    options.update(partitions=2, microbatches=2)
strategy = keras_smp.SMPStrategy(**options)

import keras  # noqa: E402

rank = keras_smp.rank()
keras.utils.set_random_seed(0)
x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = np.random.RandomState(1).randn(64, 2).astype("float32")
with strategy.scope():
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(2)])
    if mode == "pp":
        model = keras_smp.DistributedModel(model)
    model.compile("sgd", "mse")


def scenario(name, fn):
    began = time.monotonic()
    row = {"scenario": name, "rank": rank}
    try:
        row["result"] = fn()
        row["raised"] = None
    except ValueError as e:
        row["raised"] = str(e)
    row["seconds"] = time.monotonic() - began
    print("ROW " + json.dumps(row), flush=True)


n = 64 if rank == 0 else 48
scenario("rows", lambda: model.fit(x[:n], y[:n], batch_size=16, epochs=1,
                                   verbose=0).history["loss"])
scenario("call", lambda: float(model.evaluate(x, y, batch_size=16, verbose=0))
         if rank == 0 else model.predict(x, batch_size=16, verbose=0).tolist())
v = 32 if rank == 0 else 16
scenario("validation", lambda: model.fit(
    x, y, batch_size=16, epochs=1, verbose=0,
    validation_data=(x[:v], y[:v])).history["loss"])


def unknown_length(call):
    import tensorflow as tf

    batches = 4 if rank == 0 else 3
    if call == "predict":  # Keras draws predict's batches eagerly
        data = tf.data.Dataset.from_tensor_slices(x[:16 * batches])
        return model.predict(data.batch(16).filter(lambda _: True),
                             verbose=0).tolist()
    # First the same element spec, infinite then of a known length, on
    # both ranks: TensorFlow's iterator spec ignored the length, so a step
    # traced for infinite data served finite data without any end handling,
    # and one traced for data of known length serves the filtered data.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(data.repeat(), steps_per_epoch=2, epochs=1, verbose=0)
    model.fit(data, epochs=1, verbose=0)
    data = tf.data.Dataset.from_tensor_slices(
        (x[:16 * batches], y[:16 * batches])).batch(16).filter(
        lambda *_: True)
    return model.fit(data, epochs=1, verbose=0).history["loss"]


scenario("unknown_length", lambda: unknown_length("fit"))
scenario("unknown_length_predict", lambda: unknown_length("predict"))


def infinite_on_one_rank():
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    # Rank 1's data is finite, of unknown length (4 batches, 3 taken).
    data = data.repeat() if rank == 0 else data.filter(lambda *_: True)
    return model.fit(data, steps_per_epoch=3, epochs=1,
                     verbose=0).history["loss"]


scenario("infinite_on_one_rank", infinite_on_one_rank)
# Weight histograms on rank 0 only: with one stage per process each
# histogram epoch gathers the model from every rank (rank 0 waited in the
# gather until the timeout); data parallel, no gather: it runs.
scenario("histograms_on_one_rank", lambda: model.fit(
    x, y, batch_size=16, epochs=1, verbose=0,
    callbacks=[keras.callbacks.TensorBoard(
        os.path.join(sys.argv[2], "tb"), histogram_freq=1)]
    if rank == 0 else []).history["loss"])


def save_paths(save):
    # Each rank its own path (the rank in the name): with one stage per
    # process the index named shards written elsewhere; refused on every
    # rank before anything is written. Data parallel, rank 0 writes.
    folder = os.path.join(sys.argv[2], "saves")
    os.makedirs(folder, exist_ok=True)
    save(os.path.join(folder, f"rank{rank}"))
    return sorted(os.listdir(folder))


scenario("save_weights_paths", lambda: save_paths(
    lambda p: model.save_weights(p + ".weights.h5")))
scenario("save_paths", lambda: save_paths(lambda p: model.save(p + ".keras")))


class Predicts(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        model.predict(x[:16], batch_size=16, verbose=0)


def agree():
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        validation_data=(x[:32], y[:32]),
                        callbacks=[Predicts()]).history
    return {"history": history,
            "evaluate": float(model.evaluate(x, y, batch_size=16,
                                             verbose=0)),
            "predict": model.predict(x, batch_size=16, verbose=0).tolist()}


scenario("agree", agree)


def keys():
    # Calls 0-2 were refused, 3 and 4 trained, 5 and 6 failed at their
    # data's end (pp), 7 was refused, 8 was refused (pp), 9 is the fit
    # (10, 11 its callback's predicts), 12 the evaluate, 13 the predict:
    # rank 0 deleted each call's keys once every rank had started the next.
    from tensorflow.python.eager import context

    held = []
    for key in [f"keras_smp/calls/{c}/0" for c in range(14)] + [
            "keras_smp/calls/9/validation/0"]:
        try:
            # (a key held is found at once; 1 ms was too short for the
            # service's answer on a loaded machine: a held key then read
            # as absent)
            context.context().get_config_key_value(key, 1000)
            held.append(key)
        except Exception:  # noqa: BLE001 (not there: a timeout)
            pass
    return held


if rank == 0:
    scenario("keys", keys)
if rank == 0:
    scenario("ended", lambda: float(model.evaluate(x, y, batch_size=16,
                                                   verbose=0)))
