"""Where the variables being created go: thread-local settings (pure Python).

`DistributedModel` sets them while it (re-)creates a model's weights;
`SMPStrategy` reads them in its variable creator:

- `placing(stage)`: each model replica's copy of the variables created
  inside goes on that replica's device for pipeline stage `stage`.
- `local_variables()`: the variables created inside are plain,
  process-local ones (with one stage per process, the copies a process
  keeps of other stages' weights must not be mirrored or broadcast: the
  other processes do not create them).

Both are thread-local and nest (the inner setting wins; leaving it restores
the outer one).

Example:

>>> with placing(1):
...     current_placement()
1
>>> current_placement() is None, creating_local()
(True, False)
>>> with local_variables():
...     creating_local()
True
"""

import contextlib
import threading

_state = threading.local()


@contextlib.contextmanager
def _setting(name, value):
    """Sets a thread-local attribute for the `with` body."""
    previous = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


@contextlib.contextmanager
def placing(stage):
    """Variables created inside go to pipeline stage `stage`."""
    with _setting("placement", stage):
        yield


def current_placement():
    """The stage set by `placing`, or `None`."""
    return getattr(_state, "placement", None)


@contextlib.contextmanager
def local_variables():
    """Variables created inside are plain, process-local ones."""
    with _setting("local", True):
        yield


def creating_local():
    """Whether `local_variables` is active."""
    return bool(getattr(_state, "local", False))


@contextlib.contextmanager
def consistent_initial_values():
    """The variables created inside get initial values that are already
    right on every process (a tensor-parallel shard, cut from a whole
    weight made identical across its stage): the strategy must not
    broadcast them from another process."""
    with _setting("consistent", True):
        yield


def initial_values_consistent():
    """Whether `consistent_initial_values` is active."""
    return bool(getattr(_state, "consistent", False))


@contextlib.contextmanager
def local_shards(shard_of):
    """The variable created inside is a tensor-parallel weight whose ranks
    are the local replicas of this process: replica `r`'s copy starts as
    `shard_of(r)` (its shard of the whole initial value), not as a copy of
    replica 0's."""
    with _setting("shards", shard_of):
        yield


def local_shard_initializer():
    """The `shard_of` function `local_shards` set, or `None`."""
    return getattr(_state, "shards", None)


@contextlib.contextmanager
def replica_updates():
    """Variable updates inside run in each replica's own context, on its
    own copy, without a `merge_call` (TensorFlow's path for XLA on GPUs).

    Keras' optimizer updates inside `tf.cond` (gradient accumulation, EMA
    overwrites) cannot `merge_call`; the gradients must be the same on
    every replica already (summed before), so every copy gets the same
    update."""
    with _setting("replica_updates", True):
        yield


def updating_in_replicas():
    """Whether `replica_updates` is active (in this replica's thread)."""
    return bool(getattr(_state, "replica_updates", False))
