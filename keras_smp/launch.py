"""Multi-worker process launcher: `keras-smp launch -n N -- CMD ...`.

Starts `N` copies of a command on this machine, each with its own
`TF_CONFIG` describing the job's cluster, prefixes their output with the
worker's world rank, and supervises them: if one worker fails, or the
launcher is interrupted, every worker (and every process a worker started
in its process group) is stopped. The processes the launcher starts die
with it (Linux: a killed launcher leaves no worker holding the job's ports;
a wrapper command such as `bash -c` should `exec` the real program).

- `--max-restarts K`: after a worker fails, the whole job is stopped and
  started again (same ranks, new ports), at most `K` times; each restart
  and its cause are printed and workers see `SMP_RESTART_COUNT`. Scripts
  resume from their `BackupAndRestore` / `CheckpointManager` state.
- `--nnodes H --node-rank R --master ADDR:PORT`: run the same command on
  each of `H` nodes; the launchers meet at node 0's `ADDR:PORT`
  (`keras_smp.rendezvous`: no SSH, no shared filesystem) and every worker
  gets one `TF_CONFIG` naming all nodes' workers. A failure or restart on
  one node stops or restarts every node; a node whose launcher dies ends
  the job on the others.

Command line:

```
keras-smp launch -n 2 -- python train.py --epochs 3
keras-smp launch -n 2 --max-restarts 3 -- python train.py
python -m keras_smp.launch -n 2 --host-map a,a -- python train.py
# on each of 2 nodes (R = 0, 1):
keras-smp launch --nnodes 2 --node-rank R --master 10.0.0.1:29400 -n 4 -- python train.py
```

Exit status: `0` when all workers succeed; the failed worker's exit code
(`128 + signal` if it was killed by a signal) once no restart is left (on
every node of the job); `124` when `--timeout` expires; `130` / `143` when
the launcher receives SIGINT / SIGTERM; `2` for invalid arguments; `127` /
`126` when the command cannot be started; `1` when the rendezvous fails.

This module uses only the standard library (it never imports TensorFlow), so
it is cheap to import from notebooks and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Mapping, Optional, Sequence

from keras_smp import rendezvous
from keras_smp.runtime import malloc

__all__ = ["free_ports", "make_tf_config", "tf_config_for", "worker_env", "run",
           "main"]

_PROG = "keras-smp launch"
_POLL_INTERVAL = 0.05
EXIT_TIMEOUT = 124
# Where a worker the launcher started writes why it fails (its own exception,
# or another rank's that stopped it: `record_failure`), so the launcher can
# name the rank that failed first, not the one whose process ended first.
FAILURE_FILE_ENV = "KERAS_SMP_FAILURE_FILE"


def record_failure(error: str, stopped_by: Optional[int] = None,
                   lost: bool = False) -> None:
    """Records why this worker fails, for `keras-smp launch` (nothing when
    the launcher did not start it). Called by keras-smp's exit hooks.

    Args:
        error: one line: `"ValueError: ..."` (this worker's exception) or
            the failing rank's line when `stopped_by` is given.
        stopped_by: the world rank whose reported failure stopped this one.
        lost: this worker failed because it lost a peer (a collective
            aborted, timed out or lost its connection): not a cause.
    """
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path:
        return
    record = {"error": error, "stopped_by": stopped_by, "lost": lost,
              "time": time.time()}
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher names the worker without the reason


def read_failure(path: str) -> Optional[dict]:
    """The record `record_failure` wrote at `path`, or None.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "rank1")
    >>> os.environ[FAILURE_FILE_ENV] = path
    >>> record_failure("ValueError: bad shape")
    >>> read_failure(path)["error"], read_failure(path)["stopped_by"]
    ('ValueError: bad shape', None)
    >>> del os.environ[FAILURE_FILE_ENV]
    """
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Finds `n` distinct free TCP ports on the loopback interface (or on
    `host`; `""` probes every interface, for workers other nodes reach).

    All `n` sockets are bound to `127.0.0.1:0` at the same time before being
    closed, so the returned ports are guaranteed to be distinct. As with any
    such probe, another process could grab a port before it is used.

    Args:
        n: Number of ports to return, `>= 0`.

    Returns:
        A list of `n` distinct port numbers.

    Example:

    >>> ports = free_ports(2)
    >>> len(set(ports))
    2
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"`n` must be >= 0, got {n}.")
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def make_tf_config(ports: Sequence[int], index: int, host: str = "localhost") -> str:
    """Builds the `TF_CONFIG` JSON string for one worker of a local cluster.

    Args:
        ports: One port per worker; worker `i` listens on `host:ports[i]`.
        index: Index of the worker this config is for, in `[0, len(ports))`.
        host: Host name used for every worker address.

    Returns:
        A JSON string such as
        `{"cluster": {"worker": ["localhost:P0", ...]}, "task": {"type": "worker", "index": i}}`.

    Example:

    >>> import json
    >>> json.loads(make_tf_config([1111, 2222], 1))["task"]
    {'type': 'worker', 'index': 1}
    """
    ports = [int(p) for p in ports]
    if not ports:
        raise ValueError("`ports` must contain at least one port.")
    return tf_config_for([f"{host}:{p}" for p in ports], index)


def tf_config_for(workers: Sequence[str], index: int) -> str:
    """The `TF_CONFIG` JSON of worker `index` of a cluster of `workers`
    (`"addr:port"` each, in world-rank order).

    Example:

    >>> import json
    >>> json.loads(tf_config_for(["a:1", "b:2"], 1))["cluster"]
    {'worker': ['a:1', 'b:2']}
    """
    workers = [str(w) for w in workers]
    if not workers:
        raise ValueError("`workers` must contain at least one address.")
    index = int(index)
    if not 0 <= index < len(workers):
        raise ValueError(f"`index` must be in [0, {len(workers)}), got {index}.")
    return json.dumps(
        {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": index},
        }
    )


def worker_env(
    ports: Sequence[int],
    index: int,
    host_map: Optional[Sequence[str]] = None,
    base_env: Optional[Mapping[str, str]] = None,
    workers: Optional[Sequence[str]] = None,
) -> dict[str, str]:
    """Returns the environment the launcher gives worker `index`.

    Args:
        ports: One port per worker (see `make_tf_config`).
        index: Index of the worker.
        host_map: Optional host label per worker, exported as the
            comma-separated `SMP_HOST_MAP`.
        base_env: Environment to start from; defaults to `os.environ`.
        workers: The whole cluster's `"addr:port"` addresses (several
            nodes); `ports` and `index` are then ignored for the cluster,
            `index` is the world rank.

    Returns:
        A new dict with `TF_CONFIG`, `SMP_LAUNCHED=1`, `PYTHONUNBUFFERED=1`,
        `PYTHONFAULTHANDLER=1` and `MALLOC_ARENA_MAX=1` (each unless
        `base_env` sets it, or for the latter a `GLIBC_TUNABLES`
        arena_max; see `keras_smp.runtime.malloc`) and (if given)
        `SMP_HOST_MAP` set on top of `base_env`.

    Example:

    >>> env = worker_env([1111, 2222], 0, base_env={})
    >>> env["SMP_LAUNCHED"], env["PYTHONFAULTHANDLER"], env["MALLOC_ARENA_MAX"]
    ('1', '1', '1')
    """
    env = dict(os.environ if base_env is None else base_env)
    env["TF_CONFIG"] = (make_tf_config(ports, index) if workers is None
                        else tf_config_for(workers, index))
    env["SMP_LAUNCHED"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # A worker killed by a signal (a native crash: SIGSEGV, SIGABRT, ...)
    # prints every thread's Python stack first, so its log says where.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    # glibc's malloc in one arena from the start (unless set):
    # keras_smp.runtime.malloc.
    malloc.worker_env(env)
    if host_map is not None:
        host_map = list(host_map)
        size = len(ports) if workers is None else len(workers)
        if len(host_map) != size:
            raise ValueError(
                f"`host_map` has {len(host_map)} entries but there are "
                f"{size} workers."
            )
        env["SMP_HOST_MAP"] = ",".join(host_map)
    return env


# ---------------------------------------------------------------------------
# Process-group helpers.


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True if process group `pgid` has a live (non-zombie) member."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    # Linux: orphaned members that already died may linger as zombies until
    # their new parent reaps them; they cannot be killed, so ignore them.
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _exit_code(returncode: int) -> int:
    if returncode < 0:
        return 128 + (-returncode)
    return returncode


class _Output:
    """Serializes whole lines from several reader threads onto one stream."""

    def __init__(self, stream):
        self._stream = stream
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, text: str) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                try:
                    self._stream.write(text)
                except UnicodeEncodeError:
                    enc = getattr(self._stream, "encoding", None) or "ascii"
                    self._stream.write(
                        text.encode(enc, "backslashreplace").decode(enc, "replace")
                    )
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                # Keep draining the workers' pipes, but stop writing.
                self._broken = True


def _pump(pipe, prefix: str, out: _Output) -> None:
    try:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            if not line.endswith("\n"):
                line += "\n"
            out.write_line(prefix + line)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _message(text: str) -> None:
    try:
        sys.stderr.write(f"{_PROG}: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def horovod_rendezvous(num_workers: int):
    """Starts Horovod's Gloo rendezvous for `num_workers` local workers.

    Does what `horovodrun --gloo` does for one host: Horovod's own
    rendezvous server (`horovod.runner`), and the `HOROVOD_*` variables of
    each worker. Returns `(server, [env of worker i])`; stop the server
    with `server.stop()`.
    """
    try:
        from horovod.runner.common.util.hosts import get_host_assignments
        from horovod.runner.common.util.hosts import parse_hosts
        from horovod.runner.gloo_run import create_slot_env_vars
        from horovod.runner.http.http_server import RendezvousServer
    except ImportError as e:
        raise RuntimeError(
            f"{_PROG} --horovod needs Horovod in this Python environment "
            "(build it with `bash scripts/horovod-env.sh`, then use "
            ".venv-hvd/bin/keras-smp).") from e
    plan = get_host_assignments(parse_hosts(f"localhost:{num_workers}"), num_workers)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    common = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
    }
    envs = []
    for slot in plan:
        env = dict(common)
        env.update({k: str(v) for k, v in create_slot_env_vars(slot).items()})
        env["HOROVOD_HOSTNAME"] = "localhost"
        envs.append(env)
    return server, envs


def _die_with_parent():  # pragma: no cover (runs in the forked child)
    """Linux: the worker gets SIGKILL when its launcher dies, so a killed
    launcher never leaves workers that hold the job's ports."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


