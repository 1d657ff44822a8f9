"""Multi-node rendezvous and restart decisions for `keras-smp launch`.

Standard library only (no TensorFlow): the launcher imports it.

Every node runs `keras-smp launch --nnodes H --node-rank R --master
ADDR:PORT -n N -- CMD`. Node 0's launcher also runs a `RendezvousServer`
on `ADDR:PORT`; every node's launcher (node 0's too) keeps one TCP
connection to it for the whole job, exchanging one JSON object per line:

- node -> master `join` (each round): its node rank, node count, worker
  count and the free ports its workers will listen on;
- master -> every node `start`, once all `H` nodes joined: the whole
  cluster (`addr:port` of every worker, node by node: node `R`'s workers
  are world ranks `sum(N of nodes < R) + i`) and this node's first rank;
- node -> master `exit`: its workers all succeeded, or one failed (its
  exit code, a cause, and whether a restart can help);
- master -> every node `restart` (a new round: every node stops its
  workers and joins again) or `stop` (the job is over, with this exit
  code). A node whose launcher disconnects stops the job; a node that
  loses the master stops its workers.

The addresses of a node's workers are the address the master sees its
connection come from (`--node-addr` overrides it). Nothing here runs over
SSH or needs a shared filesystem. TensorFlow then runs the job over its own
gRPC runtime, exactly as with a hand-written `TF_CONFIG`.

`Coordinator` holds the decisions (pure logic, no sockets): which round
the job is in, who joined, and when to restart or stop. A one-node job
without `--master` uses it directly (`LocalCoordination`).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import socket
import struct
import threading
import time
from typing import Optional

__all__ = ["Coordinator", "Decision", "LocalCoordination", "NodeClient",
           "RendezvousServer", "parse_master"]

#: How long a node waits for the others (and for the master) by default.
DEFAULT_RENDEZVOUS_TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every node does next: `op` is `"start"`, `"restart"` or
    `"stop"`; `code` the job's exit status (for `"stop"`)."""

    op: str
    round: int = 0
    code: int = 0
    cause: str = ""
    workers: tuple = ()
    first_rank: int = 0


def parse_master(text: str) -> tuple[str, int]:
    """`"host:port"` (or `"[v6]:port"`) as `(host, port)`.

    Example:

    >>> parse_master("10.0.0.1:29400")
    ('10.0.0.1', 29400)
    """
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--master must be ADDR:PORT (the address and a free port of "
            f"node 0, reachable from every node), got {text!r}; e.g. "
            f"--master 10.0.0.1:29400.")
    return host, int(port)


