"""`allreduce_compression`: gradients all-reduced as 16-bit floats.

Each run (tests/workers/compressed_sync.py) trains a 3-layer MLP with
SGD (lr 0.1) for 3 steps of 32 rows; the reference is plain Keras on one
device. For each weight, the error of the compressed run against the
reference is measured relative to the weight's largest total update
(|w - w_ref|max / |w_ref - w0|max):

Modes: data parallel over 2 processes, 2 processes x 2 local replicas
on 2 emulated hosts (hierarchical), 2 pipelines of 2 stages in 2
processes (with clipping), one stage per process with 2 replicas of each
(4 processes), an SMP custom loop, and the Horovod lane (float16).

- bound: 3u (4u hierarchical), u the unit roundoff of the wire dtype
  (bfloat16 2^-8, float16 2^-11). Each step's gradient is the sum of
  the replicas' shares, each rounded to the wire dtype (relative error
  <= u each), then the sum rounded (<= u; the hierarchical all-reduce of
  4 replicas rounds twice: the sum inside a host, then across hosts): at
  most 2u (3u) of the shares' magnitudes, which equals 2u (3u) of the
  step's update where the shares have one sign. The 3 steps' updates of
  a weight mostly have one sign too, and the weights' small drift changes
  later gradients by a second-order amount: one u more leaves room for
  both. Observed (Intel Xeon and AMD EPYC): 0.4-0.7u.
- compression really happened: the largest relative error of the run is
  above u/16, where the uncompressed run's is float32 rounding (observed
  2.4e-6, bound 1e-5 = conftest.RTOL): 2.4e-4 for bfloat16 and 3e-5 for
  float16 are 10x and 3x that bound. And each rank's all-reduce traced
  exactly its weights' gradients compressed, once per local replica
  (`GradientAllReduce.compressed_traced`).
- float16 sums beyond 65504 (the loss x 2^20, the learning rate / 2^20:
  the same updates) are summed again in float32: finite weights, equal to
  one device's to float32 rounding (RTOL) in `fit`; in a custom loop,
  which sums each gradient on its own, the overflowing ones so and the
  others within 3u.
"""

import json
import os

import numpy as np
import pytest

from conftest import HVD_PYTHON
from conftest import RTOL
from conftest import WORKERS
from conftest import hvd_env_or_skip
from conftest import launch
from conftest import run_python

U = {"bfloat16": 2.0**-8, "float16": 2.0**-11, None: 0.0}
WORKER = os.path.join(WORKERS, "compressed_sync.py")


def _train(out, mode, config=None, clip=False, processes=2, horovod=False,
           launcher_args=(), scale=1.0):
    args = [WORKER, "--out", str(out), "--mode", mode,
            "--config", json.dumps(config or {}), "--scale", str(scale)] + (
                ["--clip"] if clip else [])
    os.makedirs(str(out), exist_ok=True)
    python = HVD_PYTHON if horovod else None
    if processes == 1:
        run_python(args, timeout=300, python=python)
    else:
        launch(processes, args, timeout=300, python=python,
               launcher_args=(("--horovod",) if horovod else ())
               + tuple(launcher_args))
    ranks = []
    for r in range(processes):
        with np.load(os.path.join(str(out), f"rank{r}.npz")) as f:
            ranks.append({k: f[k] for k in f.files})
    return ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("reference"), "reference",
                  processes=1)[0]


def _errors(got, ref):
    """Each weight's largest error, relative to its largest update."""
    n = sum(k.startswith("w_") for k in ref)
    assert n == 6 and n == sum(k.startswith("w_") for k in got)
    out = []
    for i in range(n):
        np.testing.assert_array_equal(got[f"w0_{i}"], ref[f"w0_{i}"])
        update = np.abs(ref[f"w_{i}"] - ref[f"w0_{i}"]).max()
        assert update > 1e-3  # training moved every weight
        out.append(np.abs(got[f"w_{i}"] - ref[f"w_{i}"]).max() / update)
    return out


# (case, mode, config, --clip, processes, launcher arguments, gradients
# each rank's all-reduce sends compressed: its replicas x its weights,
# traced once; None where not counted)
CASES = [
    # data parallel over 2 processes: exact, bfloat16, float16
    ("dp", "fit", {}, False, 2, (), None),
    ("dp_bfloat16", "fit", {"allreduce_compression": "bfloat16"}, False, 2,
     (), [6, 6]),
    ("dp_float16", "fit", {"allreduce_compression": "fp16"}, False, 2, (),
     [6, 6]),
    # 2 processes x 2 local replicas on 2 emulated hosts: hierarchical
    ("hierarchical_bfloat16", "fit",
     {"allreduce_compression": "bfloat16", "allreduce": "hierarchical",
      "local_devices": 2}, False, 2, ("--host-map", "a,b"), [12, 12]),
    # a 2-stage pipeline in each process, replicas across them, with
    # clipping (the gradients are summed before they are clipped)
    ("hybrid_clip_bfloat16", "fit",
     {"allreduce_compression": "bfloat16", "partitions": 2,
      "microbatches": 2, "local_devices": 2}, True, 2, (), [6, 6]),
    # one stage per process, 2 replicas of each (4 processes): stage 0
    # holds 1 layer (2 weights), stage 1 two
    ("stages_bfloat16", "fit",
     {"allreduce_compression": "bfloat16", "partitions": 2,
      "microbatches": 2}, False, 4, (), [2, 4, 2, 4]),
    # SMP custom loop: StepOutput.accumulate() averages over the replicas
    ("custom_loop_bfloat16", "custom_loop",
     {"allreduce_compression": "bfloat16"}, False, 2, (), None),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,mode,config,clip,processes,launcher,counts",
                         CASES, ids=[c[0] for c in CASES])
