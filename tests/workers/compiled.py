"""Counts the XLA-compiled stage calls a worker traces (jit_compile=True)."""

from keras_smp.runtime import xla as _xla

#: `count[0]`: calls of compiled functions traced since the last reset.
count = [0]
_original = _xla.compiled


def _counting(fn, name, layers=(), **kwargs):
    out = _original(fn, name, layers, **kwargs)
    if out is fn:  # not compiled (a layer XLA cannot compile)
        return out

    def called(*args, **kwargs):
        count[0] += 1
        return out(*args, **kwargs)

    return called


_xla.compiled = _counting
