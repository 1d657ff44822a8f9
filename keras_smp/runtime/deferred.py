"""Layer weights created as shapes only, materialised by the stage that owns them.

With one pipeline stage per process, a process must never hold the whole
model: each stage process only materialises its own stage's weights. But
layers are built (`Layer.add_weight`) before anyone knows which stage a
layer goes to: a `Sequential` model is built before `DistributedModel`
partitions it. So under a one-stage-per-process `SMPStrategy`, layer
weights are created *deferred*: the Keras variable (its shape, dtype,
name, trainable flag, regularizer...) exists, but its storage is a
zero-element process-local TensorFlow variable, and the initial value
(Keras' seeded initializer, not yet called) is kept for later.
`DistributedModel` then materialises its own stage's weights
(`materialize`, through the strategy: mirrored, broadcast within the
stage's data-parallel group); other stages' weights stay zero-element
forever in this process, and so do their optimizer slots.

Keras initializers are seeded when constructed, so a weight materialised
later has the value it would have had at construction.

Example (no strategy: a deferred weight is created, then materialised):

>>> import keras, tensorflow as tf
>>> layer = keras.layers.Dense(3)
>>> with tf.variable_creator_scope(creator):
...     layer.build((None, 2))
>>> is_pending(layer.kernel), tuple(layer.kernel.shape), layer.kernel.value.shape
(True, (2, 3), TensorShape([0]))
>>> materialize(layer.kernel)
>>> is_pending(layer.kernel), layer.kernel.value.shape
(False, TensorShape([2, 3]))
"""

import contextlib

import tensorflow as tf

from keras_smp.runtime import placement
from keras_smp.runtime import split_draws


def creator(next_creator, **kwargs):
    """A `tf.variable_creator_scope` creator: a zero-element local
    variable that keeps the initial value it was asked for."""
    initial = kwargs["initial_value"]
    dtype = kwargs.get("dtype") or getattr(initial, "dtype", None)
    kwargs["initial_value"] = tf.zeros([0], tf.as_dtype(dtype or tf.float32))
    kwargs.pop("shape", None)
    kwargs.pop("colocate_with", None)
    with placement.local_variables(), tf.init_scope():
        variable = next_creator(**kwargs)
    variable._smp_initial_value = initial
    return variable


def holds_no_copy(variable):
    """Whether `variable` is another pipeline stage's, with no storage in
    this process (one stage per process: deferred, or freed)."""
    return bool(getattr(variable, "_smp_local", False)
                or is_pending(variable))


def initial_value(variable):
    """The initial value a deferred Keras variable waits for, or `None`."""
    # Instance dictionaries only: a distributed variable would delegate an
    # unknown attribute to its value (a read, for sync-on-read variables
    # an all-reduce).
    storage = vars(variable).get("_value") if hasattr(variable, "__dict__") \
        else None
    if storage is None or not hasattr(storage, "__dict__"):
        return None
    return vars(storage).get("_smp_initial_value")


def is_pending(variable):
    """Whether a Keras variable was created deferred and not materialised."""
    return initial_value(variable) is not None


def materialize(variable):
    """Creates a deferred Keras variable's storage with its initial value.

    Call it inside the strategy's scope (and placement) the variable
    belongs to; the strategy's variable creator then mirrors and
    broadcasts it as it does for any variable.
    """
    initial = initial_value(variable)
    if initial is None:
        return
    variable._value = None
    variable._smp_local = False
    # A tensor-parallel shard's initial value is already its rank's (cut
    # from a whole weight synced across the stage): not broadcast again.
    consistent = (placement.consistent_initial_values()
                  if getattr(variable, "_smp_tp_axis", None) is not None
                  else contextlib.nullcontext())
    # (an initializer's draws are no rows of a batch being split)
    with tf.init_scope(), consistent, split_draws.exactly(None):
        variable._initialize(initial)
