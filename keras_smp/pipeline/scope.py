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
        index: stage index, `0 <= index < partitions` (times
            `virtual_stages` with several model stages per rank: see
            docs/schedules.md). Stages must be used
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
