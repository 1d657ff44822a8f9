"""SMPStrategy data parallelism: results equal single-device training.

Every run here is a real Python process (or several, through
`keras-smp launch`); tolerances are rtol=1e-5, atol=1e-6 per unit of the
compared array's largest magnitude (conftest.scaled_atol; float32 rounding
of the same global-batch sums taken in another order).
"""

import json
import os
import re

import numpy as np
import pytest

from conftest import WORKERS
from conftest import assert_same_training
from conftest import fit_model
from conftest import launch
from conftest import load
from conftest import run_python


@pytest.mark.parametrize("fusion_mb", [64, 0])
def test_two_logical_devices_match_single_device(tmp_path, reference,
                                                 fusion_mb):
    cfg = json.dumps({"fusion_threshold_mb": fusion_mb})
    run_python(fit_model(tmp_path, "--local-devices", "2", "--config", cfg))
    got = load(tmp_path)
    assert int(got["replicas"]) == 2
    assert str(got["algorithm"]) == "ring"
    assert int(got["buckets_traced"]) > 0, "gradients bypassed GradientAllReduce"
    assert_same_training(got, reference())


def test_adam_two_devices_match_single_device(tmp_path, reference):
    # Adam divides by sqrt(v)+eps: a gradient that is ~0 with rounding noise
    # can move a weight by up to lr; this small model has no such gradients,
    # and the tight bound holds.
    run_python(fit_model(tmp_path, "--local-devices", "2", "--optimizer",
                         "adam"))
    assert_same_training(load(tmp_path), reference("--optimizer", "adam"))


def test_training_actually_changes_weights(tmp_path, reference):
    # Guards the fidelity tests against comparing two untrained models.
    ref = reference()
    run_python(fit_model(tmp_path, "--mode", "reference", "--epochs", "1"))
    one_epoch = load(tmp_path)
    assert not np.allclose(one_epoch["w0"], ref["w0"], rtol=1e-3)
    assert ref["loss"][-1] < ref["loss"][0]


def test_bad_config_fails_before_tensorflow_starts(tmp_path):
    proc = run_python(
        fit_model(tmp_path, "--config", json.dumps({"microbatchs": 2})),
        check=False)
    assert proc.returncode != 0
    assert "microbatchs" in proc.stderr and "microbatches" in proc.stderr


def test_malformed_tf_config_is_a_clear_error(tmp_path):
    proc = run_python(fit_model(tmp_path), check=False,
                      extra_env={"TF_CONFIG": '{"cluster": {"worker": ['})
    assert proc.returncode != 0
    assert "TF_CONFIG" in proc.stderr


def test_partitions_not_divisible_by_workers_is_a_clear_error(tmp_path):
    tf_config = json.dumps({
        "cluster": {"worker": ["localhost:1", "localhost:2", "localhost:3"]},
        "task": {"type": "worker", "index": 0}})
    proc = run_python(
        fit_model(tmp_path, "--config", json.dumps({"partitions": 2})),
        check=False, extra_env={"TF_CONFIG": tf_config})
    assert proc.returncode != 0
    assert "3" in proc.stderr and "partitions" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 4])
def test_multi_worker_fit_matches_single_device(tmp_path, reference, workers):
    proc = launch(workers, fit_model(tmp_path))
    ref = reference()
    for r in range(workers):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == workers
        assert int(got["buckets_traced"]) > 0
        assert_same_training(got, ref)
    # Progress bars only on the chief.
    assert "[0] Epoch 1/3" in proc.stdout
    for r in range(1, workers):
        assert f"[{r}] Epoch" not in proc.stdout


@pytest.mark.parametrize("where", ["logical_devices", "workers"])
def test_xla_data_parallel_matches_single_device_xla(tmp_path, reference,
                                                    where):
    # compile(jit_compile=True): the model's call (and so its backward) is
    # compiled with XLA inside the step; the gradient all-reduce and the
    # optimizer run outside. The reference is plain Keras compiling its
    # whole step with XLA on one device; the same bounds.
    if where == "workers":
        launch(2, fit_model(tmp_path, "--xla"))
    else:
        run_python(fit_model(tmp_path, "--xla", "--local-devices", "2"))
    ref = reference("--xla")
    for r in range(2 if where == "workers" else 1):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == 2
        assert int(got["compiled_calls"]) > 0, "the model ran uncompiled"
        assert bool(got["jit_compile"])
        assert int(got["buckets_traced"]) > 0
        assert_same_training(got, ref)


