"""Shared helpers: run TensorFlow workers in subprocesses.

TensorFlow can be initialised once per process (logical devices, collective
ops), so every test that trains runs its own Python processes; the pytest
process itself never imports TensorFlow.
"""

import fcntl
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")

# The Horovod environment (TensorFlow 2.15.1 + Horovod 0.28.1), built by
# `make test` through scripts/horovod-env.sh.
HVD_PYTHON = os.path.join(ROOT, ".venv-hvd", "bin", "python")

# Float32 fidelity bound used throughout: the same global batch summed in a
# different order differs only by rounding.
RTOL = 1e-5
# Absolute bound per unit of magnitude: `assert_same_training` scales it by
# the largest magnitude of the array compared (at least 1). An element that
# is a sum of terms of size S, reordered, is off by a few float32 ulps of S
# (eps = 1.19e-7), however small the element itself is after cancellation:
# e.g. logits of size ~6 differ by 1.3e-6 to 1.7e-6 between Intel and AMD
# CPUs (different kernels' summation orders). 1e-6 x S is ~8 ulps of S.
ATOL = 1e-6


def scaled_atol(ref, atol=ATOL):
    """`atol` scaled by the magnitude of `ref` (its max |value|, >= 1)."""
    ref = np.asarray(ref, dtype="float64")
    scale = float(np.max(np.abs(ref))) if ref.size else 1.0
    return atol * max(1.0, scale)


def hvd_env_or_skip():
    """Skips (printing why) when .venv-hvd is missing; fails under CI."""
    if os.path.exists(HVD_PYTHON):
        return
    message = ("the Horovod environment .venv-hvd is missing; `make test` "
               "builds it (bash scripts/horovod-env.sh)")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


# On workers' PYTHONPATH: a `sitecustomize` that keeps `import keras` from
# importing scikit-learn, matplotlib and IPython (about 1.1 s per process).
LEAN_IMPORTS = os.path.join(ROOT, "tests", "lean_imports")


def env(lean=True, **extra):
    """The environment of a worker process: the package importable,
    TensorFlow's logs quiet, no cluster settings from outside; `lean`:
    without Keras' optional integrations (`tests/lean_imports`)."""
    e = dict(os.environ)
    path = [LEAN_IMPORTS] if lean else []
    e["PYTHONPATH"] = os.pathsep.join(
        path + [ROOT, e.get("PYTHONPATH", "")])
    e["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # As `keras-smp launch` gives its workers (keras_smp.runtime.malloc),
    # whatever the shell says: the fork servers start with it, so the
    # launched workers' environment matches theirs and they are forked.
    e["MALLOC_ARENA_MAX"] = "1"
    for k in ("TF_CONFIG", "SMP_CONFIG", "SMP_HOST_MAP", "SLURM_PROCID"):
        e.pop(k, None)
    # (`None`: the variable is removed)
    e.update(extra)
    return {k: v for k, v in e.items() if v is not None}


# Every worker's time limit (`run_python`, `launch`) is multiplied by this:
# the limits are set from runs on the development machine (Intel Xeon), and
# CI's 2-core machines vary: a run on one took 1.35x as long overall (3619 s
# against 2688 s), a 184 s test hit its 280 s launcher limit there. A limit
# only guards against hangs, so room costs nothing unless a test hangs (the
# per-test `timeout` of setup.cfg still bounds every test).
# KERAS_SMP_TEST_TIMEOUT_SCALE overrides it.
TIMEOUT_SCALE = float(os.environ.get("KERAS_SMP_TEST_TIMEOUT_SCALE", "1.6"))
# ... but not past setup.cfg's per-test `timeout` (600 s) less 30 s, where
# the limit was below it: the launcher's own message names a stuck worker.
PER_TEST_LIMIT = 600


def _scaled(timeout):
    return max(timeout, min(timeout * TIMEOUT_SCALE, PER_TEST_LIMIT - 30))


# Workers are forked from a server that has imported TensorFlow and Keras
# (tests/forkserver.py, which says what a fork keeps and how that is
# handled): no TensorFlow import per worker (2.4 s wall idle and warm
# here, more on busy cores; the suite 45 -> 35-37 min). Only `run_python` and
# `launch` with this interpreter and `lean` use it; KERAS_SMP_TEST_FORK=0
# turns it off, `fork=False` for one call (a process whose memory a test
# measures).
FORK_CLIENT = os.path.join(ROOT, "tests", "fork_python.py")
FORK_SERVERS = []  # this pytest process's servers' socket paths


def _python(python, lean, fork):
    """(command prefix that runs `python`, environment it needs)."""
    if fork and lean and python is None and FORK_SERVERS:
        return ([sys.executable, "-S", "-E", FORK_CLIENT, sys.executable],
                {"KERAS_SMP_TEST_FORKSERVER": ",".join(FORK_SERVERS)})
    return [python or sys.executable], {}


@pytest.fixture(scope="session", autouse=True)
def fork_servers(worker_tmpdir):
    """Two fork servers per pytest process (each its own hash seed: ranks
    0 and 1 of a job use different ones); see `FORK_SERVERS`."""
    if os.environ.get("KERAS_SMP_TEST_FORK", "1") == "0":
        print("KERAS_SMP_TEST_FORK=0: every worker a fresh interpreter")
        yield []
        return
    servers = []
    for i in range(2):
        path = os.path.join(str(worker_tmpdir), f"forkserver{i}.sock")
        log = open(os.path.join(str(worker_tmpdir), f"forkserver{i}.log"),
                   "wb")
        servers.append((path, log, subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "forkserver.py"),
             path], env=env(OPENBLAS_NUM_THREADS="1"), cwd=ROOT,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)))
    # Until a server listens (its socket file exists), its clients run a
    # fresh interpreter.
    FORK_SERVERS[:] = [path for path, _, _ in servers]
    yield FORK_SERVERS
    FORK_SERVERS[:] = []
    for _, log, proc in servers:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run_python(args, timeout=240, extra_env=None, check=True, python=None,
               lean=True, fork=True):
    """Runs `python ARGS` with the package importable; returns the result
    (`lean`: see `env`; `timeout` in seconds, times `TIMEOUT_SCALE`;
    `fork`: see `FORK_CLIENT`)."""
    command, fork_env = _python(python, lean, fork)
    return _run_python(command + list(args), _scaled(timeout),
                       dict(fork_env, **(extra_env or {})), check, lean)


