"""Turning a lost worker into an error that names it.

A worker process that fails reports its error to the others
(`runtime.shutdown`), which then stop with an error naming that rank and
its exception. A worker process that dies or hangs surfaces in the others
as a collective `DeadlineExceededError` (after `collective_timeout_seconds`), or as
`UnavailableError` / `CancelledError` / `AbortedError` (connection lost,
coordination service heartbeat) from deep inside TensorFlow. `guard(fn,
runtime)` wraps a Keras step function so those become one `RuntimeError`
that names this worker, the worker that was lost (when TensorFlow's message
tells: a task name or an address of the cluster), the timeout, and what to
do; and the ranks' data ending at different steps (`runtime.data_end`) a
`ValueError` naming them. `startup_error` does the same for workers that
never joined.
"""

import re

from keras_smp.runtime import calls
from keras_smp.runtime import shutdown

LOST = shutdown.lost_errors()
_HINTS = ("timed out", "socket closed", "connect", "unavailable", "abort",
          "cancel", "heartbeat", "deadline")


def lost_ranks(message, cluster, me):
    """World ranks other than `me` that TensorFlow's `message` mentions.

    Looks for task names (`/job:worker/replica:0/task:3`) and the cluster's
    `host:port` addresses.

    >>> from keras_smp.topology import resolve_cluster
    >>> import json
    >>> c = resolve_cluster({"TF_CONFIG": json.dumps({"cluster": {"worker": [
    ...     "localhost:1000", "localhost:1001"]}, "task": {"type": "worker",
    ...     "index": 0}})})
    >>> lost_ranks("Socket closed ipv4:127.0.0.1:1001", c, 0)
    [1]
    """
    found = set()
    for job, task in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", message):
        rank = _rank_of_task(cluster, job, int(task))
        if rank is not None:
            found.add(rank)
    addresses = list(cluster.workers)
    for rank, address in enumerate(addresses):
        port = address.rsplit(":", 1)[-1]
        if address in message or re.search(rf"[:/]{re.escape(port)}\b", message):
            found.add(rank)
    found.discard(me)
    return sorted(found)


def _rank_of_task(cluster, job, index):
    spec = cluster.cluster_spec or {}
    chiefs = len(spec.get("chief", []))
    if job == "chief":
        return index
    if job == "worker":
        return chiefs + index
    return None


def describe(error, topology, cluster, timeout):
    """The `RuntimeError` message for a lost peer.

    Args:
        error: the TensorFlow error (one of `LOST`).
        topology: this process's `Topology`.
        cluster: the `ClusterInfo`.
        timeout: `collective_timeout_seconds`.
    """
    topo = topology
    text = error.message or str(error)
    where = (f"pipeline rank {topo.pp_rank} (rank {topo.rank} of "
             f"{topo.world_size}, replica {topo.dp_rank})"
             if topo.pp_size > 1 else
             f"worker rank {topo.rank} of {topo.world_size}")
    reported = shutdown.failed_rank(text)
    if reported is not None:
        rank, what = reported
        address = (f" ({cluster.workers[rank]})"
                   if 0 <= rank < len(cluster.workers) else "")
        return (
            f"keras-smp: {where} stopped: rank {rank}{address} failed with "
            f"{what}. That rank's log has the traceback; fix the error there "
            "and restart the job (keras.callbacks.BackupAndRestore resumes "
            "from the last backup).")
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    telling = [l for l in lines if any(h in l.lower() for h in _HINTS)]
    first = (telling or lines or [""])[0][:240]
    ranks = lost_ranks(text, cluster, topo.rank)
    if ranks:
        who = ("lost rank " + ", ".join(map(str, ranks)) +
               f" ({', '.join(cluster.workers[r] for r in ranks)})")
    else:
        peers = [r for r in range(topo.world_size) if r != topo.rank]
        who = ("lost a peer (TensorFlow did not say which; peers: ranks "
               f"{peers})")
    return (
        f"keras-smp: {where} {who}: a collective failed with "
        f"{type(error).__name__}: {first!r}. That worker process has "
        "probably died or hung; look at its log. Every collective waits at "
        f"most collective_timeout_seconds={timeout:g}. Restart the job "
        "(keras.callbacks.BackupAndRestore resumes from the last backup).")


def startup_error(error, cluster, timeout):
    """The `RuntimeError` message for workers that never joined the cluster.

    Args:
        error: the TensorFlow error (one of `LOST`).
        cluster: the `ClusterInfo`.
        timeout: `collective_timeout_seconds`.
    """
    text = error.message or str(error)
    ranks = lost_ranks(text, cluster, cluster.rank)
    addresses = list(cluster.workers)
    who = (", ".join(f"rank {r} ({addresses[r]})" for r in ranks)
           if ranks else "some of its peers")
    return (
        f"keras-smp: worker rank {cluster.rank} of "
        f"{cluster.world_size} could not start: {who} did not join within "
        f"collective_timeout_seconds={timeout:g} "
        f"({type(error).__name__}). Start every worker listed in TF_CONFIG "
        "(or the SLURM job), check the addresses, ports and firewalls, or "
        "raise collective_timeout_seconds if workers start slowly.")


def guard(fn, runtime):
    """Wraps a step function: lost peers raise a `RuntimeError` naming them.

    Args:
        fn: the function to wrap (returned as is if already guarded).
        runtime: the `keras_smp.runtime.Runtime` (topology, cluster,
            config's timeout).
    """
    if getattr(fn, "_smp_lost_peer_guard", False):
        return fn

    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LOST as e:
            raise RuntimeError(describe(
                e, runtime.topology, runtime.cluster,
                runtime.config.collective_timeout_seconds)) from e
        except Exception as e:
            # The ranks' data of unknown length ended at different steps
            # (`runtime.data_end`): TensorFlow's failed assertion, as the
            # message naming those ranks.
            ended = calls.parse_data_end(str(e))
            if ended is None:
                raise
            raise ValueError(calls.data_end_message(*ended)) from None

    guarded._smp_lost_peer_guard = True
    guarded.__wrapped__ = fn
    return guarded
