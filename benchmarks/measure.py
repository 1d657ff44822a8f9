"""What the benchmarks share, in one place: a process's peak resident
memory, the CPU's name (figures hold for that CPU only), and running a
script's workers under `keras-smp launch`."""


def peak_mb():
    """This process's peak resident memory (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def cpu_model():
    """The CPU's model name (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f
                        if l.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown CPU"


def launch_workers(root, script, args, n=2, timeout=600):
    """Runs `python script --worker ARGS` on `n` local workers with
    `keras-smp launch` (keras-smp from `root`); returns the finished
    process (stdout lines prefixed `[rank] `)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=root + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "keras_smp.launch", "-n", str(n), "--timeout",
         str(timeout), "--", sys.executable, os.path.abspath(script),
         "--worker", *args], env=env, cwd=root, capture_output=True,
        text=True, timeout=timeout + 100)


def timed_fit(model, dataset, steps, warmup=2):
    """`model.fit` for `warmup + steps` steps of `dataset` (repeated);
    returns `(median ms per step after the warm-up, History)`."""
    import time

    import keras
    import numpy as np

    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    history = model.fit(dataset, steps_per_epoch=steps + warmup, epochs=1,
                        verbose=0, callbacks=[Timer()])
    return float(np.median(times[warmup:])) * 1000, history
