"""Local multi-worker process launcher: `keras-smp launch -n N -- CMD ...`.

Starts `N` copies of a command on this machine, each with its own
`TF_CONFIG` describing a localhost `MultiWorkerMirroredStrategy`-style
cluster, prefixes their output with the worker index, and supervises them:
if one worker fails, or the launcher is interrupted, every worker (and every
process a worker started in its process group) is stopped.

Command line:

```
keras-smp launch -n 2 -- python train.py --epochs 3
python -m keras_smp.launch -n 2 --host-map a,a -- python train.py
```

Exit status: `0` when all workers succeed; the failed worker's exit code
(`128 + signal` if it was killed by a signal); `124` when `--timeout`
expires; `130` / `143` when the launcher receives SIGINT / SIGTERM; `2` for
invalid arguments; `127` / `126` when the command cannot be started.

This module uses only the standard library (it never imports TensorFlow), so
it is cheap to import from notebooks and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional, Sequence

__all__ = ["free_ports", "make_tf_config", "worker_env", "run", "main"]

_PROG = "keras-smp launch"
_POLL_INTERVAL = 0.05
EXIT_TIMEOUT = 124


def free_ports(n: int) -> list[int]:
    """Finds `n` distinct free TCP ports on the loopback interface.

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
            sock.bind(("127.0.0.1", 0))
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
    index = int(index)
    if not 0 <= index < len(ports):
        raise ValueError(f"`index` must be in [0, {len(ports)}), got {index}.")
    return json.dumps(
        {
            "cluster": {"worker": [f"{host}:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


def worker_env(
    ports: Sequence[int],
    index: int,
    host_map: Optional[Sequence[str]] = None,
    base_env: Optional[Mapping[str, str]] = None,
) -> dict[str, str]:
    """Returns the environment the launcher gives worker `index`.

    Args:
        ports: One port per worker (see `make_tf_config`).
        index: Index of the worker.
        host_map: Optional host label per worker, exported as the
            comma-separated `SMP_HOST_MAP`.
        base_env: Environment to start from; defaults to `os.environ`.

    Returns:
        A new dict with `TF_CONFIG`, `SMP_LAUNCHED=1`, `PYTHONUNBUFFERED=1`
        and (if given) `SMP_HOST_MAP` set on top of `base_env`.

    Example:

    >>> env = worker_env([1111, 2222], 0, base_env={})
    >>> env["SMP_LAUNCHED"]
    '1'
    """
    env = dict(os.environ if base_env is None else base_env)
    env["TF_CONFIG"] = make_tf_config(ports, index)
    env["SMP_LAUNCHED"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if host_map is not None:
        host_map = list(host_map)
        if len(host_map) != len(ports):
            raise ValueError(
                f"`host_map` has {len(host_map)} entries but there are "
                f"{len(ports)} workers."
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


class _Launcher:
    def __init__(self, command, num_workers, host_map, grace_seconds, timeout, prefix,
                 horovod=False):
        self.horovod = horovod
        self.rendezvous = None
        self.command = list(command)
        self.num_workers = num_workers
        self.host_map = host_map
        self.grace_seconds = grace_seconds
        self.timeout = timeout
        self.prefix = prefix
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.signals: list[int] = []
        self.out = _Output(sys.stdout)

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

    # -- lifecycle --------------------------------------------------------

    def _spawn(self) -> Optional[int]:
        ports = free_ports(self.num_workers)
        hvd_envs = [{}] * self.num_workers
        if self.horovod:
            self.rendezvous, hvd_envs = horovod_rendezvous(self.num_workers)
        for i in range(self.num_workers):
            if self.signals:
                return None
            env = worker_env(ports, i, self.host_map)
            env.update(hvd_envs[i])
            try:
                proc = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            except OSError as e:
                _message(f"cannot start worker {i}: {e}")
                self.teardown(signal.SIGTERM)
                return 127 if isinstance(e, FileNotFoundError) else 126
            self.procs.append(proc)
            reader = threading.Thread(
                target=_pump,
                args=(proc.stdout, f"[{i}] " if self.prefix else "", self.out),
                name=f"keras-smp-worker-{i}-output",
                daemon=True,
            )
            reader.start()
            self.readers.append(reader)
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

    def _join_readers(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def _supervise(self) -> int:
        start = time.monotonic()
        while True:
            if self.signals:
                signum = self.signals[0]
                _message(f"received {_signal_name(signum)}; stopping all workers")
                self.teardown(signum)
                return 128 + signum
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code is not None and code != 0:
                    proc = self.procs[i]
                    # Let the failed worker's last lines (traceback) through first.
                    self.readers[i].join(1.0)
                    if code < 0:
                        how = f"was killed by {_signal_name(-code)}"
                    else:
                        how = f"exited with code {code}"
                    others = "; stopping the other workers" if self.num_workers > 1 else ""
                    _message(f"worker {i} (pid {proc.pid}) {how}{others}")
                    self.teardown(signal.SIGTERM)
                    return _exit_code(code) or 1
            if all(code == 0 for code in codes):
                # Stop stray processes the workers left in their groups.
                self.teardown(signal.SIGTERM, only_alive=True)
                return 0
            if self.timeout is not None and time.monotonic() - start >= self.timeout:
                _message(f"timeout of {self.timeout:g}s expired; stopping all workers")
                self.teardown(signal.SIGTERM)
                return EXIT_TIMEOUT
            time.sleep(_POLL_INTERVAL)

    def run(self) -> int:
        old = self._install_handlers()
        try:
            code = self._spawn()
            if code is None:
                code = self._supervise()
            return code
        finally:
            try:
                # Safety net for unexpected errors: never leave workers behind.
                if any(p.poll() is None for p in self.procs):
                    self.teardown(signal.SIGKILL)
                self._join_readers()
            finally:
                self._restore_handlers(old)
                if self.rendezvous is not None:
                    self.rendezvous.stop()


def run(
    command: Sequence[str],
    num_workers: int,
    *,
    host_map: Optional[Sequence[str]] = None,
    grace_seconds: float = 5.0,
    timeout: Optional[float] = None,
    prefix: bool = True,
    horovod: bool = False,
) -> int:
    """Runs `num_workers` local copies of `command` and supervises them.

    Worker `i` gets `TF_CONFIG` for a localhost cluster on free ports, plus
    `SMP_LAUNCHED=1` and `PYTHONUNBUFFERED=1`; it runs in its own session and
    its merged stdout/stderr lines are printed as `"[i] line"`. If a worker
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
    launcher = _Launcher(command, int(num_workers), host_map, grace_seconds, timeout, prefix,
                         horovod=horovod)
    return launcher.run()


# ---------------------------------------------------------------------------
# Command line.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
            "Start N local workers running CMD, each with TF_CONFIG for a "
            "localhost cluster, and stop all of them if one fails."
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
    )


if __name__ == "__main__":
    sys.exit(main())
