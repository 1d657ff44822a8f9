"""The bad-input catalogue: every kind of bad input fails early and says why.

Each case feeds one bad value and checks the exception names the problem
(the bad value or setting, and the fix where there is one). Pure-Python
inputs (config, TF_CONFIG, SLURM, launcher arguments, schedules) run here;
TensorFlow-side inputs (batches, dtypes, shapes, partition indices, steps,
checkpoints) run in one worker process (tests/workers/bad_inputs.py);
cluster-level mistakes start real worker processes and check none is left
running.
"""

import json
import os
import re
import time

import pytest

from conftest import WORKERS
from conftest import launch
from conftest import run_python

TF_CONFIG_2 = ('{"cluster": {"worker": ["a:1", "b:2"]}, '
               '"task": {"type": "worker", "index": %s}}')

# (case, callable building the bad input, exception type, regex on message)
PURE_CASES = {
    "unknown config key": (
        lambda c: c.SMPConfig.build({"partitons": 2}), ValueError,
        r"Unknown keras-smp config key 'partitons'.*Did you mean 'partitions'"),
    "partitions zero": (
        lambda c: c.SMPConfig.build({"partitions": 0}), ValueError,
        r"'partitions'.*received 0, expected an integer >= 1"),
    "microbatches as a string": (
        lambda c: c.SMPConfig.build({"microbatches": "4"}), ValueError,
        r"'microbatches'.*received '4'.*not a string"),
    "unknown pipeline schedule": (
        lambda c: c.SMPConfig.build({"pipeline": "zigzag"}), ValueError,
        r"'pipeline'.*received 'zigzag', expected one of"),
    "horovod with another allreduce": (
        lambda c: c.SMPConfig.build({"horovod": True, "allreduce": "ring"}),
        ValueError, r"horovod=True.*requires allreduce='horovod'.*'ring'"),
    "negative fusion threshold": (
        lambda c: c.SMPConfig.build({"fusion_threshold_mb": -1}), ValueError,
        r"'fusion_threshold_mb'.*received -1.0, expected a finite number >= 0"),
    "zero collective timeout": (
        lambda c: c.SMPConfig.build({"collective_timeout_seconds": 0}),
        ValueError, r"'collective_timeout_seconds'.*received 0.0.*> 0"),
    "config of the wrong type": (
        lambda c: c.SMPConfig.build([1, 2]), TypeError,
        r"config must be None, a dict or an SMPConfig; received list"),
    "SMP_CONFIG not JSON": (
        lambda c: c.SMPConfig.build(environ={"SMP_CONFIG": "{bad"}),
        ValueError, r"SMP_CONFIG is not valid JSON.*received '\{bad'"),
    "TF_CONFIG not JSON": (
        lambda c: c.resolve_cluster({"TF_CONFIG": "{bad"}), ValueError,
        r"Invalid TF_CONFIG: it is not valid JSON.*'\{bad'"),
    "TF_CONFIG task index out of range": (
        lambda c: c.resolve_cluster({"TF_CONFIG": TF_CONFIG_2 % 5}),
        ValueError, r'task\["index"\] is 5, out of range.*0\.\.1'),
    "TF_CONFIG address without port": (
        lambda c: c.resolve_cluster({"TF_CONFIG": TF_CONFIG_2.replace(
            '"a:1"', '"a"') % 0}),
        ValueError, r"cluster\[\"worker\"\]\[0\] is 'a'.*\"host:port\""),
    "TF_CONFIG without cluster": (
        lambda c: c.resolve_cluster(
            {"TF_CONFIG": '{"task": {"type": "worker", "index": 0}}'}),
        ValueError, r'missing "cluster"'),
    "SLURM rank beyond task count": (
        lambda c: c.resolve_cluster({
            "SLURM_PROCID": "3", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}),
        ValueError, r"SLURM_PROCID=3 with SLURM_NTASKS=2"),
    "partitions not dividing the workers": (
        lambda c: c.Topology.from_cluster(c.resolve_cluster(
            {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2", "c:3"]}, '
                          '"task": {"type": "worker", "index": 0}}'}),
            partitions=2),
        ValueError, r"partitions=2 does not divide.*world_size=3"),
    "unknown schedule name": (
        lambda c: c.get_schedule("zigzag", 2, 4), ValueError,
        r"Unknown pipeline schedule: received 'zigzag'"),
}


