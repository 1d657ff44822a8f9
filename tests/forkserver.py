"""A fork server for the suite's worker processes (test infrastructure).

Importing TensorFlow and Keras costs a worker process 4-8 s of CPU on the
2-core machines this suite runs on (`python -X importtime`: 4.5 s, mostly
the shared libraries' loading and TensorFlow's op registration; 6.8 s
wall for `import keras_smp, tensorflow, keras` on an Intel Xeon), and the
suite starts hundreds of workers: on short multi-process tests that
import is most of the test's time. This server imports them once, then
forks a worker for each request: a forked worker is a real, separate
process (its own address space, its own TensorFlow runtime and
collectives over gRPC), started in milliseconds.

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
  from the server's in anything read at start-up or at the imports
  (`STARTUP_PREFIXES`: `PYTHON*` but `PYTHONUNBUFFERED` and
  `PYTHONFAULTHANDLER`, which the worker applies; `TF_*` but `TF_CONFIG`;
  `KERAS_*` but `KERAS_SMP_*`; `XLA_*`, `NPY_*`, `HOME`, `OMP_*`, ...) is
  not forked: the client runs `python` itself (`exec`, the same pid). So
  do other forms than `python SCRIPT ...` and `python -c CODE ...` (`-m`,
  interpreter options, a missing script). OpenBLAS runs 1 thread in every
  worker (the server's setting: a server with BLAS threads could not fork
  safely). A script that sets a TensorFlow variable itself before its
  `import tensorflow` gets it only where TensorFlow reads it later
  (`TF_DETERMINISTIC_OPS`: checked by tests/test_forkserver.py).
- Processes: each worker leads its own process group, to which the client
  relays signals and which the server SIGKILLs when the client goes away;
  the worker itself (not its children) dies with the server
  (PR_SET_PDEATHSIG).
- The hash seed: each pytest process starts two servers (each its own
  random seed) and the client picks one by its rank's parity
  (`TF_CONFIG`'s task index), so ranks 0 and 1 of a job never share a
  string-hash order, as two fresh interpreters would not: code iterating a
  set in a rank-dependent order still fails here. (Single-process runs,
  the `reference` fixture's included, and every even rank use the first
  server's seed.)
- Random state: Python's `random` reseeds itself in a fork; NumPy's global
  generator is reseeded here.
- `keras_smp` itself is not imported by the server: every worker imports
  it fresh, with its own environment.

`KERAS_SMP_TEST_FORK=0` turns the server off (every worker a fresh
`python`); tests that measure a process's memory pass `fork=False`.
"""

import ctypes
import os
import selectors
import signal
import socket
import sys

# RELAYED: blocked while the server forks (a worker never runs the server's
# handlers).
from fork_python import RELAYED
from fork_python import encode
from fork_python import read_message

# Environment variables a fork cannot honour (read when the interpreter
# starts or TensorFlow, Keras or NumPy is imported): a request that differs
# from the server in one runs in a fresh interpreter.
STARTUP_PREFIXES = ("PYTHON", "TF_", "XLA_", "KERAS_", "NPY_", "OMP_", "MKL_",
                    "CUDA_", "LD_", "MALLOC_", "OPENBLAS_", "HOME", "LANG",
                    "LC_")
# ... except these: a fork applies the first two itself, the launcher's
# TF_CONFIG and keras-smp's own settings are read after the fork, and the
# server runs OpenBLAS on 1 thread whatever the request says (deliberately:
# a server with BLAS threads could not fork safely; it changes no result).
APPLIED = {"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "TF_CONFIG",
           "OPENBLAS_NUM_THREADS"}


def startup_env(env):
    return {k: v for k, v in env.items()
            if k.startswith(STARTUP_PREFIXES) and k not in APPLIED
            and not k.startswith("KERAS_SMP_")}


def why_not_fork(request, own):
    """None when the request can run in a fork of this server (`own`: its
    start-up environment), else why."""
    argv = request["argv"]
    if not argv or not (argv[0] == "-c" and len(argv) > 1
                        or not argv[0].startswith("-")):
        return f"interpreter options {argv[:1]}"
    if argv[0] != "-c" and not os.path.isfile(
            os.path.join(request["cwd"], argv[0])):
        return f"no script {argv[0]!r}"  # `python` says so itself
    theirs = startup_env(request["env"])
    if theirs != own:
        keys = {k for k, _ in set(theirs.items()) ^ set(own.items())}
        return f"start-up environment differs: {sorted(keys)}"
    return None


