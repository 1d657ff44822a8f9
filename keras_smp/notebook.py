"""`notebook_launcher`: run a training function on N local workers from Jupyter.

In the spirit of Hugging Face Accelerate's `notebook_launcher`: the function
(defined in the notebook) is pickled by value with cloudpickle and run by N
fresh Python worker processes, each with `TF_CONFIG` for a localhost
cluster, exactly as `keras-smp launch` would start a script. Their output
streams into the cell, prefixed `[rank]`; the chief's (rank 0's) return
value is returned. Workers are fresh processes, so the kernel's own
TensorFlow state (devices already initialised) does not matter, and a
worker failure or a kernel interrupt stops them all.

Example:

```python
import keras_smp

def train(epochs):
    import keras_smp
    strategy = keras_smp.SMPStrategy()
    import keras, numpy as np
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=8,
                        epochs=epochs, verbose=0)
    return keras_smp.rank(), history.history["loss"][-1]

rank, loss = keras_smp.notebook_launcher(train, args=(2,), num_workers=2)
assert rank == 0
```
"""

import os
import pickle
import shutil
import sys
import tempfile

from keras_smp import launch


def notebook_launcher(function, args=(), kwargs=None, num_workers=2, *,
                      host_map=None, timeout=None, env=None):
    """Runs `function(*args, **kwargs)` in `num_workers` worker processes.

    Args:
        function: the training function; it runs in fresh processes, so it
            imports what it uses (`keras_smp`, `keras`, ...) and builds
            `SMPStrategy` itself. Must be picklable by cloudpickle
            (functions and classes defined in the notebook are).
        args: positional arguments (picklable).
        kwargs: keyword arguments (picklable).
        num_workers: number of worker processes (>= 1).
        host_map: optional host label per worker (emulated hosts, exported
            as `SMP_HOST_MAP`), e.g. `["a", "a", "b", "b"]`.
        timeout: optional time limit in seconds for the whole run.
        env: extra environment variables for the workers.

    Returns:
        What `function` returned on the chief (rank 0).

    Raises:
        RuntimeError: a worker failed (its traceback is in the output above),
            the run timed out or was interrupted.
    """
    import cloudpickle

    work = tempfile.mkdtemp(prefix="keras_smp_notebook_")
    try:
        payload = os.path.join(work, "function.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump((function, tuple(args), dict(kwargs or {})), f)
        command = [sys.executable, "-m", "keras_smp.notebook", payload, work]
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        try:
            code = launch.run(command, num_workers, host_map=host_map,
                              timeout=timeout)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if code != 0:
            raise RuntimeError(
                f"notebook_launcher: the workers failed (exit status {code}); "
                "the failing worker's traceback is in the output above.")
        with open(os.path.join(work, "result.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _worker(payload, work):
    import cloudpickle  # noqa: F401  (registers what pickle.load needs)

    with open(payload, "rb") as f:
        function, args, kwargs = pickle.load(f)
    result = function(*args, **kwargs)
    from keras_smp import ranks

    if ranks.rank() == 0:
        import cloudpickle as cp

        tmp = os.path.join(work, "result.pkl.tmp")
        with open(tmp, "wb") as f:
            cp.dump(result, f)
        os.replace(tmp, os.path.join(work, "result.pkl"))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
