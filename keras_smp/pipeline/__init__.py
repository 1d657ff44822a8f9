"""Pipeline parallelism: schedules (pure Python) and their runtime.

`keras_smp.pipeline.schedule` holds the TensorFlow-free schedule layer;
its public names are re-exported here lazily, so that
`python -m keras_smp.pipeline.schedule` does not import the module twice.
"""

_SCHEDULE_NAMES = (
    "Action", "COMPUTE_KINDS", "COMM_KINDS", "GPipe", "Interleaved1F1B",
    "KINDS", "OneFOneB", "OneFOneBSplit", "SCHEDULES", "Schedule",
    "Timeline", "ZeroBubbleH1", "ZeroBubbleV", "get_schedule", "simulate",
)

__all__ = list(_SCHEDULE_NAMES)


def __getattr__(name):
    if name in _SCHEDULE_NAMES:
        from keras_smp.pipeline import schedule
        return getattr(schedule, name)
    raise AttributeError(f"module 'keras_smp.pipeline' has no attribute {name!r}")
