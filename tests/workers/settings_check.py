"""`process.check_same_settings` and `agreement.check_same_call` with a
fake coordination service (used by tests): one thread per rank in this
process, a dict as the key-value store. Prints one JSON line per
scenario: what each rank raised.

Scenarios:
- "agree": 3 ranks with the same settings: none raises.
- "differ": rank 2 has another `microbatches` and fewer devices: every rank
  raises the same ValueError.
- "race": rank 1's wait for the verdict ends just as rank 0 fails (its
  failure published, the verdict stored): rank 1 still raises the verdict
  itself, whole, not rank 0's one-line report of it.
- "calls agree": 3 ranks start the same evaluate, then the same fit, a
  predict within it (a callback's) and the fit's validation: none raises;
  rank 0 deleted each call's keys once every rank had started the next.
- "calls differ": rank 1 starts predict where the others evaluate; the
  same fit, but rank 1 validates on other data; an evaluate, rank 2's
  with fewer steps and other batch dtypes: every rank raises the same
  ValueError each time.
- "ended": rank 2's script has ended (its exit key says so): ranks 0 and 1
  raise the same ValueError naming it, within seconds, not at the timeout.
- "rank 0 ended": ranks 1 and 2 wait for rank 0's verdict, but its script
  has ended: both raise naming rank 0.
"""

import itertools
import json
import os
import threading
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from keras_smp.config import SMPConfig  # noqa: E402
from keras_smp.runtime import agreement  # noqa: E402
from keras_smp.runtime import process  # noqa: E402
from keras_smp.runtime.calls import call_record  # noqa: E402
from keras_smp.runtime import shutdown  # noqa: E402


class Store:
    def __init__(self):
        self.values = {}
        self.cond = threading.Condition()


class Ctx:
    """The eager context's key-value calls, over `store`."""

    def __init__(self, store, fail_first_get_of=None):
        self.store = store
        self.fail_first_get_of = fail_first_get_of

    def set_config_key_value(self, key, value):
        with self.store.cond:
            if key in self.store.values:
                raise tf.errors.AlreadyExistsError(None, None, key)
            self.store.values[key] = value
            self.store.cond.notify_all()

    def delete_config_key_value(self, key):
        # The coordination service's: the key, and the keys under it.
        with self.store.cond:
            for k in [k for k in self.store.values
                      if k == key or k.startswith(key + "/")]:
                del self.store.values[k]

    def get_config_key_value(self, key, timeout_in_ms):
        if key == self.fail_first_get_of:
            self.fail_first_get_of = None
            # Wait (bounded) until rank 0 stored the verdict and failed,
            # then end this slice as a timeout would.
            with self.store.cond:
                self.store.cond.wait_for(
                    lambda: shutdown._FAILED in self.store.values, 30)
            time.sleep(0.6)  # more than half a 1 s slice: a timeout
            raise tf.errors.DeadlineExceededError(None, None, "timeout")
        with self.store.cond:
            if not self.store.cond.wait_for(
                    lambda: key in self.store.values, timeout_in_ms / 1000):
                raise tf.errors.DeadlineExceededError(None, None, key)
            return self.store.values[key]


def in_threads(rank, n, timeout):
    """Runs `rank(r)` for r < n, one thread each, and waits for them."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def run(name, configs, devices, race=False):
    store = Store()
    process._settings_checks = itertools.repeat(0)  # one check per thread
    raised = {}

    def rank(r):
        ctx = Ctx(store, "keras_smp/settings/0/verdict"
                  if race and r == 1 else None)
        context = types.SimpleNamespace(context=lambda: ctx)
        cluster = types.SimpleNamespace(rank=r, world_size=len(configs))
        layout = types.SimpleNamespace(
            mode="multi_process", device_type="CPU",
            devices=tuple((f"/cpu:{d}",) for d in range(devices[r])))
        try:
            process.check_same_settings(cluster, configs[r], layout,
                                        context=context)
            raised[r] = None
        except Exception as e:  # noqa: BLE001
            raised[r] = [type(e).__name__, str(e)]
            if r == 0 and race:  # what runtime.shutdown does on failure
                ctx.set_config_key_value(f"{shutdown._ERROR}/0",
                                         f"ValueError: {e}"[:100])
                ctx.set_config_key_value(shutdown._FAILED, "0")

    in_threads(rank, len(configs), 60)
    print(json.dumps({"scenario": name, "raised": raised}), flush=True)


same = [SMPConfig.build(microbatches=4, environ={})] * 3
run("agree", same, [1, 1, 1])
run("differ", same[:2] + [SMPConfig.build(microbatches=8, environ={})],
    [1, 1, 2])
run("race", [SMPConfig.build(microbatches=4, environ={}),
             SMPConfig.build(microbatches=2, environ={})], [1, 1], race=True)


class PerThread(threading.local):
    """`agreement._call_checks` (a process's count of its calls), one per
    thread here: each thread plays a rank, i.e. a process."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return self.n - 1


def calls(name, plans, ended=()):
    """`plans[r]`: rank r's `(record, of)` checks in order, `of` the
    position in the plan of the call a validation belongs to (`[]`: its
    script ended; `ended` lists the ranks whose exit key says so)."""
    store = Store()
    for r in ended:
        store.values[f"{shutdown._PREFIX}/{r}"] = "done"
    agreement._call_checks = PerThread()
    raised, took = {}, {}

    def rank(r):
        ctx = Ctx(store)
        context = types.SimpleNamespace(context=lambda: ctx)
        runtime = types.SimpleNamespace(
            collectives=True,
            cluster=types.SimpleNamespace(rank=r, world_size=len(plans)),
            config=types.SimpleNamespace(collective_timeout_seconds=30))
        began = time.monotonic()
        raised[r], indices = [], []
        for record, of in plans[r]:
            indices.append(None if of is None else indices[of])
            try:
                indices[-1] = agreement.check_same_call(
                    runtime, record, indices[-1], context=context)
                raised[r].append(None)
            except Exception as e:  # noqa: BLE001
                raised[r].append([type(e).__name__, str(e)])
        took[r] = time.monotonic() - began

    in_threads(rank, len(plans), 90)
    print(json.dumps({"scenario": name, "raised": raised,
                      "seconds": max(took.values()),
                      "keys": sorted(k for k in store.values
                                     if k.startswith("keras_smp/calls"))}),
          flush=True)


inputs = [("float32", [None, 8]), ("float32", [None, 2])]
evaluate = (call_record("evaluate", steps=4, arguments={"batch_size": 16},
                        inputs=inputs), None)
fit = (call_record("fit", steps=4, arguments={"epochs": 3}, inputs=inputs),
       None)
validation = (call_record("validation of fit", steps=2, inputs=[
    ("float32", [16, 8]), ("float32", [16, 2])]), 1)
predict = (call_record("predict", steps=4, inputs=inputs[:1]), None)
calls("calls agree", [[evaluate, fit, predict, validation]] * 3)
short = (call_record("evaluate", steps=3, arguments={"batch_size": 16},
                     inputs=[("float64", [None, 8]), ("float32", [None, 2])]),
         None)
other = (call_record("validation of fit", steps=1, inputs=[
    ("float32", [32, 8]), ("float32", [32, 2])]), 1)
calls("calls differ", [[evaluate, fit, validation, evaluate],
                       [predict, fit, other, evaluate],
                       [evaluate, fit, validation, short]])
calls("ended", [[evaluate], [evaluate], []], ended=[2])
calls("rank 0 ended", [[], [evaluate], [evaluate]], ended=[0])
