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
    assert env["PYTHONFAULTHANDLER"] == "1"
    assert launch.worker_env([1], 0, base_env={"PYTHONFAULTHANDLER": ""})[
        "PYTHONFAULTHANDLER"] == ""  # the user's setting wins
    assert env["SMP_HOST_MAP"] == "a,b"
    assert json.loads(env["TF_CONFIG"])["task"]["index"] == 1
    with pytest.raises(ValueError):
        launch.worker_env([1, 2], 0, host_map=["a"])


@pytest.mark.timeout(90)
def test_a_worker_killed_by_a_native_crash_leaves_its_python_stack():
    # A SIGSEGV inside a native call (as a crashing kernel would): the
    # worker's log shows where in Python it was (faulthandler), and the
    # launcher names the signal.
    code = ("import ctypes, os\n"
            "def crash_here():\n"
            "    ctypes.string_at(0)\n"
            "if os.environ['SMP_LAUNCHED'] and "
            "'\"index\": 1' in os.environ['TF_CONFIG']:\n"
            "    crash_here()\n")
    result = _run("module", "-n", "2", "--", *_worker(code))
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "[1] Fatal Python error: Segmentation fault" in out, out
    assert "crash_here" in out, out
    assert "worker 1 (pid" in out and "was killed by SIGSEGV" in out, out


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
def test_the_worker_that_failed_first_is_named_not_the_first_to_exit():
    # keras-smp reports a rank's error to every rank (runtime.shutdown), so
    # a peer it stopped may end before it. Worker 1 fails on its own but
    # ends 3 s later; worker 0, stopped by it, ends at once: the launcher
    # names worker 1 and its error (the workers' failure records).
    code = (
        "import json, os, sys, time\n"
        "from keras_smp.launch import record_failure\n"
        "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "if rank == 1:\n"
        "    record_failure('ValueError: bad batch')\n"
        "    time.sleep(1.5)\n"
        "    sys.exit(3)\n"
        "time.sleep(1)\n"
        "record_failure('ValueError: bad batch', stopped_by=1)\n"
        "sys.exit(1)\n"
    )
    result = _run("main", "-n", "2", "--grace-seconds", "2", "--",
                  *_worker(code), timeout=45)
    assert result.returncode == 3  # worker 1's, not worker 0's
    assert re.search(r"keras-smp launch: worker 1 \(pid \d+\) failed: "
                     r"ValueError: bad batch; stopping the other workers",
                     result.stderr), result.stderr
    # A worker stopped by another without that one's record still says so.
    stopped = code.replace("    record_failure('ValueError: bad batch')\n", "")
    result = _run("main", "-n", "2", "--grace-seconds", "2", "--",
                  *_worker(stopped), timeout=45)
    assert re.search(r"worker 0 \(pid \d+\) exited with code 1, stopped by "
                     r"rank 1's failure: ValueError: bad batch",
                     result.stderr), result.stderr
    # A worker that lost a peer is not the cause: the peer killed by a
    # signal (no record) is named.
    killed = (
        "import json, os, signal, sys, time\n"
        "from keras_smp.launch import record_failure\n"
        "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "if rank == 1:\n"
        "    time.sleep(1)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(1.5)  # notices the loss after it\n"
        "record_failure('RuntimeError: lost rank 1', lost=True)\n"
        "sys.exit(1)\n"
    )
    result = _run("main", "-n", "2", "--grace-seconds", "2", "--",
                  *_worker(killed), timeout=45)
    assert result.returncode == 128 + signal.SIGKILL
    assert re.search(r"worker 1 \(pid \d+\) was killed by SIGKILL",
                     result.stderr), result.stderr


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
        (["-n", "1", "--max-restarts", "-1", "--", "true"], "must be >= 0"),
        (["-n", "1", "--nnodes", "2", "--", "true"], "--nnodes 2 needs --master ADDR:PORT"),
        (["-n", "1", "--nnodes", "2", "--node-rank", "2", "--master", "h:1", "--", "true"],
         "--node-rank 2 must be < --nnodes 2"),
        (["-n", "1", "--nnodes", "2", "--master", "node0", "--", "true"],
         "--master must be ADDR:PORT"),
        (["-n", "1", "--nnodes", "2", "--master", "h:1", "--horovod", "--", "true"],
         "across nodes use horovodrun"),
        (["-n", "2", "--nnodes", "2", "--master", "h:1", "--host-map", "a,b", "--", "true"],
         "Remove --host-map"),
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


# --------------------------------------------------------------------------
# Restarts (--max-restarts) and several nodes (--nnodes, --master).