def test_compressed_gradients_stay_within_the_wire_dtypes_rounding(
        tmp_path, reference, case, mode, config, clip, processes, launcher,
        counts):
    ranks = _train(tmp_path, mode, config, clip, processes,
                   launcher_args=launcher)
    wire = {"fp16": "float16"}.get(config.get("allreduce_compression"),
                                   config.get("allreduce_compression"))
    for got in ranks[1:]:  # every replica applies the same update
        for k in ranks[0]:
            if k.startswith("w"):
                np.testing.assert_array_equal(got[k], ranks[0][k],
                                              err_msg=k)
    if counts is not None:
        assert [int(r["compressed"]) for r in ranks] == counts
    errors = _errors(ranks[0], reference)
    u = U[wire]
    if wire is None:
        assert max(errors) <= RTOL, errors
        return
    bound = (4 if config.get("allreduce") == "hierarchical" else 3) * u
    assert max(errors) <= bound, (case, errors)
    assert max(errors) > u / 16, (
        f"{case}: the gradients do not look compressed (errors {errors})")

# Loss x 2^20, learning rate / 2^20: the same updates (powers of 2), and
# gradients beyond float16's 65504.
SCALE = 2.0**20


@pytest.fixture(scope="module")
def scaled_reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("scaled"), "reference",
                  processes=1, scale=SCALE)[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode,config,processes", [
    ("fit", {"allreduce_compression": "float16"}, 2),
    # 2 stage processes x 2 replicas
    ("fit", {"allreduce_compression": "float16", "partitions": 2,
             "microbatches": 2}, 4),
    ("custom_loop", {"allreduce_compression": "float16"}, 2),
], ids=["dp", "stages", "custom_loop"])
def test_float16_sums_that_overflow_are_summed_again_in_float32(
        tmp_path, scaled_reference, mode, config, processes):
    ref = scaled_reference
    # Some gradient entry exceeds float16's range: 3 steps moved a weight
    # by more than 3 x lr x 65504.
    lr = 0.1 / SCALE
    moved = max(np.abs(ref[f"w_{i}"] - ref[f"w0_{i}"]).max()
                for i in range(6))
    assert moved > 3 * lr * 65504, moved
    ranks = _train(tmp_path, mode, config, processes=processes, scale=SCALE)
    for got in ranks:
        for k in got:
            assert np.all(np.isfinite(got[k])), k
    errors = _errors(ranks[0], ref)
    if mode == "fit":
        # Each step's sync overflowed and was summed again in float32:
        # one device's weights to float32 rounding, as uncompressed.
        assert max(errors) <= RTOL, errors
    else:
        # A custom loop sums each gradient on its own: those that
        # overflowed in float16 were summed again in float32 (a weight
        # to float32 rounding), the others stayed compressed.
        assert min(errors) <= RTOL, errors
        assert max(errors) <= 3 * U["float16"], errors


@pytest.mark.slow
def test_horovod_sends_float16_compressed_gradients(tmp_path):
    # The Horovod lane (its own TensorFlow): its own one-device reference.
    hvd_env_or_skip()
    reference = _train(tmp_path / "reference", "reference", processes=1,
                       horovod=True)[0]
    ranks = _train(tmp_path / "hvd", "fit",
                   {"allreduce": "horovod", "allreduce_compression": "float16"},
                   horovod=True)
    for k in ranks[0]:
        np.testing.assert_array_equal(ranks[1][k], ranks[0][k], err_msg=k)
    errors = _errors(ranks[0], reference)
    u = U["float16"]
    assert u / 16 < max(errors) <= 3 * u, errors
    assert [int(r["compressed"]) for r in ranks] == [6, 6]
    # Sums beyond float16's range: summed again in float32 through
    # Horovod too (its allreduce inside the same branch).
    reference = _train(tmp_path / "scaled_reference", "reference",
                       processes=1, horovod=True, scale=SCALE)[0]
    ranks = _train(tmp_path / "hvd_scaled", "fit",
                   {"allreduce": "horovod", "allreduce_compression": "float16"},
                   horovod=True, scale=SCALE)
    for k in ranks[0]:
        assert np.all(np.isfinite(ranks[0][k])), k
    assert max(_errors(ranks[0], reference)) <= RTOL
