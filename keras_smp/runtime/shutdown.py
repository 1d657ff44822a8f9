"""A job's orderly exit: every rank waits until every rank's script ended.

TensorFlow's coordination service runs in one process of the job, the
coordination leader (world rank 0: the chief, or worker 0). Every
collective of every rank needs it: group resolution, key-value store,
heartbeats. When the leader's script ends first and its process exits,
ranks still in collectives it takes no part in (a tensor-parallel group's
`save_weights`, `smp.mp_barrier()` of another pipeline, the last stage's
final ops) fail with "Failed to send RPC to coordination service. Either
the leader task was preempted/died/restarted".

Nor may a rank simply leave early: the service expects heartbeats from
every task until the job ends, and reports a task that stopped sending
them as crashed to every other rank (TensorFlow then aborts their
collectives), about 20 s after it left.

`install(cluster, timeout_seconds)` (called by `process.start` once the
distributed runtime runs) makes the exit orderly: every rank, when its
script ends, says so (one key in the coordination service's store) and
waits until every other rank's script has ended, at most
`timeout_seconds` in all (`collective_timeout_seconds`); then all exit
together. A rank that does not answer in time gets a warning naming it.

A rank that fails (an unhandled exception, `sys.exit`, `exit()` or
`quit()` with a non-zero or non-int status) says so instead and does not
wait, and the ranks waiting stop waiting within a second of one saying
so (or when the service is gone): a failure still ends the processes at
once, so a launcher notices it as soon as before. It also reports its error to the whole job through the
coordination service (`report_error_to_cluster`, TensorFlow's own error
propagation), which aborts every other rank's collectives at once with
"keras-smp: rank R failed [N chars]: <the exception>", and puts it in the
key-value store for ranks waiting on a key (`failure`): a rank whose pipeline
neighbour raised (a model error at trace time on one stage process only, a
bad batch) stops within a second with that error (`runtime.errors`
names it), not ~10 s later with a lost-heartbeat message, nor at
`collective_timeout_seconds`. (`raise SystemExit(1)` written out is not seen as a failure: a rank
ending that way waits like one that succeeded, and a peer stuck in a
collective with it fails only at `collective_timeout_seconds`.) Ctrl-C ends the wait. A process killed by a signal runs no
exit hook: the others wait for it until the timeout, unless the launcher
stops the job first (`keras-smp launch` stops every worker as soon as one
fails).

Horovod's own exit hook (`hvd.shutdown`) runs after the wait
(`after_wait`), so that late ranks' Horovod all-reduces still work.
"""

import atexit
import builtins
import re
import sys
import threading
import time
import warnings

from keras_smp.launch import record_failure

_PREFIX = "keras_smp/exit"
# Set by a rank that fails with its own error (its rank; `_publish`).
_FAILED = f"{_PREFIX}/failed"
_ERROR = f"{_PREFIX}/error"  # /<rank>: a failing rank's one-line error
# Set by a rank failing because of another's failure or a lost peer (not a
# cause: `_FAILED` names causes only); ends the others' exit wait too.
_FAILING = f"{_PREFIX}/failing"
_state = {"installed": False, "failed": False, "reported": False,
          "status": None, "published": False}
_REPORT_SECONDS = 5.0  # the most a failing rank spends reporting its error
_SUMMARY_CHARS = 600  # of the exception's message, in the report
_after = []  # run at exit after the wait (`after_wait`)
_lock = threading.Lock()
_SLICE_SECONDS = 1.0  # the wait at exit, in slices (Ctrl-C ends it)
_TELL_SECONDS = 10.0  # the most a rank spends saying it is done


def _mark_failed(status=None):
    _state["failed"] = True
    if status is not None:
        _state["status"] = status


def summary(exc_type, value):
    """One line for the other ranks: `"ValueError: <message>"`.

    Terminal colours dropped, whitespace collapsed, at most
    `_SUMMARY_CHARS` characters of the message.

    >>> summary(ValueError, ValueError("bad\\n\\n  \\x1b[1mshape\\x1b[0m"))
    'ValueError: bad shape'
    """
    text = "" if value is None else re.sub(r"\x1b\[[0-9;]*m", "", str(value))
    text = " ".join(text.split())
    if len(text) > _SUMMARY_CHARS:
        text = text[:_SUMMARY_CHARS - 3] + "..."
    name = getattr(exc_type, "__name__", str(exc_type))
    return f"{name}: {text}" if text else name