class _Api:
    from keras_smp.config import SMPConfig
    from keras_smp.pipeline.schedule import get_schedule
    from keras_smp.topology import Topology
    from keras_smp.topology import resolve_cluster


@pytest.mark.parametrize("case", sorted(PURE_CASES))
def test_pure_bad_input_is_named(case):
    build, error, pattern = PURE_CASES[case]
    with pytest.raises(error) as info:
        build(_Api)
    assert re.search(pattern, str(info.value), flags=re.S), str(info.value)


LAUNCHER_CASES = {
    "no workers": (["-n", "0", "--", "python"], r"must be >= 1, got 0"),
    "no command": (["-n", "2"], r"missing command after '--'"),
    "host map of the wrong length": (
        ["-n", "2", "--host-map", "a", "--", "python"],
        r"--host-map has 1 entries but -n is 2"),
}


@pytest.mark.parametrize("case", sorted(LAUNCHER_CASES))
def test_bad_launcher_arguments_are_named(case, capsys):
    from keras_smp.launch import main

    argv, pattern = LAUNCHER_CASES[case]
    assert main(argv) == 2
    assert re.search(pattern, capsys.readouterr().err)


# TensorFlow side: case -> (exception type, regex on the message)
TF_CASES = {
    "wrap_a_model_with_its_own_train_step": (
        "ValueError", r"DistributedModel\(OwnTrainStep\) wraps a model that "
                      r"overrides `train_step`.*would be skipped.*"
                      r"compile\(loss=.*@smp.step"),
    "subclass_with_its_own_compute_loss": (
        "ValueError", r"OwnLoss overrides `compute_loss`.*would be skipped"),
    "optimizer_created_outside_the_scope": (
        "ValueError", r"optimizer SGD of model '.*' was created outside the "
                      r"SMPStrategy's scope.*with strategy.scope\(\): "
                      r"model.compile\(optimizer=keras.optimizers.SGD"),
    "dataset_without_drop_remainder": (
        "ValueError", r"^The per-replica batch of 2 samples is smaller than "
                      r"microbatches=4.*drop_remainder=True"),
    "feature_shape_mismatch": (
        "ValueError", r"expected.*8.*(7|found)|incompatible.*shape.*7"),
    "label_shape_mismatch": (
        "ValueError", r"Dimensions must be equal, but are 3 and 2.*"
                      r"\[16,3\], \[16,2\]"),
    "string_features": ("ValueError", r"Invalid dtype: str"),
    "partition_index_out_of_range": (
        "ValueError", r"keras_smp.partition\(3\).*only partitions=2 stages"),
    "microbatches_more_than_batch": (
        "ValueError", r"batch of 2 samples is smaller than microbatches=4"),
    "step_batch_not_divisible": (
        "ValueError", r"'a' \(axis 0\) of 10 samples does not divide into microbatches=4"),
    "get_gradients_eagerly": (
        "RuntimeError", r"only works inside an @smp.step.*tf.GradientTape"),
    "checkpoint_of_wrong_type": (
        "TypeError", r"expects a tf.train.Checkpoint.*received dict"),
    "save_model_before_build": (
        "ValueError", r"save_model: the model has no weights yet"),
    "save_weights_max_shard_size": (
        "ValueError", r"shards by pipeline stage, not by size: drop "
                      r"max_shard_size=1.*'.weights.json'"),
    "wrap_a_non_model": (
        "TypeError", r"expects a keras.Model.*received str 'not a model'"),
    "wrap_a_distributed_model": (
        "TypeError", r"DistributedModel\(already\) wraps a model that is "
                     r"already a DistributedModel"),
}


