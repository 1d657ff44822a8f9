"""What every rank's `fit`, `evaluate` and `predict` calls must agree on.

Pure Python (no TensorFlow): the records and the messages.

With several processes, every step of `fit`, `evaluate` and `predict`
under an `SMPStrategy` runs collectives that need every rank (gradient
all-reduces, metric sums, stage-to-stage transfers). A rank that makes
another call, runs more steps, feeds batches of another shape, or skips
the call (`if rank == 0: model.evaluate(...)`) leaves the others waiting
in a collective until `collective_timeout_seconds` (300 s by default),
then failing with a lost-peer error that names no cause, or fails in a
collective with TensorFlow's "Shape mismatch in the collective instance".

So, before the first step of every such call, each rank says what it is
about to run (`call_record`), and rank 0 compares them
(`call_disagreements`; `runtime.agreement.check_same_call` does the
exchange): every rank then fails at once with the same message naming the
difference, or, when another rank's script already ended, with
`ended_message`.
"""

import json
import re
from collections.abc import Mapping

from keras_smp.config import ranks_text

#: The calls compared, and the validation of a `fit` (its own data, checked
#: when the fit first validates).
CALLS = ("fit", "evaluate", "predict", "validation of fit")

_FIX = (
    "Every rank must call fit, evaluate and predict the same number of "
    "times, in the same order, with the same arguments and the same global "
    "batches: the same dataset (same seed in shuffle), batch size, steps "
    "and number of rows (or drop_remainder=True), infinite (`.repeat()`) "
    "on every rank or on none. To evaluate or predict "
    "for one rank, call it on every rank (each gets the whole result) and "
    "use the result on that rank: not `if rank == 0: model.evaluate(...)`.")


def call_record(call: str, *, steps, arguments: Mapping | None = None,
                inputs=None, orders: Mapping | None = None) -> dict:
    """What one rank is about to run: a JSON-able dict.

    Args:
        call: one of `CALLS`.
        steps: the steps per epoch it will run (`steps_per_epoch`, or the
            data's batches), or `None` when the data does not say (a
            generator without `__len__`, a dataset of unknown cardinality).
        arguments: the call's arguments that decide its steps and shapes,
            e.g. `{"epochs": 3, "initial_epoch": 0, "batch_size": 16}`.
        inputs: `(dtype, shape)` per input tensor of a batch, e.g.
            `("float32", [None, 8])`; `None` in a shape, or `inputs=None`,
            where the data does not say (an unknown dimension matches any).
        orders: `{what: order}`: the orders this rank reads its data in,
            where it reads its replica's batch (a data-parallel replica's
            first stage's tensor-parallel rank 0); compared only among the
            ranks giving one (`runtime.data_order`).

    Example:

    ```python
    from keras_smp.runtime.calls import call_record

    record = call_record("fit", steps=4, arguments={"epochs": 3},
                         inputs=[("float32", [None, 8]), ("int64", [None])])
    assert record["steps"] == 4 and record["arguments"] == {"epochs": 3}
    assert record["inputs"] == ["float32[None, 8]", "int64[None]"]
    ```
    """
    if call not in CALLS:
        raise ValueError(f"call={call!r}: expected one of {CALLS}.")
    return {"call": call,
            "steps": "unknown" if steps is None else int(steps),
            "arguments": dict(arguments or {}),
            "inputs": None if inputs is None else [
                f"{dtype}{list(shape)}" for dtype, shape in inputs],
            "orders": dict(orders or {})}


def _parsed(inputs):
    """`[(dtype, [dims])]` of a record's inputs (`None` dims unknown)."""
    parsed = []
    for text in inputs:
        dtype, _, dims = text.partition("[")
        parsed.append((dtype, [None if d.strip() == "None" else d.strip()
                               for d in dims.rstrip("]").split(",")
                               if d.strip()]))
    return parsed


def inputs_compatible(a, b) -> bool:
    """Whether two records' `inputs` can be the same batches: as many
    tensors, the same dtypes and ranks, dimensions equal where both are
    known (`None`, data that does not say, matches any)."""
    if a is None or b is None:
        return True
    a, b = _parsed(a), _parsed(b)
    return len(a) == len(b) and all(
        da == db and len(sa) == len(sb) and all(
            x is None or y is None or x == y for x, y in zip(sa, sb))
        for (da, sa), (db, sb) in zip(a, b))


def _ordinal(index):
    n = index + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(
        n % 10, "th")
    return f"{n}{suffix}"


def _differences(records, ranks, field, label):
    groups: dict[str, list] = {}
    for rank in ranks:
        value = records[rank].get(field)
        groups.setdefault(json.dumps(value, sort_keys=True), []).append(rank)
    if len(groups) == 1:
        return []
    return [f"- {label}: " + "; ".join(
        f"{_shown(value)} on {ranks_text(members)}"
        for value, members in groups.items())]


