"""Every rank checked to agree, through the coordination service's store.

`agree` is the one exchange: every rank puts a JSON record under a key,
rank 0 reads them all and puts a verdict (a message, or `""` when they
agree), every rank reads the verdict. It serves:

- the start-up settings check (`runtime.process.check_same_settings`);
- `check_same_call`: before the first step of every `fit`, `evaluate` and
  `predict` call under a multi-process `SMPStrategy`, every rank says
  what it is about to run (`runtime.calls.call_record`): the call, its
  steps per epoch, the arguments that decide them, the shapes and dtypes
  of its batches. Ranks that differ, or a rank whose script already ended
  (`if rank == 0: model.evaluate(...)`), fail at once on every rank with
  the same message, instead of waiting in a collective until
  `collective_timeout_seconds`.

Costs one key per rank per call, and rank 0 one read per rank.
"""

import itertools
import json

from keras_smp.runtime import shutdown
from keras_smp.runtime import tf_private
from keras_smp.runtime.calls import call_disagreements
from keras_smp.runtime.calls import ended_message

# This process's fit/evaluate/predict calls checked (every rank makes them
# in the same order, so the n-th keys match).
_call_checks = itertools.count()
_CALLS = "keras_smp/calls"


def agree(ctx, base, rank, world_size, record, judge, *, what,
          timeout_seconds, on_ended=None, done=None):
    """Puts `record` (a JSON-able dict) at `{base}/{rank}`; rank 0 reads
    every rank's and puts `judge(records) or ""` at `{base}/verdict`;
    returns the verdict on every rank (`""`: they agree).

    Args:
        ctx: TensorFlow's eager context (tests pass a fake).
        base: the keys' prefix, unique per exchange.
        rank, world_size: this process's world rank, and the job's size.
        record: this rank's record.
        judge: `{rank: record} -> message or None` (rank 0 runs it).
        what: what the ranks are doing, for the wait's messages.
        timeout_seconds: the most to wait for a rank.
        on_ended: `other rank -> message`: the verdict when a rank whose
            key is awaited has ended its script (`None`: wait on).
        done: a key (directory) rank 0 deletes once every rank's record
            is in: a previous exchange's, which every rank has read by
            then (`None`: none).

    Raises:
        RuntimeError: a rank failed, or did not answer within
            `timeout_seconds`.
    """
    mine = json.dumps(record)
    ctx.set_config_key_value(f"{base}/{rank}", mine)
    watch_end = on_ended is not None
    if rank == 0:
        records = {0: json.loads(mine)}
        verdict = ""
        for other in range(1, world_size):
            try:
                records[other] = json.loads(shutdown.wait_for_key(
                    ctx, f"{base}/{other}", rank=rank, source=other,
                    what=what, timeout_seconds=timeout_seconds,
                    watch_end=watch_end))
            except shutdown.RankEnded as e:
                verdict = on_ended(e.rank)
                break
        else:
            verdict = judge(records) or ""
            if done is not None:
                ctx.delete_config_key_value(done)
        ctx.set_config_key_value(f"{base}/verdict", verdict)
        return verdict
    try:
        return shutdown.wait_for_key(
            ctx, f"{base}/verdict", rank=rank, source=0, what=what,
            timeout_seconds=timeout_seconds, watch_end=watch_end)
    except RuntimeError as e:
        # Rank 0 posting the verdict, raising it and (it caught it) ending
        # its script just as this rank's slice of the wait ended: the
        # verdict itself (whole), not rank 0's report of its failure nor
        # its end.
        ended = isinstance(e, shutdown.RankEnded)
        if not ended and getattr(e, "smp_stopped_by", None) is None:
            raise
        try:
            return ctx.get_config_key_value(f"{base}/verdict", 1)
        except shutdown.lost_errors():
            if ended:
                return on_ended(e.rank)
            raise e from None


def check_same_call(runtime, record, of_call=None, context=None):
    """Checks, before its first step, that every rank makes the same
    `fit` / `evaluate` / `predict` call (`record`: this rank's
    `runtime.calls.call_record`) with a multi-process runtime; a no-op
    otherwise.

    Args:
        runtime: the model's strategy's `Runtime`.
        record: this rank's `call_record`.
        of_call: `None` for a call (counted), or the index this returned
            for the call that a later check belongs to (a fit's
            validation data: `record["call"] == "validation of fit"`).
        context: TensorFlow's eager context module (tests pass a fake).

    Returns:
        The call's index in this process (0-based; `None` where nothing
        is checked).

    Raises:
        ValueError: on every rank, when any rank differs (the message
            names each difference and the ranks), or on the ranks finding
            that another rank's script ended instead.
        RuntimeError: a rank failed, or did not answer within
            `collective_timeout_seconds`.
    """
    if not runtime.collectives or runtime.cluster.world_size == 1:
        return None
    if of_call is None:
        index = next(_call_checks)
        base, done = f"{_CALLS}/{index}", (
            f"{_CALLS}/{index - 1}" if index else None)
    else:
        index = of_call
        base, done = f"{_CALLS}/{index}/validation", None
    rank = runtime.cluster.rank
    verdict = agree(
        (context or tf_private.context).context(), base, rank,
        runtime.cluster.world_size, record,
        lambda records: call_disagreements(records, index),
        what=f"the start of {record['call']} (every rank must make the "
             "same fit/evaluate/predict calls; rank 0 answers once every "
             "rank has started this one)",
        timeout_seconds=runtime.config.collective_timeout_seconds,
        on_ended=lambda other: ended_message(rank, record, index, other),
        done=done)
    if verdict:
        raise ValueError(verdict)
    return index
