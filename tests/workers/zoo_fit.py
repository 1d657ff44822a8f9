"""Trains zoo models (tests/workers/zoo.py) in one mode; dumps the results.

Usage: zoo_fit.py --out DIR --mode MODE [--microbatches M] NAME [NAME ...]

MODE:
  reference  plain Keras, one device, no strategy
  dp         SMPStrategy data parallel (run under `keras-smp launch -n 2`)
  pipe       2-stage pipeline in this process (2 logical CPUs)
  stage      one stage per process (run under `keras-smp launch -n 2`)
  hybrid     2-stage pipeline in each process x data parallel across
             processes (run under `keras-smp launch -n 2`)

Writes DIR/NAME.rankR.npz: final weights (w0, w1, ...), every History key
(h:KEY), every evaluate() entry (e:KEY), predict() outputs (p0, ...) and
the optimizer's scalar variables (o:I:NAME: iterations, loss scale, ...);
or DIR/NAME.rankR.err with the exception when the model fails.
"""

import argparse
import os
import sys
import traceback

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", required=True,
               choices=["reference", "dp", "pipe", "stage", "hybrid"])
p.add_argument("--microbatches", type=int, default=2)
p.add_argument("--pipeline", default="1f1b")
p.add_argument("--split", default=None,
               help="DistributedModel split_points (comma-separated layer "
               "names) instead of automatic partitioning")
p.add_argument("names", nargs="+")
args = p.parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

strategy = None
pipelined = args.mode in ("pipe", "stage", "hybrid")
if args.mode != "reference":
    import keras_smp

    config = {"collective_timeout_seconds": int(os.environ.get("ZOO_TIMEOUT", 120))}
    if pipelined:
        config.update(partitions=2, microbatches=args.microbatches,
                      pipeline=args.pipeline)
    local = 2 if args.mode in ("pipe", "hybrid") else None
    strategy = keras_smp.SMPStrategy(config, local_devices=local)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import zoo  # noqa: E402

rank = strategy.topology.rank if strategy is not None else 0


def train(name):
    model, compile_args, (x, y, sw), fit_args = zoo.build(name)
    if pipelined:
        model = keras_smp.DistributedModel(
            model, split_points=args.split.split(",") if args.split else None)
    model.compile(**compile_args)
    vx, vy = fit_args.pop("eval_data")
    history = model.fit(x, y, sample_weight=sw, batch_size=zoo.BATCH,
                        verbose=0, **fit_args)
    evaluation = model.evaluate(vx, vy, batch_size=zoo.BATCH, verbose=0,
                                return_dict=True)
    predictions = model.predict(vx, batch_size=zoo.BATCH, verbose=0)
    out = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    for k, v in history.history.items():
        out[f"h:{k}"] = np.array(v, dtype="float64")
    for k, v in evaluation.items():
        out[f"e:{k}"] = np.array(v, dtype="float64")
    scalars = [v for v in model.optimizer.variables if len(v.shape) == 0]
    for i, v in enumerate(scalars):  # iterations, loss scale, ...
        # By position and name (paths carry the optimizer's name, which
        # counts the optimizers this process created before).
        out[f"o:{i}:{v.name}"] = np.array(v.numpy(), dtype="float64")
    for i, v in enumerate(keras.tree.flatten(predictions)):
        out[f"p{i}"] = np.asarray(v, dtype="float64")
    return out


for name in args.names:
    policy, floatx = keras.config.dtype_policy(), keras.config.floatx()
    try:
        if strategy is not None:
            with strategy.scope():
                result = train(name)
        else:
            result = train(name)
        np.savez(os.path.join(args.out, f"{name}.rank{rank}.npz"), **result)
        print(f"zoo: {name} ok", flush=True)
    except Exception as e:  # recorded; the test decides
        with open(os.path.join(args.out, f"{name}.rank{rank}.err"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        print(f"zoo: {name} FAILED {type(e).__name__}: {str(e)[:300]}",
              flush=True)
        if args.mode in ("dp", "stage", "hybrid"):
            # Peers may now wait on this process: stop the job.
            raise
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