# Prints its rank, restart count and cluster; fails (exit 3) while the
# restart count is below FAILS if its rank is FAIL_RANK, after every worker
# of the run has printed (marker files in MARKERS, at most 20 s).
RESTART_WORKER = r"""
import json, os, sys, time
c = json.loads(os.environ["TF_CONFIG"])
rank, count = c["task"]["index"], int(os.environ["SMP_RESTART_COUNT"])
print(f"rank {rank} run {count} node {os.environ.get('SMP_NODE_RANK')} "
      f"cluster {json.dumps(c['cluster'])}", flush=True)
marks = os.environ["MARKERS"]
open(os.path.join(marks, f"{rank}-{count}"), "w").close()
if rank == int(os.environ["FAIL_RANK"]) and count < int(os.environ["FAILS"]):
    deadline = time.time() + 20
    while time.time() < deadline and not all(
            os.path.exists(os.path.join(marks, f"{r}-{count}"))
            for r in range(len(c["cluster"]["worker"]))):
        time.sleep(0.05)
    sys.exit(3)
"""


@pytest.mark.timeout(60)
def test_max_restarts_restarts_the_whole_job_after_a_failure(tmp_path):
    result = _run("module", "-n", "2", "--max-restarts", "2", "--restart-delay", "0.1",
                  "--", *_worker(RESTART_WORKER), FAIL_RANK=1, FAILS=1,
                  MARKERS=tmp_path)
    assert result.returncode == 0, result.stderr
    # Both workers ran twice: the first run (count 0) failed, the restart
    # (count 1, new ports, same ranks) succeeded.
    for rank in (0, 1):
        for count in (0, 1):
            assert f"[{rank}] rank {rank} run {count} " in result.stdout, result.stdout
    assert "run 2" not in result.stdout
    assert re.search(r"restarting the job in 0.1s after: worker 1 \(pid \d+\) exited with "
                     r"code 3 \(restart 1 of 2\)", result.stderr), result.stderr


@pytest.mark.timeout(60)
def test_max_restarts_exhausted_exits_with_the_workers_code(tmp_path):
    result = _run("module", "-n", "2", "--max-restarts", "1", "--restart-delay", "0",
                  "--", *_worker(RESTART_WORKER), FAIL_RANK=0, FAILS=5,
                  MARKERS=tmp_path)
    assert result.returncode == 3
    assert result.stderr.count("restarting the job") == 1, result.stderr
    assert "no restart left (1 used)" in result.stderr
    assert "[1] rank 1 run 1 " in result.stdout and "run 2" not in result.stdout


@pytest.mark.timeout(60)
def test_signal_to_the_launcher_is_never_restarted(tmp_path):
    # The worker and its launcher get SIGTERM together (as from a batch
    # system's time limit): exit 143, no restart, no traceback.
    code = ("import os, signal, time\n"
            "print('ready', flush=True)\n"
            "os.kill(os.getppid(), signal.SIGTERM)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n")
    result = _run("module", "-n", "1", "--max-restarts", "3", "--", *_worker(code))
    assert result.returncode == 143, result.stderr
    assert "restarting" not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout.count("ready") == 1


