"""`allreduce_compression`: gradients all-reduced as 16-bit floats.

Each run (tests/workers/compressed_sync.py) trains a 3-layer MLP with
SGD (lr 0.1) for 3 steps of 32 rows; the reference is plain Keras on one
device. For each weight, the error of the compressed run against the
reference is measured relative to the weight's largest total update
(|w - w_ref|max / |w_ref - w0|max):

- bound: 2u, u the unit roundoff of the wire dtype (bfloat16 2^-8,
  float16 2^-11). Each step's gradient is a sum of 2 replicas' shares,
  each rounded to the wire dtype, then the sum rounded (3 roundings of at
  most u/2 of the shares' magnitudes, which here have one sign mostly:
  <= 1.5u of the update per step), plus float32 noise. Observed (Intel
  Xeon and AMD EPYC): 0.4-0.7u.
- compression really happened: the largest relative error of the run is
  above u/16, where the uncompressed run's is float32 rounding (observed
  2.4e-6, bound 1e-5 = conftest.RTOL): 2.4e-4 for bfloat16 and 3e-5 for
  float16 are 10x and 3x that bound.
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


def _train(out, mode, config=None, clip=False, processes=2, horovod=False):
    args = [WORKER, "--out", str(out), "--mode", mode,
            "--config", json.dumps(config or {})] + (
                ["--clip"] if clip else [])
    os.makedirs(str(out), exist_ok=True)
    python = HVD_PYTHON if horovod else None
    if processes == 1:
        run_python(args, timeout=300, python=python)
    else:
        launch(processes, args, timeout=300, python=python,
               **({"launcher_args": ("--horovod",)} if horovod else {}))
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


@pytest.mark.slow
@pytest.mark.parametrize("case,mode,config,clip", [
    # data parallel over 2 processes: exact, bfloat16, float16
    ("dp", "fit", {}, False),
    ("dp_bfloat16", "fit", {"allreduce_compression": "bfloat16"}, False),
    ("dp_float16", "fit", {"allreduce_compression": "fp16"}, False),
    # a 2-stage pipeline in each process, replicas across them, with
    # clipping (the gradients are summed before they are clipped)
    ("hybrid_clip_bfloat16", "fit",
     {"allreduce_compression": "bfloat16", "partitions": 2,
      "microbatches": 2, "local_devices": 2}, True),
    # SMP custom loop: StepOutput.accumulate() averages over the replicas
    ("custom_loop_bfloat16", "custom_loop",
     {"allreduce_compression": "bfloat16"}, False),
])
def test_compressed_gradients_stay_within_the_wire_dtypes_rounding(
        tmp_path, reference, case, mode, config, clip):
    ranks = _train(tmp_path, mode, config, clip)
    wire = {"fp16": "float16"}.get(config.get("allreduce_compression"),
                                   config.get("allreduce_compression"))
    for got in ranks[1:]:  # every replica applies the same update
        for k in ranks[0]:
            np.testing.assert_array_equal(got[k], ranks[0][k], err_msg=k)
    errors = _errors(ranks[0], reference)
    u = U[wire]
    if wire is None:
        assert max(errors) <= RTOL, errors
        assert ranks[0]["compressed"] == 0
        return
    assert max(errors) <= 2 * u, (case, errors)
    assert max(errors) > u / 16, (
        f"{case}: the gradients do not look compressed (errors {errors})")
    if mode == "fit":  # every weight's gradient went compressed
        assert ranks[0]["compressed"] >= 6, ranks[0]["compressed"]


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
    assert u / 16 < max(errors) <= 2 * u, errors
    assert ranks[0]["compressed"] >= 6