def failed_rank(message):
    """`(rank, error)` when `message` (a TensorFlow error's) carries a
    rank's own failure report (`_report`), else `None`.

    The report gives its error's length, so text TensorFlow appends (on the
    same line or the next) is not taken for part of it.

    >>> failed_rank("Collective ops is aborted by: Error reported from "
    ...             "/job:worker/task:1: keras-smp: rank 1 failed "
    ...             "[21 chars]: ValueError: bad shape [type.googleapis.com"
    ...             "/tensorflow.CoordinationServiceError='...']")
    (1, 'ValueError: bad shape')
    >>> failed_rank("Socket closed") is None
    True
    """
    found = re.search(r"keras-smp: rank (\d+) failed \[(\d+) chars\]: ",
                      message)
    if found is None:
        return None
    start = found.end()
    return int(found.group(1)), message[start:start + int(found.group(2))]


def lost_errors():
    """TensorFlow's errors for a lost peer (`runtime.errors.LOST`)."""
    import tensorflow as tf

    return (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError)


def _chain(value):
    """`value` and the exceptions that caused it (at most 8)."""
    found = []
    while value is not None and len(found) < 8 and value not in found:
        found.append(value)
        value = value.__cause__ or value.__context__
    return found


def _why(exc_type, value):
    """`(what, stopped_by, lost)` for this rank's failure record: another
    rank's reported error that stopped this one (`stopped_by` its rank), a
    lost peer (a collective aborted, timed out or disconnected: `lost`),
    or this rank's own error."""
    chain = _chain(value)
    for e in chain:
        peer = getattr(e, "smp_stopped_by", None) or failed_rank(str(e))
        if peer is not None:
            return peer[1], peer[0], False
    what = summary(exc_type, value)
    if chain and "tensorflow" in sys.modules:
        lost = lost_errors()
        if any(isinstance(e, lost) for e in chain):
            return what, None, True
    return what, None, False


def _fail(context, rank, exc_type=None, value=None):
    """This rank fails (once): records why for `keras-smp launch` and
    reports its own error to the job; a failure caused by another rank's
    (its report, or a lost peer) is recorded, not reported: the others see
    the cause itself. Never raises (an exit hook)."""
    if _state["reported"]:
        return
    try:
        if exc_type is None and getattr(sys, "last_type", None) is not None:
            # An unhandled exception whose hook was not ours (another
            # library replaced `sys.excepthook` after keras-smp's).
            exc_type, value = sys.last_type, getattr(sys, "last_value", None)
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # Ctrl-C (or the launcher stopping every worker): not an error
            # to blame on this rank.
            _state["reported"] = True
            return
        if exc_type is not None:
            what, stopped_by, lost = _why(exc_type, value)
        elif _state["status"] is not None:
            what, stopped_by, lost = (f"exit status {_state['status']!r}",
                                      None, False)
        else:
            what, stopped_by, lost = "an unhandled exception", None, False
    except Exception:  # noqa: BLE001 (an exception whose str() fails...)
        what, stopped_by, lost = "an unhandled exception", None, False
    _state["reported"] = True
    record_failure(what, stopped_by=stopped_by, lost=lost)
    if stopped_by is None and not lost:
        _publish(context, rank, what)
        _report(context, rank, what)


def _publish(context, rank, what):
    """Puts this rank's failure in the coordination service's key-value
    store (`failure`), for ranks waiting on a key rather than in a
    collective (the report does not end such waits)."""

    def publish():
        ctx = context.context()
        try:
            ctx.set_config_key_value(f"{_ERROR}/{rank}", what)
            ctx.set_config_key_value(_FAILED, str(rank))
            _state["published"] = True
        except Exception:  # noqa: BLE001 (rank 0's process may be gone)
            pass

    _bounded(publish, _REPORT_SECONDS)


def failure(ctx):
    """`(rank, error)` of a rank that failed and said so, else `None` (a
    look, not a wait). `ctx`: TensorFlow's eager context."""
    try:
        rank = int(ctx.get_config_key_value(_FAILED, timeout_in_ms=1))
    except Exception:  # noqa: BLE001 (not set: a timeout)
        return None
    try:
        # Set before the rank's number (`_publish`): there, unless that
        # rank failed without one (a failing exit status said at exit).
        what = ctx.get_config_key_value(f"{_ERROR}/{rank}",
                                        timeout_in_ms=1000)
    except Exception:  # noqa: BLE001 (failed without an error line)
        what = "a failure (its log says which)"
    return rank, what


