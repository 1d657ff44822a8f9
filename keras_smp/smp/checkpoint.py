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
- With one pipeline stage per process (`smp.init` with `local_devices=1`)
  each stage's process holds its stage's weights and slots only: the first
  replica's process of every stage writes them under
  `directory/pp_rank_P`, and each process restores its stage's. Restore
  with the same partitions.

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
        runtime = state.runtime()
        local_tp = getattr(runtime, "local_tensor_parallel", 1) or 1
        if local_tp > 1:
            # A TensorFlow checkpoint saves one copy of a distributed
            # variable: here the copies are different shards.
            raise ValueError(
                f"CheckpointManager with tensor_parallel_degree={local_tp} "
                "over the local devices of one process would save only the "
                "first device's shard of each split weight. Save with "
                "Keras: `model.save_weights(path)` / "
                "`keras.callbacks.ModelCheckpoint` (whole weights).")
        self.checkpoint = checkpoint
        topology = state.topology()
        self.root = str(directory)
        self.directory = self.root
        self._tp_size = topology.tp_size
        # One stage per process: one checkpoint per pipeline stage.
        self._stages = (topology.pp_size if getattr(runtime, "mode", None)
                        == "multi_process" else 1)
        if self._stages > 1:
            self.directory = os.path.join(self.root,
                                          f"pp_rank_{topology.pp_rank}")
        elif topology.tp_size > 1:
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
        """Raises when this job's own location holds no checkpoint but the
        directory holds checkpoints of another tensor_parallel_degree
        (which would otherwise be ignored, or half-restored)."""
        if tf.train.latest_checkpoint(self.directory):
            return  # this degree's own checkpoints: restorable
        root = self.root
        if not tf.io.gfile.isdir(root):
            return
        staged = sorted(
            name.rstrip("/") for name in tf.io.gfile.listdir(root)
            if name.startswith("pp_rank_") and tf.train.latest_checkpoint(
                os.path.join(root, name.rstrip("/"))))
        if self._stages > 1 and staged and len(staged) != self._stages:
            raise ValueError(
                f"CheckpointManager: {root!r} holds checkpoints of "
                f"{len(staged)} pipeline stages ({', '.join(staged)}), and "
                f"this job runs partitions={self._stages} (one stage per "
                "process); a stage's checkpoint holds its own layers only. "
                f"Restore with partitions={len(staged)}, or move between "
                "partition counts with whole weights: "
                "`model.save_weights(path)` there and "
                "`model.load_weights(path)` here.")
        if (self._stages > 1) != bool(staged) and (
                staged or tf.train.latest_checkpoint(root)):
            raise ValueError(
                f"CheckpointManager: {root!r} holds checkpoints "
                + (f"of one pipeline stage per process ({', '.join(staged)}"
                   "), each holding its stage's weights only, and none of "
                   "this job, which holds whole replicas. Restore with "
                   "smp.init's local_devices=1 and the same partitions"
                   if staged else
                   "of whole replicas, and none of this job's stages (one "
                   "stage per process, smp.init's local_devices=1). "
                   "Restore with local_devices unset")
                + ", or move between layouts with whole weights: "
                "`model.save_weights(path)` there and "
                "`model.load_weights(path)` here.")
        ranks = sorted(
            int(name.rstrip("/")[len("tp_rank_"):])
            for name in tf.io.gfile.listdir(root)
            if name.startswith("tp_rank_")
            and name.rstrip("/")[len("tp_rank_"):].isdigit()
            and tf.train.latest_checkpoint(
                os.path.join(root, name.rstrip("/"))))
        if self._tp_size == 1:
            other = len(ranks) or None
        else:
            other = (1 if tf.train.latest_checkpoint(root) else
                     (max(ranks) + 1 if ranks and max(ranks) >= self._tp_size
                      else None))
        if other is not None:
            raise ValueError(
                f"CheckpointManager: {root!r} holds checkpoints of "
                f"tensor_parallel_degree={'>= ' if self._tp_size > 1 and other > 1 else ''}"
                f"{other} (one per tensor-parallel rank) and none of this "
                f"job's tensor_parallel_degree={self._tp_size}; a rank's "
                "checkpoint holds its shards only. Restore with the degree "
                "that saved them, or move across degrees with whole "
                "weights: `model.save_weights(path)` there and "
                "`model.load_weights(path)` here.")

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
        if topology.dp_rank == 0:  # first replica's processes
            path = self._manager.save(checkpoint_number=checkpoint_number)
        # Nobody goes on (and maybe restores) before the files exist.
        mine = (topology.pp_rank, topology.tp_rank)
        views = comms.allgather((topology.dp_rank, mine, path))
        return next(p for dp, shard, p in views
                    if dp == 0 and shard == mine)

    def _agreed_path(self, save_path, comms):
        """Shards (tensor parallelism, one stage per process): every
        rank's path to restore, checked together (every rank raises, or
        none: a rank restoring alone would wait for the others in its
        first step's collectives)."""
        try:
            path, error = save_path or self.latest_checkpoint, None
        except ValueError as e:
            path, error = None, str(e)
        if path is not None and os.path.dirname(os.path.abspath(
                str(path))) != os.path.abspath(self.directory):
            layout = (f"partitions={self._stages} (one stage per process)"
                      if self._stages > 1 else
                      f"tensor_parallel_degree={self._tp_size}")
            error = (f"CheckpointManager.restore({str(path)!r}): with "
                     f"{layout} each process "
                     "restores its own rank's shards, from "
                     f"{self.directory!r}; give a path there (or no path, "
                     "for the latest).")
        views = comms.allgather(
            (error, None if path is None else os.path.basename(str(path))))
        errors = [e for e, _ in views if e]
        if errors:
            raise ValueError(errors[0])
        names = sorted({str(n) for _, n in views})
        if len(names) > 1:
            raise ValueError(
                f"CheckpointManager.restore: the "
                f"{'pipeline' if self._stages > 1 else 'tensor-parallel'} "
                "ranks found different checkpoints "
                f"({', '.join(names)}; 'None': "
                f"none in its directory under {self.root!r}), e.g. after a "
                "save interrupted between ranks or a directory not shared "
                "by every process. Give every process the same "
                "`save_path` name that every rank holds (see "
                "`manager.checkpoints`), or share the directory.")
        return path

    def restore(self, save_path=None):
        """Restores `save_path` (default: the latest checkpoint).

        Before the model has weights, the restore is deferred to the first
        step. Returns the path restored (or to be restored), or `None` when
        there is no checkpoint yet. Every process calls it.
        """
        from keras_smp.smp import comms

        if self._tp_size == 1 and self._stages == 1:
            path = save_path or self.latest_checkpoint
        else:
            path = self._agreed_path(save_path, comms)
        if path is None:
            return None
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
    from keras_smp.runtime import deferred

    for opt in _children(checkpoint):
        if isinstance(opt, keras.optimizers.Optimizer) and not opt.built:
            # Slots must exist to receive their saved values (this
            # stage's weights' only, with one stage per process).
            opt.build([v for m in models for v in m.trainable_variables
                       if not deferred.holds_no_copy(v)])
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
