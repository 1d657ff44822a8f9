"""SMP's custom-loop API: `smp.init`, `@smp.step`, `StepOutput`."""

import json
import os

import numpy as np
import pytest

from conftest import RTOL
from conftest import WORKERS
from conftest import launch
from conftest import run_python
from conftest import scaled_atol


@pytest.mark.parametrize("grads", ["get_gradients", "tape",
                                   "tape_added_losses", "loss_scale",
                                   "dropout"])
def test_step_training_matches_full_batch_training(grads):
    # partitions=2, microbatches=4: gradients accumulated over microbatches
    # inside @smp.step equal the whole batch's, with SGD + momentum; with
    # activity regularizers on both stages, `model.losses` inside the step
    # holds the microbatch's (each a mean over its rows). "loss_scale":
    # mixed_float16 with a LossScaleOptimizer whose scale is set far
    # above float16's range before step 1 (back to 2^10 for step 2): both
    # loops skip it. The
    # pipelined step was traced before its optimizer was built: Keras'
    # `scale_loss` would have kept multiplying by `initial_scale` (2^10)
    # there, applying step 1 with its gradients divided by 2^40.
    # "dropout": Dropout and GaussianNoise layers on the stages; each
    # microbatch drew the first rows of the batch's masks (other training)
    # before keras-smp drew each its own rows of them; their seed
    # generators advance once per step, as in the plain loop.
    out = run_python([f"{WORKERS}/custom_loop_fit.py", grads]).stdout
    r = json.loads(out.split("RESULT ", 1)[1])
    assert r["stages"] == 2 and r["microbatches"] == 4
    assert r["moved"] > 1e-3
    assert r["seeds"][0] == r["seeds"][1], r
    if grads == "dropout":
        assert r["seeds"][0] == [[5, 3], [6, 3]], r
    if grads == "loss_scale":
        assert r["scales"] == [[2.0 ** 10] * 2, [2.0 ** 39] * 2,
                               [2.0 ** 10] * 2], r
        assert r["iterations"] == [2, 2], r
        # float16 activations: four float16 ulps (2^-11 each), relative
        # and per unit of magnitude, as test_model_zoo's mixed_float16.
        assert r["weight_diff"] <= 2e-3 * r["magnitude"], r
        assert r["logit_diff"] <= 2e-3 * r["logit_magnitude"], r
        np.testing.assert_allclose(r["losses"], r["plain_losses"],
                                   rtol=2e-3)
        return
    assert r["weight_diff"] <= 1e-6, r
    assert r["logit_diff"] <= 1e-5, r
    np.testing.assert_allclose(r["losses"], r["plain_losses"], rtol=1e-5)


@pytest.mark.parametrize("layout", ["default", "stages"])
def test_step_keeps_one_microbatch_gradient_at_a_time(layout):
    # tests/workers/custom_loop_memory.py: 2 stages x 8 microbatches, 64 MB
    # of weights, small activations; in one process (the default layout)
    # and one stage per process (2 processes, 32 MB of weights each). The
    # weights exist before the training steps (a forward step made them).
    # Every microbatch's gradients were returned by the step, alive until
    # `accumulate()` added them. The control (`--keep`) holds them in
    # Python (its training step runs eagerly): two steps grow a process's
    # peak resident set by 10.4x its weights in one process, 10.6x per
    # stage process (AMD EPYC, every run). Traced into one graph, the same
    # sums measured 3.9x - 10.8x there, as the executor's order let it
    # free each gradient once added or not: too variable for a control
    # (it failed CI once). Summed inside the step, each microbatch's
    # gradient computed after the earlier ones' sum, a step holds the sum,
    # one microbatch's gradient and the update's temporaries: measured
    # 2.0x and 2.4x - 2.9x. Bounds: 4x for the sum; the control must cost
    # 3x the weights more, so the test sees the difference it claims.
    # Memory is each process's measured VmHWM, not computed from shapes.
    def measure(*flags):
        if layout == "stages":
            out = launch(2, [f"{WORKERS}/custom_loop_memory.py", "--stages",
                             *flags], timeout=300).stdout
        else:
            out = run_python([f"{WORKERS}/custom_loop_memory.py", *flags],
                             timeout=300).stdout
        return sorted((json.loads(line.split("RESULT ", 1)[1])
                       for line in out.splitlines() if "RESULT " in line),
                      key=lambda r: r["rank"])

    summed, kept = measure(), measure("--keep")
    assert len(summed) == len(kept) == (2 if layout == "stages" else 1)
    for s, k in zip(summed, kept):
        weights = s["weights_mb"]
        grown = {"summed": s["peak_mb"] - s["built_mb"],
                 "kept": k["peak_mb"] - k["built_mb"]}
        assert grown["summed"] <= 4 * weights, (s["rank"], grown, weights)
        assert grown["kept"] >= grown["summed"] + 3 * weights, (
            s["rank"], grown, weights)
        # The same sums (TensorFlow's graph optimizer may regroup the
        # additions outside the step: measured 1 float32 ulp of the loss,
        # 4e-9 of the weights' magnitude); each weight's sum compared per
        # unit of its sum of magnitudes (the sum itself cancels).
        np.testing.assert_allclose(s["losses"], k["losses"], rtol=1e-6)
        for a, b, size in zip(s["digest"], k["digest"], s["abs_sum"]):
            assert abs(a - b) <= 1e-6 * size, (s["rank"], a, b, size)