class RankEnded(RuntimeError):
    """`wait_for_key(..., watch_end=True)`: the rank expected to set the
    key ended its script (it waits at exit for the others) without
    setting it. `rank`: that rank."""

    def __init__(self, rank, what):
        super().__init__(f"keras-smp: rank {rank}'s script ended while "
                         f"waited for in {what}.")
        self.rank = rank


def _ended(ctx, rank):
    """Whether `rank`'s script ended without failing (a look)."""
    try:
        return ctx.get_config_key_value(f"{_PREFIX}/{rank}",
                                        timeout_in_ms=1) == "done"
    except Exception:  # noqa: BLE001 (not set: a timeout)
        return False


def wait_for_key(ctx, key, *, rank, source, what, timeout_seconds,
                 watch_end=False):
    """The value at `key` in the coordination service's store, waiting at
    most `timeout_seconds`, in slices of `_SLICE_SECONDS`: a rank that
    fails and says so (`failure`) ends the wait with its error (a report
    does not end a wait on a key); with `watch_end`, so does `source`'s
    script ending (`RankEnded`).

    Args:
        ctx: TensorFlow's eager context.
        key: the key to wait for.
        rank: this process's world rank (for the messages).
        source: the rank expected to set `key` (for the messages).
        what: what this rank is doing, e.g. `"broadcast"`.
        timeout_seconds: the most to wait (`collective_timeout_seconds`).
        watch_end: also end the wait when `source`'s script ended (one
            more look per slice).

    Raises:
        RankEnded: with `watch_end`, `source`'s script ended.
        RuntimeError: another rank failed (its error; the exception's
            `smp_stopped_by` is `(rank, error)`), the coordination service
            is gone, or `source` did not answer within `timeout_seconds`.
    """
    lost = lost_errors()
    deadline = time.monotonic() + timeout_seconds
    while True:
        wait = max(0.001, min(_SLICE_SECONDS, deadline - time.monotonic()))
        began = time.monotonic()
        try:
            return ctx.get_config_key_value(key, max(1, int(wait * 1000)))
        except lost as e:
            # One look per slice (each look that finds nothing stays
            # pending at the coordination service until the job ends).
            failed = failure(ctx)
            if failed is not None:
                other, error = failed
                stopped = RuntimeError(
                    f"keras-smp: rank {rank} stopped in {what} (waiting for "
                    f"rank {source}): rank {other} failed with {error}. That "
                    "rank's log has the traceback; fix the error there and "
                    "restart the job.")
                # Not this rank's own failure (`_fail` records it as
                # stopped by that rank's).
                stopped.smp_stopped_by = failed
                raise stopped from e
            if watch_end and _ended(ctx, source):
                raise RankEnded(source, what) from e
            if time.monotonic() - began < wait / 2:  # not a timeout
                raise RuntimeError(
                    f"keras-smp: rank {rank} lost the coordination service "
                    f"in {what}, waiting for rank {source} "
                    f"({type(e).__name__}: {e}). Rank 0's process hosts it: "
                    "it has probably ended; look at its log and restart the "
                    "job.") from e
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"keras-smp: rank {rank} waited {timeout_seconds:g} s in "
                    f"{what} for rank {source}, which did not answer "
                    f"({type(e).__name__}). Every rank of the group must "
                    "make the same communication calls in the same order; "
                    "a lost rank means the job must be restarted.") from e


def _report(context, rank, what):
    """Reports this rank's failure to every rank of the job: the
    coordination service aborts their collectives (TensorFlow's; not
    Horovod's) with the message (a rank already told of another's failure
    cannot report: ignored)."""

    def report():
        try:
            import tensorflow as tf

            context.context().report_error_to_cluster(
                tf.errors.ABORTED, f"keras-smp: rank {rank} failed "
                f"[{len(what)} chars]: {what}")
        except Exception:  # noqa: BLE001 (no service, or already failing)
            pass

    _bounded(report, _REPORT_SECONDS)


def _failing_status(status):
    return not (status is None or status == 0)


