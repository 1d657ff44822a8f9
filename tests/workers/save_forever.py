"""Saves a ~100 MB model again and again (tests kill it mid-save).

    save_forever.py save PATH   before save i every weight is set to i;
                                prints "SAVING i" before, "SAVED i" after
    save_forever.py load PATH   loads PATH, prints "VALUE v" (all weights
                                must hold the same value v)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

what, path = sys.argv[1], sys.argv[2]
with strategy.scope():
    model = keras.Sequential([keras.Input((4096,))] + [
        keras.layers.Dense(2048) for _ in range(3)])
if what == "load":
    model.load_weights(path)
    values = np.unique(np.concatenate([w.ravel() for w in model.get_weights()]))
    print("VALUE " + " ".join(str(v) for v in values), flush=True)
    sys.exit(0)
i = 0
while True:
    i += 1
    model.set_weights([np.full(w.shape, i, w.dtype) for w in model.get_weights()])
    print(f"SAVING {i}", flush=True)
    model.save_weights(path)
    print(f"SAVED {i}", flush=True)
