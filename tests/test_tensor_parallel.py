"""Tensor parallelism: the rank layout, the layer API, and training across
real worker processes against single-device training."""

import json
import os

import numpy as np
import pytest

from conftest import ROOT, RTOL, WORKERS, launch, run_python, scaled_atol
from keras_smp import tensor
from keras_smp.runtime.layout import check_tensor_parallel
from keras_smp.topology import Topology

# ---------------------------------------------------------------------------
# Topology (pure Python)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["cluster", "spread"])
@pytest.mark.parametrize("world,pp,tp", [(8, 2, 2), (8, 1, 4), (12, 3, 2),
                                         (4, 1, 1), (6, 1, 3)])
def test_every_rank_has_one_place_and_tp_is_innermost(placement, world, pp,
                                                      tp):
    hosts = ("h",) * world
    topo = Topology(world, 0, hosts, partitions=pp,
                    placement_strategy=placement, tensor_parallel_degree=tp)
    assert (topo.tp_size, topo.pp_size, topo.mp_size) == (tp, pp, pp * tp)
    assert topo.dp_size == world // (pp * tp)
    seen = set()
    for r in range(world):
        t = Topology(world, r, hosts, partitions=pp,
                     placement_strategy=placement, tensor_parallel_degree=tp)
        coords = (t.pp_rank, t.dp_rank, t.tp_rank)
        assert topo.rank_of(*coords) == r
        assert t.mp_rank == t.pp_rank * tp + t.tp_rank
        seen.add(coords)
        # The tensor-parallel group: consecutive ranks, same stage/replica.
        group = t.tp_group()
        assert group == tuple(range(r - t.tp_rank, r - t.tp_rank + tp))
        assert r in t.dp_group() and r in t.pp_group() and r in t.mp_group()
        assert len(set(t.dp_group())) == topo.dp_size
        assert {topo.tp_of(x) for x in t.dp_group()} == {t.tp_rank}
        assert {topo.tp_of(x) for x in t.pp_group()} == {t.tp_rank}
        assert sorted(t.mp_group()) == sorted(
            x for x in range(world) if topo.coords(x)[1] == t.dp_rank)
    assert len(seen) == world


def test_topology_rejects_degrees_that_do_not_divide_the_job():
    with pytest.raises(ValueError, match=r"partitions=2 x tensor_parallel_"
                                         r"degree=2 = 4 does not divide.*"
                                         r"world_size=6.*e\.g\. 4 or 8"):
        Topology(6, 0, ("h",) * 6, partitions=2, tensor_parallel_degree=2)
    with pytest.raises(ValueError, match="tensor_parallel_degree must be >= 1"):
        Topology(2, 0, ("h",) * 2, tensor_parallel_degree=0)


def test_tensor_parallel_settings_that_cannot_run_fail_early():
    check_tensor_parallel(1, 2, None, 1)
    check_tensor_parallel(2, 1, 1, 4)
    check_tensor_parallel(2, 2, None, 4)  # tp x pp in processes
    with pytest.raises(ValueError, match="1 process.*launch -n 2"):
        check_tensor_parallel(2, 1, None, 1)
    with pytest.raises(ValueError, match="4 processes and local_devices=2 "
                                         r"\(use 1"):
        check_tensor_parallel(2, 1, 2, 4)
    # The ranks as the local devices of one process: a whole model.
    assert check_tensor_parallel(2, 1, 2, 1) is True
    assert check_tensor_parallel(2, 1, None, 4) is False
    with pytest.raises(ValueError, match="partitions=2 .*local_devices=2 "
                                         r"\(with partitions=1\)"):
        check_tensor_parallel(2, 2, 4, 1)
    with pytest.raises(ValueError, match="local_devices=3.*local_devices=2"):
        check_tensor_parallel(2, 1, 3, 1)


