"""Tests for `keras_smp.launch` with real (tiny, TensorFlow-free) processes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_smp import launch

ROOT = Path(__file__).resolve().parents[1]

# Launcher invocation forms: `python -m keras_smp.launch ...` and `main()`
# called with the `launch` subcommand, as the console script does.
MAIN_SNIPPET = "import sys; from keras_smp.launch import main; sys.exit(main(sys.argv[1:]))"


def _launcher(form, *args):
    if form == "module":
        return [sys.executable, "-m", "keras_smp.launch", *args]
    assert form == "main"
    return [sys.executable, "-c", MAIN_SNIPPET, "launch", *args]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(form, *args, timeout=60, **env):
    return subprocess.run(
        _launcher(form, *args),
        cwd=ROOT,
        env=_env(**env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )


def _worker(code):
    return [sys.executable, "-c", code]


def _pid_gone(pid):
    """True if `pid` no longer exists (a not-yet-reaped zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # Orphans are reaped by init, which may lag; zombies are dead.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _wait_gone(pid, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not _pid_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_for_files(paths, timeout=30.0, proc=None):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"launcher exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {paths}")
        time.sleep(0.05)


def _kill_pids_from(paths):
    """Best-effort cleanup so a failing test never leaves sleepers behind."""
    for path in paths:
        try:
            pids = [int(x) for x in path.read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            if not _pid_gone(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


# Each worker writes its pid (and optionally a grandchild's) atomically into
# $WORK_DIR/pid<i>, then behaves according to $MODE.
SLEEPER = r"""
import json, os, subprocess, sys, time, signal
i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
d = os.environ["WORK_DIR"]
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.getpid()]
if os.environ.get("GRANDCHILD"):
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
tmp = os.path.join(d, f"pid{i}.tmp")
with open(tmp, "w") as f:
    f.write(" ".join(map(str, pids)))
os.replace(tmp, os.path.join(d, f"pid{i}"))
print("ready", flush=True)
time.sleep(600)
"""

FAIL_WORKER_0 = r"""
import json, os, time
i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
d = os.environ["WORK_DIR"]
if i == 0:
    deadline = time.time() + 20
    while not os.path.exists(os.path.join(d, "pid1")) and time.time() < deadline:
        time.sleep(0.05)
    raise RuntimeError("worker zero failed on purpose")
exec(os.environ["SLEEPER"])
"""


# --------------------------------------------------------------------------
# Pure helpers.


def test_free_ports_are_distinct_and_bindable():
    ports = launch.free_ports(4)
    assert len(ports) == 4 and len(set(ports)) == 4
    assert all(0 < p < 65536 for p in ports)
    assert launch.free_ports(0) == []
    with pytest.raises(ValueError):
        launch.free_ports(-1)


def test_make_tf_config():
    config = json.loads(launch.make_tf_config([1111, 2222], 1))
    assert config == {
        "cluster": {"worker": ["localhost:1111", "localhost:2222"]},
        "task": {"type": "worker", "index": 1},
    }
    config = json.loads(launch.make_tf_config([5], 0, host="127.0.0.1"))
    assert config["cluster"]["worker"] == ["127.0.0.1:5"]
    with pytest.raises(ValueError):
        launch.make_tf_config([1111, 2222], 2)
    with pytest.raises(ValueError):
        launch.make_tf_config([], 0)


def test_worker_env():
    env = launch.worker_env([1, 2], 1, host_map=["a", "b"], base_env={"KEEP": "x"})
    assert env["KEEP"] == "x"
    assert env["SMP_LAUNCHED"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["SMP_HOST_MAP"] == "a,b"
    assert json.loads(env["TF_CONFIG"])["task"]["index"] == 1
    with pytest.raises(ValueError):
        launch.worker_env([1, 2], 0, host_map=["a"])


# --------------------------------------------------------------------------
# Successful runs.

PRINT_CONFIG = (
    "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
    "print('index', c['task']['index']); "
    "print('cluster', json.dumps(c['cluster'])); "
    "print('env', os.environ['SMP_LAUNCHED'], os.environ['PYTHONUNBUFFERED'], "
    "os.environ.get('INHERITED'))"
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,form", [(2, "module"), (4, "main")])
def test_workers_get_tf_config_and_prefixed_output(n, form):
    result = _run(form, "-n", str(n), "--", *_worker(PRINT_CONFIG), INHERITED="yes")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 * n, result.stdout
    clusters = set()
    for i in range(n):
        mine = [l for l in lines if l.startswith(f"[{i}] ")]
        assert len(mine) == 3, result.stdout
        assert f"[{i}] index {i}" in mine
        assert f"[{i}] env 1 1 yes" in mine
        (cluster_line,) = [l for l in mine if l.startswith(f"[{i}] cluster ")]
        clusters.add(cluster_line[len(f"[{i}] cluster ") :])
    assert len(clusters) == 1  # every worker sees the same cluster
    workers = json.loads(clusters.pop())["worker"]
    assert len(workers) == n
    assert all(re.fullmatch(r"localhost:\d+", w) for w in workers)
    assert len(set(workers)) == n  # distinct ports


@pytest.mark.timeout(60)
def test_no_prefix_and_host_map():
    code = "import os; print('map=' + os.environ['SMP_HOST_MAP'])"
    result = _run("module", "-n", "2", "--no-prefix", "--host-map", "a,b", "--", *_worker(code))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["map=a,b", "map=a,b"]


def test_main_in_process(capsys):
    code = "import sys; sys.stdout.write('partial line without newline')"
    assert launch.main(["launch", "-n", "1", "--", *_worker(code)]) == 0
    assert capsys.readouterr().out == "[0] partial line without newline\n"


# --------------------------------------------------------------------------
# Failures and teardown.


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["module", "main"])
def test_failed_worker_stops_the_others(tmp_path, form):
    pid_file = tmp_path / "pid1"
    start = time.monotonic()
    try:
        result = _run(
            form, "-n", "2", "--grace-seconds", "5", "--", *_worker(FAIL_WORKER_0),
            timeout=45, WORK_DIR=tmp_path, SLEEPER=SLEEPER, GRANDCHILD=1,
        )
        elapsed = time.monotonic() - start
        assert result.returncode != 0
        assert result.returncode == 1
        assert elapsed < 30
        assert re.search(
            r"keras-smp launch: worker 0 \(pid \d+\) exited with code 1; "
            r"stopping the other workers",
            result.stderr,
        ), result.stderr
        assert "[0] RuntimeError: worker zero failed on purpose" in result.stdout
        assert "[1] ready" in result.stdout
        worker_pid, grandchild_pid = map(int, pid_file.read_text().split())
        # The launcher reaped its worker: the pid no longer exists.
        with pytest.raises(ProcessLookupError):
            os.kill(worker_pid, 0)
        # The worker's child, in the worker's process group, was killed too.
        assert _wait_gone(grandchild_pid), "grandchild survived teardown"
    finally:
        _kill_pids_from([pid_file])


@pytest.mark.timeout(60)
def test_worker_killed_by_signal():
    code = (
        "import json, os, signal, time\n"
        "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n"
    )
    result = _run("main", "-n", "2", "--grace-seconds", "2", "--", *_worker(code), timeout=45)
    assert result.returncode == 128 + signal.SIGKILL
    assert re.search(r"worker 1 \(pid \d+\) was killed by SIGKILL", result.stderr), result.stderr


@pytest.mark.timeout(60)
def test_timeout_escalates_to_sigkill(tmp_path):
    paths = [tmp_path / "pid0", tmp_path / "pid1"]
    try:
        result = _run(
            "module", "-n", "2", "--timeout", "4", "--grace-seconds", "0.5", "--",
            *_worker(SLEEPER), timeout=45, WORK_DIR=tmp_path, IGNORE_TERM=1,
        )
        assert result.returncode == 124, result.stderr
        assert "timeout of 4s expired" in result.stderr
        for path in paths:
            if path.exists():  # the worker got far enough to ignore SIGTERM
                (pid,) = map(int, path.read_text().split())
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
    finally:
        _kill_pids_from(paths)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "signum,expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)]
)
def test_signal_to_launcher_stops_workers(tmp_path, signum, expected):
    paths = [tmp_path / "pid0", tmp_path / "pid1"]
    out = (tmp_path / "out.txt").open("w")
    proc = subprocess.Popen(
        _launcher("module", "-n", "2", "--grace-seconds", "5", "--", *_worker(SLEEPER)),
        cwd=ROOT,
        env=_env(WORK_DIR=tmp_path, GRANDCHILD=1),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_files(paths, proc=proc)
        pids = [int(x) for p in paths for x in p.read_text().split()]
        start = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == expected
        assert time.monotonic() - start < 10
        for pid in pids:
            assert _wait_gone(pid), f"pid {pid} survived"
        text = (tmp_path / "out.txt").read_text()
        assert f"received {signal.Signals(signum).name}; stopping all workers" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        _kill_pids_from(paths)


# --------------------------------------------------------------------------
# Argument validation.


@pytest.mark.parametrize(
    "args,message",
    [
        (["-n", "2", "--"], "missing command after '--'"),
        (["-n", "2"], "missing command after '--'"),
        (["-n", "2", "python", "x.py"], "must follow '--'"),
        (["-n", "0", "--", "true"], "must be >= 1"),
        (["-n", "-3", "--", "true"], "must be >= 1"),
        (["-n", "two", "--", "true"], "invalid integer"),
        (["--", "true"], "-n/--num-workers"),
        (["-n", "2", "--host-map", "a,b,c", "--", "true"], "--host-map has 3 entries but -n is 2"),
        (["-n", "2", "--host-map", "a,", "--", "true"], "empty entry"),
        (["-n", "1", "--timeout", "0", "--", "true"], "must be > 0"),
        (["-n", "1", "--grace-seconds", "-1", "--", "true"], "must be >= 0"),
    ],
)
def test_bad_arguments_in_process(capsys, args, message):
    assert launch.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "form,args,message",
    [
        ("module", ["-n", "0", "--", "true"], "must be >= 1"),
        ("main", ["-n", "2", "--"], "missing command after '--'"),
        ("module", ["-n", "2", "--host-map", "a", "--", "true"], "--host-map has 1 entries"),
    ],
)
def test_bad_arguments_exit_2(form, args, message):
    result = _run(form, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "usage: keras-smp launch" in result.stderr


@pytest.mark.timeout(60)
def test_missing_executable():
    result = _run("module", "-n", "2", "--", "/nonexistent/keras-smp-no-such-program")
    assert result.returncode == 127
    assert "cannot start worker 0" in result.stderr
