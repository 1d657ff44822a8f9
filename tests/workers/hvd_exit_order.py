"""Horovod all-reduces of one process set after the other set is done.

4 processes, `SMPStrategy(partitions=2, allreduce="horovod")`: Horovod
process sets {0, 2} (stage 0's replicas) and {1, 3} (stage 1's). After a
`fit`, ranks 0 and 2 end their scripts at once; ranks 1 and 3 wait
`argv[1]` seconds, then all-reduce their ranks over their process set and
print `LATE {"rank", "summed"}`. Every rank prints `EXIT rank` when its
script ends.
"""

import json
import sys
import time

import keras_smp as smp

strategy = smp.SMPStrategy(partitions=2, allreduce="horovod",
                           collective_timeout_seconds=120)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

with strategy.scope():
    model = smp.DistributedModel(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)]))
    model.compile("sgd", "mse")
x = np.ones((16, 4), "float32")
model.fit(x, x, batch_size=8, epochs=1, verbose=0)
rank = smp.rank()
if rank in (1, 3):
    import horovod.tensorflow as hvd

    from keras_smp.distribute import horovod as smp_horovod

    time.sleep(float(sys.argv[1]))
    process_set = smp_horovod._process_sets[(1, 3)]
    summed = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum,
                           process_set=process_set)
    print("LATE " + json.dumps({"rank": rank,
                                "summed": float(summed.numpy()[0])}),
          flush=True)
print(f"EXIT {rank}", flush=True)
