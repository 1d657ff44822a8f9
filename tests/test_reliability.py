"""Reliability: atomic checkpoints, layout-independent weights, SIGKILL + resume.

- A process SIGKILLed while saving leaves the previous checkpoint loadable.
- Weights saved with partitions=2 load with partitions=1 and 4, and with
  another data-parallel size (and from one stage per process).
- Stage processes write one shard each (Keras' sharded format): plain Keras
  loads it; a save that fails midway leaves the previous checkpoint.
- A worker SIGKILLed mid-epoch under `keras-smp launch --max-restarts 1`:
  the launcher names it and restarts the job, which resumes from
  BackupAndRestore's last backup and ends with an uninterrupted run's
  weights. (Survivors' own
  errors, without the launcher: tests/test_pipeline_failures.py.)
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from conftest import WORKERS
from conftest import assert_same_training
from conftest import env
from conftest import fit_model
from conftest import launch
from conftest import load
from conftest import run_python

SAVER = os.path.join(WORKERS, "save_forever.py")


def _kill_during_save(path, delay):
    """SIGKILLs the saver `delay` s after it starts save 3; returns the
    number of the last save it had started."""
    proc = subprocess.Popen(
        [sys.executable, SAVER, "save", str(path)], env=env(), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("SAVING 3"):
                time.sleep(delay)
                proc.kill()
                break
            assert time.monotonic() < deadline
        rest = proc.stdout.read()
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        started = [int(l.split()[1]) for l in ("SAVING 3\n" + rest).splitlines()
                   if l.startswith("SAVING")]
        return max(started)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.03, 0.08])
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, delay):
    path = tmp_path / "model.weights.h5"
    last = _kill_during_save(path, delay)
    out = run_python([SAVER, "load", str(path)]).stdout
    values = out.split("VALUE ", 1)[1].split()
    # One whole checkpoint: the save in progress (if it finished) or the
    # one before; never a truncated or mixed file.
    assert len(values) == 1, f"mixed checkpoint: {values}"
    assert float(values[0]) in (last - 1, last), (values, last)


DEEP = ("--model", "deep", "--pipelined", "--epochs", "2")


@pytest.fixture(scope="module")
def saved_2_stages(tmp_path_factory):
    """deep model trained with partitions=2 x 2 replicas in one process."""
    out = tmp_path_factory.mktemp("saved2")
    run_python(fit_model(out, *DEEP, "--local-devices", "4",
                         "--config", '{"partitions": 2, "microbatches": 2}',
                         "--save-weights", str(out / "w.weights.h5")))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("partitions,devices", [(1, 1), (4, 4), (2, 2)])
def test_weights_saved_with_2_stages_load_with_other_layouts(
        saved_2_stages, tmp_path, partitions, devices):
    run_python(fit_model(
        tmp_path, *DEEP, "--local-devices", str(devices),
        "--config", f'{{"partitions": {partitions}, "microbatches": 2}}',
        "--load-weights", str(saved_2_stages / "w.weights.h5")))
    assert_same_training(load(tmp_path), load(saved_2_stages),
                         keys=("evaluate", "predict"))


@pytest.mark.slow
def test_weights_saved_by_stage_processes_load_in_one_process(tmp_path):
    # One stage per process (2 workers) saves; one process with 4 stages
    # on 4 devices loads: same predictions.
    saved = tmp_path / "saved"
    launch(2, fit_model(saved, *DEEP, "--config",
                        '{"partitions": 2, "microbatches": 2}',
                        "--save-weights", str(saved / "w.weights.h5")))
    loaded = tmp_path / "loaded"
    run_python(fit_model(
        loaded, *DEEP, "--local-devices", "4",
        "--config", '{"partitions": 4, "microbatches": 2}',
        "--load-weights", str(saved / "w.weights.h5")))
    assert_same_training(load(loaded), load(saved),
                         keys=("evaluate", "predict"))


@pytest.mark.slow
def test_stage_processes_write_one_shard_each_that_plain_keras_loads(tmp_path):
    # 2 stages x 2 replicas, one stage per process: each stage's first
    # replica writes its own shard (no process gathers the model); the
    # index is Keras' sharded format: plain Keras (no keras-smp in the
    # loop) loads it and predicts as the trained pipeline does.
    saved = tmp_path / "saved"
    launch(4, fit_model(saved, *DEEP, "--config",
                        '{"partitions": 2, "microbatches": 2}',
                        "--save-weights", str(saved / "w.weights.h5")))
    index = json.loads((saved / "w.weights.json").read_text())
    layer_shards = {g: f for g, f in index["weight_map"].items()
                    if g.startswith("/layers/")}
    assert sorted(set(layer_shards.values())) == [
        "w_00001.weights.h5", "w_00002.weights.h5"], index
    assert all(isinstance(f, str) for f in layer_shards.values()), (
        "a layer's weights split over shards", index)
    assert sorted(p.name for p in saved.glob("w_*.weights.h5")) == [
        "w_00000.weights.h5", "w_00001.weights.h5", "w_00002.weights.h5"]
    plain = tmp_path / "plain"
    run_python(fit_model(plain, "--model", "deep", "--mode", "reference",
                         "--load-weights", str(saved / "w.weights.json")))
    assert_same_training(load(plain), load(saved),
                         keys=("evaluate", "predict"))


@pytest.mark.slow
def test_a_failed_sharded_save_leaves_the_previous_checkpoint(tmp_path):
    out = run_python([os.path.join(WORKERS, "sharded_save.py"),
                      str(tmp_path)]).stdout
    assert out.strip().endswith("OK"), out


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True],
                         ids=["data-parallel", "stage-per-process"])
def test_sigkill_mid_epoch_then_restart_resumes_exactly(
        tmp_path, reference, pipelined):
    flags = ["--callbacks", "--epochs", "4"]
    if pipelined:
        flags += ["--pipelined", "--config",
                  '{"partitions": 2, "microbatches": 2}']
    # `--max-restarts 1`: the launcher stops the job when rank 1 is
    # SIGKILLed in epoch 3 of its first run, names the worker, and starts
    # the job again; the restart resumes from BackupAndRestore's backup.
    proc = launch(2, fit_model(tmp_path, *flags, "--kill-at-epoch", "2"),
                  launcher_args=("--max-restarts", "1", "--restart-delay",
                                 "0.5"))
    assert "rank 1: SIGKILL in epoch 2" in proc.stdout
    assert re.search(r"restarting the job in 0.5s after: worker 1 \(pid \d+\) "
                     r"was killed by SIGKILL \(restart 1 of 1\)", proc.stderr), (
        proc.stderr)
    first, restarted = proc.stdout.split("[0] rank 0: run 1\n")
    assert "[0] rank 0: run 0" in first and "Epoch 3/4" in first
    assert "Epoch 3/4" in restarted and "Epoch 4/4" in restarted
    assert "Epoch 1/4" not in restarted and "Epoch 2/4" not in restarted
    # Same final state as an uninterrupted run of the same job (the same
    # reduction order: equal to float32 rounding of a few ulps) ...
    whole = tmp_path / "uninterrupted"
    launch(2, fit_model(whole, *flags))
    for r in range(2):
        assert_same_training(load(tmp_path, r), load(whole, r), rtol=1e-6,
                             atol=1e-7, keys=("evaluate", "predict"))
    # ... whose weights equal single-device training's (fidelity bound).
    assert_same_training(load(tmp_path), reference("--epochs", "4"), keys=())


EXIT_ORDER = os.path.join(WORKERS, "exit_order.py")


def _records(stdout, tag):
    return {r["rank"]: r for r in (
        json.loads(l.split(f"{tag} ", 1)[1]) for l in stdout.splitlines()
        if f"] {tag} " in l)}


@pytest.mark.slow
def test_ranks_still_talking_outlive_the_leaders_script(tmp_path):
    # Rank 0 hosts TensorFlow's coordination service. Ranks 0 and 1 end
    # their scripts first; 40 s later ranks 2 and 3 gather, meet and
    # all-reduce in their own pipeline group, which needs that service and
    # healthy peers. keras-smp's exit order keeps ranks 0 and 1 until then
    # (without it rank 2 fails with "Failed to connect to remote host" in
    # allgather; with rank 0 alone waiting, TensorFlow reports rank 1
    # "stopped sending heartbeats" ~20 s after it left and aborts the
    # all-reduce).
    out = launch(4, [EXIT_ORDER, "--late", "40"], timeout=240).stdout
    ended, group = _records(out, "EXIT"), _records(out, "GROUP")
    assert sorted(ended) == [0, 1, 2, 3], out
    assert sorted(group) == [2, 3], out
    for r in (2, 3):
        assert group[r]["got"] == [2, 3], out
        assert group[r]["summed"] == 5.0, out
        assert group[r]["started"] > ended[0]["ended"] + 25, out
    assert "unhealthy" not in out, out


@pytest.mark.slow
def test_a_failing_leader_does_not_wait_for_the_others_at_exit(tmp_path):
    # Rank 0 fails when its script ends while rank 2 and 3 would talk for
    # another 90 s: the leader must not wait for them (the launcher stops
    # the job as soon as rank 0 exits). The job's own start takes ~20 s
    # on 2 cores; waiting would take over 90 s.
    start = time.monotonic()
    proc = launch(4, [EXIT_ORDER, "--late", "90", "--fail-rank", "0"],
                  timeout=200, check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 0 fails on purpose" in proc.stdout + proc.stderr
    assert "worker 0" in proc.stdout + proc.stderr
    assert elapsed < 80, (elapsed, proc.stdout[-3000:])


class _FakeContext:
    """The coordination service's key-value store, in memory."""

    def __init__(self, store, blocks=False):
        self.store, self.waited, self.blocks = store, [], blocks
        self.reported = []

    def report_error_to_cluster(self, code, message):
        self.reported.append((code, message))

    def context(self):
        return self

    def async_wait(self):
        pass

    def set_config_key_value(self, key, value):
        if key in self.store:  # TensorFlow's store: the first writer wins
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.store[key] = value

    def get_config_key_value(self, key, timeout_in_ms=0):
        if key not in ("keras_smp/exit/failed",  # looked at, not waited for
                       "keras_smp/exit/failing"):
            self.waited.append((key, timeout_in_ms))
        if key not in self.store:
            if self.blocks:  # a timeout: the call took its whole time
                time.sleep(timeout_in_ms / 1000)
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            raise RuntimeError(f"UNAVAILABLE: task lost: {key}")
        return self.store[key]


