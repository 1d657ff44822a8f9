"""Multi-process pipeline executor: one stage per worker process.

Each process runs its own stage's actions of the shared pure-Python
`Schedule` (`schedule.compute_actions(stage)`) inside the Keras step's
`tf.function`. Activations go to the next stage and their gradients come
back through TensorFlow collective point-to-point ops
(`CollectiveBcastSendV2` / `CollectiveBcastRecvV2` on the two-member group
of neighbouring stages), over TensorFlow's own runtime (gRPC; NCCL on GPUs).

Ordering: the stage's actions are chained with control dependencies in
schedule order, each action including the sends of its results: the next
action starts once the neighbour has taken the data. Receives are issued
without dependencies at the start of the step (they wait for their data),
so every send finds its receive already posted and a blocking send never
waits on the peer's schedule, which is what makes 1F1B deadlock-free (see
docs/schedules.md). Chaining the sends matters on a serial device (one
inter-op thread): a send left outside the chain would only be dispatched
when the chain stalls, after all forward passes, and the next stage would
idle until then. Every op carries `timeout_seconds`, so a dead or hung peer
turns into a `DeadlineExceededError` instead of a hang.
"""

import tensorflow as tf

from keras_smp.pipeline.executor import _as_list
from keras_smp.pipeline.executor import _tf_variable

# Group keys of point-to-point and pipeline groups (cluster-global).
P2P_KEY_BASE = 600_000


class StageLinks:
    """Collective links of one stage process within its pipeline replica.

    Args:
        num_stages: stages per replica (`P`).
        stage: this process's stage (`pp_rank`).
        replica: this process's data-parallel replica (`dp_rank`).
        timeout_seconds: timeout of every collective op (0 = none).
    """

    def __init__(self, num_stages, stage, replica, timeout_seconds=0):
        self.num_stages = num_stages
        self.stage = stage
        self.replica = replica
        self.timeout = float(timeout_seconds or 0)

    def _pair_key(self, boundary):
        # Boundary b joins stages b and b+1 of this replica.
        return P2P_KEY_BASE + self.replica * self.num_stages + boundary

    def pipeline_key(self):
        """Group of all stages of this replica (losses, outputs, weights)."""
        return P2P_KEY_BASE + 50_000 + self.replica

    def tied_key(self, stage_mask):
        """Group of this replica's stages in `stage_mask` (tied weights)."""
        if stage_mask >= 1 << 12:
            raise ValueError(
                "Weights tied across more than the first 12 pipeline stages "
                "are not supported.")
        return P2P_KEY_BASE + 100_000 + self.replica * 4096 + stage_mask

    def send(self, tensor, group_key, group_size, instance_key):
        return tf.raw_ops.CollectiveBcastSendV2(
            input=tensor, group_size=group_size, group_key=group_key,
            instance_key=instance_key, communication_hint="auto",
            timeout_seconds=self.timeout)

    def recv(self, shape, dtype, group_key, group_size, instance_key):
        return tf.raw_ops.CollectiveBcastRecvV2(
            group_size=group_size, group_key=group_key,
            instance_key=instance_key, shape=shape, T=dtype,
            communication_hint="auto", timeout_seconds=self.timeout)

    # Instance keys: distinct per tensor, microbatch and direction within a
    # step; the same keys are reused by the next step (as TF's own do).
    @staticmethod
    def _instance(kind, microbatch, index):
        return 1 + (microbatch * 2 + kind) * 1000 + index

    def send_activations(self, tensors, microbatch):
        key = self._pair_key(self.stage)
        return [self.send(t, key, 2, self._instance(0, microbatch, i))
                for i, t in enumerate(tensors)]

    def recv_activations(self, specs, microbatch):
        key = self._pair_key(self.stage - 1)
        return [self.recv(shape, dtype, key, 2,
                          self._instance(0, microbatch, i))
                for i, (shape, dtype) in enumerate(specs)]

    def send_gradients(self, tensors, microbatch):
        key = self._pair_key(self.stage - 1)
        return [self.send(t, key, 2, self._instance(1, microbatch, i))
                for i, t in enumerate(tensors)]

    def recv_gradients(self, specs, microbatch):
        key = self._pair_key(self.stage)
        return [self.recv(shape, dtype, key, 2,
                          self._instance(1, microbatch, i))
                for i, (shape, dtype) in enumerate(specs)]

    def barrier(self, world_size, instance_key):
        """Waits (eagerly) until every worker of the job has arrived.

        TensorFlow resolves collective groups through task 0, so a worker
        whose collectives finished must not let task 0 exit before the
        others' have: callers end their collective sequences with this.
        """
        return tf.raw_ops.CollectiveReduceV2(
            input=tf.zeros([1]), group_size=world_size,
            group_key=P2P_KEY_BASE + 90_000, instance_key=instance_key,
            ordering_token=[], merge_op="Add", final_op="Id",
            communication_hint="auto", timeout_seconds=self.timeout)

    def share_from_last(self, tensors, specs, instance_base):
        """Broadcasts the last stage's `tensors` to every stage of the replica.

        On the last stage returns `tensors` (after sending); elsewhere
        receives tensors of `specs` (shape, dtype).
        """
        p = self.num_stages
        if p == 1:
            return list(tensors)
        key = self.pipeline_key()
        if self.stage == p - 1:
            sends = [self.send(t, key, p, instance_base + i)
                     for i, t in enumerate(tensors)]
            with tf.control_dependencies(sends):
                return [tf.identity(t) for t in tensors]
        return [self.recv(shape, dtype, key, p, instance_base + i)
                for i, (shape, dtype) in enumerate(specs)]


