"""keras-smp: model and data parallelism for Keras 3 on TensorFlow.

Public API:

- `SMPStrategy`: a `tf.distribute.Strategy`; build and compile under its
  scope, then `fit` / `evaluate` / `predict` as usual.
- `DistributedModel`: a `keras.Model` whose steps run a microbatch
  pipeline over `partitions` stages; `partition(i)` places layers manually.
- `SMPConfig`: every option, validated.
- SageMaker smp's custom-loop API: `init(config)`, `@step`, `StepOutput`
  (see `keras_smp.smp.custom_loop`), `CheckpointManager`, and the
  communication helpers `broadcast`, `allgather`, `send`, `recv_from`,
  `barrier` with `CommGroup` / `RankType` (see `keras_smp.smp.comms`).
- `assemble_checkpoint(index, out)`: one `.weights.h5` file from a sharded
  checkpoint (one shard per pipeline stage), streamed weight by weight.
- `set_activation_checkpointing(layer)`: recompute a layer's forward pass
  in its backward (SageMaker smp's name), as naming it in the config's
  `activation_checkpointing`.
- `notebook_launcher(fn, num_workers=N, args=...)`: run a training
  function on N local worker processes from a Jupyter notebook.
- rank helpers with SageMaker smp's names: `rank()`, `size()`,
  `local_rank()`, `local_size()`, `dp_rank()`, `dp_size()`, `pp_rank()`,
  `pp_size()`, `tp_rank()`, `tp_size()`, `mp_rank()`, `mp_size()`.
- tensor parallelism: `tensor_parallelism()` (a scope: Dense,
  EinsumDense, MultiHeadAttention, Embedding and ReversibleEmbedding
  layers created inside are split across `tensor_parallel_degree`
  processes), `set_tensor_parallelism(layer)`, `is_tensor_parallel`,
  `tensor_parallel_layers(model)`.

TensorFlow is imported lazily: `import keras_smp` and the rank helpers work
without it, so launch scripts can read ranks before building anything.

On Linux with glibc, `import keras_smp` limits malloc to one arena, so that
TensorFlow's threads keep a step's memory mapped from step to step (import it
before TensorFlow runs anything); setting `MALLOC_ARENA_MAX` or
`GLIBC_TUNABLES=glibc.malloc.arena_max=...` yourself keeps your value
(`keras_smp.runtime.malloc`).
"""

from keras_smp.runtime import malloc as _malloc

# Before TensorFlow starts its thread pools: see keras_smp.runtime.malloc.
_malloc.limit_arenas()

from keras_smp.config import SMPConfig  # noqa: E402
from keras_smp.pipeline.scope import partition
from keras_smp.ranks import dp_rank
from keras_smp.ranks import dp_size
from keras_smp.ranks import is_chief
from keras_smp.ranks import local_rank
from keras_smp.ranks import local_size
from keras_smp.ranks import mp_rank
from keras_smp.ranks import mp_size
from keras_smp.ranks import pp_rank
from keras_smp.ranks import pp_size
from keras_smp.ranks import rank
from keras_smp.ranks import size
from keras_smp.ranks import tp_rank
from keras_smp.ranks import tp_size

__version__ = "0.1.0"

_LAZY = {
    "SMPStrategy": "keras_smp.distribute.strategy",
    "DistributedModel": "keras_smp.pipeline.model",
    "init": "keras_smp.smp.setup",
    "step": "keras_smp.smp.custom_loop",
    "StepOutput": "keras_smp.smp.custom_loop",
    "CheckpointManager": "keras_smp.smp.checkpoint",
    "assemble_checkpoint": "keras_smp.pipeline.shards",
    "set_activation_checkpointing": "keras_smp.pipeline.recompute",
    "notebook_launcher": "keras_smp.notebook",
    "tensor_parallelism": "keras_smp.tensor.layers",
    "set_tensor_parallelism": "keras_smp.tensor.layers",
    "is_tensor_parallel": "keras_smp.tensor.layers",
    "tensor_parallel_layers": "keras_smp.tensor.layers",
    "VocabParallelSparseCategoricalCrossentropy": "keras_smp.tensor.losses",
    "VocabParallelSparseCategoricalAccuracy": "keras_smp.tensor.losses",
    "vocab_parallel_logits": "keras_smp.tensor.losses",
    "broadcast": "keras_smp.smp.comms",
    "allgather": "keras_smp.smp.comms",
    "send": "keras_smp.smp.comms",
    "recv_from": "keras_smp.smp.comms",
    "barrier": "keras_smp.smp.comms",
    "dp_barrier": "keras_smp.smp.comms",
    "mp_barrier": "keras_smp.smp.comms",
    "pp_barrier": "keras_smp.smp.comms",
    "CommGroup": "keras_smp.smp.comms",
    "RankType": "keras_smp.smp.comms",
    "WORLD": "keras_smp.smp.comms",
    "MP_GROUP": "keras_smp.smp.comms",
    "DP_GROUP": "keras_smp.smp.comms",
    "PP_GROUP": "keras_smp.smp.comms",
    "WORLD_RANK": "keras_smp.smp.comms",
    "MP_RANK": "keras_smp.smp.comms",
    "DP_RANK": "keras_smp.smp.comms",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name != "tensorflow":
                raise
            import sys

            raise ModuleNotFoundError(
                f"keras_smp.{name} needs TensorFlow, which is not installed "
                f"in this environment ({sys.executable}). keras-smp leaves "
                "the choice of distribution to you: `pip install "
                "keras-smp[cpu]` (tensorflow-cpu), `keras-smp[gpu]` "
                "(tensorflow[and-cuda]) or `keras-smp[tf]` (tensorflow); "
                "install only one of them.", name="tensorflow") from e
        return getattr(module, name)
    raise AttributeError(f"module 'keras_smp' has no attribute {name!r}")


import sys as _sys  # noqa: E402

if "keras" in _sys.modules and "tensorflow" in _sys.modules:
    # Keras is loaded already (`import keras, keras_smp`): define
    # DistributedModel now, which registers it for `keras.models.load_model`
    # (to find a saved class Keras imports only its own packages).
    __getattr__("DistributedModel")

__all__ = [
    "SMPConfig", "SMPStrategy", "DistributedModel", "partition", "rank", "size", "local_rank", "local_size",
    "dp_rank", "dp_size", "pp_rank", "pp_size", "mp_rank", "mp_size",
    "tp_rank", "tp_size", "tensor_parallelism", "set_tensor_parallelism",
    "is_tensor_parallel", "tensor_parallel_layers",
    "VocabParallelSparseCategoricalCrossentropy",
    "VocabParallelSparseCategoricalAccuracy", "vocab_parallel_logits",
    "is_chief", "init", "step", "StepOutput", "CheckpointManager",
    "notebook_launcher", "assemble_checkpoint", "set_activation_checkpointing",
    "broadcast", "allgather", "send", "recv_from", "barrier", "dp_barrier",
    "mp_barrier", "pp_barrier", "CommGroup", "RankType", "WORLD", "MP_GROUP",
    "DP_GROUP", "PP_GROUP", "WORLD_RANK", "MP_RANK", "DP_RANK",
]
