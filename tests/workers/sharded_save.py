"""Sharded checkpoints in one process (2 stages): a save that fails after
writing its shards leaves the previous checkpoint whole; saves reuse no
shard file of the checkpoint in place; stale shards are removed; the
checkpoint assembles into one .weights.h5 and into a .keras export.

    sharded_save.py DIR     prints "OK" at the end (asserts on the way)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402
from keras_smp.pipeline import shards  # noqa: E402

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

folder = sys.argv[1]
path = os.path.join(folder, "m.weights.json")  # sharded in any mode


def build():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.Dense(8), keras.layers.Dense(1)])
    model = keras_smp.DistributedModel(inner)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def set_all(model, value):
    model.set_weights([np.full(w.shape, value, w.dtype)
                       for w in model.get_weights()])
    for v in model.optimizer.variables[2:]:  # the slots
        v.assign(np.full(v.shape, value, v.dtype))


def loaded_values(target=path):
    model = build()
    model.load_weights(target)
    return np.unique(np.concatenate(
        [w.ravel() for w in model.get_weights()]
        + [np.ravel(v) for v in model.optimizer.variables[2:]]))


def shard_files():
    return sorted(n for n in os.listdir(folder) if n.startswith("m_"))


with strategy.scope():
    model = build()
set_all(model, 1.0)
model.save_weights(path)
assert shard_files() == ["m_00000.weights.h5", "m_00001.weights.h5",
                         "m_00002.weights.h5"], shard_files()
assert list(loaded_values()) == [1.0], loaded_values()

# Save 2 fails once its shards are written (before the index is replaced).
set_all(model, 2.0)
write_index = shards._write_index


def failing(*args, **kwargs):
    raise OSError("disk full (simulated)")


shards._write_index = failing
try:
    model.save_weights(path)
    raise AssertionError("the failing save did not raise")
except RuntimeError as e:
    assert "disk full (simulated)" in str(e), e
    assert "the previous checkpoint there, if any, is unchanged" in str(e)
shards._write_index = write_index
assert list(loaded_values()) == [1.0], loaded_values()

# Save 3 succeeds: new shard numbers, the old ones removed.
model.save_weights(path)
assert shard_files() == ["m_00000.weights.h5", "m_00003.weights.h5",
                         "m_00004.weights.h5"], shard_files()
assert list(loaded_values()) == [2.0], loaded_values()

# One plain file, streamed from the shards.
whole = shards.assemble_checkpoint(path, os.path.join(folder, "whole.weights.h5"))
plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                          keras.layers.Dense(8), keras.layers.Dense(1)])
plain.load_weights(whole)
assert all(np.all(w == 2.0) for w in plain.get_weights())

# A plain Keras model for export (the architecture from the
# DistributedModel, the weights streamed from the shards, no optimizer).
exported = keras.models.load_model(shards.assemble_checkpoint(
    path, os.path.join(folder, "export.keras"), model=model))
assert type(exported) is keras.Sequential, type(exported)
assert getattr(exported, "optimizer", None) is None
assert all(np.all(w == 2.0) for w in exported.get_weights())
print("OK")
