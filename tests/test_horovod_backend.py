"""`SMPStrategy(allreduce="horovod")`: Horovod as the gradient-sync backend.

Runs in the Horovod environment (.venv-hvd: TensorFlow 2.15.1, Horovod
0.28.1 with Gloo, built by `make test`), workers started with `keras-smp
launch --horovod`. The single-device reference is computed in the same
environment (same TensorFlow). In data-parallel runs every rank initialises
its model from its own seed (`--seed-by-rank`), so matching the reference
(seed of rank 0) also shows Horovod's broadcast of rank 0's initial weights.
"""

import json
import os

import pytest

from conftest import HVD_PYTHON
from conftest import WORKERS
from conftest import assert_same_training
from conftest import fit_model
from conftest import hvd_env_or_skip
from conftest import launch
from conftest import load
from conftest import run_python


@pytest.fixture(scope="module")
def hvd_reference(tmp_path_factory):
    hvd_env_or_skip()
    out = tmp_path_factory.mktemp("hvd_reference")
    run_python(fit_model(out, "--mode", "reference"), python=HVD_PYTHON)
    return load(out)


def _fit(tmp_path, workers, config, *flags, seed_by_rank=True):
    seed = ["--seed-by-rank"] if seed_by_rank else []
    launch(workers, fit_model(tmp_path, *seed, "--config",
                              json.dumps(config), *flags),
           python=HVD_PYTHON, launcher_args=("--horovod",), timeout=300)
    return [load(tmp_path, r) for r in range(workers)]


@pytest.mark.slow
def test_horovod_data_parallel_fit_matches_single_device(tmp_path,
                                                        hvd_reference):
    for got in _fit(tmp_path, 2, {"allreduce": "horovod"}):
        assert str(got["algorithm"]) == "horovod"
        assert int(got["replicas"]) == 2
        assert int(got["buckets_traced"]) > 0  # gradients went through it
        assert_same_training(got, hvd_reference)


@pytest.mark.slow
def test_horovod_pipeline_fit_matches_single_device(tmp_path, hvd_reference):
    # 2 stages x 2 replicas, one stage per process: each stage's gradients
    # are summed in a Horovod process set of that stage's 2 replicas.
    # Every rank seeded alike: with one stage per process, a stage's
    # initial values come from that stage's first replica (not from rank
    # 0, which never holds other stages' weights); test_memory.py checks
    # that broadcast with per-rank seeds.
    config = {"allreduce": "horovod", "partitions": 2, "microbatches": 2}
    for got in _fit(tmp_path, 4, config, "--pipelined", seed_by_rank=False):
        assert str(got["algorithm"]) == "horovod"
        assert int(got["replicas"]) == 2
        assert_same_training(got, hvd_reference)


def test_horovod_backend_without_horovod_says_how_to_get_it(tmp_path):
    # The main environment has no Horovod.
    proc = run_python(
        fit_model(tmp_path, "--config", '{"allreduce": "horovod"}'),
        check=False)
    assert proc.returncode != 0
    assert "ImportError: allreduce='horovod' needs Horovod" in proc.stderr
    assert "scripts/horovod-env.sh" in proc.stderr


def test_horovod_backend_needs_one_replica_per_process(tmp_path):
    hvd_env_or_skip()
    proc = run_python(
        fit_model(tmp_path, "--local-devices", "2", "--config",
                  '{"allreduce": "horovod"}'),
        check=False, python=HVD_PYTHON)
    assert proc.returncode != 0
    assert "allreduce='horovod' runs one model replica per process" in proc.stderr
    assert "2 replicas" in proc.stderr


@pytest.mark.slow
def test_horovod_backend_without_horovod_rendezvous_is_named(tmp_path):
    # `keras-smp launch` without --horovod: each Horovod starts alone.
    hvd_env_or_skip()
    proc = launch(2, fit_model(tmp_path, "--config",
                               '{"allreduce": "horovod"}'),
                  python=HVD_PYTHON, check=False, timeout=180)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Horovod sees rank 0 of 1, but keras-smp's cluster" in out, out[-3000:]
    assert "keras-smp launch --horovod" in out


@pytest.mark.slow
def test_late_process_set_all_reduces_outlive_the_other_ranks(tmp_path):
    # Ranks 0 and 2 end their scripts first; ranks 1 and 3 then all-reduce
    # over their Horovod process set. Horovod shuts itself down at exit:
    # keras-smp runs that after its wait for every rank (before, the
    # first rank to finish shut Horovod down and the late all-reduce
    # failed with "Process set does not exist or has not been registered").
    hvd_env_or_skip()
    out = launch(4, [os.path.join(WORKERS, "hvd_exit_order.py"), "5"],
                 python=HVD_PYTHON, launcher_args=("--horovod",),
                 timeout=300).stdout
    late = [json.loads(l.split("LATE ", 1)[1]) for l in out.splitlines()
            if "] LATE " in l]
    assert sorted(r["rank"] for r in late) == [1, 3], out
    assert all(r["summed"] == 4.0 for r in late), out
    assert sorted(int(l.rsplit(" ", 1)[1]) for l in out.splitlines()
                  if "] EXIT " in l) == [0, 1, 2, 3], out
