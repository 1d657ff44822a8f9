"""`CheckpointManager`: SMP's checkpointing for custom training loops.

A look-alike of `tf.train.CheckpointManager` around a `tf.train.Checkpoint`
of the model and the optimizer:

- `save()` writes on rank 0 only (every process holds whole, identical
  replicas in a custom loop) and then waits for it on every rank. TensorFlow
  writes the shards under temporary names and switches the `checkpoint`
  index file last, by rename: a process killed during a save leaves the
  previous checkpoint loadable.
- `restore()` may come before the first step, as SMP scripts do: when the
  model has no weights yet, the restore waits until the first step has
  built them (and the optimizer's), then runs before that step computes
  anything. Every rank reads the same checkpoint.
- With `tensor_parallel_degree > 1` each tensor-parallel rank holds its
  own shards: the first replica's process of every tensor-parallel rank
  writes them under `directory/tp_rank_R` (SMP's partial checkpoints), and
  each process restores its rank's. Restore with the same degree; to
  change it, use `model.save_weights` (whole weights).

Example:

```python
import tempfile
import keras, numpy as np, tensorflow as tf
import keras_smp as smp

smp.init({"partitions": 1})
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
opt = keras.optimizers.SGD(0.1)
ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
manager = smp.CheckpointManager(ckpt, tempfile.mkdtemp(), max_to_keep=2)
path = manager.save()
manager.restore()
assert manager.latest_checkpoint == path
```
"""

import os
import weakref

import tensorflow as tf

from keras_smp import state

# Checkpoints whose restore waits for a model to be built.
_pending = []


class CheckpointManager:
    """Saves and restores a `tf.train.Checkpoint` (SMP's `CheckpointManager`).

    Args:
        checkpoint: a `tf.train.Checkpoint` (e.g. of `model` and
            `optimizer`).
        directory: where checkpoints go (shared by all ranks for restore).
        max_to_keep: how many to keep (`None`: all).
        checkpoint_name: file name prefix.
    """

    def __init__(self, checkpoint, directory="/opt/ml/checkpoints",
                 max_to_keep=None, checkpoint_name="ckpt"):
        if not isinstance(checkpoint, tf.train.Checkpoint):
            raise TypeError(
                "CheckpointManager expects a tf.train.Checkpoint, e.g. "
                "tf.train.Checkpoint(model=model, optimizer=optimizer); "
                f"received {type(checkpoint).__name__}.")
        self.checkpoint = checkpoint
        topology = state.topology()
        self.root = str(directory)
        self.directory = self.root
        self._tp_size = topology.tp_size
        if topology.tp_size > 1:
            # Shards: one checkpoint per tensor-parallel rank.
            self.directory = os.path.join(self.root,
                                          f"tp_rank_{topology.tp_rank}")
        self._manager = tf.train.CheckpointManager(
            checkpoint, self.directory, max_to_keep=max_to_keep,
            checkpoint_name=checkpoint_name)

    @property
    def latest_checkpoint(self):
        """Path prefix of the newest checkpoint, or `None`."""
        self._check_degree()
        return tf.train.latest_checkpoint(self.directory)

    def _check_degree(self):
        """Raises when the directory holds checkpoints of another
        tensor_parallel_degree (every rank sees the same files, so every
        rank raises)."""
        if not os.path.isdir(self.root):
            return
        ranks = sorted(
            int(name[len("tp_rank_"):]) for name in os.listdir(self.root)
            if name.startswith("tp_rank_")
            and name[len("tp_rank_"):].isdigit()
            and tf.train.latest_checkpoint(os.path.join(self.root, name)))
        found = len(ranks) if ranks else (
            1 if tf.train.latest_checkpoint(self.root) else None)
        if found is not None and found != self._tp_size:
            raise ValueError(
                f"CheckpointManager: {self.root!r} holds checkpoints of "
                f"tensor_parallel_degree={found} (one per tensor-parallel "
                f"rank), but this job runs tensor_parallel_degree="
                f"{self._tp_size}; a rank's checkpoint holds its shards only. "
                "Restore with the degree that saved them, or move across "
                "degrees with whole weights: `model.save_weights(path)` "
                "there and `model.load_weights(path)` here.")

    @property
    def checkpoints(self):
        """Paths of the kept checkpoints, oldest first."""
        return self._manager.checkpoints

    def save(self, checkpoint_number=None):
        """Writes a checkpoint (on rank 0; with tensor parallelism, on
        the first replica of each tensor-parallel rank) and returns its
        path prefix."""
        from keras_smp.smp import comms

        topology = state.topology()
        path = None
        if topology.rank == topology.tp_rank:  # first replica's processes
            path = self._manager.save(checkpoint_number=checkpoint_number)
        # Nobody goes on (and maybe restores) before the files exist.
        paths = comms.allgather(path)
        return paths[topology.tp_rank]

    def restore(self, save_path=None):
        """Restores `save_path` (default: the latest checkpoint).

        Before the model has weights, the restore is deferred to the first
        step. Returns the path restored (or to be restored), or `None` when
        there is no checkpoint yet. Every process calls it.
        """
        from keras_smp.smp import comms

        path = save_path or self.latest_checkpoint
        if path is None:
            return None
        if self._tp_size > 1 and not all(comms.allgather(
                os.path.dirname(os.path.abspath(str(path)))
                == os.path.abspath(self.directory))):
            # (Every rank raises: one restoring alone would wait for the
            # others in its first step's collectives.)
            raise ValueError(
                f"CheckpointManager.restore({str(path)!r}): with "
                f"tensor_parallel_degree={self._tp_size} each process "
                "restores its own rank's shards, from "
                f"{self.directory!r}; give a path there (or no path, for "
                "the latest).")
        if _built(self.checkpoint):
            _restore(self.checkpoint, path)
        else:
            _pending.append((weakref.ref(self.checkpoint), path))
        return path


def _children(checkpoint):
    return list(checkpoint._trackable_children().values())


def _built(checkpoint):
    import keras

    for obj in _children(checkpoint):
        if isinstance(obj, keras.Model) and not obj.variables:
            return False
    return True


def _restore(checkpoint, path):
    import keras

    models = [o for o in _children(checkpoint) if isinstance(o, keras.Model)]
    for opt in _children(checkpoint):
        if isinstance(opt, keras.optimizers.Optimizer) and not opt.built:
            # Slots must exist to receive their saved values.
            opt.build([v for m in models for v in m.trainable_variables])
    checkpoint.restore(path).assert_existing_objects_matched()


def restore_pending(model):
    """Runs deferred restores of checkpoints that hold `model`."""
    for entry in list(_pending):
        checkpoint = entry[0]()
        if checkpoint is None:
            _pending.remove(entry)
            continue
        if any(o is model for o in _children(checkpoint)) and _built(checkpoint):
            _pending.remove(entry)
            _restore(checkpoint, entry[1])
