"""`partition(i)` scopes: manual placement of layers on pipeline stages.

Pure Python (no TensorFlow): the scope only records the innermost active
partition index; `DistributedModel` reads it while it traces `call` and
assigns every Keras layer (and `keras.ops` operation) called inside the
scope to that stage.
"""

import contextlib
import threading

_state = threading.local()


def _stack():
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def current_partition():
    """Returns the innermost active `partition` index, or `None`."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def partition(index):
    """Places the layers called inside the scope on pipeline stage `index`.

    Use it in the `call` of a `keras_smp.DistributedModel` subclass. The
    innermost scope wins; layers called outside every scope go to
    `default_partition` (see `SMPConfig`). Placement is per Keras layer: a
    layer called in two scopes shares its weights between the two stages.

    Args:
        index: stage index, `0 <= index < partitions`. Stages must be used
            in data-flow order (a stage never consumes a later stage's
            output).

    Example:

    ```python
    import keras, keras_smp

    class TwoStage(keras_smp.DistributedModel):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(8, activation="tanh")
            self.d2 = keras.layers.Dense(1)

        def call(self, x):
            with keras_smp.partition(0):
                x = self.d1(x)
            with keras_smp.partition(1):
                return self.d2(x)
    ```
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(
            f"partition() expects a stage index, an int >= 0; received "
            f"{index!r}.")
    stack = _stack()
    stack.append(index)
    try:
        yield index
    finally:
        stack.pop()


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
    """Internal: variables created inside go to pipeline stage `stage`.

    `SMPStrategy` reads it when it creates a variable, and places the
    variable's copy of each model replica on that replica's stage device.
    """
    with _setting("placement", stage):
        yield


def current_placement():
    """Internal: the stage set by `placing`, or `None`."""
    return getattr(_state, "placement", None)


@contextlib.contextmanager
def local_variables():
    """Internal: variables created inside are plain, process-local ones.

    With one stage per process, the copies a process keeps of other stages'
    weights (empty while training, full while a checkpoint is written) must
    not be mirrored or broadcast: the other processes do not create them.
    """
    with _setting("local", True):
        yield


def creating_local():
    """Internal: whether `local_variables` is active."""
    return bool(getattr(_state, "local", False))
