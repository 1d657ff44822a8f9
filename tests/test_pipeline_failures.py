"""A stage process that dies or hangs must not hang the others.

Two worker processes run one pipeline stage each (started directly, not by
`keras-smp launch`, whose teardown would hide how the survivors behave).
Once both train, one is killed (SIGKILL) or frozen (SIGSTOP); the other
must exit non-zero within the collective timeout plus a margin, with an
error naming its stage and the likely cause. A worker that raises an
exception instead makes the other stop at once with that exception named.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import ROOT, WORKERS, env
from keras_smp.launch import free_ports, make_tf_config

TIMEOUT = 15  # collective_timeout_seconds of the workers
MARGIN = 45   # detection, error handling and interpreter exit


class Worker:
    def __init__(self, index, ports, partitions=2, timeout=TIMEOUT,
                 extra=()):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.steps = 0
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(WORKERS, "pipeline_train_forever.py"),
             "--timeout", str(timeout), "--partitions", str(partitions),
             *extra],
            env=env(TF_CONFIG=make_tf_config(ports, index)), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("STEP"):
                self.steps += 1

    def stderr(self):
        self.log.seek(0)
        return self.log.read()

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("victim,how,partitions", [
    (1, signal.SIGKILL, 2), (1, signal.SIGSTOP, 2), (0, signal.SIGKILL, 2),
    (1, signal.SIGKILL, 1)],
    ids=["stage1-killed", "stage1-frozen", "stage0-killed",
         "data-parallel-rank1-killed"])
def test_lost_worker_fails_the_others_in_bounded_time(victim, how, partitions):
    ports = free_ports(2)
    workers = [Worker(i, ports, partitions) for i in range(2)]
    try:
        deadline = time.monotonic() + 180
        while min(w.steps for w in workers) < 3:
            for w in workers:
                assert w.proc.poll() is None, w.stderr()[-3000:]
            assert time.monotonic() < deadline, "workers did not start training"
            time.sleep(0.5)
        os.kill(workers[victim].proc.pid, how)
        start = time.monotonic()
        survivor = workers[1 - victim]
        try:
            code = survivor.proc.wait(timeout=TIMEOUT + MARGIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stage {1 - victim} still running "
                        f"{TIMEOUT + MARGIN}s after stage {victim} got "
                        f"{signal.Signals(how).name}")
        elapsed = time.monotonic() - start
        err = survivor.stderr()
        assert code != 0
        reason = [l for l in err.splitlines()
                  if "keras-smp" in l or "heartbeat" in l.lower()]
        print(f"stage {1 - victim} exited {code} after {elapsed:.1f}s: "
              f"{reason[-1][:300] if reason else err[-300:]}")
        # Our error names this worker and the lost one, unless TensorFlow's
        # coordination service ended the process first (task 0 lost), in
        # which case TensorFlow's own message names the lost task.
        where = (f"keras-smp: pipeline rank {1 - victim}" if partitions > 1
                 else f"keras-smp: worker rank {1 - victim} of 2")
        ours = where in err and f"lost rank {victim} (" in err
        tf_own = re.search(rf"task:{victim}\b.*(heartbeat|coordinat|"
                           r"unavailable|disconnect)|(heartbeat|coordinat)"
                           rf".*task:{victim}\b", err, flags=re.I)
        assert ours or tf_own, err[-3000:]
    finally:
        for w in workers:
            w.kill()


@pytest.mark.slow
@pytest.mark.parametrize("failing,partitions", [(1, 2), (0, 2), (1, 1)],
                         ids=["stage1-raises", "stage0-raises",
                              "data-parallel-rank1-raises"])
def test_an_exception_on_one_worker_stops_the_others_naming_it(
        failing, partitions):
    # The failing rank reports its exception to the job through
    # TensorFlow's coordination service (keras_smp.runtime.shutdown), which
    # aborts the peer's collectives: the peer's error names that rank and
    # its exception. Without the report the peer says it "lost rank N ...
    # probably died or hung" once heartbeats stop (~10 s), or waits for
    # collective_timeout_seconds (set long here, so only the report can
    # end it well within the bound below).
    timeout = 300
    ports = free_ports(2)
    workers = [Worker(i, ports, partitions, timeout=timeout,
                      extra=["--fail-rank", str(failing)]) for i in range(2)]
    try:
        codes = [w.proc.wait(timeout=180) for w in workers]
        err = workers[failing].stderr()
        assert codes[failing] != 0
        assert f"RuntimeError: rank {failing} fails on purpose" in err, \
            err[-3000:]
        survivor = workers[1 - failing]
        err = survivor.stderr()
        assert codes[1 - failing] != 0, err[-3000:]
        where = (f"keras-smp: pipeline rank {1 - failing}" if partitions > 1
                 else f"keras-smp: worker rank {1 - failing} of 2")
        assert (f"{where}" in err and f"stopped: rank {failing} "
                f"(localhost:{ports[failing]}) failed with RuntimeError: "
                f"rank {failing} fails on purpose. That rank's log has the "
                "traceback" in err), err[-3000:]
        assert "probably died or hung" not in err, err[-3000:]
    finally:
        for w in workers:
            w.kill()
