"""`smp.init`: SMP's set-up of a custom training loop.

Two layouts, chosen from the config and the job:

- every process runs whole model replicas, stage `s` on its local device
  `s` (the default; `keras_smp.smp.custom_loop.init`);
- one pipeline stage per process (`local_devices=1` in a job of several
  processes, as SMP ran a partition per GPU process): each process holds
  and trains its own stage's weights only, so a model too big for one
  process trains across `partitions` of them. `init` then creates an
  `SMPStrategy` and makes it TensorFlow's current strategy
  (`tf.distribute.experimental_set_strategy`), so models, optimizers and
  metrics made afterwards are made for it: other stages' weights are
  shapes without storage (`keras_smp.runtime.deferred`).
"""

import tensorflow as tf

from keras_smp import runtime as runtime_lib
from keras_smp.config import SMPConfig
from keras_smp.distribute.strategy import SMPStrategy
from keras_smp.runtime import patches
from keras_smp.runtime import process
from keras_smp.smp import custom_loop


def init(config=None):
    """Initialises keras-smp for a custom training loop (SMP's `smp.init`).

    Validates `config` (a dict with SMP's keys; the `SMP_CONFIG`
    environment variable overrides it), resolves the cluster and installs
    both for the rank helpers, `DistributedModel`, `@smp.step` and the
    communication helpers. Also gives Keras optimizers SMP's
    `optimizer.get_gradients(loss, params)`. For `model.fit` use
    `SMPStrategy` instead.

    By default every process runs whole model replicas: a step runs stage
    `s` on local device `s` (GPU `s`, or logical CPU `s` when `init` comes
    before other TensorFlow calls). With several worker processes
    (`keras-smp launch`, `TF_CONFIG`, SLURM) each process is a
    data-parallel replica: `init` starts TensorFlow's distributed runtime,
    the first step copies rank 0's initial weights to every replica, and
    `StepOutput.accumulate()` averages gradients over the replicas. With
    `horovod=True` (SMP's hybrid mode, launched with `keras-smp launch
    --horovod`) `init` initialises Horovod over the replicas instead and
    the script averages gradients with `hvd.allreduce` as in SMP; do not
    call `hvd.init()` yourself.

    With `local_devices=1` in a job of `partitions x replicas` processes,
    each process runs one pipeline stage, as SMP did: it holds and trains
    only its stage's weights (and its optimizer's slots for them), the
    step's `model(x)` returns the model's outputs on every process of the
    pipeline, and gradients of other stages' weights are `None` (Keras'
    `apply_gradients` skips them). Every process of a pipeline must be
    given the same batch. See docs/custom-loop.md.

    Returns:
        The validated `SMPConfig`.

    Example:

    ```python
    import keras_smp as smp
    config = smp.init({"partitions": 2, "microbatches": 2})
    assert config.partitions == 2 and smp.rank() == 0
    ```
    """
    built = SMPConfig.build(config)
    if (built.local_devices == 1 and built.partitions > 1
            and process.resolve_cluster().world_size > 1):
        return custom_loop.init(config, start=_start_stage_per_process)
    return custom_loop.init(config)


def _stage_reducer(variables):
    """The sum over the stage processes of the pipeline whose model holds
    `variables` (for the optimizer's global norm and finite check), or
    `None`."""
    ids = {id(v) for v in variables}
    for model in custom_loop.models_across():
        if any(id(w) in ids for w in model.trainable_variables):
            return model._smp_stage_reducer()
    return None


def _start_stage_per_process(config):
    """One pipeline stage per process: an `SMPStrategy` made current."""
    built = SMPConfig.build(config)
    unsupported = {
        "tensor_parallel_degree": built.tensor_parallel_degree != 1,
        "horovod": built.horovod,
        "virtual_stages": built.virtual_stages != 1,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(
            f"smp.init with local_devices=1 (one pipeline stage per "
            f"process) does not support {bad[0]}={getattr(built, bad[0])!r} "
            "in custom loops yet. Leave local_devices unset (every process "
            "runs whole replicas, its stages on its own devices), or train "
            "with SMPStrategy and model.fit, which supports it.")
    if tf.distribute.has_strategy():
        raise ValueError(
            "smp.init with local_devices=1 makes its own tf.distribute "
            f"strategy current, but {tf.distribute.get_strategy()!r} is "
            "already (smp.init inside `strategy.scope()`): call smp.init "
            "outside any strategy's scope.")
    strategy = SMPStrategy(config)
    tf.distribute.experimental_set_strategy(strategy)
    patches.apply_own_stage_only(_stage_reducer)
    return runtime_lib.of(strategy)