@pytest.fixture
def exit_state(monkeypatch):
    from keras_smp.runtime import shutdown

    monkeypatch.setitem(shutdown._state, "failed", False)
    monkeypatch.setitem(shutdown._state, "reported", False)
    monkeypatch.setitem(shutdown._state, "status", None)
    monkeypatch.setitem(shutdown._state, "published", False)
    monkeypatch.delattr(sys, "last_type", raising=False)
    return shutdown


def test_a_failure_report_is_one_line_that_names_the_exception(exit_state):
    import tensorflow  # noqa: F401 (imported before the report's thread,
    # which waits at most 5 s, imports it: as in a worker, where it is)
    long = ValueError("\x1b[1mbad\x1b[0m\n\n  shape " + "x" * 2000)
    line = exit_state.summary(type(long), long)
    assert line.startswith("ValueError: bad shape xxx") and "\n" not in line
    assert len(line) <= len("ValueError: ") + exit_state._SUMMARY_CHARS
    assert line.endswith("...")
    # What the peers' errors quote: the report, without TensorFlow's lines.
    rank0 = _FakeContext({})
    exit_state._report(rank0, 2, line)
    (_, message), = rank0.reported
    for after in ("\nThe error could be from a previous operation.",
                  " [type.googleapis.com/tensorflow.CoordinationServiceError"
                  "='\x18\x01']"):
        text = (f"Collective ops is aborted by: Error reported from "
                f"/job:worker/task:2: {message}{after}")
        assert exit_state.failed_rank(text) == (2, line)
    assert exit_state.failed_rank("Socket closed") is None