def _run_python(command, timeout, extra_env, check, lean):
    proc = subprocess.run(
        command, env=env(lean=lean, **extra_env),
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def launch(n, args, timeout=300, extra_env=None, check=True, launcher_args=(),
           python=None, lean=True, fork=True):
    """Runs `keras-smp launch -n N -- python ARGS` (real worker processes;
    `lean`: see `env`; `timeout` as in `run_python`: the launcher stops
    the workers 20 s before it; `fork`: see `FORK_CLIENT`)."""
    worker, fork_env = _python(python, lean, fork)
    timeout = _scaled(timeout)
    return _run_python(
        [python or sys.executable, "-m", "keras_smp.launch", "-n", str(n),
         "--timeout", str(max(10, int(timeout - 20))), *launcher_args, "--",
         *worker, *args],
        timeout, dict(fork_env, **(extra_env or {})), check, lean)


def fit_model(out, *flags):
    return [os.path.join(WORKERS, "fit_model.py"), "--out", str(out), *flags]


def load(out, rank=0):
    with np.load(os.path.join(str(out), f"rank{rank}.npz")) as f:
        return {k: f[k] for k in f.files}


def assert_same_training(got, ref, rtol=RTOL, atol=ATOL,
                         keys=("loss", "evaluate", "predict")):
    """Final weights, losses, evaluate and predict agree within float32.

    `atol` is per unit of magnitude: it is scaled by each compared array's
    largest |value| (see `scaled_atol`), so the bound holds on any x86-64
    CPU whatever the summation order of its kernels.
    """
    weights = sorted(k for k in ref if k.startswith("w"))
    assert weights and weights == sorted(k for k in got if k.startswith("w"))
    for k in weights + list(keys):
        np.testing.assert_allclose(got[k], ref[k], rtol=rtol,
                                   atol=scaled_atol(ref[k], atol), err_msg=k)


@pytest.fixture(scope="session", autouse=True)
def worker_tmpdir(tmp_path_factory):
    """Worker processes' temporary files go under pytest's own temporary
    directory (which keeps only its last 3 runs), not /tmp: a worker the
    tests kill cannot remove its scratch directories itself."""
    path = tmp_path_factory.mktemp("worker_tmp")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Single-device plain-Keras run, computed once per set of flags, for
    the whole run: pytest-xdist's workers share one cache directory (this
    run's, the parent of their temporary directories); the first to need a
    set of flags computes it while the other waits on its lock file."""
    cache = {}
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, above the workers'
    shared = base / "reference_cache"
    shared.mkdir(exist_ok=True)

    def get(*flags):
        if flags not in cache:
            key = hashlib.sha1(repr(flags).encode()).hexdigest()[:16]
            out = shared / key
            with open(shared / f"{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                done = shared / f"{key}.done"  # written once complete
                if not done.exists():
                    out.mkdir(exist_ok=True)
                    run_python(fit_model(out, "--mode", "reference", *flags))
                    done.touch()
            cache[flags] = load(out)
        return cache[flags]

    return get
