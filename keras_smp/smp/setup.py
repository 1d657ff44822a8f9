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

import weakref

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
    `apply_gradients` skips them). The step's tensor arguments are the
    first stage's process's (broadcast to the pipeline's other
    processes). See docs/custom-loop.md.

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


# {trace graph: {id(model): its reducer}}: one per model and trace, so
# two optimizer steps in one traced function take different keys.
_reducers = weakref.WeakKeyDictionary()


def _stage_sync(variables):
    """`(reduce_sum, sum_tied)` of the pipeline whose model holds
    `variables`, or `None`: the sum over its stage processes (for the
    optimizer's global norm), and `sum_tied(grads, variables)`, which sums
    the gradients of weights several stage processes use over them
    (`DistributedModel._smp_sum_tied_parts`)."""
    ids = {id(v) for v in variables}
    models = [m for m in custom_loop.models_across()
              if any(id(w) in ids for w in m.trainable_variables)]
    if len(models) > 1:
        raise NotImplementedError(
            "One optimizer applies the weights of several DistributedModels "
            f"({', '.join(repr(m.name) for m in models)}) in a custom loop "
            "with one stage per process; give each model its own "
            "optimizer.")
    if not models:
        return None
    graph = tf.compat.v1.get_default_graph()
    per_graph = _reducers.setdefault(graph, {})
    if id(models[0]) not in per_graph:
        per_graph[id(models[0])] = models[0]._smp_stage_reducer()
    return per_graph[id(models[0])], models[0]._smp_sum_tied_parts


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
    patches.apply_own_stage_only(_stage_sync)
    return runtime_lib.of(strategy)
