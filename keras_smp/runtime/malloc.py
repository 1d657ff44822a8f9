"""One glibc malloc arena per process: TensorFlow's memory stays mapped.

TensorFlow runs its kernels (XLA's compiled stages included) on its own
thread pools, so on Linux their memory comes from glibc's per-thread
malloc arenas. A per-thread arena grows in heaps of at most 64 MB and
gives a heap back to the system (`munmap`) as soon as it is empty: a
training step whose temporaries (activations, gradients, XLA's buffers)
exceed a heap maps and zeroes fresh pages every step. Measured on AMD
EPYC, 2 cores (8 x Dense(1024), batch 1024, XLA, 1 thread per pool): a
2-stage pipeline of 8 microbatches in one process took 1.3 million page
faults and 825-860 ms/step, against 0.22 million and 590-616 ms/step in
glibc's main arena (plain Keras: 500 ms). PyTorch runs its ops on the
calling thread, in the main arena, and does not pay this.

`import keras_smp` therefore sets glibc's `M_ARENA_MAX` to 1: threads
that first allocate afterwards (TensorFlow starts its thread pools when it
runs its first operation, after `import tensorflow`) share the main
arena, which grows and shrinks at its top only. Threads that allocated
before keep their arenas, so import keras_smp before TensorFlow runs
anything (as `SMPStrategy` requires anyway). `keras-smp launch` exports
`MALLOC_ARENA_MAX=1` to its workers, which glibc applies from the
process's start. Both leave malloc alone when the environment sets
`MALLOC_ARENA_MAX` or `GLIBC_TUNABLES=glibc.malloc.arena_max=...`: set
either to choose (glibc's default allows 8 arenas per core), e.g. where
many threads allocate at once
(a wide `tf.data` pipeline) and contend for one arena. Nothing is
changed on other C libraries or systems.

Example:

```python
from keras_smp.runtime import malloc
malloc.limit_arenas({"MALLOC_ARENA_MAX": "4"})  # the user's choice: kept
assert malloc.ENV == "MALLOC_ARENA_MAX"
```
"""

import ctypes
import os
import platform
import sys

ENV = "MALLOC_ARENA_MAX"
ARENAS = 1
_M_ARENA_MAX = -8  # glibc's malloc.h


def glibc():
    """This process's C library, if it is glibc on Linux (else `None`)."""
    if not sys.platform.startswith("linux"):
        return None
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018  (present in glibc)
    except (OSError, AttributeError):
        return None
    return libc


def user_set(environ):
    """Whether `environ` chooses glibc's arena limit itself."""
    return (ENV in environ
            or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", ""))


def limit_arenas(environ=None):
    """Limits glibc to `ARENAS` malloc arena(s), unless `environ` (default
    `os.environ`) chooses the limit itself (`user_set`) or the C library is
    not glibc. Returns whether glibc accepted the limit (it binds threads
    that allocate for the first time afterwards)."""
    environ = os.environ if environ is None else environ
    if user_set(environ):
        return False
    libc = glibc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, ARENAS) == 1


def worker_env(env):
    """`env` for a launched worker: `MALLOC_ARENA_MAX=1`, unless `env`
    chooses the limit itself (`user_set`)."""
    if not user_set(env):
        env[ENV] = str(ARENAS)
    return env