@pytest.fixture(scope="module")
def tf_results():
    out = run_python([f"{WORKERS}/bad_inputs.py"], timeout=300).stdout
    return json.loads(out.split("RESULT ", 1)[1])


@pytest.mark.parametrize("case", sorted(TF_CASES))
def test_tensorflow_side_bad_input_is_named_early(case, tf_results):
    error, pattern = TF_CASES[case]
    got_type, message, seconds = tf_results[case]
    assert got_type and re.fullmatch(error, got_type), (got_type, message)
    assert re.search(pattern, message, flags=re.S), message
    assert seconds < 30, f"{case} took {seconds:.0f} s to fail"


def test_every_tensorflow_case_is_checked(tf_results):
    assert sorted(tf_results) == sorted(TF_CASES)


@pytest.mark.slow
def test_partitions_not_dividing_the_launched_workers_stop_everyone():
    # 3 workers, partitions=2: every worker fails at SMPStrategy creation,
    # the launcher exits non-zero and nobody is left running.
    start = time.monotonic()
    proc = launch(3, ["-c", "import keras_smp; keras_smp.SMPStrategy(partitions=2)"],
                  timeout=120, check=False)
    assert proc.returncode != 0
    assert "partitions=2 does not divide" in proc.stdout
    assert time.monotonic() - start < 90


@pytest.fixture(scope="module")
def fake_service_checks():
    # One thread per rank, a dict as the key-value store (see the worker).
    proc = run_python([os.path.join(WORKERS, "settings_check.py")],
                      timeout=180)
    return {r["scenario"]: r for r in map(
        json.loads, (l for l in proc.stdout.splitlines() if l.startswith("{")))}


def test_settings_check_over_a_fake_coordination_service(fake_service_checks):
    rows = {k: v["raised"] for k, v in fake_service_checks.items()}
    assert rows["agree"] == {"0": None, "1": None, "2": None}
    # Every rank raises the same ValueError, naming each difference.
    differ = rows["differ"]
    assert sorted(differ) == ["0", "1", "2"]
    assert all(v == differ["0"] for v in differ.values()), differ
    kind, message = differ["0"]
    assert kind == "ValueError"
    lines = message.splitlines()
    assert ("- microbatches: 4 on ranks 0, 1 (keyword arguments); 8 on rank "
            "2 (keyword arguments)") in lines
    assert "- model replicas per process: 1 on ranks 0, 1; 2 on rank 2" in lines
    assert "- devices per process: 1 on ranks 0, 1; 2 on rank 2" in lines
    # Rank 1's wait ended as rank 0 failed: still the verdict, whole.
    race = rows["race"]
    assert race["1"] == race["0"], race
    assert race["1"][0] == "ValueError"
    assert "- microbatches: 4 on rank 0" in race["1"][1]