class Coordinator:
    """Rounds, joins and restart decisions of one job (no I/O).

    Args:
        nnodes: nodes in the job.
        max_restarts: how many times a failed job is started again.

    Every method returns the list of `(node_rank, Decision)` to send.

    Example (two nodes; node 1's worker fails once, the job restarts):

    >>> c = Coordinator(2, max_restarts=1)
    >>> c.join(0, 0, 1, "10.0.0.1", [2222])
    []
    >>> [(r, d.op, d.first_rank) for r, d in c.join(1, 0, 1, "10.0.0.2", [2222])]
    [(0, 'start', 0), (1, 'start', 1)]
    >>> [(d.op, d.round) for _, d in c.exit(1, 0, 1, "worker 1 failed", True)]
    [('restart', 1), ('restart', 1)]
    """

    def __init__(self, nnodes: int, max_restarts: int = 0):
        self.nnodes = int(nnodes)
        self.max_restarts = int(max_restarts)
        self.round = 0
        self.restarts = 0
        self.joined: dict[int, tuple[str, list[int]]] = {}
        self.exits: dict[int, int] = {}
        self.final: Optional[Decision] = None

    def _all(self, decision):
        # Node 0 last: its launcher hosts the server, and must not end
        # before every other node has the decision.
        return [(r, decision) for r in range(self.nnodes - 1, -1, -1)]

    def join(self, node_rank, round_, nproc, addr, ports, public=None):
        """`addr`: where the node's workers are reached; `public`: for node
        0's own connection, which comes from loopback when `--master`
        names node 0 itself, the address other nodes reached it at."""
        if self.final is not None:
            return [(node_rank, self.final)]
        if round_ != self.round or node_rank in self.joined or not (
                0 <= node_rank < self.nnodes) or len(ports) != nproc:
            return self.stop(1, f"node {node_rank} joined round {round_} "
                                f"out of turn (the job is in round "
                                f"{self.round})")
        self.joined[node_rank] = (addr, list(ports), public)
        if len(self.joined) < self.nnodes:
            return []
        # A node seen from loopback (node 0 reaching its own server via a
        # name that resolves to 127.0.x.x) is addressed, when other nodes
        # are not, at the address those nodes reached the master at.
        seen = [(a, pub) for a, _, pub in self.joined.values()]
        remote = [pub for a, pub in seen if not _loopback(a) and pub]
        workers, firsts = [], {}
        for r in range(self.nnodes):
            addr, ports, _ = self.joined[r]
            if _loopback(addr) and remote:
                addr = remote[0]
            firsts[r] = len(workers)
            host = f"[{addr}]" if ":" in addr else addr
            workers += [f"{host}:{p}" for p in ports]
        return [(r, Decision("start", self.round, workers=tuple(workers),
                             first_rank=firsts[r]))
                for r in range(self.nnodes)]

    def missing(self):
        """Node ranks that have not joined the current round."""
        return [r for r in range(self.nnodes) if r not in self.joined]

    def exit(self, node_rank, round_, code, cause, restartable):
        if self.final is not None:
            return [(node_rank, self.final)]
        if round_ != self.round:
            return []  # a late report of a round already restarted
        self.exits[node_rank] = code
        if code != 0:
            if restartable and self.restarts < self.max_restarts:
                self.restarts += 1
                self.round += 1
                self.joined, self.exits = {}, {}
                return self._all(Decision(
                    "restart", self.round, cause=(
                        f"{cause} (restart {self.restarts} of "
                        f"{self.max_restarts})")))
            if restartable and self.max_restarts:
                cause += (f"; no restart left ({self.max_restarts} "
                          f"used)")
            return self.stop(code, cause)
        if len(self.exits) == self.nnodes:
            return self.stop(0, "every worker succeeded")
        return []

    def stop(self, code, cause):
        if self.final is None:
            self.final = Decision("stop", self.round, code=code, cause=cause)
        return self._all(self.final)


class LocalCoordination:
    """A one-node job's coordination, in the launcher's process."""

    def __init__(self, nproc: int, max_restarts: int = 0):
        self.nproc = nproc
        self.coordinator = Coordinator(1, max_restarts)

    def join(self, round_, ports, wait=None):
        ((_, decision),) = self.coordinator.join(
            0, round_, self.nproc, "localhost", ports)
        return decision

    def report(self, round_, code, cause, restartable, wait=None):
        got = self.coordinator.exit(0, round_, code, cause, restartable)
        return got[0][1] if got else self.coordinator.final

    def poll(self):
        return None

    def close(self):
        pass


def _unmapped(addr):
    """An IPv4 address as seen by a dual-stack socket, as IPv4."""
    return addr[7:] if addr.startswith("::ffff:") else addr


def _loopback(addr):
    return addr.startswith("127.") or addr in ("::1", "localhost")


# TCP keepalive (Linux option names): a node or master that vanishes
# without closing its connection (powered off, partitioned) is noticed in
# about a minute; a blocked send gives up after _SEND_TIMEOUT seconds.
_KEEPALIVE = (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 6))
_SEND_TIMEOUT = 10


def _tune(conn):
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    try:  # a blocking socket (the reader thread waits in recv) with a
        # bounded send: SO_SNDTIMEO, struct timeval {seconds, microseconds}
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", _SEND_TIMEOUT, 0))
    except (OSError, struct.error):
        pass


def _send(conn, obj):
    conn.sendall((json.dumps(obj) + "\n").encode())