def test_a_failing_rank_records_whether_its_own_error_or_a_peers(
        exit_state, monkeypatch, tmp_path):
    # keras-smp launch reads the record to name the rank that failed first.
    import tensorflow as tf

    from keras_smp import launch

    path = str(tmp_path / "rank0")
    monkeypatch.setenv(launch.FAILURE_FILE_ENV, path)
    # Stopped by rank 1's report (the guard's error, caused by TensorFlow's):
    # recorded as rank 1's failure, not reported again.
    try:
        try:
            raise ValueError("Collective ops is aborted by: Error reported "
                             "from /job:worker/task:1: keras-smp: rank 1 "
                             "failed [13 chars]: KeyError: 'x'\nThe error "
                             "could be")
        except ValueError as cause:
            raise RuntimeError("keras-smp: pipeline rank 0 stopped") from cause
    except RuntimeError as e:
        stopped = e
    rank0 = _FakeContext({})
    exit_state._fail(rank0, 0, RuntimeError, stopped)
    record = launch.read_failure(path)
    assert (record["error"], record["stopped_by"]) == ("KeyError: 'x'", 1)
    assert rank0.reported == []
    # Its own error: recorded and reported.
    monkeypatch.setitem(exit_state._state, "reported", False)
    exit_state._fail(rank0, 0, KeyError, KeyError("y"))
    record = launch.read_failure(path)
    assert (record["error"], record["stopped_by"]) == ("KeyError: 'y'", None)
    assert [m for _, m in rank0.reported] == [
        "keras-smp: rank 0 failed [13 chars]: KeyError: 'y'"]
    assert exit_state.failure(rank0) == (0, "KeyError: 'y'")
    # A lost peer (the guard's error, caused by TensorFlow's): recorded as
    # lost, not reported (the others see the lost peer themselves).
    try:
        try:
            raise tf.errors.UnavailableError(None, None, "Socket closed")
        except tf.errors.UnavailableError as cause:
            raise RuntimeError("keras-smp: lost rank 2") from cause
    except RuntimeError as e:
        lost = e
    monkeypatch.setitem(exit_state._state, "reported", False)
    exit_state._fail(rank0, 0, RuntimeError, lost)
    record = launch.read_failure(path)
    assert record["lost"] and record["stopped_by"] is None
    assert record["error"] == "RuntimeError: keras-smp: lost rank 2"
    assert len(rank0.reported) == 1
    # Stopped in a communication helper (its error says by whom): recorded
    # as such; at exit it says it fails without naming itself the cause.
    stopped = RuntimeError("keras-smp: rank 0 stopped in recv_from")
    stopped.smp_stopped_by = (1, "KeyError: 'z'")
    store = {}
    helper = _FakeContext(store)
    monkeypatch.setitem(exit_state._state, "reported", False)
    monkeypatch.setitem(exit_state._state, "published", False)
    exit_state._fail(helper, 0, RuntimeError, stopped)
    record = launch.read_failure(path)
    assert (record["error"], record["stopped_by"]) == ("KeyError: 'z'", 1)
    exit_state._state["failed"] = True
    exit_state._at_exit(helper, 0, 2, 30)
    assert store == {"keras_smp/exit/failing": "0",
                     "keras_smp/exit/0": "failed"}
    assert exit_state.failure(helper) is None and helper.reported == []
    # Ctrl-C: neither recorded nor reported.
    os.remove(path)
    monkeypatch.setitem(exit_state._state, "reported", False)
    exit_state._fail(rank0, 0, KeyboardInterrupt, KeyboardInterrupt())
    assert launch.read_failure(path) is None and len(rank0.reported) == 1
    # An exception whose str() fails still gives a record and a report.

    class Odd(Exception):
        def __str__(self):
            raise TypeError("no str")

    monkeypatch.setitem(exit_state._state, "reported", False)
    exit_state._fail(rank0, 0, Odd, Odd())
    assert launch.read_failure(path)["error"] == "an unhandled exception"
    assert len(rank0.reported) == 2


