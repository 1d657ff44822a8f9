"""The suite's fork server (tests/forkserver.py) runs a worker as a fresh
`python` runs it: the same output, exit status, `__main__`, `sys.argv`,
`sys.path`, environment, temporary directory and exit order (atexit
before the script's globals go), tracebacks from the script on, death by
the same signal; signals to the client reach the worker; a killed client
takes its worker with it; what a fork cannot honour runs in a fresh
interpreter. The first checks run a script both ways and compare.
"""

import os
import signal
import subprocess
import time

import pytest

from conftest import FORK_SERVERS
from conftest import ROOT
from conftest import _python
from conftest import env
from conftest import run_python


@pytest.fixture(autouse=True)
def servers_listening(fork_servers):
    """Waits (at most 120 s) for this pytest process's servers to listen."""
    if not fork_servers:
        pytest.skip("KERAS_SMP_TEST_FORK=0: the fork server is off")
    deadline = time.monotonic() + 120
    while not all(os.path.exists(p) for p in FORK_SERVERS):
        assert time.monotonic() < deadline, "fork servers did not start"
        time.sleep(0.2)


SCRIPT = r"""
import atexit, os, sys, tempfile
print("forked", "tensorflow" in sys.modules)  # imported by the server only
print("argv", sys.argv)
print("main", __name__, __file__ == os.path.abspath(sys.argv[0]),
      sys.modules["__main__"].__dict__ is globals())
print("path0", sys.path[0] == os.path.dirname(os.path.realpath(sys.argv[0])))
print("cwd", os.getcwd())
print("env", os.environ.get("FORK_TEST_VALUE"))
print("tmp", tempfile.gettempdir() == os.environ["TMPDIR"])
class Last:
    def __del__(self):
        print("globals released", flush=True)
last = Last()
atexit.register(lambda: print("atexit", flush=True))
print("to stderr", file=sys.stderr)
code = sys.argv[1]
if code == "raise":
    raise ValueError("bad value")
if code == "interrupt":
    raise KeyboardInterrupt
if code == "sigkill":
    os.kill(os.getpid(), 9)
sys.exit(int(code))
"""


def _both(tmp_path, *args, **extra):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env_ = dict(dict(FORK_TEST_VALUE="v", TMPDIR=str(tmp_path),
                     PYTHONUNBUFFERED="1"), **extra)
    return [run_python([str(script), *args], timeout=60, check=False,
                       extra_env=env_, fork=fork) for fork in (True, False)]


@pytest.mark.parametrize("code,buffered", [
    ("0", False), ("0", True), ("3", False), ("raise", True),
    ("interrupt", True), ("sigkill", False)])
def test_forked_worker_runs_as_a_fresh_python(tmp_path, code, buffered):
    # buffered: without PYTHONUNBUFFERED (the launcher sets it; run_python
    # does not); "sigkill" unbuffered, or nothing would be flushed.
    forked, fresh = _both(tmp_path, code,
                          PYTHONUNBUFFERED="" if buffered else "1")
    assert forked.stdout.splitlines()[0] == "forked True", forked.stdout
    assert fresh.stdout.splitlines()[0] == "forked False", fresh.stdout
    assert forked.stdout.splitlines()[1:] == fresh.stdout.splitlines()[1:]
    expected = {"raise": 1, "interrupt": -signal.SIGINT,
                "sigkill": -signal.SIGKILL}
    assert forked.returncode == fresh.returncode == (
        expected[code] if code in expected else int(code))
    assert forked.stderr == fresh.stderr  # tracebacks from the script on
    if code in ("0", "3"):
        assert forked.stdout.splitlines()[-2:] == [
            "atexit", "globals released"]


def test_what_a_fork_cannot_honour_runs_in_a_fresh_python(tmp_path):
    # A start-up variable the server was not started with; a missing
    # script (python's own message and status).
    forked, fresh = _both(tmp_path, "0", TF_FORKSERVER_TEST_ONLY="1")
    assert forked.stdout.splitlines()[0] == "forked False", forked.stdout
    missing = [run_python([str(tmp_path / "none.py")], check=False,
                          fork=fork) for fork in (True, False)]
    assert missing[0].returncode == missing[1].returncode == 2
    assert missing[0].stderr == missing[1].stderr


def test_tensorflow_variable_set_by_the_script_takes_effect(tmp_path):
    # TF_DETERMINISTIC_OPS, which the fidelity workers set before their
    # `import tensorflow`: TensorFlow reads it at first use, after the fork.
    code = ("import os, sys\n"
            "print('forked', 'tensorflow' in sys.modules)\n"
            "os.environ['TF_DETERMINISTIC_OPS'] = '1'\n"
            "from tensorflow.python.framework import config\n"
            "print('determinism', config.is_op_determinism_enabled())\n")
    outs = [run_python(["-c", code], timeout=120, fork=fork).stdout.split()
            for fork in (True, False)]
    assert outs[0] == ["forked", "True", "determinism", "True"], outs
    assert outs[1] == ["forked", "False", "determinism", "True"], outs


SLEEPER = r"""
import os, signal, subprocess, sys, time
def on_term(*_):
    print("terminated", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, on_term)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         stdout=subprocess.DEVNULL)
print(os.getpid(), child.pid, flush=True)
time.sleep(600)
"""


def _start_sleeper():
    command, fork_env = _python(None, True, True)
    proc = subprocess.Popen(command + ["-c", SLEEPER], env=env(**fork_env),
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    worker, grandchild = map(int, proc.stdout.readline().split())
    assert worker != proc.pid  # a fork of the server, not the client
    return proc, worker, grandchild


def _gone(pid, within=10):
    """True once `pid` has exited (a zombie waiting to be reaped counts)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def test_signals_to_the_client_reach_the_worker():
    proc, worker, grandchild = _start_sleeper()
    try:
        proc.send_signal(signal.SIGTERM)  # the worker's handler: exit 7
        assert proc.wait(30) == 7
        assert proc.stdout.read().strip() == "terminated"
        assert _gone(worker)
    finally:
        proc.kill()
        for pid in (worker, grandchild):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_killed_client_takes_its_worker_and_its_children():
    proc, worker, grandchild = _start_sleeper()
    try:
        proc.kill()  # SIGKILL: nothing relayed; the server kills the group
        proc.wait(30)
        assert _gone(worker) and _gone(grandchild), (worker, grandchild)
    finally:
        for pid in (worker, grandchild):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_client_without_a_server_is_python(tmp_path):
    # No KERAS_SMP_TEST_FORKSERVER: the client execs `python` (its pid).
    command, _ = _python(None, True, True)
    proc = subprocess.Popen(
        command + ["-c", "import os, sys; print(os.getpid(), sys.argv, "
                   "'tensorflow' in sys.modules)", "x"],
        env=env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.split(" ", 1) == [str(proc.pid), "['-c', 'x'] False\n"], out