def test_call_check_over_a_fake_coordination_service(fake_service_checks):
    # Before the first step of each fit / evaluate / predict (and of a
    # fit's validation), every rank says what it runs; rank 0 compares.
    rows = fake_service_checks
    agree = rows["calls agree"]
    assert agree["raised"] == {str(r): [None] * 4 for r in range(3)}
    # Rank 0 deleted each call's keys once every rank had started the
    # next: left are the last call's and the fit's (call 1) validation's,
    # made after call 2 (a predict within the fit) started.
    assert agree["keys"] == [f"keras_smp/calls/{c}/{k}" for c in (
        "1/validation", "2") for k in ("0", "1", "2", "verdict")]
    differ = rows["calls differ"]["raised"]
    assert sorted(differ) == ["0", "1", "2"]
    # Every rank raises the same error for each differing call.
    assert differ["1"] == differ["0"] and differ["2"] == differ["0"], differ
    assert differ["0"][1] is None  # the fit itself agrees
    first, validation, third = [m for _, m in differ["0"][::2] + differ[
        "0"][3:]]
    assert all(raised[0] == "ValueError" for raised in differ["0"] if raised)
    assert first.startswith("keras-smp: the processes of this job differ "
                            "in their 1st fit/evaluate/predict call")
    assert "- call: evaluate on ranks 0, 2; predict on rank 1" in \
        first.splitlines()
    assert validation.startswith(
        "keras-smp: the processes of this job differ in the validation "
        "data of their 2nd fit/evaluate/predict call")
    assert "- steps: 2 on ranks 0, 2; 1 on rank 1" in validation
    assert third.startswith("keras-smp: the processes of this job differ "
                            "in their 3rd fit/evaluate/predict call")
    assert "- steps: 4 on ranks 0, 1; 3 on rank 2" in third.splitlines()
    assert ("- batch inputs: [float32[None, 8], float32[None, 2]] on ranks "
            "0, 1; [float64[None, 8], float32[None, 2]] on rank 2") in \
        third.splitlines()
    assert "- batch_size" not in third  # equal on every rank: not named
    assert "not `if rank == 0: model.evaluate(...)`" in first
    # A rank whose script ended: the others fail at the first 1 s slice of
    # their wait, not at the 30 s timeout, all with the same message.
    for scenario, gone, waiting in (("ended", 2, ("0", "1")),
                                    ("rank 0 ended", 0, ("1", "2"))):
        row = rows[scenario]
        assert row["seconds"] < 10, row
        assert row["raised"][str(gone)] == []
        for r in waiting:
            ((kind, message),) = row["raised"][r]
            assert kind == "ValueError"
            assert (f"starts evaluate() (its 1st fit/evaluate/predict "
                    f"call), but rank {gone}'s script ended after 0 such "
                    "calls") in message, message


@pytest.mark.slow
def test_ranks_started_with_different_settings_all_fail_at_once_naming_them():
    # Different microbatches (an argument) and fusion_threshold_mb (one
    # node's SMP_CONFIG): without the start-up check the ranks waited for
    # each other until collective_timeout_seconds (120-150 s here), then
    # blamed a "lost" peer. Now every rank fails at start-up with the same
    # error; the differing timeouts are allowed and not named.
    start = time.monotonic()
    proc = launch(2, [os.path.join(WORKERS, "settings_differ.py")],
                  timeout=200, check=False)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "STARTED" not in out, out[-3000:]
    assert elapsed < 100, f"took {elapsed:.0f} s"
    for rank in (0, 1):
        # Each rank's own error (or, had rank 0's report reached rank 1
        # first, rank 1's "rank 0 failed with ..." carrying the same text).
        said = "\n".join(line for line in out.splitlines()
                         if line.startswith(f"[{rank}] "))
        assert ("- microbatches: 2 on rank 0 (keyword arguments); 4 on "
                "rank 1 (keyword arguments)") in said, out[-3000:]
        assert ("- fusion_threshold_mb: 64.0 on rank 0 (default); 1.0 on "
                "rank 1 (environment variable SMP_CONFIG)") in said
    assert "- collective_timeout_seconds" not in out
    assert "keras-smp: the processes of this job do not run with the same " \
        "settings" in out
    assert "lost" not in out.lower(), out[-3000:]