def _node(rank, nnodes, master, nproc, *extra, **env):
    """Starts `keras-smp launch --nnodes ... --node-rank rank` (a "node")."""
    return subprocess.Popen(
        _launcher("module", "--nnodes", str(nnodes), "--node-rank", str(rank),
                  "--master", master, "-n", str(nproc), *extra),
        cwd=ROOT, env=_env(**env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs, timeout=45):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        outs.append((p.returncode, out, err))
    return outs


@pytest.mark.timeout(90)
def test_two_nodes_build_one_cluster_and_restart_together(tmp_path):
    master = f"127.0.0.1:{launch.free_ports(1)[0]}"
    args = ("--max-restarts", "1", "--restart-delay", "0.1", "--",
            *_worker(RESTART_WORKER))
    # Node 1 starts first: it waits for the master. Rank 2 (node 1's
    # second worker) fails in the first run: both nodes restart.
    procs = [_node(1, 2, master, 2, *args, FAIL_RANK=2, FAILS=1, MARKERS=tmp_path)]
    time.sleep(0.5)
    procs.insert(0, _node(0, 2, master, 1, *args, FAIL_RANK=2, FAILS=1,
                          MARKERS=tmp_path))
    (code0, out0, err0), (code1, out1, err1) = _finish(procs)
    assert code0 == 0 and code1 == 0, (err0, err1)
    clusters = set()
    for out, node, ranks in ((out0, 0, [0]), (out1, 1, [1, 2])):
        for rank in ranks:
            for count in (0, 1):
                (line,) = [l for l in out.splitlines()
                           if l.startswith(f"[{rank}] rank {rank} run {count} node {node} ")]
                clusters.add((count, line.split(" cluster ", 1)[1]))
    # One cluster per run, seen by every worker of both nodes: node 0's
    # worker first, then node 1's two, each at its node's address.
    assert len(clusters) == 2
    for _, cluster in clusters:
        workers = json.loads(cluster)["worker"]
        assert len(workers) == 3 and len(set(workers)) == 3
        assert all(w.startswith("127.0.0.1:") for w in workers)
    for err in (err0, err1):
        assert "after: node 1: worker 2" in err and "(restart 1 of 1)" in err, err


@pytest.mark.timeout(90)
def test_killing_one_nodes_launcher_ends_the_job_on_the_other(tmp_path):
    master = f"127.0.0.1:{launch.free_ports(1)[0]}"
    pid_file = tmp_path / "pid1"
    sleeper = ("import os, time\n"
               "if os.environ['SMP_NODE_RANK'] == '1':\n"
               "    open(os.environ['PID_FILE'], 'w').write(str(os.getpid()))\n"
               "print('ready', flush=True)\n"
               "time.sleep(120)\n")
    node0 = _node(0, 2, master, 1, "--", *_worker(sleeper), PID_FILE=pid_file)
    node1 = _node(1, 2, master, 1, "--", *_worker(sleeper), PID_FILE=pid_file)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "node 1's worker never started"
            time.sleep(0.1)
        worker1 = int(pid_file.read_text())
        start = time.monotonic()
        node1.kill()  # SIGKILL: no teardown by node 1's launcher
        ((code0, out0, err0),) = _finish([node0], timeout=30)
        assert time.monotonic() - start < 10
        assert code0 == 1
        assert "the job stopped: node 1's launcher disconnected" in err0, err0
        # Node 1's worker died with its launcher (no orphan holding ports).
        assert _wait_gone(worker1), "node 1's worker outlived its launcher"
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
            p.wait()
        _kill_pids_from([pid_file])


@pytest.mark.timeout(90)
def test_a_signal_on_one_node_stops_every_node_without_restart():
    master = f"127.0.0.1:{launch.free_ports(1)[0]}"
    sleeper = "print('ready', flush=True); import time; time.sleep(120)"
    nodes = [_node(r, 2, master, 1, "--max-restarts", "2", "--", *_worker(sleeper))
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + 30
        # Both nodes' workers run (node 1's launcher printed its cluster).
        line = nodes[1].stderr.readline()
        assert "node 1 of 2: world ranks 1-1 of 2" in line, line
        assert nodes[1].stdout.readline() == "[1] ready\n"
        assert time.monotonic() < deadline
        nodes[1].send_signal(signal.SIGTERM)
        (code0, out0, err0), (code1, out1, err1) = _finish(nodes, timeout=30)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert code1 == 143 and "received SIGTERM; stopping all workers" in err1, err1
    assert code0 == 143, err0
    assert "the job stopped: node 1: received SIGTERM" in err0, err0
    assert "restarting" not in err0 + err1


@pytest.mark.timeout(60)
def test_a_node_that_never_joins_is_named_after_the_rendezvous_timeout():
    master = f"127.0.0.1:{launch.free_ports(1)[0]}"
    node0 = _node(0, 3, master, 1, "--rendezvous-timeout", "2", "--", "true")
    ((code, out, err),) = _finish([node0], timeout=30)
    assert code == 1
    assert "node(s) [1, 2] did not join round 0 within --rendezvous-timeout 2s" in err, err
    assert out == ""  # no worker was started


@pytest.mark.parametrize("module", ["launch", "rendezvous"])
def test_docstring_examples(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"keras_smp.{module}")
    failed, attempted = doctest.testmod(mod, verbose=False)
    assert attempted > 0 and failed == 0


def test_worker_lines_stay_whole_when_stderr_writes_meanwhile():
    # A worker's stdout and stderr went into one pipe: unbuffered Python
    # (the launcher sets PYTHONUNBUFFERED) writes a `print` of several
    # arguments piece by piece, and a line another thread wrote to stderr
    # (TensorFlow's C++ logs) landed inside it ("[1] RAISEDE0000 ...": a
    # test then missed the error message). Each stream now has its pipe.
    code = (
        "import os, sys, threading\n"
        "def noise():\n"
        "    for i in range(20000):\n"
        "        os.write(2, b'E0000 log line from another thread\\n')\n"
        "t = threading.Thread(target=noise); t.start()\n"
        "for i in range(3000):\n"
        "    print('PIECE', i, 'of', 'a', 'line', 'end')\n"
        "t.join()\n")
    proc = _run("module", "-n", "1", "--", *_worker(code), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    pieces = [ln for ln in lines if "PIECE" in ln]
    whole = [ln for ln in pieces
             if re.fullmatch(r"\[0\] PIECE \d+ of a line end", ln)]
    assert len(whole) == 3000, [ln for ln in pieces if ln not in whole][:5]
    # ... and every stderr line arrives, whole, beside them.
    logs = [ln for ln in lines if "E0000" in ln]
    assert logs.count("[0] E0000 log line from another thread") == 20000, (
        [ln for ln in logs if ln != "[0] E0000 log line from another thread"
         ][:5], len(logs))