@pytest.mark.slow
def test_workers_times_local_devices_hierarchical(tmp_path, reference):
    # 2 processes x 2 logical CPUs on 2 emulated hosts: "auto" picks the
    # hierarchical all-reduce (sum in host, shards across hosts, share back).
    launch(2, fit_model(tmp_path, "--local-devices", "2"),
           launcher_args=("--host-map", "a,b"))
    for r in range(2):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == 4
        assert str(got["algorithm"]) == "hierarchical"
        assert_same_training(got, reference())


@pytest.mark.slow
def test_callbacks_across_workers(tmp_path, reference):
    # ModelCheckpoint, BackupAndRestore, EarlyStopping, TensorBoard and
    # CSVLogger(append=True) on 2 workers: training still matches, files are
    # written once (by the chief: the CSV holds each epoch once; both ranks
    # appended their rows before; keras.saving.save_model wrote from every
    # rank, into one file: a zip with bad CRCs), and a second run restores from the
    # backup without retraining. The non-chief's TensorBoard scratch
    # directory is gone when it exits.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = launch(2, fit_model(tmp_path, "--callbacks"),
                  extra_env={"TMPDIR": str(scratch)})
    board = re.search(r"rank 1: tensorboard log_dir (\S+)", proc.stdout)
    assert board and board.group(1).startswith(str(scratch)), proc.stdout
    assert not os.path.exists(board.group(1)), "scratch summaries left"
    assert_same_training(load(tmp_path, 1), reference())
    files = tmp_path / "files"
    assert (files / "ckpt.keras").is_file()
    assert (files / "best.weights.h5").is_file()
    events = list((files / "tb").rglob("events.out.tfevents.*"))
    assert len({e.parent for e in events}) == len(events) >= 1, events
    assert not (files / "backup").exists(), "backup not cleaned after fit"
    assert _csv_epochs(files / "log.csv") == [0, 1, 2]
    # keras.saving.save_model / save_weights and keras.models.save_model,
    # each rank naming its own file: the chief's only (as model.save).
    written = sorted(p.name for p in files.glob("rank*_*"))
    assert written == ["rank0_models.keras", "rank0_saving.keras",
                       "rank0_saving.weights.h5", "rank0_skip.weights.h5"], (
        written)


def test_fit_on_a_distributed_dataset_across_workers():
    # A dataset distributed by the strategy itself: the per-call check of
    # infinite data read its cardinality as a method and failed.
    proc = launch(2, [os.path.join(WORKERS, "distributed_dataset_fit.py")],
                  timeout=240)
    losses = dict(re.findall(r"LOSS (\d) (\S+)", proc.stdout))
    assert sorted(losses) == ["0", "1"], proc.stdout[-2000:]
    assert losses["0"] == losses["1"], losses  # the same global batches


def _csv_epochs(path):
    """The epochs of a `CSVLogger` file's rows (one header line first)."""
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("epoch,"), lines
    assert not any(line.startswith("epoch,") for line in lines[1:]), lines
    return [int(line.split(",")[0]) for line in lines[1:]]


@pytest.mark.slow
def test_backup_and_restore_resumes_after_failure(tmp_path, reference):
    # Rank 1 fails at epoch 2; the launcher stops the job. The re-run
    # restores epoch 2's backup on both workers and ends where an
    # uninterrupted run ends.
    proc = launch(2, fit_model(tmp_path, "--callbacks", "--fail-at-epoch",
                               "2"), check=False)
    assert proc.returncode != 0
    assert "fails on purpose" in proc.stdout
    assert (tmp_path / "files" / "backup").exists()
    proc = launch(2, fit_model(tmp_path, "--callbacks"))
    assert "Epoch 3/3" in proc.stdout and "Epoch 1/3" not in proc.stdout
    # The first run's epochs, then the resumed one's: each once.
    assert _csv_epochs(tmp_path / "files" / "log.csv") == [0, 1, 2]
    for r in range(2):
        assert_same_training(load(tmp_path, r), reference(),
                             keys=("evaluate", "predict"))


@pytest.mark.slow
def test_tensorflow_used_before_the_strategy_is_a_clear_error(tmp_path):
    # A dataset created before SMPStrategy starts TensorFlow, after which
    # collective ops cannot be configured; say so and how to fix it,
    # instead of TensorFlow's bare "must be configured at program startup".
    script = tmp_path / "early.py"
    script.write_text(
        "import tensorflow as tf\n"
        "ds = tf.data.Dataset.range(4)\n"
        "import keras_smp\n"
        "keras_smp.SMPStrategy()\n")
    proc = launch(2, [str(script)], timeout=120, check=False)
    assert proc.returncode != 0
    assert "TensorFlow already started in this process" in proc.stdout
    assert "Create `keras_smp.SMPStrategy(...)`" in proc.stdout
    assert "first, at the top of the script" in proc.stdout


