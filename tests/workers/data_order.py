"""Which rows each data-parallel process trains when `fit` shuffles NumPy
arrays (Keras' default), under `keras-smp launch -n 2`:

- `unseeded`, `unseeded_batch`: no seed set anywhere, `shuffle=True` and
  `shuffle="batch"`;
- `half_seeded`: rank 1 seeded, rank 0 not; `seeded_apart`: each rank
  seeded with its own seed (1 + rank) -> each fit's error;
- `seeded_alike`: every rank seeded with 5, and `plain_seeded`: Keras on
  one device seeded with 5;
- `after_unfinished`: a fit that stops 2 batches into a pass, then
  another;
- a `tf.data` dataset shuffled without a seed (`fit`, `evaluate`: the
  errors), with seed 7, and each rank's own half with auto-sharding off;
- `shuffled_or_not`: rank 0 shuffles the arrays, rank 1 does not (the
  error);
- a `fit`'s `validation_data` shuffled without a seed (the error, and the
  steps trained before it) and with seed 7;
- a `PyDataset` Keras shuffles, unseeded (the error) and seeded alike;
- `from_files`: TFRecord files read through `list_files` (shuffled,
  unseeded) and an unseeded `shuffle`; `py_dataset_forever`: a `PyDataset`
  of unknown length (never shuffled): both train.

The inputs are the rows' indices (`x[i] = i`); a model records every row
of each step's share (`tf.py_function`). Writes OUT/rank{R}.json:
`{case: [[rows of step 0], [rows of step 1], ...]}` and, for the failing
cases, `{case: error message}`.

    data_order.py OUT
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

OUT = sys.argv[1]
strategy = keras_smp.SMPStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

RANK = strategy.topology.rank
N, ROWS, EPOCHS = 96, 32, 2
X = np.arange(N, dtype="float32").reshape(N, 1)
Y = np.zeros((N, 1), "float32")
seen = []


def note(rows):
    seen.append(rows.numpy().astype(int).ravel().tolist())
    return np.int64(0)


class Recorder(keras.Model):
    def train_step(self, data):
        x, _ = data
        done = tf.py_function(note, [x], tf.int64)
        with tf.control_dependencies([done]):
            return super().train_step(data)


def model():
    with strategy.scope():
        inputs = keras.Input((1,))
        model = Recorder(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def fit(shuffle=True, data=None):
    seen.clear()
    if data is None:
        model().fit(X, Y, batch_size=ROWS, epochs=EPOCHS, shuffle=shuffle,
                    verbose=0)
    else:
        model().fit(data, epochs=EPOCHS, verbose=0)
    return list(seen)


def failure(call=fit):
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def dataset(seed=None, rows=None):
    data = tf.data.Dataset.from_tensor_slices((X, Y) if rows is None else
                                              (X[rows], Y[rows]))
    return data.shuffle(N, seed=seed).batch(ROWS, drop_remainder=True)


def own_half():
    # Each rank reads a half of its own (auto-sharding off): its own
    # shuffle is fine.
    data = dataset(rows=slice(RANK, None, 2))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return fit(data=data.with_options(options))


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return N // ROWS

    def __getitem__(self, i):
        return X[i * ROWS:(i + 1) * ROWS], Y[i * ROWS:(i + 1) * ROWS]


def after_unfinished():
    # A pass left unfinished (2 of 3 batches, the rest prefetched or not),
    # then a new fit: its permutations start alike on every rank.
    model().fit(X, Y, batch_size=ROWS, epochs=1, steps_per_epoch=2,
                shuffle="batch", verbose=0)
    return fit("batch")


def plain(seed):
    # Keras on one device (no strategy), seeded.
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((1,))
    model = Recorder(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    seen.clear()
    model.fit(X, Y, batch_size=ROWS, epochs=EPOCHS, verbose=0)
    return list(seen)


def from_files():
    # A pipeline that reads files (TensorFlow shards it by file: each rank
    # its own files, their list shuffled after sharding, unseeded).
    folder = os.path.join(OUT, f"files{RANK}")
    os.makedirs(folder, exist_ok=True)
    for f in range(4):
        with tf.io.TFRecordWriter(os.path.join(folder, f"{f}.tfrecord")) as w:
            for row in range(f * 24, (f + 1) * 24):
                w.write(tf.io.serialize_tensor(
                    tf.constant([float(row)])).numpy())

    def parse(record):
        x = tf.ensure_shape(tf.io.parse_tensor(record, tf.float32), [1])
        return x, tf.zeros([1])

    data = tf.data.Dataset.list_files(os.path.join(folder, "*.tfrecord"))
    data = data.interleave(tf.data.TFRecordDataset).map(parse)
    return fit(data=data.shuffle(N).batch(ROWS // 2, drop_remainder=True))


class Forever(keras.utils.PyDataset):
    # Of unknown length: Keras never shuffles it.
    @property
    def num_batches(self):
        return None

    def __getitem__(self, i):
        i %= N // ROWS
        return X[i * ROWS:(i + 1) * ROWS], Y[i * ROWS:(i + 1) * ROWS]


def forever():
    seen.clear()
    model().fit(Forever(), epochs=1, steps_per_epoch=3, verbose=0)
    return list(seen)


def with_validation(seed):
    # Arrays in order, validation data shuffled (with `seed`): returns
    # the error (unseeded) and the steps trained.
    seen.clear()
    error = failure(lambda: model().fit(
        X, Y, batch_size=ROWS, epochs=EPOCHS, shuffle=False, verbose=0,
        validation_data=dataset(seed)))
    return {"error": error, "steps": len(seen)}


report = {"unseeded": fit(), "unseeded_batch": fit("batch"),
          "from_files": from_files(), "py_dataset_forever": forever(),
          "after_unfinished": after_unfinished(),
          "py_dataset_unseeded": failure(lambda: fit(data=Batches())),
          "dataset_unseeded": failure(lambda: fit(data=dataset())),
          "evaluate_unseeded": failure(
              lambda: model().evaluate(dataset(), verbose=0)),
          "dataset_seeded": fit(data=dataset(seed=7)),
          "dataset_own_half": own_half(),
          "validation_unseeded": with_validation(None),
          "validation_seeded": with_validation(7)}
if RANK == 1:
    tf.random.set_seed(3)
report["half_seeded"] = failure()
keras.utils.set_random_seed(1 + RANK)
report["seeded_apart"] = failure()
report["plain_seeded"] = plain(5)
keras.utils.set_random_seed(5)
report["seeded_alike"] = fit()
keras.utils.set_random_seed(5)
report["py_dataset_seeded_alike"] = fit(data=Batches())
# Rank 0 shuffles, rank 1 reads in order: each would keep its share of
# another order.
report["shuffled_or_not"] = failure(lambda: fit(shuffle=RANK == 0))
with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
    json.dump(report, f)