def test_replicas_with_different_position_counts_fail_naming_the_embedding():
    # tests/workers/uneven_positions.py: each worker pads its own
    # sequences (5 and 6 positions, unknown when traced) into a position
    # embedding trained with Adam. The replicas' rows of such a lookup are
    # added position by position (one device's gradient); with different
    # positions that sum has no meaning (and a collective of different
    # shapes fails or waits), so both ranks fail at the first step with
    # the fix, well before collective_timeout_seconds (60 s).
    start = time.monotonic()
    proc = launch(2, [os.path.join(WORKERS, "uneven_positions.py")],
                  timeout=200, check=False)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NO ERROR" not in out, out[-3000:]
    assert elapsed < 100, f"took {elapsed:.0f} s"
    for rank in (0, 1):
        raised = [line for line in out.splitlines()
                  if line.startswith(f"[{rank}] RAISED")]
        assert raised, out[-3000:]
        assert ("the data-parallel replicas hold different numbers of ids "
                "in the sparse gradient of token_and_position/positions/"
                "embeddings") in raised[0], raised[0]
        assert "padded_batch" in raised[0], raised[0]
        assert f"[Ids on this replica:] [{5 + rank}] [mean over the " \
            "replicas:] [5.5]" in raised[0], raised[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dp", "pp"])
def test_ranks_making_different_calls_fail_at_the_call_naming_it(mode,
                                                                 tmp_path):
    # A plain Keras model trained data-parallel ("dp") and a 2-stage
    # DistributedModel with one stage per process ("pp"). Without the
    # check, different steps or calls waited in a collective until
    # collective_timeout_seconds (120 s here), then blamed a "lost" peer
    # (pp), or failed in TensorFlow's "Collective instance 114 expected
    # type 0 and data_type 9" (dp); `if rank == 0: model.evaluate(...)`
    # waited until the timeout in every mode.
    proc = launch(2, [os.path.join(WORKERS, "calls_differ.py"), mode,
                      str(tmp_path)], timeout=300)
    rows = {}
    for line in proc.stdout.splitlines():
        if "ROW {" in line:
            row = json.loads(line.split("ROW ", 1)[1])
            rows[row["scenario"], row["rank"]] = row
    expected = {
        "rows": ("1st fit/evaluate/predict call", "- steps: 4 on rank 0; 3 "
                 "on rank 1"),
        "call": ("2nd fit/evaluate/predict call", "- call: evaluate on rank "
                 "0; predict on rank 1"),
        "validation": ("the validation data of their 3rd", "- steps: 2 on "
                       "rank 0; 1 on rank 1"),
        # Infinite data on one rank only (both with steps_per_epoch): rank
        # 0's steps skip the per-step "has every rank a batch?" agreement
        # that rank 1's run (pp: rank 1 waited in it until the timeout;
        # dp: both failed in TensorFlow's "Graph execution error ...
        # CollectiveReduceV2").
        "infinite_on_one_rank": (
            "8th fit/evaluate/predict call", "- data: infinite (repeat()) "
            "on rank 0; finite (or of unknown length) on rank 1"),
    }
    for name, (which, line) in expected.items():
        mine, theirs = rows[name, 0], rows[name, 1]
        # The same error on both ranks, before any step of the call.
        assert mine["raised"] is not None, mine
        assert mine["raised"] == theirs["raised"], (mine, theirs)
        assert which in mine["raised"].splitlines()[0], mine
        assert line in mine["raised"].splitlines(), mine
        assert max(mine["seconds"], theirs["seconds"]) < 60, (mine, theirs)
    # Data of unknown length ending at different steps: with one stage per
    # process every rank fails at once, at the step where rank 1's ended,
    # naming it (rank 1 went on to its next call while rank 0 waited in a
    # transfer: 120 s, then "lost a peer"); data parallel, TensorFlow
    # gives rank 1 an empty 4th batch.
    # Keras' predict draws its batches eagerly: the same message.
    for name in ("unknown_length", "unknown_length_predict"):
        mine, theirs = rows[name, 0], rows[name, 1]
        if mode == "pp":
            assert mine["raised"] is not None, mine
            assert mine["raised"] == theirs["raised"], (mine, theirs)
            assert mine["raised"].startswith(
                "keras-smp: the data ended on rank 1 while rank 0 still had "
                "a batch, at the same step."), mine
            assert max(mine["seconds"], theirs["seconds"]) < 60, (
                mine, theirs)
        else:
            assert mine["raised"] is None and theirs["raised"] is None, (
                mine, theirs)
            assert mine["result"] == theirs["result"], (mine, theirs)
    # TensorBoard's weight histograms on rank 0 only: with one stage per
    # process each histogram epoch gathers the model from every rank, so
    # the fit is refused before its first step (rank 0 waited in the
    # gather); data parallel gathers nothing: it trains.
    mine, theirs = rows["histograms_on_one_rank", 0], rows[
        "histograms_on_one_rank", 1]
    if mode == "pp":
        assert mine["raised"] is not None and (
            mine["raised"] == theirs["raised"]), (mine, theirs)
        assert "9th fit/evaluate/predict call" in mine["raised"], mine
        assert ("- TensorBoard histogram_freq: [1] on rank 0; None on "
                "rank 1") in mine["raised"].splitlines(), mine
        assert max(mine["seconds"], theirs["seconds"]) < 60, (mine, theirs)
    else:
        assert mine["raised"] is None and theirs["raised"] is None, (
            mine, theirs)
    # save_weights / save to a path with the rank in it: with one stage
    # per process refused on every rank, naming both paths, before
    # anything is written (rank 0's index named shards that rank 1 wrote
    # beside its own path: no error until a load); data parallel, rank 0
    # writes its file.
    for name, suffix in (("save_weights_paths", ".weights.h5"),
                         ("save_paths", ".keras")):
        mine, theirs = rows[name, 0], rows[name, 1]
        if mode == "pp":
            assert mine["raised"] is not None and (
                mine["raised"] == theirs["raised"]), (mine, theirs)
            assert "every process of the job must pass the same path" in (
                mine["raised"]), mine
            assert f"rank 1: '{tmp_path}/saves/rank1{suffix}'" in (
                mine["raised"]), mine
            assert not (tmp_path / "saves").exists() or not list(
                (tmp_path / "saves").iterdir()), list(
                (tmp_path / "saves").iterdir())
        else:
            assert mine["raised"] is None and theirs["raised"] is None, (
                mine, theirs)
            assert f"rank0{suffix}" in mine["result"], mine
            assert f"rank1{suffix}" not in mine["result"], mine
    # Nothing left behind: the same calls then run, with the same logs and
    # outputs on both ranks.
    agree = rows["agree", 0]
    assert agree["raised"] is None and rows["agree", 1]["raised"] is None
    assert agree["result"] == rows["agree", 1]["result"]
    assert len(agree["result"]["history"]["val_loss"]) == 2
    # Left in the coordination service: the last call's keys, and those of
    # the fit's validation (made after the callback's predicts started).
    assert rows["keys", 0]["result"] == [
        "keras_smp/calls/13/0", "keras_smp/calls/9/validation/0"]
    # Rank 1's script ended; rank 0's evaluate fails at once saying so.
    ended = rows["ended", 0]
    assert ("keras-smp: rank 0 starts evaluate() (its 15th "
            "fit/evaluate/predict call), but rank 1's script ended after 14 "
            "such calls") in ended["raised"], ended
    assert ended["seconds"] < 60, ended
    assert "lost" not in proc.stdout.lower(), proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("present", [0, 1], ids=["only-rank0", "only-rank1"])
def test_a_peer_that_never_starts_is_named_within_the_timeout(present):
    # TF_CONFIG lists 2 workers; only one starts. It must fail within the
    # collective timeout (10 s here) naming the missing task, not wait for
    # TensorFlow's default hour.
    from keras_smp.launch import free_ports
    from keras_smp.launch import make_tf_config

    missing = 1 - present
    start = time.monotonic()
    proc = run_python(
        ["-c", "import keras_smp; "
               "keras_smp.SMPStrategy(collective_timeout_seconds=10); "
               "print('STARTED')"],
        extra_env={"TF_CONFIG": make_tf_config(free_ports(2), present)},
        timeout=120, check=False)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "STARTED" not in output, output[-2000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert re.search(rf"keras-smp: worker rank {present} of 2 could not "
                     rf"start: rank {missing} \(localhost:\d+\) did not join",
                     output), output[-3000:]
