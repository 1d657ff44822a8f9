"""A fork server for the suite's worker processes (test infrastructure).

Importing TensorFlow and Keras costs a worker process about 7 s of CPU on
the 2-core machines this suite runs on (`python -X importtime`: the shared
libraries' loading and TensorFlow's op registration), and the suite starts
hundreds of workers: on short multi-process tests that import is most of
the test's time. This server imports them once, then forks a worker for
each request: a forked worker is a real, separate process (its own address
space, its own TensorFlow runtime and collectives over gRPC), started in
milliseconds.

`tests/fork_python.py` is the client: `conftest.run_python` and
`conftest.launch` run it in place of `python`, so the launcher starts it
as the worker command. It passes its arguments, environment, working
directory and standard streams (as file descriptors) to the server, which
forks; the client then relays signals to the worker and exits as the
worker did (its code, or the same signal), so the launcher and the tests
see what a `python` worker would do. When the client dies (SIGKILL), the
server kills its worker.

What a fork keeps from the server, and how that is handled:

- The interpreter's start-up settings: a request whose environment differs
  from the server's in anything read at start-up or at TensorFlow's import
  (`PYTHON*` but `PYTHONUNBUFFERED`/`PYTHONFAULTHANDLER`, which the child
  applies; `TF_*` but `TF_CONFIG`; `XLA_*`, `KERAS_BACKEND`, `KERAS_HOME`,
  `OMP_*`, `MKL_*`, `CUDA_*`, `LD_*`, `MALLOC_*`) is not forked: the client
  runs `python` itself (`exec`, the same pid). So do other forms than
  `python SCRIPT ...` and `python -c CODE ...` (`-m`, interpreter options).
- The hash seed: each pytest process starts two servers (each its own
  random seed) and the client picks one by its rank's parity
  (`TF_CONFIG`'s task index), so ranks 0 and 1 of a job never share a
  string-hash order, as two fresh interpreters would not: code iterating a
  set in a rank-dependent order still fails here.
- Random state: Python's `random` reseeds itself in a fork; NumPy's global
  generator is reseeded here.
- `keras_smp` itself is not imported by the server: every worker imports
  it fresh, with its own environment.

`KERAS_SMP_TEST_FORK=0` turns the server off (every worker a fresh
`python`); tests that measure a process's memory pass `fork=False`.
"""

import json
import os
import selectors
import signal
import socket
import sys

from fork_python import encode
from fork_python import read_message

# Environment variables a fork cannot honour (read when the interpreter
# starts or TensorFlow is imported): a request that differs from the
# server in one runs in a fresh interpreter.
STARTUP_PREFIXES = ("PYTHON", "TF_", "XLA_", "KERAS_BACKEND", "KERAS_HOME",
                    "OMP_", "MKL_", "CUDA_", "LD_", "MALLOC_", "OPENBLAS_")
# ... except these, which a fork applies itself or nothing reads early.
APPLIED = {"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "TF_CONFIG",
           "OPENBLAS_NUM_THREADS"}

def startup_env(env):
    return {k: v for k, v in env.items()
            if k.startswith(STARTUP_PREFIXES) and k not in APPLIED}


def send_message(conn, message):
    conn.sendall(encode(message))


def why_not_fork(request, own_env):
    """None when the request can run in a fork of this server, else why."""
    argv = request["argv"]
    if not argv or not (argv[0] == "-c" and len(argv) > 1
                        or not argv[0].startswith("-")):
        return f"interpreter options {argv[:1]}"
    if startup_env(request["env"]) != startup_env(own_env):
        keys = sorted(set(startup_env(request["env"]).items())
                      ^ set(startup_env(own_env).items()))
        return f"start-up environment differs: {sorted({k for k, _ in keys})}"
    return None


def serve(path):
    import numpy  # noqa: F401 - what every worker imports
    import tensorflow  # noqa: F401
    import keras  # noqa: F401

    parent = os.getppid()
    own_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients connect once it is listening
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    workers = {}  # pid -> the client's connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while os.getppid() == parent:
            for key, _ in selector.select(timeout=0.05):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    child = start(conn, own_env, listener, selector, workers)
                    if child is not None:  # in the forked worker: run it
                        return child
                    continue
                conn = key.fileobj  # a client that went away: kill its worker
                pid = next(p for p, c in workers.items() if c is conn)
                try:
                    if conn.recv(1):
                        continue
                except OSError:
                    pass
                _kill(pid)
                selector.unregister(conn)
            reap(workers, selector)
    finally:
        if os.getpid() == SERVER_PID:
            for pid in workers:
                _kill(pid)
            try:
                os.unlink(path)
            except OSError:
                pass
    return None


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap(workers, selector):
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is None:
            continue
        if os.WIFSIGNALED(status):
            result = {"signal": os.WTERMSIG(status)}
        else:
            result = {"exit": os.WEXITSTATUS(status)}
        try:
            send_message(conn, result)
        except OSError:
            pass
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def start(conn, own_env, listener, selector, workers):
    """Forks a worker for the request on `conn`; returns the request in the
    worker, None in the server."""
    conn.settimeout(30)
    try:
        first, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        request = read_message(conn, first)
        if request is None:
            raise EOFError("the client went away")
    except (OSError, EOFError, ValueError) as e:
        conn.close()
        print(f"forkserver: bad request: {e}", file=sys.stderr)
        return None
    reason = why_not_fork(request, own_env) if len(fds) == 3 else "no fds"
    if reason is not None:  # logged: the server's log says what ran fresh
        print(f"forkserver: fresh interpreter for {request['argv'][:2]}: "
              f"{reason}", file=sys.stderr, flush=True)
        send_message(conn, {"fallback": reason})
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        selector.close()
        listener.close()
        for other in workers.values():
            other.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    send_message(conn, {"pid": pid})
    conn.settimeout(None)
    workers[pid] = conn
    selector.register(conn, selectors.EVENT_READ)
    return None


def run_worker(request):
    """In the forked worker: become `python ARGV` and run it."""
    import io
    import runpy
    import types

    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setpgid(0, 0)  # its own process group, as the launcher gives one
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile

    tempfile.tempdir = None  # TMPDIR as the request's environment says
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = raw if unbuffered else io.BufferedWriter(raw)
        setattr(sys, name, io.TextIOWrapper(
            stream, write_through=unbuffered,
            line_buffering=name == "stderr" and not unbuffered))
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = (
        sys.stdout, sys.stderr, sys.stdin)
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # as `python` reports it: from the script on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (
                __file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)


SERVER_PID = os.getpid()

if __name__ == "__main__":
    _request = serve(sys.argv[1])
    if _request is not None:
        run_worker(_request)