@pytest.mark.parametrize("pieces", [4, 1])
def test_ring_pieces_go_in_flight_together_on_cpu(pieces):
    # One process, 2 logical CPUs: a 16 MB bucket and a 4 KB one (fusion
    # off). With allreduce_pieces=4 the big bucket goes as 4 collectives of
    # 1M elements, each on its own ordering token, none depending on
    # another (so TensorFlow runs them together); the small bucket stays
    # whole and, being the last bucket, goes first, before piece 0 on its
    # stream (buckets go in reverse model order). With 1, both buckets go
    # whole, in that order, on one token.
    proc = run_python([os.path.join(WORKERS, "allreduce_pieces_graph.py"),
                       str(pieces)])
    got = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert got["exact"], got
    assert len(got["devices"]) == 2, got
    for device in got["devices"]:
        if pieces == 4:
            assert device["sizes"] == [1000] + [2**20] * 4, device
            assert device["tokens"] == 4, device
        else:
            assert device["sizes"] == [1000, 4 * 2**20], device
            assert device["tokens"] == 1, device
        assert device["dependent_pairs"] == 1, device
        assert device["small_first"], device
    assert got["pieces_traced"] == 2 * (5 if pieces == 4 else 2), got


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicas", "pipelines"])
def test_ring_pieces_in_training_match_single_device(tmp_path, reference,
                                                     layout):
    # A model with a 1024 x 1024 kernel: 4 MB of gradients in one bucket,
    # which the ring all-reduce on CPU sends as 4 pieces in flight
    # (allreduce_pieces=4). 2 worker processes x 2 logical
    # CPUs: "replicas", 4 data-parallel replicas (2 in each process);
    # "pipelines", one 2-stage pipeline (m = 4) in each process, each
    # stage's gradients summed across the processes on that stage's
    # device. The same bounds as every data-parallel test.
    config = {"allreduce_pieces": 4}
    flags = ["--model", "wide", "--local-devices", "2"]
    if layout == "pipelines":
        config.update(partitions=2, microbatches=4)
        flags += ["--pipelined"]
    flags += ["--config", json.dumps(config)]
    launch(2, fit_model(tmp_path, *flags))
    ref = reference("--model", "wide")
    for r in range(2):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == (4 if layout == "replicas" else 2)
        assert str(got["algorithm"]) == "ring"
        # Pieces really were cut: more ring collectives than buckets.
        assert int(got["pieces_traced"]) > int(got["buckets_traced"]) > 0, (
            int(got["pieces_traced"]), int(got["buckets_traced"]))
        assert_same_training(got, ref)


def test_python_scalars_of_optimizer_variables_in_callbacks():
    # A callback logging `float(self.model.optimizer.learning_rate)` or
    # `int(...iterations)` (a common pattern) failed under any
    # tf.distribute strategy: Keras converts the variable's value, a
    # MirroredVariable, which has no `float()` ("float() argument must be
    # a string or a real number, not 'MirroredVariable'"). Under an
    # SMPStrategy they read as on one device: a pipeline and 2 replicas in
    # one process, against plain Keras; a tensor of more dimensions still
    # refuses, as Keras does.
    code = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import json, keras, numpy as np, keras_smp

class Log(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        opt = self.model.optimizer
        seen.append([float(opt.learning_rate), int(opt.iterations)])
        try:
            float(self.model.weights[0])
        except TypeError as e:
            seen.append(str(e).split(". Got")[0])

for mode in ("plain", "pipeline", "replicas"):
    seen = []
    strategy = (tf.distribute.get_strategy() if mode == "plain" else
                keras_smp.SMPStrategy(partitions=2, microbatches=2)
                if mode == "pipeline" else
                keras_smp.SMPStrategy(local_devices=2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1)])
        if mode == "pipeline":
            model = keras_smp.DistributedModel(model)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=8, epochs=2,
              verbose=0, callbacks=[Log()])
    print("SEEN", mode, json.dumps(seen))
"""
    out = run_python(["-c", code]).stdout
    seen = {line.split()[1]: json.loads(line.split(None, 2)[2])
            for line in out.splitlines() if line.startswith("SEEN")}
    assert sorted(seen) == ["pipeline", "plain", "replicas"], out
    # The rate (a float32 variable), the step counts after each epoch, and
    # Keras' own refusal of a kernel.
    refusal = "Only scalar arrays can be converted to Python scalars"
    rate = float(np.float32(0.01))
    assert seen["plain"] == [[rate, 2], refusal, [rate, 4], refusal]
    assert seen["pipeline"] == seen["plain"]
    assert seen["replicas"] == seen["plain"]