def test_exit_order_every_rank_waits_for_every_other_rank(
        exit_state, monkeypatch):
    monkeypatch.setattr(exit_state, "_SLICE_SECONDS", 0.05)
    store = {"keras_smp/exit/1": "done", "keras_smp/exit/2": "done"}
    rank0 = _FakeContext(store, blocks=True)
    with pytest.warns(UserWarning, match=r"rank 0 exits without word from "
                      r"rank\(s\) \[3\] after waiting up to 0.3 s "
                      r"\(collective_timeout_seconds\)"):
        exit_state._at_exit(rank0, 0, 4, 0.3)
    assert store["keras_smp/exit/0"] == "done"
    assert [k for k, _ in rank0.waited[:3]] == [
        f"keras_smp/exit/{r}" for r in (1, 2, 3)]
    # Waits of one slice at a time (Ctrl-C ends the wait).
    assert all(0 < ms <= 50 for _, ms in rank0.waited)
    # A service that is gone (an error at once, not a timeout): no wait.
    gone = _FakeContext({})
    exit_state._at_exit(gone, 0, 4, 30)
    assert len(gone.waited) == 1


def test_exit_order_a_failed_rank_ends_the_wait(exit_state):
    # Rank 1 said it fails: rank 2 waits for nobody (not for rank 0 first).
    store = {"keras_smp/exit/1": "failed", "keras_smp/exit/failed": "1"}
    rank2 = _FakeContext(store, blocks=True)
    exit_state._at_exit(rank2, 2, 4, 30)  # no wait, no warning
    assert rank2.waited == []
    # A rank's own key saying "failed" ends the wait too.
    store = {"keras_smp/exit/0": "done", "keras_smp/exit/1": "failed"}
    rank2 = _FakeContext(store, blocks=True)
    exit_state._at_exit(rank2, 2, 4, 30)
    assert [k for k, _ in rank2.waited] == [
        "keras_smp/exit/0", "keras_smp/exit/1"]