def _lines(conn):
    """The JSON objects a connection sends, until it closes."""
    buf = b""
    while True:
        try:
            chunk = conn.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                yield json.loads(line)
            except ValueError:
                return


class RendezvousServer:
    """The master's side: a `Coordinator` behind a TCP port (on node 0).

    Args:
        host, port: where to listen (`--master`'s address and port).
        nnodes, max_restarts: see `Coordinator`.
        timeout: seconds the nodes have to join each round; then the job
            stops, naming the missing nodes.
    """

    def __init__(self, host, port, nnodes, max_restarts=0,
                 timeout=DEFAULT_RENDEZVOUS_TIMEOUT):
        self.coordinator = Coordinator(nnodes, max_restarts)
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._open = 0  # connections not yet closed by their node
        self._closed = threading.Event()
        # Every interface: `host` may be a name that resolves only later
        # (a Kubernetes pod's DNS record) or to loopback on node 0 itself.
        try:
            if socket.has_dualstack_ipv6():
                self._sock = socket.create_server(
                    ("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                    backlog=64, reuse_port=False)
            else:
                self._sock = socket.create_server(("", port), backlog=64)
        except OSError as e:
            raise OSError(
                f"the rendezvous cannot listen on port {port} of node 0 "
                f"({e}); --master {host}:{port} must name a free port "
                "there.") from e
        # When the current round's joins are timed: from the start, and
        # from a restarted round's first join (not from the decision, which
        # is followed by teardown and --restart-delay).
        self._round_started = time.monotonic()
        threading.Thread(target=self._accept, daemon=True,
                         name="keras-smp-rendezvous").start()
        threading.Thread(target=self._watch, daemon=True,
                         name="keras-smp-rendezvous-timeout").start()

    def _deliver(self, decisions):
        for rank, decision in decisions:
            conn = self._conns.get(rank)
            if conn is None:
                continue
            try:
                _send(conn, dataclasses.asdict(decision))
            except OSError:
                pass
            if decision.op == "restart":
                self._round_started = None

    def _accept(self):
        while not self._closed.is_set():
            try:
                conn, (addr, *_) = self._sock.accept()
                addr = _unmapped(addr)
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr),
                             daemon=True).start()

    def _serve(self, conn, addr):
        _tune(conn)
        rank = None
        with self._lock:
            self._open += 1
        try:
            for msg in _lines(conn):
                with self._lock:
                    if msg.get("op") == "join":
                        if rank is None:
                            rank = self._admit(conn, msg)
                            if rank is None:
                                return
                        if self._round_started is None:
                            self._round_started = time.monotonic()
                        self._deliver(self.coordinator.join(
                            rank, int(msg["round"]), int(msg["nproc"]),
                            msg.get("addr") or addr, list(msg["ports"]),
                            public=_unmapped(conn.getsockname()[0])))
                    elif msg.get("op") == "exit" and rank is not None:
                        self._deliver(self.coordinator.exit(
                            rank, int(msg["round"]), int(msg["code"]),
                            str(msg.get("cause", "")),
                            bool(msg.get("restartable"))))
        except (KeyError, TypeError, ValueError):
            pass  # a malformed message: handled as a disconnect
        finally:
            with self._lock:
                self._open -= 1
                if rank is not None and self._conns.get(rank) is conn:
                    del self._conns[rank]
                    if self.coordinator.final is None:
                        self._deliver(self.coordinator.stop(
                            1, f"node {rank}'s launcher disconnected"))
            try:
                conn.close()
            except OSError:
                pass

    def _admit(self, conn, msg):
        """The node rank of a new connection's first join, or None (the
        node is told why and the job stops)."""
        c = self.coordinator
        rank = int(msg["node_rank"])
        why = None
        if msg.get("nnodes") != c.nnodes:
            why = (f"node {rank} started with --nnodes {msg.get('nnodes')}, "
                   f"node 0 with --nnodes {c.nnodes}")
        elif not 0 <= rank < c.nnodes:
            why = f"node rank {rank} is not in [0, {c.nnodes})"
        elif rank in self._conns:
            why = f"two launchers started with --node-rank {rank}"
        if why is None:
            self._conns[rank] = conn
            return rank
        decisions = c.stop(1, why)
        try:
            _send(conn, dataclasses.asdict(decisions[0][1]))
        except OSError:
            pass
        self._deliver(decisions)
        return None

    def _watch(self):
        while not self._closed.wait(0.5):
            with self._lock:
                c = self.coordinator
                if c.final is not None:
                    continue
                late = c.missing()
                started = self._round_started
                if late and started is not None and (
                        time.monotonic() - started > self.timeout):
                    self._deliver(c.stop(1, (
                        f"node(s) {late} did not join round {c.round} within "
                        f"--rendezvous-timeout {self.timeout:g}s; start "
                        "`keras-smp launch` with the same --master and "
                        "--nnodes on every node")))

    def close(self, linger=10.0):
        """Stops listening; waits (at most `linger` seconds) until every
        node has closed its connection, so that a decision already sent
        reaches every node before node 0's launcher exits."""
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline:
            with self._lock:
                if self._open == 0 or self.coordinator.final is None:
                    return
            time.sleep(0.05)


