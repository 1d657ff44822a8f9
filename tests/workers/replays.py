"""Counts the recomputations (activation checkpointing) a worker traces."""

from keras_smp.pipeline import step as _step_lib

#: `count[0]`: recomputations traced since the last reset.
count = [0]
_original = _step_lib._replay


def _counting(graph, stage):
    snapshot, replay = _original(graph, stage)

    def counted(*args):
        count[0] += 1
        return replay(*args)

    return snapshot, counted


_step_lib._replay = _counting