def test_exit_order_runs_what_must_come_after_the_wait(
        exit_state, monkeypatch):
    # Horovod's shutdown: after the wait, also when failing.
    ran = []
    monkeypatch.setitem(exit_state._state, "installed", True)
    monkeypatch.setattr(exit_state, "_after", [])
    exit_state.after_wait(lambda: ran.append("after"))
    store = {"keras_smp/exit/1": "done"}
    exit_state._at_exit(_FakeContext(store), 0, 2, 30)
    assert ran == ["after"] and store["keras_smp/exit/0"] == "done"
    exit_state._state["failed"] = True
    exit_state._at_exit(_FakeContext({}), 0, 2, 30)
    assert ran == ["after", "after"]


def test_exit_order_waits_in_slices_up_to_one_deadline(
        exit_state, monkeypatch):
    monkeypatch.setattr(exit_state, "_SLICE_SECONDS", 0.05)
    rank0 = _FakeContext({}, blocks=True)
    with pytest.warns(UserWarning, match=r"rank\(s\) \[1, 2\]"):
        exit_state._at_exit(rank0, 0, 3, 0.3)
    # One deadline for all ranks (0.3 s), not 0.3 s each; several slices.
    assert sum(ms for _, ms in rank0.waited) <= 300, rank0.waited
    assert len(rank0.waited) >= 4, rank0.waited


@pytest.mark.parametrize("how", ["status", "unhandled"])
def test_exit_order_failures_do_not_wait(exit_state, monkeypatch, how):
    import tensorflow as tf

    if how == "status":
        exit_state._mark_failed(1)  # sys.exit(1)
        told = "exit status 1"
    else:  # Python sets it for an unhandled exception
        monkeypatch.setattr(sys, "last_type", RuntimeError, raising=False)
        monkeypatch.setattr(sys, "last_value", RuntimeError("boom"),
                            raising=False)
        told = "RuntimeError: boom"
    store = {}
    rank3 = _FakeContext(store)
    exit_state._at_exit(rank3, 3, 4, 30)
    # Its error and rank, in the key-value store for ranks waiting on a
    # key (smp.recv_from...), then its own exit key.
    assert store == {"keras_smp/exit/3": "failed",
                     "keras_smp/exit/failed": "3",
                     "keras_smp/exit/error/3": told}
    assert rank3.waited == []  # no wait
    assert exit_state.failure(rank3) == (3, told)
    # Reported to the whole job once (it aborts the others' collectives).
    assert rank3.reported == [
        (tf.errors.ABORTED,
         f"keras-smp: rank 3 failed [{len(told)} chars]: {told}")]
    exit_state._at_exit(rank3, 3, 4, 30)
    assert len(rank3.reported) == 1
    assert exit_state._failing_status(1) and exit_state._failing_status("x")
    assert not exit_state._failing_status(0)
    assert not exit_state._failing_status(None)
