"""Chief-only file writes for Keras models trained with `SMPStrategy`.

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


def _redirect_save(method):
    @functools.wraps(method)
    def wrapper(self, filepath, *args, **kwargs):
        if _non_chief_strategy(self) is None:
            return method(self, filepath, *args, **kwargs)
        scratch = tempfile.mkdtemp(prefix="keras_smp_scratch_")
        try:
            target = os.path.join(scratch, os.path.basename(str(filepath)))
            return method(self, target, *args, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return wrapper


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