def install(cluster, timeout_seconds, context=None):
    """Registers the exit hooks in this process (once; several processes).

    Args:
        cluster: this job's `ClusterInfo`.
        timeout_seconds: the most this process waits at exit, in all (the
            first `SMPStrategy`'s or `smp.init`'s
            `collective_timeout_seconds`).
        context: TensorFlow's eager context module (tests pass a fake).
    """
    if cluster.world_size == 1:
        return
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    if context is None:
        from keras_smp.runtime import tf_private

        context = tf_private.context
    previous_hook = sys.excepthook
    previous_exit = sys.exit

    def excepthook(exc_type, value, tb):
        _mark_failed()
        try:
            previous_hook(exc_type, value, tb)
        finally:
            _fail(context, cluster.rank, exc_type, value)

    def exit_(status=None):
        if _failing_status(status):
            _mark_failed(status)
        previous_exit(status)

    sys.excepthook = excepthook
    sys.exit = exit_
    quitter = type(getattr(builtins, "exit", None))
    if quitter.__module__ == "_sitebuiltins":  # the exit() / quit() builtins
        previous_call = quitter.__call__

        def call(self, code=None):
            if _failing_status(code):
                _mark_failed(code)
            return previous_call(self, code)

        quitter.__call__ = call
    atexit.register(_at_exit, context, cluster.rank, cluster.world_size,
                    timeout_seconds)


def after_wait(fn):
    """Runs `fn()` at exit after the wait for the other ranks (at once when
    this process waits for none). For shut-downs that must not come
    before other ranks are done, such as Horovod's (`hvd.shutdown`)."""
    if _state["installed"]:
        _after.append(fn)
    else:
        atexit.register(fn)


def _failing():
    """Whether this process is ending in failure: an unhandled exception
    (Python sets `sys.last_type` before any excepthook runs) or a failing
    `sys.exit` status."""
    return _state["failed"] or getattr(sys, "last_type", None) is not None


def _bounded(fn, seconds):
    """Runs `fn()` in a daemon thread for at most `seconds`: an exit RPC
    to a rank 0 that does not answer must not hold this process."""
    thread = threading.Thread(target=fn, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no new threads at exit (Python 3.12.0, 3.12.1)
        fn()
        return
    thread.join(seconds)


def _someone_failed(ctx):
    """Whether a rank said it fails (a look, not a wait)."""
    for key in (_FAILED, _FAILING):
        try:
            ctx.get_config_key_value(key, timeout_in_ms=1)
            return True
        except Exception:  # noqa: BLE001 (not set: a timeout)
            pass
    return False


def _at_exit(context, rank, world_size, timeout_seconds):
    try:
        _wait(context, rank, world_size, timeout_seconds)
    finally:
        for fn in _after:
            try:
                fn()
            except Exception:  # noqa: BLE001 (exiting anyway)
                pass


def _wait(context, rank, world_size, timeout_seconds):
    ctx = context.context()
    failing = _failing()
    if not failing:
        try:
            context.async_wait()  # this rank's last ops have run
        except Exception:  # noqa: BLE001 (reported by the op itself)
            pass

    if failing:
        # Records, publishes and reports this rank's failure (its own
        # exception was handled by the excepthook already; a failing exit
        # status is handled here), before the exit key below.
        _fail(context, rank)

    def tell():
        if failing and not _state["published"]:
            try:  # failing, not the cause (or could not publish)
                ctx.set_config_key_value(_FAILING, str(rank))
            except Exception:  # noqa: BLE001 (set before, or service gone)
                pass
        try:
            ctx.set_config_key_value(f"{_PREFIX}/{rank}",
                                     "failed" if failing else "done")
        except Exception:  # noqa: BLE001 (rank 0's process may be gone)
            pass

    _bounded(tell, _TELL_SECONDS)
    if failing:
        return
    deadline = time.monotonic() + timeout_seconds
    missing = []
    for other in range(world_size):
        if other == rank:
            continue
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                missing.append(other)
                break
            if _someone_failed(ctx):
                return  # the job is failing: exit now
            # Short waits, so that Ctrl-C (KeyboardInterrupt, raised
            # between them) still ends the wait, and a failure of any
            # rank is seen within one.
            wait = min(left, _SLICE_SECONDS)
            began = time.monotonic()
            try:
                said = ctx.get_config_key_value(
                    f"{_PREFIX}/{other}", timeout_in_ms=max(1, int(wait * 1000)))
            except Exception:  # noqa: BLE001
                if time.monotonic() - began < wait / 2:
                    # Not a timeout: the service is gone or says the rank
                    # is lost; the job is failing, stop waiting.
                    return
                continue
            if said == "failed":
                return  # the job is failing: exit now
            break
    if missing:
        warnings.warn(
            f"keras-smp: rank {rank} exits without word from rank(s) "
            f"{missing} after waiting up to {timeout_seconds:g} s "
            "(collective_timeout_seconds) for every rank's script to end: "
            "they were lost or are still running, and their collectives "
            "fail once rank 0's process (TensorFlow's coordination service) "
            "is gone. End every rank's script at the same point, or raise "
            "collective_timeout_seconds.", stacklevel=1)
