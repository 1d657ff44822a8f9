"""SageMaker smp's custom-loop API on the keras-smp runtime.

Scripts written for `smdistributed.modelparallel.tensorflow` run with
`import keras_smp as smp`; the names live here:

- `keras_smp.smp.custom_loop`: `init`, `@step`, `StepOutput`;
- `keras_smp.smp.checkpoint`: `CheckpointManager`;
- `keras_smp.smp.comms`: `broadcast`, `allgather`, `send`, `recv_from`,
  `barrier`, `CommGroup`, `RankType`.

`keras_smp` re-exports them lazily (`keras_smp.init`, `keras_smp.step`,
...). This package imports nothing itself, so importing it does not start
TensorFlow.
"""