class _Launcher:
    def __init__(self, command, num_workers, host_map, grace_seconds, timeout, prefix,
                 horovod=False, max_restarts=0, restart_delay=1.0, nodes=None):
        self.horovod = horovod
        self.hvd_server = None  # Horovod's Gloo rendezvous (one node)
        self.server = None  # keras-smp's rendezvous (node 0 of several)
        self.command = list(command)
        self.num_workers = num_workers
        self.host_map = host_map
        self.grace_seconds = grace_seconds
        self.timeout = timeout
        self.prefix = prefix
        self.max_restarts = max_restarts
        self.restart_delay = restart_delay
        # Several nodes: dict(nnodes, node_rank, master, rendezvous_timeout,
        # node_addr); None: this machine is the whole job.
        self.nodes = nodes
        self.procs: list[subprocess.Popen] = []
        self.readers: list[list[threading.Thread]] = []
        self.signals: list[int] = []
        self.out = _Output(sys.stdout)
        self.deadline = None
        self._own = None  # this launcher's own stop decision, once made
        self.failure_dir = None  # the workers' failure records (this round)

    # -- signal handling --------------------------------------------------

    def _on_signal(self, signum, frame):
        self.signals.append(signum)

    def _install_handlers(self):
        old = {}
        if threading.current_thread() is not threading.main_thread():
            return old
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                old[signum] = signal.signal(signum, self._on_signal)
            except (ValueError, OSError):
                pass
        return old

    @staticmethod
    def _restore_handlers(old):
        for signum, handler in old.items():
            try:
                signal.signal(signum, handler)
            except (ValueError, OSError, TypeError):
                pass

    def _interrupted(self):
        """This launcher's own stop decision (signal, timeout), or None;
        always the same object once made (`self._own`)."""
        if self._own is None and self.signals:
            signum = self.signals[0]
            self._own = rendezvous.Decision(
                "stop", code=128 + signum,
                cause=f"received {_signal_name(signum)}")
        if (self._own is None and self.deadline is not None
                and time.monotonic() >= self.deadline):
            self._own = rendezvous.Decision(
                "stop", code=EXIT_TIMEOUT,
                cause=f"timeout of {self.timeout:g}s expired")
        return self._own

    # -- lifecycle --------------------------------------------------------

    def _coordination(self):
        if self.nodes is None:
            return rendezvous.LocalCoordination(self.num_workers, self.max_restarts)
        nodes = self.nodes
        if nodes["node_rank"] == 0:
            host, port = rendezvous.parse_master(nodes["master"])
            self.server = rendezvous.RendezvousServer(
                host, port, nodes["nnodes"], self.max_restarts,
                nodes["rendezvous_timeout"])
        return rendezvous.NodeClient(
            nodes["master"], nodes["node_rank"], nodes["nnodes"], self.num_workers,
            nodes["rendezvous_timeout"], nodes.get("node_addr"))

    def _failure_file(self, rank):
        if self.failure_dir is None:
            self.failure_dir = tempfile.mkdtemp(prefix="keras-smp-launch-")
        return os.path.join(self.failure_dir, f"failure-rank{rank}")

    def _failure_cause(self):
        """`(cause, code)` of the job's failure, some worker having failed.

        Named, in this order: the worker whose own error came first (its
        `record_failure`; its process may not have ended yet: keras-smp
        reports a failure to every rank, which stops the others at once);
        a failed worker without a record (killed by a signal, or failed
        before keras-smp's exit hooks); a worker stopped by another's
        failure or lost peer (its record says which). `code`: the named
        worker's exit status (it is given `grace_seconds` to end), else (it
        is still running) the first failed worker's.
        """
        codes = {p: p.poll() for p in self.procs}
        failed = [p for p in self.procs if codes[p] not in (None, 0)]
        records = {}
        for p in self.procs:
            record = read_failure(self._failure_file(p.rank))
            if record is not None:
                records[p] = record
        own = sorted((r.get("time", 0), p.rank, p) for p, r in records.items()
                     if r.get("stopped_by") is None and not r.get("lost"))
        unrecorded = [p for p in failed if p not in records]
        named = own[0][2] if own else (unrecorded or failed)[0]
        # Failing (its record is written first), not ended yet: its own
        # exit status and last lines, if it ends within the grace time (a
        # signal to this launcher ends the wait).
        deadline = time.monotonic() + self.grace_seconds
        while (codes[named] is None and not self.signals
               and time.monotonic() < deadline):
            time.sleep(_POLL_INTERVAL)
            codes[named] = named.poll()
        code = codes[named] if codes[named] is not None else codes[failed[0]]
        record = records.get(named)
        if own and named is own[0][2]:
            return (f"worker {named.rank} (pid {named.pid}) failed: "
                    f"{record.get('error', '')}"), code
        if code < 0:
            how = f"was killed by {_signal_name(-code)}"
        else:
            how = f"exited with code {code}"
        cause = f"worker {named.rank} (pid {named.pid}) {how}"
        if record is not None and record.get("stopped_by") is not None:
            cause += (f", stopped by rank {record['stopped_by']}'s failure: "
                      f"{record.get('error', '')}")
        elif record is not None:
            cause += f": {record.get('error', '')}"
        return cause, code

    def _spawn(self, plan, round_) -> Optional[int]:
        self.procs, self.readers = [], []
        if self.failure_dir is not None:  # a new round: old records go
            shutil.rmtree(self.failure_dir, ignore_errors=True)
            self.failure_dir = None
        hvd_envs = [{}] * self.num_workers
        if self.horovod:
            if self.hvd_server is not None:
                self.hvd_server.stop()
            self.hvd_server, hvd_envs = horovod_rendezvous(self.num_workers)
        for i in range(self.num_workers):
            if self.signals:
                return None
            rank = plan.first_rank + i
            env = worker_env([], rank, self.host_map, workers=plan.workers)
            env.update(hvd_envs[i])
            env["SMP_RESTART_COUNT"] = str(round_)
            env[FAILURE_FILE_ENV] = self._failure_file(rank)
            if self.nodes is not None:
                env["SMP_NODE_RANK"] = str(self.nodes["node_rank"])
                env["SMP_NNODES"] = str(self.nodes["nnodes"])
            try:
                proc = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    # Two pipes: a line of one stream stays whole (merged
                    # into one pipe, TensorFlow's C++ log lines landed
                    # inside a Python `print`'s line, which unbuffered
                    # Python writes piece by piece).
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if _PRCTL is not None else None,
                )
            except OSError as e:
                _message(f"cannot start worker {rank}: {e}")
                self.teardown(signal.SIGTERM)
                return 127 if isinstance(e, FileNotFoundError) else 126
            proc.rank = rank
            self.procs.append(proc)
            readers = [threading.Thread(
                target=_pump,
                args=(pipe, f"[{rank}] " if self.prefix else "", self.out),
                name=f"keras-smp-worker-{rank}-{name}",
                daemon=True,
            ) for pipe, name in ((proc.stdout, "stdout"),
                                 (proc.stderr, "stderr"))]
            for reader in readers:
                reader.start()
            self.readers.append(readers)
        return None

    def teardown(self, signum: int = signal.SIGTERM, only_alive: bool = False) -> None:
        """Signals every worker group, waits `grace_seconds`, then SIGKILLs."""
        groups = [p.pid for p in self.procs]
        if only_alive:
            groups = [g for g in groups if _group_alive(g)]
        for pgid in groups:
            _killpg(pgid, signum)
        n_signals = len(self.signals)
        deadline = time.monotonic() + self.grace_seconds
        while groups:
            for p in self.procs:
                p.poll()  # reap exited workers so they stop counting as alive
            groups = [g for g in groups if _group_alive(g)]
            if not groups or time.monotonic() >= deadline:
                break
            if len(self.signals) > n_signals:  # second Ctrl-C: stop waiting
                break
            time.sleep(_POLL_INTERVAL)
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                _message(f"worker pid {p.pid} did not exit after SIGKILL")
        # Short wait for orphaned grandchildren to disappear after SIGKILL.
        deadline = time.monotonic() + 2.0
        while groups and time.monotonic() < deadline:
            groups = [g for g in groups if _group_alive(g)]
            if groups:
                time.sleep(_POLL_INTERVAL)
        # Reaped: never signal these process groups again (their ids may be
        # reused).
        self.procs = []

    def _join_readers(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        for pair in self.readers:
            for t in pair:
                t.join(max(0.0, deadline - time.monotonic()))

    def _supervise(self, coord):
        """Runs until this node's workers end or something decides.

        Returns `("own", decision)` for this launcher's own signal or
        timeout, `("job", decision)` for a decision of the job (the master:
        another node failed, restarts, or stops), or `("done", (code,
        cause))` for this node's workers' outcome (all succeeded: code 0).
        """
        while True:
            own = self._interrupted()
            if own is not None:
                return "own", own
            decision = coord.poll()
            if decision is not None:
                return "job", decision
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code is not None and code != 0:
                    # Let the failed worker's last lines (traceback) through first.
                    for reader in self.readers[i]:
                        reader.join(1.0)
                    cause, code = self._failure_cause()
                    others = ("; stopping the other workers"
                              if self.num_workers > 1 or self.nodes else "")
                    _message(cause + others)
                    self.teardown(signal.SIGTERM)
                    if self.nodes is not None:
                        cause = f"node {self._node()}: {cause}"
                    return "done", (_exit_code(code) or 1, cause)
            if all(code == 0 for code in codes):
                # Stop stray processes the workers left in their groups.
                self.teardown(signal.SIGTERM, only_alive=True)
                return "done", (0, "")
            time.sleep(_POLL_INTERVAL)

    def _stop_own(self, coord, round_, own) -> int:
        """This launcher's signal or --timeout: the job is told first (it
        stops every node, never restarts), then this node's workers stop."""
        where = f"node {self._node()}: " if self.nodes is not None else ""
        coord.report(round_, own.code, where + own.cause, False,
                     wait=lambda: _NOWAIT)
        _message(f"{own.cause}; stopping all workers")
        self.teardown(self.signals[0] if self.signals else signal.SIGTERM)
        return own.code

    def _job(self, coord) -> int:
        round_ = 0
        while True:
            host = "" if self.nodes is not None else "127.0.0.1"
            plan = coord.join(round_, free_ports(self.num_workers, host),
                              wait=self._interrupted)
            if plan is self._own:
                return self._stop_own(coord, round_, plan)
            decision = plan
            if plan.op == "start":
                if self.nodes is not None:
                    first = plan.first_rank
                    _message(
                        f"node {self._node()} of {self.nodes['nnodes']}: world ranks "
                        f"{first}-{first + self.num_workers - 1} of {len(plan.workers)}; "
                        f"cluster {', '.join(plan.workers)}")
                code = self._spawn(plan, round_)
                if code is not None:
                    coord.report(round_, code, f"cannot start the command on "
                                 f"node {self._node()}", False, wait=lambda: _NOWAIT)
                    return code
                kind, value = self._supervise(coord)
                if kind == "own":
                    return self._stop_own(coord, round_, value)
                if kind == "job":
                    decision = value
                    self.teardown(signal.SIGTERM)
                else:
                    code, cause = value
                    decision = coord.report(round_, code, cause, code != 0,
                                            wait=self._interrupted)
                    if decision is self._own:
                        return self._stop_own(coord, round_, decision)
            if decision.op == "restart":
                _message(f"restarting the job in {self.restart_delay:g}s "
                         f"after: {decision.cause}")
                round_ = decision.round
                time.sleep(self.restart_delay)
                continue
            if decision.code != 0 and (self.nodes is not None or self.max_restarts):
                _message(f"the job stopped: {decision.cause}")
            return decision.code

    def _node(self):
        return self.nodes["node_rank"] if self.nodes is not None else 0

    def run(self) -> int:
        old = self._install_handlers()
        coord = None
        if self.timeout is not None:
            self.deadline = time.monotonic() + self.timeout
        try:
            try:
                coord = self._coordination()
            except (OSError, ValueError) as e:
                _message(str(e))
                return 1
            return self._job(coord)
        finally:
            try:
                # Safety net for unexpected errors: never leave workers behind.
                if any(p.poll() is None for p in self.procs):
                    self.teardown(signal.SIGKILL)
                self._join_readers()
            finally:
                self._restore_handlers(old)
                if coord is not None:
                    coord.close()
                if self.hvd_server is not None:
                    self.hvd_server.stop()
                if self.server is not None:
                    self.server.close()
                if self.failure_dir is not None:
                    shutil.rmtree(self.failure_dir, ignore_errors=True)


# `wait` callback that gives up at once (a report whose answer is not needed).
_NOWAIT = rendezvous.Decision("stop", code=0, cause="not waiting")


def run(
    command: Sequence[str],
    num_workers: int,
    *,
    host_map: Optional[Sequence[str]] = None,
    grace_seconds: float = 5.0,
    timeout: Optional[float] = None,
    prefix: bool = True,
    horovod: bool = False,
    max_restarts: int = 0,
    restart_delay: float = 1.0,
    nnodes: int = 1,
    node_rank: int = 0,
    master: Optional[str] = None,
    rendezvous_timeout: float = rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT,
    node_addr: Optional[str] = None,
) -> int:
    """Runs `num_workers` local copies of `command` and supervises them.

    Worker `i` gets `TF_CONFIG` for a localhost cluster on free ports, plus
    `SMP_LAUNCHED=1` and `PYTHONUNBUFFERED=1`; it runs in its own session and
    its stdout and stderr lines (two pipes, read line by line: a line of
    one stream stays whole; lines of the two streams come in the order the
    launcher reads them) are printed to stdout as `"[i] line"`. If a worker
    fails, the launcher is interrupted or `timeout` expires, all worker
    process groups get SIGTERM (or the received signal), then SIGKILL after
    `grace_seconds`. Signal handlers are only installed from the main thread.

    Args:
        command: Program and arguments to run, e.g. `["python", "train.py"]`.
        num_workers: Number of workers, `>= 1`.
        host_map: Optional host label per worker, exported as `SMP_HOST_MAP`.
        grace_seconds: Time between SIGTERM and SIGKILL during teardown.
        timeout: Optional overall time limit in seconds.
        prefix: Whether to prefix output lines with `"[i] "`.
        horovod: Also start Horovod's Gloo rendezvous and give each worker
            its `HOROVOD_*` variables (as `horovodrun --gloo` would), for
            `horovod=True` configs; keras-smp calls `hvd.init()` itself.
        max_restarts: After a worker fails, stop the job and start it
            again (same ranks, new ports) up to this many times; workers
            see the count in `SMP_RESTART_COUNT` (0 for the first run).
        restart_delay: Seconds between stopping a failed job and
            starting it again.
        nnodes: Nodes in the job; with more than 1, run `run` (or
            `keras-smp launch`) on every node with the same `master`.
        node_rank: This node's index in `[0, nnodes)`; node 0 hosts the
            rendezvous, its workers are the first world ranks.
        master: `"ADDR:PORT"` of node 0's rendezvous (needed with
            `nnodes > 1`): an address of node 0 every node reaches, and a
            free port there.
        rendezvous_timeout: Seconds the nodes wait for each other (each
            start and restart); then the job stops, naming missing nodes.
        node_addr: The address other nodes reach this node's workers at
            (default: the address the master sees this node connect from).

    Returns:
        The exit status (see the module docstring): `0` on success.

    Example:

    >>> import sys
    >>> run([sys.executable, "-c", "print('hi')"], 2)  # doctest: +SKIP
    [0] hi
    [1] hi
    0
    """
    if not hasattr(os, "killpg"):  # pragma: no cover
        raise OSError(f"{_PROG} requires a POSIX system (os.killpg).")
    command = list(command)
    if not command:
        raise ValueError("`command` must not be empty.")
    if int(num_workers) < 1:
        raise ValueError(f"`num_workers` must be >= 1, got {num_workers}.")
    if host_map is not None and len(host_map) != num_workers:
        raise ValueError(
            f"`host_map` has {len(host_map)} entries but there are {num_workers} workers."
        )
    if grace_seconds < 0:
        raise ValueError(f"`grace_seconds` must be >= 0, got {grace_seconds}.")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"`timeout` must be > 0, got {timeout}.")
    if int(max_restarts) < 0:
        raise ValueError(f"`max_restarts` must be >= 0, got {max_restarts}.")
    if restart_delay < 0:
        raise ValueError(f"`restart_delay` must be >= 0, got {restart_delay}.")
    nodes = None
    if int(nnodes) < 1 or not 0 <= int(node_rank) < int(nnodes):
        raise ValueError(
            f"`node_rank` must be in [0, nnodes) with nnodes >= 1; got "
            f"node_rank={node_rank}, nnodes={nnodes}.")
    if int(nnodes) > 1 or master is not None:
        if master is None:
            raise ValueError(
                f"nnodes={nnodes} needs `master`: node 0's rendezvous "
                "address and a free port there, e.g. master='10.0.0.1:29400', "
                "the same on every node.")
        rendezvous.parse_master(master)
        if horovod:
            raise ValueError(
                "horovod=True starts Horovod's rendezvous for one node only; "
                "across nodes start the workers with `horovodrun` (or your "
                "scheduler) and give them TF_CONFIG (docs/multi-host.md).")
        if host_map is not None:
            raise ValueError(
                "`host_map` emulates hosts on one machine; with several "
                "nodes each node is a host already. Remove host_map.")
        if rendezvous_timeout <= 0:
            raise ValueError(
                f"`rendezvous_timeout` must be > 0, got {rendezvous_timeout}.")
        nodes = dict(nnodes=int(nnodes), node_rank=int(node_rank), master=master,
                     rendezvous_timeout=float(rendezvous_timeout),
                     node_addr=node_addr)
    launcher = _Launcher(command, int(num_workers), host_map, grace_seconds, timeout, prefix,
                         horovod=horovod, max_restarts=int(max_restarts),
                         restart_delay=float(restart_delay), nodes=nodes)
    return launcher.run()


