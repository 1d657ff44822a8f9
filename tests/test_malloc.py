"""glibc's malloc arenas in keras-smp processes (`keras_smp.runtime.malloc`)."""

import json
import platform
import sys

import pytest

from conftest import launch
from conftest import run_python

# Counts glibc's malloc arenas (malloc_info's XML has one <heap nr=...> per
# arena) before and after TensorFlow ran a compiled step on its own threads
# and 4 Python threads allocated 1 MB each, all alive at once.
ARENAS = r"""
import ctypes, json, os, sys, threading
libc = ctypes.CDLL(None)
libc.open_memstream.restype = ctypes.c_void_p
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

def arenas():
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, f)
    libc.fclose(f)
    return ctypes.string_at(buf, size.value).decode().count("<heap nr=")

imported = None
if sys.argv[1] == "tensorflow first":
    import tensorflow as tf
    imported = arenas()  # TensorFlow's pools start at its first op
import keras_smp
import numpy as np
import tensorflow as tf
before = arenas()
tf.config.threading.set_inter_op_parallelism_threads(2)
x = tf.constant(np.ones((256, 256), "float32"))
tf.function(lambda a: tf.reduce_sum(a @ a), jit_compile=True)(x).numpy()
ready = threading.Barrier(5)
def work():
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    ready.wait()
    libc.free(p)
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
ready.wait()
after = arenas()
for t in threads:
    t.join()
print("RESULT " + json.dumps({"before": before, "after": after,
                              "imported": imported,
                              "env": os.environ.get("MALLOC_ARENA_MAX")}))
"""


def _arenas(order, extra_env):
    # A fresh interpreter (not forked from the suite's server): glibc reads
    # MALLOC_ARENA_MAX when the process starts.
    out = run_python(["-c", ARENAS, order], extra_env=extra_env,
                     fork=False).stdout
    return json.loads(out.split("RESULT ", 1)[1])


GLIBC = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc arenas exist on Linux with glibc only; "
           "elsewhere keras-smp leaves malloc alone")


@GLIBC
@pytest.mark.parametrize("order", ["keras_smp first", "tensorflow first"])
def test_import_keeps_tensorflows_threads_in_one_malloc_arena(order):
    # Without a limit each new thread that allocates gets an arena of its
    # own (glibc's default, up to 8 per core): the control, with the
    # user's MALLOC_ARENA_MAX=16 kept by keras-smp, counts more arenas
    # after TensorFlow's and the 4 threads' allocations. `import keras_smp`
    # (no MALLOC_ARENA_MAX set), before or after `import tensorflow`,
    # limits glibc to 1: the count stays.
    limited = _arenas(order, {"MALLOC_ARENA_MAX": None})
    assert limited["env"] is None, limited
    assert limited["after"] == limited["before"], limited
    control = _arenas(order, {"MALLOC_ARENA_MAX": "16"})
    assert control["after"] >= control["before"] + 4, control
    if order == "tensorflow first":
        # `import tensorflow` alone starts no thread that allocates (its
        # pools start at its first operation): the docs' advice holds.
        assert limited["imported"] == control["imported"] == 1, (
            limited, control)


def test_a_limit_the_user_set_is_kept():
    # (Only environments that set the limit are passed: these calls return
    # before looking for glibc. This pytest process's own `import
    # keras_smp` applied its environment's choice already.)
    from keras_smp.runtime import malloc

    for user in ({"MALLOC_ARENA_MAX": "4"},
                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}):
        assert malloc.limit_arenas(dict(user)) is False, user
        assert malloc.worker_env(dict(user)) == user, user
    assert malloc.worker_env({"GLIBC_TUNABLES": "glibc.cpu.x86_ibt=on"}) == {
        "GLIBC_TUNABLES": "glibc.cpu.x86_ibt=on", "MALLOC_ARENA_MAX": "1"}


def test_launched_workers_get_one_malloc_arena_unless_set():
    # `keras-smp launch` exports MALLOC_ARENA_MAX=1 (glibc applies it from
    # the worker's start); a value the user set is passed on.
    code = "import os; print('ARENAS', os.environ.get('MALLOC_ARENA_MAX'))"
    out = launch(2, ["-c", code], timeout=60,
                 extra_env={"MALLOC_ARENA_MAX": None}).stdout
    assert out.count("ARENAS 1") == 2, out
    out = launch(2, ["-c", code], timeout=60,
                 extra_env={"MALLOC_ARENA_MAX": "4"}).stdout
    assert out.count("ARENAS 4") == 2, out