def serve(path):
    """Listens on `path` until the parent exits or SIGTERM; returns the
    request in a forked worker, None in the server."""
    own = startup_env(os.environ)  # as the imports below see it
    import numpy  # noqa: F401 - what every worker imports
    import tensorflow  # noqa: F401
    import keras  # noqa: F401

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients connect once it listens
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    workers = {}  # pid -> the client's connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while os.getppid() == parent:
            for key, _ in selector.select(timeout=0.05):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    child = start(conn, own, listener, selector, workers)
                    if child is not None:  # in the forked worker: run it
                        return child
                    continue
                conn = key.fileobj  # a client that went away: kill its worker
                try:
                    if conn.recv(1):
                        continue
                except OSError:
                    pass
                _kill(next(p for p, c in workers.items() if c is conn))
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
    """SIGKILL to a worker's process group (its own: `run_worker`)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
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
            conn.sendall(encode(result))
        except OSError:
            pass
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def start(conn, own, listener, selector, workers):
    """Forks a worker for the request on `conn`; returns the request in the
    worker, None in the server."""
    conn.settimeout(30)
    fds = []
    try:
        first, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        request = read_message(conn, first)
        if request is None:
            raise EOFError("the client went away")
    except (OSError, EOFError, ValueError) as e:
        conn.close()
        for fd in fds:
            os.close(fd)
        print(f"forkserver: bad request: {e}", file=sys.stderr, flush=True)
        return None
    reason = why_not_fork(request, own) if len(fds) == 3 else "no fds"
    if reason is not None:
        return _fresh(conn, fds, request, reason)
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    try:
        pid = os.fork()
    except OSError as e:  # (out of memory, of processes): a fresh one
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
        return _fresh(conn, fds, request, f"fork failed: {e}")
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
    try:
        os.setpgid(pid, pid)  # (the worker does too: whichever runs first)
    except OSError:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    for fd in fds:
        os.close(fd)
    workers[pid] = conn
    selector.register(conn, selectors.EVENT_READ)
    conn.settimeout(None)
    try:
        conn.sendall(encode({"pid": pid}))
    except OSError:  # the client is gone already: so is its worker
        _kill(pid)
    return None


def _fresh(conn, fds, request, reason):
    """Tells the client to run `python` itself; logged (the server's log
    says what ran fresh and why). Returns None (no worker)."""
    print(f"forkserver: fresh interpreter for {request['argv'][:2]}: "
          f"{reason}", file=sys.stderr, flush=True)
    try:
        conn.sendall(encode({"fallback": reason}))
    except OSError:
        pass
    conn.close()
    for fd in fds:
        os.close(fd)
    return None


def run_worker(request):
    """In the forked worker: become `python ARGV` and run it."""
    import io
    import tempfile
    import types

    try:  # the worker dies with the server (as with its client: `serve`)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != SERVER_PID:  # the server died before the prctl
        os._exit(1)
    try:
        os.setpgid(0, 0)  # its own process group, as the launcher gives one
    except OSError:
        pass
    for signum in RELAYED + (signal.SIGCHLD,):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR as the request's environment says
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    # The encodings and error handlers `python` chose at the server's start
    # (the same locale: STARTUP_PREFIXES), on the request's descriptors.
    sys.stdin = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)),
        encoding=sys.__stdin__.encoding, errors=sys.__stdin__.errors)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = raw if unbuffered else io.BufferedWriter(raw)
        original = getattr(sys, f"__{name}__")
        setattr(sys, name, io.TextIOWrapper(
            stream, write_through=unbuffered,
            encoding=original.encoding, errors=original.errors,
            line_buffering=name == "stderr" and not unbuffered))
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = (
        sys.stdout, sys.stderr, sys.stdin)
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    sys.modules["numpy"].random.seed()  # a fresh process's own entropy
    argv = request["argv"]
    # A real `__main__` that stays in sys.modules (its globals live until
    # the interpreter's exit, after the atexit handlers, as in `python`).
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        filename, source = "<string>", argv[1]
    else:
        sys.argv = list(argv)
        filename = os.path.abspath(argv[0])
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        main.__file__ = filename
        with open(filename, "rb") as f:
            source = f.read()
    try:
        exec(compile(source, filename, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # as `python` reports it: from the script on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.last_type, sys.last_value, sys.last_traceback = (
            type(e), e.with_traceback(tb), tb)
        sys.excepthook(type(e), e, tb)
        if isinstance(e, KeyboardInterrupt):
            # Out of the top level (reported already): the interpreter
            # finalizes, then dies of SIGINT, as `python` does.
            sys.excepthook = lambda *_: None
            raise
        sys.exit(1)


SERVER_PID = os.getpid()  # (in a worker: its parent's)

if __name__ == "__main__":
    _request = serve(sys.argv[1])
    if _request is not None:
        run_worker(_request)