def test_step_output_of_a_summed_gradient(tf_smp):
    # A gradient the step returns as `get_gradients` or a tape gave it is
    # summed inside the step: accumulate / reduce_mean / reduce_sum equal
    # those of the microbatches' gradients (`sum_gradients=False`), and
    # what needs each microbatch's value says how to keep them. Other
    # gradients stay per microbatch: a changed one (`g * 2`), an input's
    # (`tape.watch`), and a tensor's passed whole (`non_split_inputs`).
    tf, smp = tf_smp
    import keras

    model = smp.DistributedModel(keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)]))
    opt = keras.optimizers.SGD()

    def body(x, scale):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, scale])
            loss = keras.ops.mean(model(x * scale, training=True) ** 2)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        return (opt.get_gradients(loss, variables), grads, loss,
                [g * 2 for g in grads], tape.gradient(loss, x),
                tape.gradient(loss, scale))

    x = np.random.RandomState(0).randn(8, 3).astype("float32")
    scale = tf.constant(1.5)
    got, taped, loss, doubled, dx, dscale = smp.step(
        body, non_split_inputs=["scale"])(x, scale)
    each, each_taped, _, each_doubled, _, _ = smp.step(
        body, non_split_inputs=["scale"], sum_gradients=False)(x, scale)
    # Not gradients of weights as the step computed them: every
    # microbatch's value.
    for out in [loss, dx, dscale] + doubled:
        assert len(out.outputs) == 4, out
    assert dx.merge().shape == (8, 3)
    for a, b in zip(doubled, each_doubled):
        np.testing.assert_allclose(a.accumulate(), b.accumulate(),
                                   rtol=1e-6, atol=scaled_atol(b.outputs))
    for a, b in zip(got + taped, each + each_taped):
        assert len(b.outputs) == 4 and not hasattr(a, "outputs")
        # (TensorFlow's graph optimizer may regroup the additions: float32
        # rounding, per unit of magnitude.)
        atol = scaled_atol(b.outputs, 1e-7)
        np.testing.assert_allclose(a.accumulate(), b.accumulate(),
                                   rtol=1e-6, atol=atol)
        np.testing.assert_allclose(a.reduce_mean(), b.reduce_mean(),
                                   rtol=1e-6, atol=atol)
        np.testing.assert_allclose(a.reduce_sum(), np.sum(b.outputs, 0),
                                   rtol=1e-6, atol=4 * atol)
        for what in ("outputs", "merge", "concat", "stack"):
            with pytest.raises(ValueError, match=r"gradient of .*added up "
                               r"over the 4 microbatches.*"
                               r"@smp.step\(sum_gradients=False\)"):
                value = getattr(a, what)
                value()


@pytest.mark.parametrize("grads,processes", [
    ("get_gradients", 1), ("tape", 1), ("get_gradients", 2)])
def test_sparse_gradients_with_adam_match_full_batch_training(
        grads, processes):
    # tests/workers/custom_loop_sparse.py: a token embedding (ids repeat)
    # and a position embedding looked up at ops.arange(length), Adam, 2
    # stages x 4 microbatches (and 2 data-parallel processes).
    # accumulate() made the sparse gradients dense, merging a repeated
    # id's rows, which Adam (squaring each row) applies otherwise: weights
    # 0.125 from plain Keras after 4 steps, even with 1 microbatch. They
    # stay sparse now: token rows one microbatch (and replica) after
    # another, the position embedding's added position by position
    # (concatenated: 0.017; 0.025 over 2 processes). Bound: float32
    # rounding of the same sums in another order (measured 8e-8).
    worker = [f"{WORKERS}/custom_loop_sparse.py", grads]
    out = (run_python(worker) if processes == 1
           else launch(processes, worker)).stdout
    r = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert r["kinds"][:2] == ["IndexedSlices", "IndexedSlices"], r
    assert r["replicas"] == processes, r
    assert r["moved"] > 0.1, r
    assert r["diff"] <= 1e-6, r