def test_shard_arithmetic_and_einsum_axes():
    assert [tensor.shard_bounds(12, 3, i) for i in range(3)] == [
        (0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="weight 'kernel'.*10 is not a "
                                         "multiple of 4.*1, 2, 5, 10"):
        tensor.shard_bounds(10, 4, 0, what="weight 'kernel'")
    assert tensor.column_letter("abc,cde->abde") == "d"    # heads
    assert tensor.row_letter("abcd,cde->abe") == "c"       # heads
    assert tensor.column_letter("...b,bc->...c") == "c"
    assert tensor.row_letter("ab,bc->ac") == "b"
    assert tensor.column_letter("ab,b->a") is None


# ---------------------------------------------------------------------------
# The layer API, one process, no strategy (layers stay plain Keras)
# ---------------------------------------------------------------------------

API_SCRIPT = r"""
import keras, numpy as np, keras_smp
from keras_smp.tensor.layers import TensorParallelDense

with keras_smp.tensor_parallelism():
    x = keras.Input((8,))
    a = keras.layers.Dense(16, activation="relu", name="a")
    h = a(x)
    b = keras.layers.Dense(8, name="b")
    y = b(h)
    lone = keras.layers.Dense(4, name="lone")
    z = lone(y)
    with keras_smp.tensor_parallelism(False):
        norm = keras.layers.LayerNormalization(name="norm")
        plain = keras.layers.Dense(4, name="plain")
    w = plain(norm(z))
    mha = keras.layers.MultiHeadAttention(2, 4, name="mha")
    s = keras.Input((3, 8))
    o = mha(s, s)
    emb = keras.layers.ReversibleEmbedding(10, 8, name="emb")
model = keras.Model([x, s], [w, o])
layout = keras_smp.tensor_parallel_layers(model)
assert layout == {"a": "column", "b": "row", "lone": "gather",
                  "mha": "heads"}, layout
# Shown as the Keras classes (checkpoint paths, summaries, .keras files).
assert type(a).__name__ == "Dense" and isinstance(a, TensorParallelDense)
assert type(mha._query_dense).__name__ == "EinsumDense"
assert (mha._query_dense._smp_tp_mode, mha._output_dense._smp_tp_mode) == (
    "column", "row")
assert keras_smp.is_tensor_parallel(emb) and not keras_smp.is_tensor_parallel(norm)

# A Dense with a softmax (not element-wise) keeps no split output: it is
# gathered before its activation, and the next Dense is not paired with it.
with keras_smp.tensor_parallelism():
    i = keras.Input((8,))
    soft = keras.layers.Dense(16, activation="softmax", name="soft")(i)
    m2 = keras.Model(i, keras.layers.Dense(8, name="after")(soft))
assert keras_smp.tensor_parallel_layers(m2) == {"soft": "gather",
                                                "after": "gather"}
# Attention made whole again builds whole projections.
whole = keras.layers.MultiHeadAttention(2, 4)
keras_smp.set_tensor_parallelism(whole)
keras_smp.set_tensor_parallelism(whole, False)
q = keras.Input((3, 8))
whole(q, q)
assert type(whole._query_dense) is keras.layers.EinsumDense

# Without a tensor-parallel strategy: plain Keras, the same numbers.
keras.utils.set_random_seed(1)
with keras_smp.tensor_parallelism():
    tp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                           keras.layers.Dense(2)])
keras.utils.set_random_seed(1)
ref = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                        keras.layers.Dense(2)])
data = np.random.RandomState(0).randn(8, 8).astype("float32")
for m in (tp, ref):
    m.compile(optimizer="sgd", loss="mse")
    m.fit(data, data[:, :2], verbose=0)
for u, v in zip(tp.get_weights(), ref.get_weights()):
    np.testing.assert_array_equal(u, v)

# Errors name the layer and the fix.
built = keras.layers.Dense(3)
built.build((None, 2))
try:
    keras_smp.set_tensor_parallelism(built)
    raise SystemExit("no error for a built layer")
except ValueError as e:
    assert "already built" in str(e) and "before" in str(e), e
try:
    keras_smp.set_tensor_parallelism(keras.layers.Conv1D(2, 3))
    raise SystemExit("no error for Conv1D")
except ValueError as e:
    assert "Conv1D" in str(e) and "supported: Dense" in str(e), e
d = keras.layers.Dense(3)
keras_smp.set_tensor_parallelism(d)
assert keras_smp.is_tensor_parallel(d)
keras_smp.set_tensor_parallelism(d, False)
assert type(d) is keras.layers.Dense
print("api ok")
"""


def test_layer_api_marks_splits_and_stays_plain_keras_alone(tmp_path):
    script = tmp_path / "api.py"
    script.write_text(API_SCRIPT)
    proc = run_python([str(script)], timeout=300)
    assert "api ok" in proc.stdout


# ---------------------------------------------------------------------------
# Training across processes against single-device training
# ---------------------------------------------------------------------------

_runs = {}


def _run(tmp_path_factory, name, processes, *flags):
    """Runs tests/workers/tensor_fit.py once per session; its output dir."""
    key = (name, processes, flags)
    if key not in _runs:
        out = tmp_path_factory.mktemp(name)
        args = [os.path.join(WORKERS, "tensor_fit.py"), "--out", str(out),
                *flags]
        if processes == 1:
            proc = run_python(args, timeout=600, check=False)
        else:
            proc = launch(processes, args, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        _runs[key] = out
    return _runs[key]


def _result(out, rank=0):
    with np.load(os.path.join(str(out), f"rank{rank}.npz")) as f:
        return {k: f[k] for k in f.files}


def _assert_matches(got, ref, rtol=RTOL, atol=1e-6, skip=()):
    assert sorted(got) == sorted(ref)
    for k in sorted(ref):
        if k in skip:
            continue
        np.testing.assert_allclose(got[k], ref[k], rtol=rtol,
                                   atol=scaled_atol(ref[k], atol),
                                   err_msg=k)


# Attention's key bias has an exactly zero gradient (softmax ignores a
# constant shift), so its computed gradient is rounding noise; Adam
# normalises noise into steps of up to lr, so those weights measure noise.
KEY_BIASES = ("w5", "w21")  # mha0/key/bias, mha1/key/bias

# float32 tolerances: the row-parallel layers sum partial products in
# another order (rtol 1e-5, atol 1e-6 per unit of magnitude, as the rest of
# the suite). Adam divides each gradient by its own running RMS, so an
# element whose gradient is near the rounding noise of those sums gets a
# relative error far above float32's: atol 1e-5 is 1e-3 of one step of its
# learning rate (1e-2), over the 8 steps. mixed_float16: float16 keeps 11
# bits (eps 9.8e-4), so 2e-3.
CASES = {
    "tp2": (2, ["--tp", "2"], "sgd_global_clipnorm", {}),
    "tp2_dp2": (4, ["--tp", "2"], "sgd_global_clipnorm", {}),
    # tensor x pipeline x data parallel (DistributedModel, 2 microbatches;
    # the tied embedding's two users on two stages). tp x pp alone runs
    # below with the vocabulary-parallel loss (its predict gathers).
    "tp2_pp2_dp2": (8, ["--tp", "2", "--partitions", "2"],
                    "sgd_global_clipnorm", {}),
    "tp2_adam_clipnorm": (2, ["--tp", "2"], "adam_clipnorm",
                          dict(atol=1e-5, skip=KEY_BIASES)),
    "tp2_mixed_float16": (2, ["--tp", "2"], "mixed_float16",
                          dict(rtol=2e-3, atol=2e-3)),
    # VocabParallelSparseCategoricalCrossentropy and -Accuracy: the
    # logits stay split in fit and evaluate (the worker checks the width
    # the loss saw), whole in predict; the reference runs Keras' own.
    "tp2_vocab_parallel": (2, ["--tp", "2"], "vocab_parallel", {}),
    "tp2_pp2_vocab_parallel": (4, ["--tp", "2", "--partitions", "2"],
                               "vocab_parallel", {}),
    # One process whose local devices are the ranks (local_devices=T):
    # each device holds its shard (the worker measures the split weights
    # and slots per device: 1/T), the collectives run between devices.
    "tp2_local": (1, ["--tp", "2", "--local"], "sgd_global_clipnorm", {}),
    "tp4_local": (1, ["--tp", "4", "--local"], "sgd_global_clipnorm", {}),
    "tp2_local_vocab_parallel": (1, ["--tp", "2", "--local"],
                                 "vocab_parallel", {}),
    "tp2_local_mixed_float16": (1, ["--tp", "2", "--local"], "mixed_float16",
                                dict(rtol=2e-3, atol=2e-3)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_training_matches_single_device(tmp_path_factory,
                                                        case):
    processes, flags, variant, tolerance = CASES[case]
    ref = _result(_run(tmp_path_factory, f"ref_{variant}", 1, "--tp", "0",
                       "--variant", variant))
    out = _run(tmp_path_factory, case, processes, *flags,
               "--variant", variant)
    got = _result(out)
    # Weights come from a plain Keras model that loaded the run's
    # save_weights file: whole weights, readable without keras-smp.
    _assert_matches(got, ref, **tolerance)
    for r in range(1, processes):  # every rank logs and predicts the same
        other = _result(out, r)
        for k in ("loss", "evaluate", "predict"):
            np.testing.assert_allclose(other[k], got[k], rtol=1e-6,
                                       atol=scaled_atol(got[k], 1e-7))


def test_adam_with_global_clipnorm_on_a_split_embedding_matches_keras():
    # Ids repeated in the batch: Keras' global clip makes the sparse
    # gradient dense, and so must keras-smp's (kept sparse, Adam's step
    # differed: weights off by 0.019-0.027, losses 0.9637 vs 0.9669 after
    # 2 steps). 1e-4 (absolute; weights below 1): Adam divides each
    # element by its own gradient's size, so float32 rounding of a
    # near-zero element of the split layers' sums can move a weight by
    # far more than float32's epsilon (observed: 0.0).
    script = os.path.join(WORKERS, "tensor_sparse_clip.py")
    ref = run_python([script, "plain"], timeout=240).stdout
    got = launch(2, [script, "tp"], timeout=240).stdout
    ref, got = (json.loads(out.split("WEIGHTS ", 1)[1].splitlines()[0])
                for out in (ref, got))
    assert len(got) == len(ref) == 3
    for i, (g, r) in enumerate(zip(got, ref)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=scaled_atol(
            np.array(r), 1e-4), err_msg=f"w{i}")


@pytest.mark.slow
def test_checkpoint_of_one_degree_trains_on_in_another(tmp_path_factory):
    """tp=2's checkpoint, loaded into tp=4 and into plain Keras, trains on
    to the same weights."""
    tp2 = _run(tmp_path_factory, "tp2", 2, "--tp", "2",
               "--variant", "sgd_global_clipnorm")
    ckpt = os.path.join(str(tp2), "model.weights.h5")
    ref = _result(_run(tmp_path_factory, "ref_from_tp2", 1, "--tp", "0",
                       "--load", ckpt, "--epochs", "1"))
    got = _result(_run(tmp_path_factory, "tp4_from_tp2", 4, "--tp", "4",
                       "--load", ckpt, "--epochs", "1"))
    _assert_matches(got, ref)


# ---------------------------------------------------------------------------
# SMP's custom loop (smp.init, @smp.step) with tensor parallelism
# ---------------------------------------------------------------------------

CUSTOM_LOOP = os.path.join(WORKERS, "custom_loop_tp.py")


def _custom_loop(tmp_path_factory, name, processes, *flags):
    key = ("custom_loop", name, processes, flags)
    if key not in _runs:
        out = tmp_path_factory.mktemp(name)
        proc = launch(processes, [CUSTOM_LOOP, "--out", str(out), *flags],
                      timeout=400, check=False)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        _runs[key] = (out, proc.stdout)
    return _runs[key]


def test_custom_loop_refuses_horovod_with_tensor_parallelism():
    code = ("import keras_smp as smp\n"
            "try:\n"
            "    smp.init({'tensor_parallel_degree': 2, 'horovod': True})\n"
            "except ValueError as e:\n"
            "    print('ERROR', e)\n"
            "try:\n"  # one process: its devices are no ranks for @smp.step
            "    smp.init({'tensor_parallel_degree': 2})\n"
            "except ValueError as e:\n"
            "    print('ERROR', e)\n")
    out = run_python(["-c", code]).stdout
    assert "horovod=True is not supported" in out, out
    assert "StepOutput.accumulate()" in out, out
    assert ("with smp.init / @smp.step runs one tensor-parallel rank per "
            "worker process, but this job has 1 process(es)") in out, out
    assert "local_devices=2)` and model.fit" in out, out


def _whole_weights(result):
    return [result[f"w{i}"] for i in range(len(
        [k for k in result if k.startswith("w")]))]


@pytest.mark.slow
@pytest.mark.parametrize("processes,partitions,extra", [
    (2, 1, ()), (4, 2, ()), (2, 1, ("--vocab-parallel",))],
    ids=["tp2", "tp2_dp2_pp2", "tp2_vocab_parallel"])
def test_custom_loop_with_tensor_parallelism_matches_single_device(
        tmp_path_factory, processes, partitions, extra):
    """`@smp.step` over tp=2 (x 2 replicas x 2 in-process stages; or the
    loss on split logits, `smp.vocab_parallel_logits`) against plain Keras
    on the whole global batch, from the same initial weights (rank 0's,
    copied to all: the ranks were seeded differently)."""
    out, _ = _custom_loop(tmp_path_factory, f"cl_tp_{processes}_{partitions}",
                          processes, "--partitions", str(partitions), *extra)
    r0 = _result(out)
    assert int(r0["iterations"]) == 4
    plain = [r0[f"plain{i}"] for i in range(len(_whole_weights(r0)))]
    # float32: the split layers sum partial products in another order.
    for i, (got, ref) in enumerate(zip(_whole_weights(r0), plain)):
        np.testing.assert_allclose(got, ref, rtol=RTOL,
                                   atol=scaled_atol(ref), err_msg=f"w{i}")
    # `loss.reduce_mean()` averages over the replicas too: each replica's
    # is the global batch's loss.
    for d in range(processes // 2):
        np.testing.assert_allclose(_result(out, 2 * d)["losses"],
                                   r0["plain_losses"], rtol=RTOL)
    # Every rank gathers the same whole weights, bit for bit: replicated
    # weights (LayerNorm, the row-parallel biases) have their gradients
    # averaged over the tensor-parallel group, so the copies cannot drift.
    for r in range(1, processes):
        for i, (a, b) in enumerate(zip(_whole_weights(_result(out, r)),
                                       _whole_weights(r0))):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {r} w{i}")


@pytest.mark.slow
def test_custom_loop_tensor_parallel_checkpoint_resumes_exactly(
        tmp_path_factory, tmp_path):
    """CheckpointManager: each tensor-parallel rank writes its shards
    (tp_rank_R/), fresh processes restore them and train on as if never
    stopped."""
    # The uninterrupted run: the fidelity test's tp2 x dp2 x pp2.
    full, _ = _custom_loop(tmp_path_factory, "cl_tp_4_2", 4,
                           "--partitions", "2")
    ckpt = str(tmp_path / "ckpt")
    first = launch(4, [CUSTOM_LOOP, "--partitions", "2", "--stop-at", "2",
                       "--ckpt", ckpt, "--out", str(tmp_path / "a")],
                   timeout=400)
    assert "saved at step 2" in first.stdout
    assert sorted(os.listdir(ckpt)) == ["tp_rank_0", "tp_rank_1"]
    launch(4, [CUSTOM_LOOP, "--partitions", "2", "--ckpt", ckpt,
               "--out", str(tmp_path / "b")], timeout=400)
    # Another degree finds shards it cannot use, and says so.
    code = ("import tensorflow as tf, keras_smp as smp\n"
            "smp.init()\n"
            f"m = smp.CheckpointManager(tf.train.Checkpoint(), {ckpt!r})\n"
            "try:\n"
            "    m.latest_checkpoint\n"
            "except ValueError as e:\n"
            "    print('ERROR', e)\n")
    out = run_python(["-c", code]).stdout
    assert "tensor_parallel_degree=2" in out and "save_weights" in out, out
    for r in range(4):
        resumed, whole = _result(tmp_path / "b", r), _result(full, r)
        assert int(resumed["start"]) == 2 and int(resumed["iterations"]) == 4
        np.testing.assert_allclose(resumed["losses"], whole["losses"][2:],
                                   rtol=1e-6)
        for i, (a, b) in enumerate(zip(_whole_weights(resumed),
                                       _whole_weights(whole))):
            np.testing.assert_allclose(a, b, rtol=1e-6,
                                       atol=scaled_atol(b, 1e-7),
                                       err_msg=f"rank {r} w{i}")


# ---------------------------------------------------------------------------
# Examples in the docstrings and on the docs page run
# ---------------------------------------------------------------------------


def _python_blocks(text):
    import re

    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_pure_examples_run():
    import doctest
    import inspect

    import keras_smp.runtime.layout as layout
    import keras_smp.topology as topology

    for module in (tensor, layout):
        failed, attempted = doctest.testmod(module, verbose=False)
        assert attempted > 0 and failed == 0, module.__name__
    for code in _python_blocks(inspect.getdoc(Topology)):
        exec(compile(code, "<Topology example>", "exec"), {})
    page = open(os.path.join(ROOT, "docs", "tensor-parallelism.md")).read()
    blocks = [b for b in _python_blocks(page) if "Topology(" in b]
    assert blocks
    for code in blocks:
        exec(compile(code, "<docs/tensor-parallelism.md>", "exec"), {})
    assert topology.Topology is Topology


def test_keras_examples_in_docstrings_run(tmp_path):
    # Read from the source (importing it here would import Keras into the
    # test process).
    import ast

    source = open(os.path.join(ROOT, "keras_smp", "tensor", "layers.py")).read()
    tree = ast.parse(source)
    docs = [ast.get_docstring(tree)] + [
        ast.get_docstring(node) for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name in ("tensor_parallelism", "set_tensor_parallelism")]
    losses = ast.parse(open(os.path.join(
        ROOT, "keras_smp", "tensor", "losses.py")).read())
    docs += [ast.get_docstring(node) for node in losses.body
             if isinstance(node, ast.ClassDef) or (
                 isinstance(node, ast.FunctionDef)
                 and node.name == "vocab_parallel_logits")]
    blocks = [b for d in docs for b in _python_blocks(d)]
    assert len(blocks) == 6
    script = tmp_path / "examples.py"
    script.write_text("\n\n".join(blocks) + "\nprint('examples ok')\n")
    proc = run_python([str(script)], timeout=300)
    assert "examples ok" in proc.stdout


SHARED_OUTPUT_SCRIPT = r"""
import keras, numpy as np, keras_smp
from keras_smp.runtime import patches

patches.install()
with keras_smp.tensor_parallelism():
    x = keras.Input((8,))
    a = keras.layers.Dense(16, name="a")(x)
    b = keras.layers.Dense(8, name="b")(a)   # pairs with a
    c = keras.layers.Dense(8, name="c")(a)   # also uses a's output
model = keras.Model(x, [b, c])
model.compile(optimizer="sgd", loss="mse")
try:
    model.predict(np.ones((2, 8)), verbose=0)
    raise SystemExit("no error for a split output used twice")
except ValueError as e:
    assert "Dense 'a' is split by columns" in str(e), e
print("shared ok")
"""


def test_a_split_output_used_twice_fails_early(tmp_path):
    script = tmp_path / "shared.py"
    script.write_text(SHARED_OUTPUT_SCRIPT)
    proc = run_python([str(script)], timeout=300)
    assert "shared ok" in proc.stdout


@pytest.mark.slow
def test_layouts_that_cannot_run_fail_early_on_every_rank():
    proc = launch(2, [os.path.join(WORKERS, "tensor_errors.py")],
                  timeout=300)
    for rank in (0, 1):
        for what in ("built outside the scope", "Lamb",
                     "attention scores of split heads",
                     "vocab-parallel loss with a whole-logits metric",
                     "compiled again with Keras' loss",
                     "vocab-parallel loss after a softmax"):
            assert f"[{rank}] ok: {what}" in proc.stdout, proc.stdout[-3000:]
        assert f"[{rank}] errors ok" in proc.stdout
    # The same errors with the ranks on the local devices of one process,
    # and a direct call of a split layer outside the replicas.
    proc = run_python([os.path.join(WORKERS, "tensor_errors.py"), "--local"],
                      timeout=300)
    for what in ("built outside the scope", "Lamb",
                 "attention scores of split heads",
                 "vocab-parallel loss with a whole-logits metric",
                 "compiled again with Keras' loss",
                 "vocab-parallel loss after a softmax",
                 "a direct call outside the replicas", "run eagerly",
                 "a layer built by tracing its call"):
        assert f"ok: {what}" in proc.stdout, proc.stdout[-3000:]
    assert "errors ok" in proc.stdout
    proc = launch(4, [os.path.join(WORKERS, "tensor_errors.py"),
                      "--pipeline"], timeout=300)
    for rank in range(4):
        assert f"[{rank}] ok: a pipeline cut inside a Dense pair" in (
            proc.stdout), proc.stdout[-3000:]
