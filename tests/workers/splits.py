"""Counts split backwards (I then W) and fallbacks a worker traces."""

import warnings

from keras_smp.pipeline import runtime as _runtime_lib

#: `count[0]`: microbatch backwards traced split in two since the last reset.
count = [0]
#: `fallbacks[0]`: "cannot split" warnings since the last reset.
fallbacks = [0]
_input_backward = _runtime_lib.input_backward


def _counting(*args, **kwargs):
    count[0] += 1
    return _input_backward(*args, **kwargs)


_runtime_lib.input_backward = _counting
_showwarning = warnings.showwarning


def _show(message, *args, **kwargs):
    if "cannot split their backward" in str(message):
        fallbacks[0] += 1
    return _showwarning(message, *args, **kwargs)


warnings.showwarning = _show
warnings.filterwarnings("always", message=".*cannot split their backward")
