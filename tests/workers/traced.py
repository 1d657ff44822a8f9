"""Counts, per stage function made by `tracing.once_per_shape`, how often
the pipeline called it and how often its forward's Python ran (a trace, or
an inline run): traced once, the forward runs once per input shape, not
once per microbatch."""

from keras_smp.runtime import tracing as _tracing

#: `[calls, runs]` of each stage function made since the last reset.
wrappers = []
_original = _tracing.once_per_shape


def _counting(fn, name, layers=()):
    counts = [0, 0]
    wrappers.append(counts)

    def raw(tensors):
        counts[1] += 1
        return fn(tensors)

    out = _original(raw, name, layers)

    def called(tensors):
        counts[0] += 1
        return out(tensors)

    return called


_tracing.once_per_shape = _counting