def run_stage(stage_fn, variables, loss_fn, schedule, links, inputs,
              in_specs, out_specs, forward_only=False):
    """Builds this process's stage of one pipelined step.

    Must be called inside a `tf.function`.

    Args:
        stage_fn: `list[Tensor] -> list[Tensor]` of this stage.
        variables: this stage's trainable variables.
        loss_fn: `(outputs, microbatch) -> scalar` (last stage only).
        schedule: the `Schedule` shared by all stages.
        links: this process's `StageLinks`.
        inputs: per microbatch, the list of model inputs (stage 0 only).
        in_specs: `(shape, dtype)` of each tensor this stage receives.
        out_specs: `(shape, dtype)` of each tensor this stage sends on.
        forward_only: evaluation / prediction (no backward actions).

    Returns:
        `(losses, outputs, grads)`: per-microbatch losses and outputs (last
        stage; `None` elsewhere) and this stage's variable gradients summed
        over microbatches (all depending on the stage's sends).
    """
    s, p = links.stage, links.num_stages
    m = schedule.num_microbatches
    tf_vars = [_tf_variable(v) for v in variables]
    stage_in, stage_out = {}, {}
    losses, outputs = [None] * m, [None] * m
    grads = [None] * len(tf_vars)
    sends = []
    last = None
    for action in schedule.compute_actions(s):
        if forward_only and action.kind == "B":
            continue
        mb = action.microbatch
        deps = [last] if last is not None else []
        scope = f"stage{s}/{'fwd' if action.kind == 'F' else 'bwd'}_mb{mb}"
        with tf.name_scope(scope):
            if action.kind == "F":
                src = (inputs[mb] if s == 0
                       else links.recv_activations(in_specs, mb))
                with tf.control_dependencies(deps):
                    ins = [tf.identity(t) for t in _as_list(src)]
                    out = _as_list(stage_fn(ins))
                    stage_in[mb], stage_out[mb] = ins, out
                    if s == p - 1:
                        outputs[mb] = out
                        if loss_fn is not None:
                            losses[mb] = loss_fn(out, mb)
                    done = out + ([losses[mb]] if losses[mb] is not None
                                  else [])
                if s < p - 1:
                    sent = links.send_activations(out, mb)
                    sends += sent
                    done = done + sent
            else:
                seed = (None if s == p - 1
                        else links.recv_gradients(out_specs, mb))
                with tf.control_dependencies(deps):
                    ys = [losses[mb]] if s == p - 1 else stage_out[mb]
                    xs = ([] if s == 0 else stage_in[mb]) + tf_vars
                    gs = tf.gradients(ys, xs, grad_ys=seed,
                                      unconnected_gradients="zero")
                    n_in = 0 if s == 0 else len(stage_in[mb])
                    for i, g in enumerate(gs[n_in:]):
                        grads[i] = g if grads[i] is None else grads[i] + g
                    done = gs
                if s > 0:
                    sent = links.send_gradients(gs[:n_in], mb)
                    sends += sent
                    done = list(done) + sent
        last = tf.group(*done) if done else tf.no_op()
    # Whatever uses the results also waits for this stage's sends.
    with tf.control_dependencies(sends + ([last] if last is not None else [])):
        grads = [None if g is None else tf.identity(g) for g in grads]
        barrier = tf.no_op()
    return losses, outputs, grads, barrier
