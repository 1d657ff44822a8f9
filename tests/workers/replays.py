"""Counts the recomputations (activation checkpointing) a worker traces."""

from keras_smp.pipeline import recompute as _recompute_lib
from keras_smp.pipeline import step as _step_lib

#: `count[0]`: stage recomputations traced since the last reset.
count = [0]
#: `layer_count[0]`: layer recomputations traced since the last reset.
layer_count = [0]
_original = _step_lib._replay
_rerun = _recompute_lib.rerun


def _counting_rerun(state, snap, fn, what, fix, **kwargs):
    if what.startswith("layer "):
        layer_count[0] += 1
    return _rerun(state, snap, fn, what, fix, **kwargs)


_recompute_lib.rerun = _counting_rerun


def _counting(*args):
    snapshot, replay = _original(*args)

    def counted(*args):
        count[0] += 1
        return replay(*args)

    return snapshot, counted


_step_lib._replay = _counting