def _shown(value):
    """A JSON value as the message shows it (strings unquoted)."""
    value = json.loads(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(value) + "]"
    return value if isinstance(value, str) else repr(value)


def _names(records, ranks, field):
    """The keys of every rank's `field` dict, in first-seen order."""
    names = []
    for rank in ranks:
        for name in records[rank].get(field) or {}:
            if name not in names:
                names.append(name)
    return names


def call_disagreements(records: Mapping[int, Mapping], index: int
                       ) -> str | None:
    """`None` when every rank's `call_record` for its `index`-th call
    (0-based) equals rank 0's; else the message naming each difference
    and the ranks holding each value, and the fix.

    Example:

    ```python
    from keras_smp.runtime.calls import call_record, call_disagreements

    fit = call_record("fit", steps=4, arguments={"epochs": 3})
    assert call_disagreements({0: fit, 1: fit}, 0) is None
    short = call_record("fit", steps=3, arguments={"epochs": 3})
    message = call_disagreements({0: fit, 1: short}, 0)
    assert "- steps: 4 on rank 0; 3 on rank 1" in message
    ```
    """
    ranks = sorted(records)
    lines = _differences(records, ranks, "call", "call")
    if not lines:  # the same call: what it runs
        lines += _differences(records, ranks, "steps", "steps")
        for name in _names(records, ranks, "arguments"):
            lines += _differences(
                {r: {"value": (records[r].get("arguments") or {}).get(name)}
                 for r in ranks}, ranks, "value", name)
        for name in _names(records, ranks, "orders"):
            giving = [r for r in ranks
                      if name in (records[r].get("orders") or {})]
            lines += _differences(
                {r: {"value": records[r]["orders"][name]} for r in giving},
                giving, "value", name)
        first = records[ranks[0]].get("inputs")
        if not all(inputs_compatible(first, records[r].get("inputs"))
                   for r in ranks):
            lines += _differences(records, ranks, "inputs", "batch inputs")
    if not lines:
        return None
    part = ("the validation data of their" if all(
        records[r].get("call") == "validation of fit" for r in ranks)
        else "their")
    return (
        f"keras-smp: the processes of this job differ in {part} "
        f"{_ordinal(index)} fit/evaluate/predict call; every step waits for "
        "every rank, so they would wait for each other until "
        "collective_timeout_seconds, or fail in a collective:\n"
        + "\n".join(lines) + "\n" + _FIX)


def ended_message(rank: int, record: Mapping, index: int, other: int) -> str:
    """The message when rank `rank`, starting its `index`-th call (0-based;
    `record`), finds that rank `other`'s script already ended.

    Example:

    ```python
    from keras_smp.runtime.calls import call_record, ended_message

    message = ended_message(0, call_record("evaluate", steps=2), 1, 1)
    assert message.startswith("keras-smp: rank 0 starts evaluate() (its "
                              "2nd fit/evaluate/predict call), but rank 1's "
                              "script ended after 1 such call")
    message = ended_message(0, call_record("validation of fit", steps=2),
                            1, 1)
    assert "starts the validation of fit (its 2nd fit/evaluate/predict " \
        "call), but rank 1's script ended after 2 such calls" in message
    ```
    """
    call = record.get("call", "a call")
    what = (f"{call}()" if call in ("fit", "evaluate", "predict")
            else f"the {call}")
    # The fit being validated is a call the other rank made too.
    made = index + 1 if call == "validation of fit" else index
    return (
        f"keras-smp: rank {rank} starts {what} (its {_ordinal(index)} "
        f"fit/evaluate/predict call), but rank {other}'s script ended after "
        f"{made} such call{'' if made == 1 else 's'}: every step needs "
        "every rank, so this one would wait until collective_timeout_seconds."
        "\n" + _FIX)


#: What the step's agreement on the end of the data (`runtime.data_end`)
#: puts first in its failed assertion, before the batches per rank.
DATA_END_MARKER = "keras-smp: data ended at different steps"


def data_end_message(counts, expected) -> str:
    """The message when, with model parallelism across processes, some
    processes' data of unknown length has a next batch and others' not.

    Args:
        counts: per rank, its replicas holding a next batch.
        expected: per rank, its replicas (a batch each when its data has
            not ended).

    Example:

    ```python
    from keras_smp.runtime.calls import data_end_message

    message = data_end_message([1, 0], [1, 1])
    assert message.startswith(
        "keras-smp: the data ended on rank 1 while rank 0 still had a batch")
    ```
    """
    ended = [r for r, (c, e) in enumerate(zip(counts, expected)) if c < e]
    going = [r for r, (c, e) in enumerate(zip(counts, expected))
             if c == e and c > 0]
    still = (f"{ranks_text(going)} still had a batch" if going else
             "other replicas of " + ranks_text(
                 [r for r in ended if counts[r] > 0]) + " still had one")
    return (
        f"keras-smp: the data ended on {ranks_text(ended)} while {still}, "
        "at the same step. With model parallelism across processes "
        "(pipeline stages, tensor-parallel ranks) every process of the job "
        "takes each step together, so every process's data must end at the "
        "same step. This could not be checked before the first step: the "
        "data's length is unknown (a generator without `__len__`, a "
        "dataset of unknown cardinality such as one made with `filter()`), "
        "or `steps_per_epoch` asks for more batches than some rank's data "
        "holds. Give the processes of a pipeline the same data and every "
        "replica as many batches (or `.repeat()` the data and set "
        "`steps_per_epoch`; "
        "`dataset.apply(tf.data.experimental.assert_cardinality(n))` "
        "states a known length).")


def parse_data_end(text: str):
    """`(counts, expected)` from the failed agreement's message `text`
    (TensorFlow prints each as `[1 0]`), or `None` when `text` is not one.

    >>> parse_data_end(DATA_END_MARKER + "] [1 0] [1 1]")
    ([1, 0], [1, 1])
    >>> parse_data_end("something else") is None
    True
    """
    at = text.find(DATA_END_MARKER)
    if at < 0:
        return None
    vectors = re.findall(r"\[([\d\s]+)\]", text[at:])
    if len(vectors) < 2:
        return None
    counts, expected = ([int(v) for v in part.split()]
                        for part in vectors[:2])
    if len(counts) != len(expected):
        return None
    return counts, expected