# ---------------------------------------------------------------------------
# Command line.


def _int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        usage=f"{_PROG} -n N [options] -- CMD [ARGS...]",
        description=(
            "Start N local workers running CMD, each with TF_CONFIG for the job's "
            "cluster (this machine, or H nodes meeting at --master), stop all of "
            "them if one fails, and restart the job up to --max-restarts times."
        ),
    )
    parser.add_argument(
        "-n", "--num-workers", type=_positive_int, required=True, metavar="N",
        help="number of worker processes (>= 1)",
    )
    parser.add_argument(
        "--host-map", metavar="H0,H1,...",
        help="comma-separated host label per worker, exported as SMP_HOST_MAP "
        "(must have N entries)",
    )
    parser.add_argument(
        "--grace-seconds", type=_non_negative_float, default=5.0, metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers (default: 5)",
    )
    parser.add_argument(
        "--timeout", type=_positive_float, default=None, metavar="S",
        help=f"overall time limit; on expiry stop all workers and exit {EXIT_TIMEOUT}",
    )
    parser.add_argument(
        "--horovod", action="store_true",
        help="also start Horovod's Gloo rendezvous (like horovodrun --gloo) "
        "for scripts with horovod=True; needs Horovod installed",
    )
    parser.add_argument(
        "--no-prefix", action="store_true",
        help='do not prefix output lines with "[i] "',
    )
    parser.add_argument(
        "--max-restarts", type=_non_negative_int, default=0, metavar="K",
        help="after a worker fails, stop the job and start it again, at most K "
        "times (workers see SMP_RESTART_COUNT; default: 0)",
    )
    parser.add_argument(
        "--restart-delay", type=_non_negative_float, default=1.0, metavar="S",
        help="seconds between stopping a failed job and restarting it (default: 1)",
    )
    parser.add_argument(
        "--nnodes", type=_positive_int, default=1, metavar="H",
        help="nodes in the job: run the same command on each (default: 1)",
    )
    parser.add_argument(
        "--node-rank", type=_non_negative_int, default=0, metavar="R",
        help="this node's index in [0, H); node 0 hosts the rendezvous",
    )
    parser.add_argument(
        "--master", metavar="ADDR:PORT",
        help="node 0's address (reachable from every node) and a free port "
        "there for the rendezvous; required with --nnodes > 1",
    )
    parser.add_argument(
        "--node-addr", metavar="ADDR",
        help="address other nodes reach this node's workers at (default: the "
        "address the master sees this node connect from)",
    )
    parser.add_argument(
        "--rendezvous-timeout", type=_positive_float,
        default=rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT, metavar="S",
        help="seconds the nodes wait for each other at each (re)start "
        f"(default: {rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT:g})",
    )
    return parser