def test_replicas_with_sparse_gradients_of_different_sizes_fail_saying_so():
    # tests/workers/custom_loop_sparse.py uneven: the two processes' token
    # sequences are 6 and 5 long, unknown when the step is traced. Their
    # sparse gradients are gathered over the replicas, which needs as
    # many rows on each: both fail in accumulate() saying so (a
    # collective of different shapes gave TensorFlow's own error).
    proc = launch(2, [f"{WORKERS}/custom_loop_sparse.py", "uneven"],
                  check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NO ERROR" not in out, out[-3000:]
    for rank in (0, 1):
        raised = [line for line in out.splitlines()
                  if line.startswith(f"[{rank}] RAISED")]
        assert raised, out[-3000:]
        assert ("StepOutput.accumulate: the data-parallel replicas hold "
                "different numbers of rows in a sparse gradient") in \
            raised[0], raised[0]
        assert f"[Rows on this replica:] [{8 * (6 - rank)}]" in raised[0], \
            raised[0]


@pytest.fixture
def tf_smp():
    import tensorflow as tf

    import keras_smp as smp
    from keras_smp import state

    smp.init({"partitions": 2, "microbatches": 4})
    yield tf, smp
    state.reset()


def test_step_output_methods_match_direct_computation(tf_smp):
    tf, smp = tf_smp
    rng = np.random.RandomState(0)
    parts = [rng.randn(3, 2).astype("float32") for _ in range(4)]
    out = smp.StepOutput([tf.constant(p) for p in parts])
    np.testing.assert_allclose(out.reduce_sum(), np.sum(parts, axis=0),
                               rtol=1e-6)
    np.testing.assert_allclose(out.reduce_mean(), np.mean(parts, axis=0),
                               rtol=1e-6)
    np.testing.assert_array_equal(out.concat(), np.concatenate(parts))
    np.testing.assert_array_equal(out.concat(axis=1),
                                  np.concatenate(parts, axis=1))
    np.testing.assert_array_equal(out.stack(), np.stack(parts))
    for method in ("variable", "add_n", "accumulate_n"):
        np.testing.assert_allclose(out.accumulate(method),
                                   np.mean(parts, axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown method='sum'"):
        out.accumulate("sum")
    assert smp.StepOutput([None, None]).accumulate() is None


def test_merge_restores_the_original_sample_order(tf_smp):
    tf, smp = tf_smp

    @smp.step
    def identity(x, scale):
        return x * scale, tf.reduce_sum(x)

    x = np.arange(32, dtype="float32").reshape(16, 2)
    rows, sums = identity(x, 1.0)
    assert len(rows.outputs) == 4 and rows.outputs[0].shape == (4, 2)
    np.testing.assert_array_equal(rows.merge(), x)
    np.testing.assert_allclose(sums.reduce_sum(), x.sum())


def test_non_split_inputs_and_split_axes(tf_smp):
    tf, smp = tf_smp

    @smp.step(non_split_inputs=["table"], input_split_axes={"x": 1})
    def f(x, table):
        return x * 2.0, tf.shape(table)[0]

    x = np.arange(16, dtype="float32").reshape(2, 8)  # batch along axis 1
    cols, table_rows = f(x, np.ones((5, 3), "float32"))
    np.testing.assert_array_equal(table_rows.stack(), [5, 5, 5, 5])
    assert cols.outputs[0].shape == (2, 2)  # 8 columns / 4 microbatches
    np.testing.assert_array_equal(cols.merge(), x * 2.0)  # merged on axis 1


def test_merge_of_arguments_split_along_different_axes(tf_smp):
    # A time-major input split on axis 1 beside batch-major labels: the
    # outputs are batch-major, merged on axis 0 (merging every output on
    # the input's axis gave predictions of shape (4, 12) for (16, 3)).
    tf, smp = tf_smp

    @smp.step(input_split_axes={"seq": 1})
    def f(seq, labels):
        return tf.transpose(seq[-1:], [1, 0, 2])[:, 0], labels

    seq = np.random.RandomState(0).randn(5, 16, 3).astype("float32")
    labels = np.arange(16)
    last, got = f(seq, labels)
    assert last.outputs[0].shape == (4, 3)
    np.testing.assert_array_equal(last.merge(), seq[-1])
    np.testing.assert_array_equal(got.merge(), labels)
    np.testing.assert_array_equal(last.merge(axis=1),
                                  np.concatenate(last.outputs, axis=1))


def test_step_arguments_without_a_batch_axis_are_named(tf_smp):
    tf, smp = tf_smp

    @smp.step
    def f(x, temperature):
        return x / temperature

    x = np.ones((8, 2), "float32")
    np.testing.assert_array_equal(f(x, 2.0).merge(), x / 2)  # Python: whole
    with pytest.raises(ValueError, match=r"argument 'temperature' is a "
                       r"tensor of shape \(\), with no axis 0 .*"
                       r"non_split_inputs=\['temperature'\]"):
        f(x, tf.constant(2.0))
    whole = smp.step(f.python_function, non_split_inputs=["temperature"])
    np.testing.assert_array_equal(whole(x, tf.constant(2.0)).merge(), x / 2)


def test_model_call_arguments_a_step_cannot_trace_are_refused(tf_smp):
    # The stages are traced from call(inputs, training): another argument
    # (`scale`, a positional `training`) was silently dropped.
    tf, smp = tf_smp
    import keras

    class Scaled(smp.DistributedModel):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(4)
            self.d2 = keras.layers.Dense(2)

        def call(self, x, training=None, scale=1.0):
            return self.d2(self.d1(x)) * scale

    model = Scaled()
    x = np.ones((8, 3), "float32")

    @smp.step
    def keyword(x):
        return model(x, training=False, scale=10.0)

    @smp.step
    def positional(x):
        return model(x, True)

    @smp.step
    def plain(x):
        return model(x, training=False)

    with pytest.raises(TypeError, match=r"received also scale\. Pass "
                       r"`training` by keyword"):
        keyword(x)
    with pytest.raises(TypeError, match=r"received also positional argument 2 "
                       r"\(True\)"):
        positional(x)
    # Microbatches of 2 rows against 8: other kernel shapes, float32 rounding.
    np.testing.assert_allclose(plain(x).merge(), model(x), rtol=RTOL,
                               atol=scaled_atol(model(x)))


def test_init_again_with_the_same_config_or_a_clear_error(tf_smp):
    # A notebook cell run twice: the same config is a no-op; another one
    # cannot apply to the models and steps already made with the first.
    tf, smp = tf_smp
    config = smp.init({"partitions": 2, "microbatches": 4})
    assert config.microbatches == 4
    with pytest.raises(ValueError, match=r"already called in this process, "
                       r"with another config: microbatches: 4 -> 2\. "):
        smp.init({"partitions": 2, "microbatches": 2})
    assert smp.init({"partitions": 2, "microbatches": 4}) is config


def test_step_rejects_a_batch_not_divisible_by_microbatches(tf_smp):
    tf, smp = tf_smp

    @smp.step
    def f(x):
        return x

    with pytest.raises(ValueError, match=r"'x' \(axis 0\) of 10 samples does not divide into "
                       r"microbatches=4"):
        f(np.zeros((10, 2), "float32"))
    with pytest.raises(ValueError, match=r"\['nope'\].*not arguments"):
        smp.step(f.python_function, non_split_inputs=["nope"])


def test_get_gradients_outside_a_step_says_what_to_use(tf_smp):
    tf, smp = tf_smp
    import keras

    opt = keras.optimizers.SGD()
    v = keras.Variable(1.0)
    with pytest.raises(RuntimeError, match="GradientTape"):
        opt.get_gradients(v * 2.0, [v])


# -- several processes: data parallel replicas, checkpoints, comms ---------

DP = f"{WORKERS}/custom_loop_dp.py"


def _read(out, rank):
    with open(f"{out}/rank{rank}.json") as f:
        return json.load(f)


def _max_diff(a, b):
    return max(float(np.abs(np.array(x) - np.array(y)).max())
               for x, y in zip(a, b))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """2 processes x 2 stages, 4 uninterrupted steps (+ save_model)."""
    from conftest import launch

    root = tmp_path_factory.mktemp("custom_loop_dp")
    launch(2, [DP, "--steps", "4", "--out", f"{root}/full",
               "--save-model", f"{root}/saved"], timeout=240)
    return root


@pytest.mark.slow
def test_custom_loop_across_processes_matches_full_batch_training(full_run):
    r0, r1 = _read(f"{full_run}/full", 0), _read(f"{full_run}/full", 1)
    assert r0["dp_size"] == 2 and r0["iterations"] == 4
    # Rank 1 started from other random weights (another seed): the first
    # step copied rank 0's, and accumulate() averaged gradients since.
    assert _max_diff(r0["weights"], r1["weights"]) == 0.0
    assert _max_diff(r0["weights"], r0["initial"]) > 1e-2
    assert _max_diff(r0["weights"], r0["plain_weights"]) <= 1e-6
    # `loss.reduce_mean()` averages over the replicas too (as accumulate):
    # the global batch's loss, on each replica (each returned its own
    # half's, and replicas reducing gradients with it diverged).
    for r in (r0, r1):
        np.testing.assert_allclose(r["losses"], r0["plain_losses"],
                                   rtol=1e-5)
        assert r["global_rows"] == 32.0, r["global_rows"]  # reduce_sum


@pytest.mark.slow
def test_communication_helpers_across_processes(full_run):
    r0, r1 = _read(f"{full_run}/full", 0), _read(f"{full_run}/full", 1)
    for r in (r0, r1):
        assert r["comms"]["broadcast"] == {"from": 0}
        assert r["comms"]["allgather"] == [0, 10]
        assert r["comms"]["dp_allgather"] == [0, 1]
    assert r0["comms"]["recv"] == ["hello from 1"]
    assert r1["comms"]["recv"] == {"to": 1, "arr": [0]}
    # SMP's pattern: smp.broadcast on rank 0, smp.recv_from(0) on the
    # others (it waited for a key broadcast never wrote), with keras-smp's
    # own broadcast (the first step's copy of rank 0's weights) between.
    assert r1["comms"]["smp_broadcast"] == {"smp": "pattern"}
    # A broadcast receiving a send's object instead: a clear error.
    assert r0["comms"]["mixed"] is None
    assert "was sent with smp.send, not smp.broadcast" in r1["comms"][
        "mixed"]
    assert r1["comms"]["after_mixed"] == ["sent first", "broadcast"]


@pytest.mark.slow
def test_save_model_writes_one_unpartitioned_saved_model(full_run):
    # Loaded in a fresh process without keras-smp: same predictions.
    r0 = _read(f"{full_run}/full", 0)
    code = (
        "import json, sys, numpy as np, tensorflow as tf\n"
        f"r = json.load(open('{full_run}/full/rank0.json'))\n"
        f"m = tf.saved_model.load('{full_run}/saved')\n"
        "y = m.serve(np.array(r['x'], 'float32')).numpy()\n"
        "print('DIFF', float(np.abs(y - np.array(r['predict'])).max()))\n"
        "print('VARS', sum(int(np.prod(v.shape)) for v in m.variables))\n")
    out = run_python(["-c", code]).stdout
    assert float(out.split("DIFF ")[1].split()[0]) <= 1e-6
    n = sum(np.array(w).size for w in r0["weights"])
    assert int(out.split("VARS ")[1].split()[0]) == n


@pytest.mark.slow
def test_checkpoint_restored_in_fresh_processes_continues_exactly(
        full_run, tmp_path):
    from conftest import launch

    ckpt = f"{tmp_path}/ckpt"
    first = launch(2, [DP, "--steps", "4", "--stop-at", "2", "--ckpt", ckpt,
                       "--out", f"{tmp_path}/a"], timeout=240)
    assert "saved at step 2" in first.stdout
    # Fresh processes; restore() comes before the model has any weights.
    launch(2, [DP, "--steps", "4", "--ckpt", ckpt,
               "--out", f"{tmp_path}/b"], timeout=240)
    full, resumed = _read(f"{full_run}/full", 0), _read(f"{tmp_path}/b", 0)
    assert resumed["start"] == 2 and resumed["iterations"] == 4
    np.testing.assert_allclose(resumed["losses"], full["losses"][2:],
                               rtol=1e-6)
    assert _max_diff(resumed["weights"], full["weights"]) <= 1e-7


def test_communication_helpers_reject_bad_ranks_and_groups(tf_smp):
    tf, smp = tf_smp
    assert smp.broadcast({"a": 1}) == {"a": 1}
    assert smp.allgather(5, smp.CommGroup.DP_GROUP) == [5]
    smp.barrier()
    with pytest.raises(ValueError, match="DP_RANK 3 is out of range.*1 ranks"):
        smp.send("x", 3, smp.RankType.DP_RANK)
    with pytest.raises(ValueError, match="cannot send to itself"):
        smp.send("x", 0)
    with pytest.raises(ValueError, match="Unknown communication group 'nope'"):
        smp.broadcast(1, "nope")
    with pytest.raises(TypeError, match="rank must be an int"):
        smp.recv_from("0")


def test_checkpoint_manager_rejects_what_is_not_a_checkpoint(tf_smp, tmp_path):
    tf, smp = tf_smp
    with pytest.raises(TypeError, match="expects a tf.train.Checkpoint"):
        smp.CheckpointManager({"model": None}, str(tmp_path))


@pytest.mark.slow
def test_a_failing_rank_ends_a_peers_wait_in_a_communication_helper():
    # tests/workers/comms_peer_fails.py: rank 1 raises; rank 0 waits for it
    # in smp.recv_from (the coordination service's key-value store, which
    # the failure report does not abort), collective_timeout_seconds=300.
    # Rank 0 must stop with rank 1's error well before that: the wait goes
    # in 1 s slices, looking for a rank that said it failed between them.
    import subprocess
    import sys

    from conftest import ROOT, env
    from keras_smp.launch import free_ports, make_tf_config

    ports = free_ports(2)
    procs = [subprocess.Popen(
        [sys.executable, f"{WORKERS}/comms_peer_fails.py"],
        env=env(TF_CONFIG=make_tf_config(ports, i)), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    err0 = outs[0][1]
    assert procs[1].returncode != 0 and procs[0].returncode != 0, err0[-3000:]
    assert ("keras-smp: rank 0 stopped in recv_from (waiting for rank 1): "
            "rank 1 failed with ValueError: rank 1 fails on purpose before "
            "it sends. That rank's log has the traceback") in err0, \
        err0[-3000:]
    waited = float(err0.split("WAITED ")[1].split()[0])
    assert waited < 60, waited  # the timeout is 300 s


# -- one pipeline stage per process (smp.init's local_devices=1) -----------

STAGES = f"{WORKERS}/custom_loop_stages.py"


def _assert_held_equal_reference(rank, ref):
    """A stage process's weights equal plain Keras': float32 rounding of
    the same sums in another order, through Adam steps (which divide by
    the gradient's own size) and the global norm's clipping (measured 1.1e-6
    on the embedding, magnitude 0.65): the suite's bound, rtol 1e-5 and
    1e-6 absolute per unit of magnitude."""
    for k, v in rank["held"].items():
        want = np.array(ref["weights"][k])
        np.testing.assert_allclose(v, want, rtol=RTOL,
                                   atol=scaled_atol(want), err_msg=k)


def _assert_stage_run_equals_reference(r, ref):
    """A stage process's custom loop (3 steps), forward-only step, Keras
    `evaluate`, and the step of Keras' `fit` after them, against plain
    Keras on the whole batch."""
    # Losses: float32 means of microbatch means vs one mean (1e-7
    # measured); rtol 1e-5 as the other custom-loop tests.
    np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(r["eval_loss"], ref["eval_loss"], rtol=1e-5)
    # Keras' evaluate after compile: the same model in `fit`'s pipeline
    # (smp.init made its strategy current).
    np.testing.assert_allclose(r["keras_evaluate"], ref["eval_loss"],
                               rtol=1e-5)
    rows = len(r["predictions"])
    lo = r["dp_rank"] * rows
    # Logits of magnitude ~1: 1e-6 absolute (measured 1.2e-7).
    np.testing.assert_allclose(
        r["predictions"], np.array(ref["predictions"])[lo:lo + rows],
        atol=1e-6)
    _assert_held_equal_reference(r, ref)
    assert r["iterations"] == 3
    # Then Keras' `fit` under smp.init's strategy (the same optimizer, its
    # state continued): one step of plain Keras' on the global batch, in
    # the same bounds.
    np.testing.assert_allclose(r["fit_loss"], ref["fit_loss"], rtol=1e-5)
    _assert_held_equal_reference(dict(held=r["held_after_fit"]),
                                 dict(weights=ref["held_after_fit"]))


def _reference(root, name="ref"):
    with open(f"{root}/{name}/reference.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """Plain Keras on the whole batch (one process), then @smp.step with
    one stage per process: 2 processes (gradients from a tape; the second
    stage's process passes other batches, the first stage's count), 2 stages
    x 2 replicas (`get_gradients`; `save_model` after the custom loop), 2
    processes with regularizers on both stages, 2 with the embedding frozen
    (and their references), 2 stages x 2 replicas with mixed_float16 and a
    LossScaleOptimizer; every run ends with a step of Keras' `fit`."""
    root = tmp_path_factory.mktemp("custom_loop_stages")
    fit = "--keras-fit"  # every run ends with a step of Keras' `fit`
    run_python([STAGES, "--reference", fit, "--out", f"{root}/ref"])
    run_python([STAGES, "--reference", "--regularized", fit, "--out",
                f"{root}/ref_regularized"])
    launch(2, [STAGES, "--grads", "tape", "--other-data", fit, "--out",
               f"{root}/2"])
    launch(4, [STAGES, fit, "--out", f"{root}/4", "--save-model",
               f"{root}/saved"], timeout=400)
    launch(2, [STAGES, "--regularized", fit, "--out",
               f"{root}/regularized"])
    run_python([STAGES, "--reference", "--frozen-embedding", fit, "--out",
                f"{root}/ref_frozen"])
    launch(2, [STAGES, "--frozen-embedding", fit, "--out",
               f"{root}/frozen"])
    run_python([STAGES, "--reference", "--loss-scale", fit, "--out",
                f"{root}/ref_loss_scale"])
    launch(4, [STAGES, "--loss-scale", "--grads", "tape", fit, "--out",
               f"{root}/loss_scale"], timeout=400)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("run,processes", [("2", 2), ("4", 4),
                                           ("regularized", 2),
                                           ("frozen", 2)])
def test_one_stage_per_process_custom_loop_matches_full_batch_training(
        stage_runs, run, processes):
    # SMP's layout: every process holds and trains only its stage. The
    # stages' transfers are custom gradients (collectives), the outputs
    # broadcast to the pipeline, the loss computed on every stage process
    # (Keras' losses not divided by the replicas), `global_clipnorm` over
    # both stages' gradients, token-embedding rows kept sparse for Adam.
    # "regularized": an activity regularizer on stage 0, a kernel
    # regularizer on stage 1, `model.losses` (both stages' terms, summed
    # over the processes) added to the step's loss. "frozen": the
    # embedding (stage 0) frozen, as a fine-tuned backbone: its process
    # builds no backward, and takes part in the global norm with nothing.
    ref = _reference(stage_runs, {"regularized": "ref_regularized",
                                  "frozen": "ref_frozen"}.get(run, "ref"))
    ranks = [_read(f"{stage_runs}/{run}", r) for r in range(processes)]
    paths = sorted(ref["weights"])
    for r in ranks:
        _assert_stage_run_equals_reference(r, ref)
        assert r["held_after_fit"].keys() == r["held"].keys()
        moved = max(float(np.max(np.abs(np.subtract(r["held_after_fit"][k],
                                                     r["held"][k]))))
                    for k in r["held"])
        frozen = run == "frozen" and r["pp_rank"] == 0
        assert moved == 0 if frozen else moved > 1e-3, moved  # `fit` trained
        # Nothing of the other stage here: its weights have no storage,
        # the optimizer no slots for them (Adam: 2 per weight held).
        held = set(r["held"])
        assert held and held != set(paths)
        assert all(r["sizes"][k] == 0 for k in paths if k not in held)
        own = sum(r["sizes"][k] for k in held)
        slots = sum(n for k, n in r["slots"].items()
                    if k.endswith(("_momentum", "_velocity")))
        assert slots == (0 if frozen else 2 * own), (r["slots"], own)
    # The stages partition the model; replicas of a stage hold the same.
    by_stage = {}
    for r in ranks:
        by_stage.setdefault(r["pp_rank"], []).append(r)
    assert sorted(by_stage) == [0, 1]
    # (so the regularized run has a regularizer on each stage)
    assert list(by_stage[0][0]["held"]) == ["model/embedding/embeddings"]
    assert sorted(k for s in by_stage.values() for k in s[0]["held"]) \
        == paths
    for same in by_stage.values():
        assert all(r["held"] == same[0]["held"] for r in same)
        assert len(same) == processes // 2


# The tied embedding with 2 stages x 2 replicas: each stage's part is
# averaged over its replicas, then summed over the stages of its replica.
TIED_PROCESSES = {"shared": 2, "tied": 4, "shared_lookup": 2}


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    """Weights two stages use, in @smp.step with one stage per process
    (and their references): a Dense layer called in both stages (SGD), a
    tied `ReversibleEmbedding` and an Embedding looked up in both stages
    (Adam); each ends with a step of Keras' `fit`. A collective timeout of
    60 s: a stage waiting for a transfer that never comes fails in a
    minute, not five."""
    root = tmp_path_factory.mktemp("custom_loop_tied")
    for flag in ("--shared", "--tied", "--shared-lookup"):
        name = flag.lstrip("-").replace("-", "_")
        run_python([STAGES, "--reference", flag, "--keras-fit", "--out",
                    f"{root}/ref_{name}"])
        launch(TIED_PROCESSES[name], [STAGES, flag, "--keras-fit", "--out",
                                      f"{root}/{name}"],
               extra_env={"SMP_CONFIG": '{"collective_timeout_seconds": 60}'})
    return root


@pytest.mark.slow
def test_one_stage_per_process_custom_loop_draws_the_whole_batchs_masks(
        tmp_path):
    # A seeded Dropout (stage 0) and GaussianNoise (stage 1), 2 stages x 2
    # replicas (each replica its contiguous half of the global batch), 4
    # microbatches: each microbatch of each replica draws its rows of the
    # masks and noise plain Keras draws for the whole batch (before, every
    # microbatch drew the first rows: losses 0.1 apart), and each seed
    # generator advances once per step. Then Keras' `fit`, which calls
    # this model (its `call` takes no `training`) without one, as Keras
    # does: the random layers infer (keras-smp told them training=True:
    # fit's loss 0.06 apart).
    run_python([STAGES, "--reference", "--dropout", "--keras-fit", "--out",
                f"{tmp_path}/ref"])
    launch(4, [STAGES, "--dropout", "--keras-fit", "--out",
               f"{tmp_path}/run"],
           extra_env={"SMP_CONFIG": '{"collective_timeout_seconds": 60}'})
    ref = _reference(tmp_path)
    for rank in range(4):
        r = _read(f"{tmp_path}/run", rank)
        _assert_stage_run_equals_reference(r, ref)
        own = ("seed_generator/seed_generator_state" if r["pp_rank"] == 0
               else "seed_generator_1/seed_generator_state")
        for when in ("seeds_before_fit", "seeds_after_fit"):
            assert r[when][own] == ref[when][own], (rank, when, r[when])
        assert ref["seeds_before_fit"][own][1] == 3  # one advance a step


@pytest.mark.slow
@pytest.mark.parametrize("run,tied", [
    ("shared", ["model/dense_2/bias", "model/dense_2/kernel"]),
    ("tied", ["model/reversible_embedding/embeddings"]),
    ("shared_lookup", ["model/embedding/embeddings"])])
def test_one_stage_per_process_custom_loop_trains_weights_stages_share(
        tied_runs, run, tied):
    # A layer called in both stages ("shared": its Dense kernel and bias,
    # dense gradient parts), and a GPT-style tied embedding ("tied": the
    # lookup's sparse part in stage 0, the output projection's dense part
    # in stage 1; Keras' ReversibleEmbedding), and an Embedding looked up
    # in both stages ("shared_lookup", as an encoder-decoder's shared
    # token embedding: two sparse parts, their rows gathered). Each stage
    # process holds a
    # copy and its step gives its own stages' part of the gradient; the
    # optimizer sums the parts over the two stages' processes, and the
    # global norm ("shared" and "shared_lookup": `global_clipnorm`; in
    # "shared" counting it twice changed the clipping) counts the weight
    # once ("tied" runs 2 stages x 2
    # replicas, without clipping, with a LossScaleOptimizer
    # around a MultiOptimizer: summed once, not again by the inner
    # optimizer applying it). "shared_lookup"'s stage 1 also reads the
    # token ids and a float tensor stage 0 computes from them without
    # weights: their gradients, sent back, were never received (the next
    # stage's send waited until the collective timeout).
    # It was refused ("weights used by several stages").
    ref = _reference(tied_runs, f"ref_{run}")
    ranks = [_read(f"{tied_runs}/{run}", r)
             for r in range(TIED_PROCESSES[run])]
    for r in ranks:
        # (measured: losses 2.4e-7; weights at most 0.015, 0.023 and 0.11
        # of the suite's bound)
        _assert_stage_run_equals_reference(r, ref)
        # Each process holds the shared weights (and Adam's slots for them)
        for k in tied:
            assert k in r["held"], (k, sorted(r["held"]))
            if run != "shared":  # (Adam; "shared" trains with SGD)
                name = k.replace("/", "_")
                assert [n for s, n in r["slots"].items()
                        if s.endswith(f"/{name}_momentum")] \
                    == [r["sizes"][k]], (k, r["slots"])
                assert r["sizes"][k] > 0
    # ... and every copy took the same steps: equal to the bit.
    for k in tied:
        for r in ranks[1:]:
            assert r["held"][k] == ranks[0]["held"][k], k
            assert r["held_after_fit"][k] == ranks[0]["held_after_fit"][k]
    # Nothing else of the other stage is held.
    stage = {r["pp_rank"]: set(r["held"]) for r in ranks}
    assert sorted(stage) == [0, 1]
    assert stage[0] & stage[1] == set(tied)
    assert sorted(stage[0] | stage[1]) == sorted(ref["weights"])


@pytest.mark.slow
def test_one_stage_per_process_loss_scaling_skips_together(stage_runs):
    # mixed_float16 with a LossScaleOptimizer in the SMP custom loop (the
    # step scales its loss with `optimizer.scale_loss`; `apply_gradients`
    # unscales), 2 stages x 2 replicas. The reference records where its
    # gradients are finite: step 1's overflow in the first stage only
    # (the worker's `Amplify`), steps 0 and 2 finite. Every process must
    # skip step 1 (the second stage's own gradients are finite), halve
    # nothing it should not, and keep one scale: Keras' `apply` refused to
    # run outside a replica context ("apply() must be called in a replica
    # context"), and a scale read before the optimizer was built stayed
    # `initial_scale` in the traced step (it must follow the variable).
    ref = _reference(stage_runs, "ref_loss_scale")
    assert ref["finite"] == [[True, True], [False, True], [True, True]]
    # (doubled after each finite step, halved after the skip)
    assert ref["scales"] == [2.0 ** 11, 2.0 ** 15, 2.0 ** 11]
    assert ref["iterations"] == 2  # step 1 skipped
    ranks = [_read(f"{stage_runs}/loss_scale", r) for r in range(4)]
    assert sorted(r["pp_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        assert r["scales"] == ref["scales"]
        assert r["iterations"] == ref["iterations"]
        # float16 activations: four float16 ulps (2^-11 each), relative
        # and per unit of magnitude, as test_model_zoo's mixed_float16
        # (measured: losses 2e-5, weights 8e-4 of their magnitude).
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=2e-3)
        np.testing.assert_allclose(r["fit_loss"], ref["fit_loss"],
                                   rtol=2e-3)
        for held, weights in ((r["held"], ref["weights"]),
                              (r["held_after_fit"], ref["held_after_fit"])):
            assert held
            for k, v in held.items():
                want = np.array(weights[k])
                np.testing.assert_allclose(
                    v, want, rtol=2e-3,
                    atol=2e-3 * float(np.abs(want).max()), err_msg=k)
        # Guard: the applied steps moved the weights (by far more than
        # the bound), so equality means something.
        moved = max(float(np.max(np.abs(np.subtract(
            r["held_after_fit"][k], r["held"][k])))) for k in r["held"])
        assert moved > 1e-2, moved


@pytest.mark.slow
def test_one_stage_per_process_loss_scale_resumes_from_a_checkpoint(
        tmp_path):
    # mixed_float16 with a LossScaleOptimizer, one stage per process:
    # stopped after step 2 (a checkpoint per stage), resumed in fresh
    # processes. The scale (2^15 after step 1's skip), its growth counter
    # and Adam's state are restored with each stage's checkpoint (the
    # scale variable is made by the first `scale_loss`, before the
    # optimizer is built): step 2 overflows again and is skipped, as in
    # uninterrupted training.
    run_python([STAGES, "--reference", "--loss-scale", "--scale-once",
                "--out", f"{tmp_path}/ref"])
    ref = _reference(tmp_path)
    assert ref["scales"] == [2.0 ** 11, 2.0 ** 15, 2.0 ** 14]
    assert ref["iterations"] == 1
    ckpt = f"{tmp_path}/ckpt"
    flags = ["--loss-scale", "--scale-once", "--ckpt", ckpt]
    first = launch(2, [STAGES, *flags, "--stop-at", "2", "--out",
                       f"{tmp_path}/a"])
    assert first.stdout.count("saved at step 2") == 2
    launch(2, [STAGES, *flags, "--out", f"{tmp_path}/b"])
    for rank in range(2):
        r = _read(f"{tmp_path}/b", rank)
        assert r["start"] == 2
        assert r["scales"] == ref["scales"][2:]
        assert r["iterations"] == ref["iterations"]
        # four float16 ulps, as test_one_stage_per_process_loss_scaling_
        # skips_together (measured 3.7e-4 of magnitude)
        np.testing.assert_allclose(r["losses"], ref["losses"][2:],
                                   rtol=2e-3)
        for k, v in r["held"].items():
            want = np.array(ref["weights"][k])
            np.testing.assert_allclose(
                v, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()),
                err_msg=k)


@pytest.mark.slow
def test_one_stage_per_process_save_model_is_the_whole_model(stage_runs):
    # Loaded in a fresh process without keras-smp: the whole model's
    # weights, predicting what plain Keras predicts.
    ref = _reference(stage_runs)
    x = np.random.RandomState(7 + 3).randint(0, 20, (32, 6)).tolist()
    code = (
        "import json, numpy as np, tensorflow as tf\n"
        f"m = tf.saved_model.load('{stage_runs}/saved')\n"
        f"y = m.serve(np.array({x}, 'int32')).numpy()\n"
        "print('PRED', json.dumps(y.tolist()))\n"
        "print('VARS', sum(int(np.prod(v.shape)) for v in m.variables))\n")
    out = run_python(["-c", code]).stdout
    pred = json.loads(out.split("PRED ")[1].splitlines()[0])
    np.testing.assert_allclose(pred, ref["predictions"], atol=1e-6)
    n = sum(np.array(w).size for w in ref["weights"].values())
    assert int(out.split("VARS ")[1].split()[0]) == n


@pytest.mark.slow
def test_one_stage_per_process_checkpoint_resumes_in_fresh_processes(
        stage_runs, tmp_path):
    # Each stage's first replica writes its stage's checkpoint
    # (pp_rank_P); fresh processes restore before the first step (no
    # weights yet) and end where uninterrupted training ends.
    ref = _reference(stage_runs)
    ckpt = f"{tmp_path}/ckpt"
    first = launch(2, [STAGES, "--ckpt", ckpt, "--stop-at", "2",
                       "--out", f"{tmp_path}/a"])
    assert first.stdout.count("saved at step 2") == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "pp_rank_0", "pp_rank_1"]
    launch(2, [STAGES, "--ckpt", ckpt, "--out", f"{tmp_path}/b"])
    for rank in range(2):
        r = _read(f"{tmp_path}/b", rank)
        assert r["start"] == 2 and r["iterations"] == 3
        np.testing.assert_allclose(r["losses"], ref["losses"][2:],
                                   rtol=1e-5)
        _assert_held_equal_reference(r, ref)


@pytest.mark.slow
@pytest.mark.parametrize("flag,says", [
    ("--shared-bn", "Layer 'batch_normalization' is called on pipeline "
     "ranks [0, 1] and its calls update its weights"),
    ("--frozen-head", "Pipeline stage(s) [1] of DistributedModel 'model' "
     "train no weight"),
    ("--subset", "leaves out every trainable weight of pipeline stage(s) "
     "[0] of DistributedModel 'model'")])
def test_one_stage_per_process_refuses_what_it_does_not_carry(
        tmp_path, flag, says):
    # A BatchNormalization called in both stages: each process would
    # update only its own copy of the moving statistics. A frozen last
    # stage after a trained
    # one: its process would have to relay gradients without a backward
    # of its own (it waited until the timeout). A gradient of the second
    # stage's weights only: the first stage's process built no backward,
    # and the second waited for it to receive its input gradient until the
    # collective timeout. Every rank raises as the step is traced (no rank
    # waits for another's collective).
    out = launch(2, [STAGES, flag, "--out", str(tmp_path)]).stdout
    assert out.count("REFUSED") == 2, out[-3000:]
    assert says in out and "local_devices" in out


def test_one_stage_per_process_refuses_what_smp_init_cannot_run():
    # Checked before anything starts (one process: the set-up's checks).
    code = (
        "import keras_smp.smp.setup as setup, tensorflow as tf\n"
        "for bad in ({'tensor_parallel_degree': 2}, {'horovod': True},\n"
        "            {'virtual_stages': 2, 'microbatches': 2,\n"
        "             'pipeline': 'interleaved_1f1b'}):\n"
        "    try:\n"
        "        setup._start_stage_per_process(dict(partitions=2, "
        "local_devices=1, **bad))\n"
        "    except NotImplementedError as e:\n"
        "        print('REFUSED', e)\n"
        "with tf.distribute.MirroredStrategy(['/cpu:0']).scope():\n"
        "    try:\n"
        "        setup._start_stage_per_process({'partitions': 2, "
        "'local_devices': 1})\n"
        "    except ValueError as e:\n"
        "        print('REFUSED', e)\n")
    out = run_python(["-c", code]).stdout
    assert out.count("REFUSED") == 4, out
    for says in ("tensor_parallel_degree=2", "horovod=True",
                 "virtual_stages=2", "outside any strategy's scope"):
        assert says in out, out


@pytest.mark.slow
def test_one_stage_per_process_custom_loop_carries_ids_a_lambda_computes(
        tmp_path):
    # tests/workers/custom_loop_ints.py: a Lambda's argmax (int32; Keras'
    # graph says float32) crosses to the second stage's Embedding. The
    # stages' collectives disagreed on its dtype; now it travels as int32
    # and the 3 steps equal a tape on one device (float32 bounds).
    worker = os.path.join(WORKERS, "custom_loop_ints.py")
    run_python([worker, str(tmp_path), "--reference"])
    launch(2, [worker, str(tmp_path)],
           extra_env={"SMP_CONFIG": '{"collective_timeout_seconds": 60}'})
    with open(tmp_path / "reference.json") as f:
        ref = json.load(f)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = json.load(f)
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=RTOL,
                                   atol=scaled_atol(ref["loss"]))
        for a, b in zip(got["weights"], ref["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=scaled_atol(b))
