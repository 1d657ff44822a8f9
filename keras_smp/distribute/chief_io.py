"""Chief-only file writes for Keras models trained with `SMPStrategy`.

The chief's (and a single process's) `save` / `save_weights` of models
under `SMPStrategy` (and of every `DistributedModel`) write to a temporary
name in the target folder and rename it into place, so a process killed
mid-save leaves the previous checkpoint loadable.

Every worker runs the same callbacks. Left alone, `ModelCheckpoint` and
`BackupAndRestore` on several workers write the same files at once (HDF5
then fails with "unable to lock file") and delete each other's backups.
As `tf.keras` did for MultiWorkerMirroredStrategy, non-chief workers here
still run every save (so any collective op inside it stays matched across
workers) but into a private scratch directory that is removed right after;
only the chief writes the real files. Readers (restore) read the chief's
files, so multi-host restore needs a shared filesystem.

`install()` patches `keras.Model.save`, `keras.Model.save_weights`,
`keras.callbacks.BackupAndRestore` and `keras.callbacks.TensorBoard` (whose
non-chief summaries go to a scratch directory) once per process; the patches act only for
models whose strategy is a multi-worker `SMPStrategy` on a non-chief worker.
"""

import functools
import os
import shutil
import tempfile

_installed = False


def _non_chief_strategy(model):
    from keras_smp.distribute.strategy import SMPStrategy

    strategy = getattr(model, "_distribute_strategy", None)
    if not isinstance(strategy, SMPStrategy):
        return None
    if strategy.cluster.world_size > 1 and not strategy.is_chief:
        return strategy
    return None


def _smp_model(model):
    from keras_smp.distribute.strategy import SMPStrategy
    from keras_smp.pipeline.model import DistributedModel

    return (isinstance(getattr(model, "_distribute_strategy", None), SMPStrategy)
            or isinstance(model, DistributedModel))


def _redirect_save(method):
    @functools.wraps(method)
    def wrapper(self, filepath, *args, **kwargs):
        if _non_chief_strategy(self) is not None:
            scratch = tempfile.mkdtemp(prefix="keras_smp_scratch_")
            try:
                target = os.path.join(scratch, os.path.basename(str(filepath)))
                return method(self, target, *args, **kwargs)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        if not (_smp_model(self) and isinstance(filepath, (str, os.PathLike))):
            return method(self, filepath, *args, **kwargs)
        return _atomic(method, self, os.fspath(filepath), *args, **kwargs)

    return wrapper


def _atomic(method, model, filepath, *args, **kwargs):
    """Saves to a temporary name in the same folder, then renames.

    A process killed during the save leaves the previous file intact (and
    a stray `.tmp-<pid>-<name>` behind); the rename is atomic on POSIX.
    """
    overwrite = kwargs.get("overwrite", args[0] if args else True)
    if not overwrite and os.path.exists(filepath):
        return method(model, filepath, *args, **kwargs)  # Keras asks first
    folder, name = os.path.split(os.path.abspath(filepath))
    os.makedirs(folder, exist_ok=True)
    # Keras checks the suffix (.keras, .weights.h5): keep the name's end.
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        result = method(model, tmp, *args, **kwargs)
        os.replace(tmp, filepath)
        return result
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def install():
    """Installs the chief-only write patches (idempotent)."""
    global _installed
    if _installed:
        return
    import keras

    keras.Model.save = _redirect_save(keras.Model.save)
    keras.Model.save_weights = _redirect_save(keras.Model.save_weights)

    backup = keras.callbacks.BackupAndRestore
    save_model = backup._save_model
    on_train_end = backup.on_train_end

    @functools.wraps(save_model)
    def _save_model(self):
        if _non_chief_strategy(self.model) is None:
            return save_model(self)
        # Same save (and collectives) as the chief, into scratch.
        self.model.save_weights(filepath=self._weights_path, overwrite=True)

    @functools.wraps(on_train_end)
    def _on_train_end(self, logs=None):
        if _non_chief_strategy(self.model) is None:
            return on_train_end(self, logs)

    backup._save_model = _save_model
    backup.on_train_end = _on_train_end

    board = keras.callbacks.TensorBoard
    set_model = board.set_model

    @functools.wraps(set_model)
    def _set_model(self, model):
        if _non_chief_strategy(model) is not None:
            # Summaries of non-chief workers duplicate the chief's.
            self.log_dir = tempfile.mkdtemp(prefix="keras_smp_tb_")
        return set_model(self, model)

    board.set_model = _set_model
    _installed = True
