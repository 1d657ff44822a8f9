"""Which embedding lookups' sparse gradients are added position by position
over microbatches (`StagedGraph.batch_free_sparse`), in one process.

Prints `ROW {json}`: the names of the tables found batch-free, the error
`sparse.add_rows` raises when the ids differ, and the module docstring's
example run.
"""

import inspect
import json
import re

import keras_smp

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                 local_devices=2)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

from keras_smp.runtime import sparse  # noqa: E402


class Lookups(keras.layers.Layer):
    """Tables looked up at ids of every kind, all added to the tokens'."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seeds = keras.random.SeedGenerator(3)
        names = ["tokens", "positions", "pairs", "constant", "slots",
                 "zeros", "drawn"]
        self.tables = {n: keras.layers.Embedding(20, 4, name=n)
                       for n in names}

    def call(self, x):
        t = self.tables
        length = ops.shape(x)[-1]
        positions = ops.arange(0, length)
        h = t["tokens"](x)  # the data: a row per token
        h = h + t["positions"](positions)  # the same ids at any batch
        h = h + t["pairs"](positions // 2)  # each id twice, any batch
        h = h + ops.sum(t["constant"](ops.arange(0, 3)), axis=0)
        # A row per sample: the positions broadcast over the batch, and
        # zeros of the batch's shape (from shapes alone, but as many as
        # the batch's tokens).
        h = h + t["slots"](ops.broadcast_to(positions[None, :],
                                            ops.shape(x)))
        h = h + t["zeros"](ops.zeros(ops.shape(x), "int32"))
        # Random ids (a seed generator's state): new in every microbatch.
        drawn = keras.random.randint((3,), 0, 20, seed=self.seeds)
        return h + ops.sum(t["drawn"](drawn), axis=0)


class RawTable(keras.layers.Layer):
    """A position table read with `ops.take` in a layer holding no
    `Embedding`: not traced, its gradient concatenated."""

    def build(self, shape):
        self.table = self.add_weight(shape=(20, 4), name="raw")

    def call(self, h):
        return h + ops.take(self.table, ops.arange(0, ops.shape(h)[1]),
                            axis=0)


with strategy.scope():
    inputs = keras.Input((None,), dtype="int32")
    h = Lookups(name="lookups")(inputs)
    h = keras.layers.Dense(4, name="mid")(h)
    h = RawTable(name="raw")(h)
    model = keras_smp.DistributedModel(keras.Model(
        inputs, keras.layers.Dense(3, name="out")(h)),
        split_points=["mid"])
    model.build((None, 6))

graph = model.staged_graph
found = graph.batch_free_sparse()
names = sorted(w.path.split("/")[-2] for w in model.weights
               if id(w) in found)
# Cached: the same set, not traced again.
again = graph.batch_free_sparse() is found

try:
    sparse.add_rows(
        tf.IndexedSlices(tf.ones([2, 1]), tf.constant([0, 1]),
                         tf.constant([4, 1])),
        tf.IndexedSlices(tf.ones([3, 1]), tf.constant([0, 1, 2]),
                         tf.constant([4, 1])), what="the gradient of t")
    error = None
except tf.errors.InvalidArgumentError as e:
    error = e.message

example = re.findall(r"```python\n(.*?)```", inspect.getdoc(sparse),
                     flags=re.S)
for code in example:
    exec(compile(code, "<sparse example>", "exec"), {})

print("ROW " + json.dumps({"batch_free": names, "cached": again,
                           "error": error, "examples": len(example)}),
      flush=True)
