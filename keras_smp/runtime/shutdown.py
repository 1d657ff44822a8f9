"""A job's orderly exit: the coordination leader leaves last.

TensorFlow's coordination service runs in one process of the job, the
coordination leader (world rank 0: the chief, or worker 0). Every
collective of every rank needs it: group resolution, key-value store,
heartbeats. When the leader's script ends first and its process exits,
ranks still in collectives it takes no part in (a tensor-parallel group's
`save_weights`, `smp.mp_barrier()` of another pipeline, the last stage's
final ops) fail with "Failed to send RPC to coordination service. Either
the leader task was preempted/died/restarted".

`install(cluster, timeout_seconds)` (called by `process.start` once the
distributed runtime runs) makes the exit orderly, with no barrier for the
other ranks:

- every other rank, when its script ends, tells the leader it is done (one
  key in the coordination service's store) and exits at once;
- the leader, when its script ends, waits until every other rank said so,
  at most `timeout_seconds` in all (`collective_timeout_seconds`), then
  exits; a rank that does not answer in time gets a warning naming it.

A rank that fails (an unhandled exception, `sys.exit` with a non-zero or
non-int status) says so instead, and a failing leader does not wait: a
failure still ends the process at once, so a launcher notices it as soon
as before. A process killed by a signal runs no exit hook: the leader
waits for it until the timeout, unless the launcher stops the job first
(`keras-smp launch` stops every worker as soon as one fails).
"""

import atexit
import sys
import threading
import time
import warnings

_PREFIX = "keras_smp/exit"
_state = {"installed": False, "failed": False}
_lock = threading.Lock()


def _mark_failed():
    _state["failed"] = True


def _failing_status(status):
    return not (status is None or status == 0)


def install(cluster, timeout_seconds, context=None):
    """Registers the exit hooks in this process (once; several processes).

    Args:
        cluster: this job's `ClusterInfo`.
        timeout_seconds: the most the leader waits at exit, in all.
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

    def excepthook(*args):
        _mark_failed()
        previous_hook(*args)

    def exit_(status=None):
        if _failing_status(status):
            _mark_failed()
        previous_exit(status)

    sys.excepthook = excepthook
    sys.exit = exit_
    # World rank 0 (the chief, else worker 0) hosts the service
    # (`multi_worker_util.coordination_leader`).
    atexit.register(_at_exit, context, cluster.rank, cluster.world_size,
                    0, timeout_seconds)


def _at_exit(context, rank, world_size, leader, timeout_seconds):
    ctx = context.context()
    if rank != leader:
        status = "failed" if _state["failed"] else "done"
        if status == "done":
            try:
                context.async_wait()  # this rank's last ops have run
            except Exception:  # noqa: BLE001 (reported by the op itself)
                pass
        try:
            ctx.set_config_key_value(f"{_PREFIX}/{rank}", status)
        except Exception:  # noqa: BLE001 (the leader may be gone)
            pass
        return
    if _state["failed"]:
        return
    deadline = time.monotonic() + timeout_seconds
    missing = []
    for other in range(world_size):
        if other == leader:
            continue
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            missing.append(other)
            continue
        try:
            ctx.get_config_key_value(f"{_PREFIX}/{other}",
                                     timeout_in_ms=left_ms)
        except Exception:  # noqa: BLE001 (timeout, or the rank was lost)
            missing.append(other)
    if missing:
        warnings.warn(
            f"keras-smp: the coordination leader (rank {leader}) exits "
            f"without word from rank(s) {missing} after waiting up to "
            f"{timeout_seconds:g} s (collective_timeout_seconds): they were "
            "lost or are still running, and their collectives will fail "
            "once the coordination service is gone. End every rank's "
            "script at the same point, or raise collective_timeout_seconds.",
            stacklevel=1)