def _parse(argv: list[str]):
    parser = _build_parser()
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
        args = parser.parse_args(options)
    else:
        args, extra = parser.parse_known_args(argv)
        if extra:
            parser.error(
                f"unexpected arguments {' '.join(extra)!r}: the worker command must "
                f"follow '--', e.g. {_PROG} -n 2 -- python train.py"
            )
        command = []
    if not command:
        parser.error(f"missing command after '--', e.g. {_PROG} -n 2 -- python train.py")
    host_map = None
    if args.host_map is not None:
        host_map = [h.strip() for h in args.host_map.split(",")]
        if any(not h for h in host_map):
            parser.error(f"--host-map has an empty entry: {args.host_map!r}")
        if len(host_map) != args.num_workers:
            parser.error(
                f"--host-map has {len(host_map)} entries but -n is {args.num_workers}"
            )
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be < --nnodes {args.nnodes}")
    if args.nnodes > 1 or args.master is not None:
        if args.master is None:
            parser.error(
                f"--nnodes {args.nnodes} needs --master ADDR:PORT (node 0's address "
                "and a free port there, the same on every node)")
        try:
            rendezvous.parse_master(args.master)
        except ValueError as e:
            parser.error(str(e))
        if args.horovod:
            parser.error(
                "--horovod starts Horovod's rendezvous for one node only; across "
                "nodes use horovodrun (docs/multi-host.md)")
        if host_map is not None:
            parser.error("--host-map emulates hosts on one machine; with --nnodes "
                         "each node is a host. Remove --host-map")
    return args, command, host_map


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `keras-smp launch` and `python -m keras_smp.launch`.

    Args:
        argv: Command-line arguments without the program name, with or
            without a leading `"launch"` subcommand; defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status: `0` on success, `2` for invalid arguments, otherwise
        as described in the module docstring.

    Example:

    >>> main(["launch", "-n", "2", "--", "python", "-c", "print(1)"])  # doctest: +SKIP
    [0] 1
    [1] 1
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        argv = argv[1:]
    try:
        args, command, host_map = _parse(argv)
    except SystemExit as e:  # argparse: usage error (2) or --help (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return run(
        command,
        args.num_workers,
        host_map=host_map,
        grace_seconds=args.grace_seconds,
        timeout=args.timeout,
        prefix=not args.no_prefix,
        horovod=args.horovod,
        max_restarts=args.max_restarts,
        restart_delay=args.restart_delay,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master=args.master,
        rendezvous_timeout=args.rendezvous_timeout,
        node_addr=args.node_addr,
    )


if __name__ == "__main__":
    sys.exit(main())