class NodeClient:
    """A node's side: joins rounds and reports its workers' outcome.

    Connects to the master (retrying until `timeout`: the master's node may
    start later). Decisions arrive on a reader thread; `poll()` returns one
    without waiting.
    """

    def __init__(self, master, node_rank, nnodes, nproc,
                 timeout=DEFAULT_RENDEZVOUS_TIMEOUT, node_addr=None):
        self.node_rank, self.nnodes, self.nproc = node_rank, nnodes, nproc
        self.node_addr = node_addr
        self.timeout = float(timeout)
        host, port = parse_master(master)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._conn = socket.create_connection((host, port), timeout=10)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"cannot reach the master launcher at {master} "
                        f"within {self.timeout:g}s ({e}); start node 0's "
                        "`keras-smp launch` with the same --master, and "
                        "check that this node can reach that address") from e
                time.sleep(0.5)
        self._conn.settimeout(None)
        _tune(self._conn)
        self._decisions: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True,
                         name="keras-smp-rendezvous-client").start()

    def _read(self):
        for msg in _lines(self._conn):
            fields = {f.name for f in dataclasses.fields(Decision)}
            msg = {k: v for k, v in msg.items() if k in fields}
            msg["workers"] = tuple(msg.get("workers", ()))
            self._decisions.put(Decision(**msg))
        self._decisions.put(Decision(
            "stop", code=1, cause="lost the connection to the master "
            "launcher (node 0)"))

    def _wait(self, wait):
        """The next decision; `wait()` is called every half second and may
        return a decision of its own (the launcher was interrupted)."""
        while True:
            try:
                return self._decisions.get(timeout=0.5)
            except queue.Empty:
                if wait is not None:
                    own = wait()
                    if own is not None:
                        return own

    def join(self, round_, ports, wait=None):
        _send_quiet(self._conn, {
            "op": "join", "node_rank": self.node_rank, "nnodes": self.nnodes,
            "round": round_, "nproc": self.nproc, "ports": list(ports),
            "addr": self.node_addr})
        return self._wait(wait)

    def report(self, round_, code, cause, restartable, wait=None):
        _send_quiet(self._conn, {"op": "exit", "round": round_, "code": code,
                                 "cause": cause, "restartable": restartable})
        return self._wait(wait)

    def poll(self):
        try:
            return self._decisions.get_nowait()
        except queue.Empty:
            return None

    def close(self):
        # shutdown first: it sends the FIN and wakes the reader thread's
        # recv (close alone does neither while that recv is blocked).
        for step in (lambda: self._conn.shutdown(socket.SHUT_RDWR),
                     self._conn.close):
            try:
                step()
            except OSError:
                pass


def _send_quiet(conn, obj):
    try:
        _send(conn, obj)
    except OSError:
        pass  # the reader thread reports the lost connection
