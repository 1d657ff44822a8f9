"""Models with steps of their own (`train_step`, `test_step`), for the
workers: written for one device, as Keras' guides write them."""

import keras
import tensorflow as tf


class _GuideSteps:
    """The `train_step` and `test_step` of Keras' guide ("Customizing what
    happens in fit()"): the loss from `compute_loss`, fed to the `loss`
    tracker as it is (no replicas in mind)."""

    def _update(self, x, y, y_pred, loss):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            elif metric.name == "compile_metrics":
                metric.update_state(y, y_pred)
            # (per-output losses: `compute_loss` tracks them)
        return {m.name: m.result() for m in self.metrics}

    def train_step(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred,
                                     sample_weight=sw)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self._update(x, y, y_pred, loss)

    def test_step(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        return self._update(x, y, y_pred, self.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False))


class GuideSteps(_GuideSteps, keras.Sequential):
    """A Sequential model with the guide's steps."""


class GuideFunctional(_GuideSteps, keras.Model):
    """A functional model with the guide's steps."""


class OwnLossSteps(keras.Model):
    """A `train_step` / `test_step` calling a loss object and tracking
    its own metrics (a `Mean` of the loss, a mean absolute error)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    @property
    def metrics(self):
        return [self.tracker, self.mae]

    def _update(self, y, y_pred, loss):
        self.tracker.update_state(loss)
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self._update(y, y_pred, loss)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self._update(y, y_pred, self.loss_fn(y, y_pred))


class GAN(keras.Model):
    """Keras' GAN example's shape: no `call` of its own; its `train_step`
    trains a discriminator and a generator with two optimizers."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.d_tracker = keras.metrics.Mean(name="d_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]

    def train_step(self, real):
        rows = tf.shape(real)[0]
        latent = tf.tanh(real[:, :4] * 0.5 + 0.1)  # per row: any split
        fake = self.generator(latent)
        both = tf.concat([fake, real], 0)
        labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(both))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((rows, 1)), self.discriminator(
                self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(
            zip(grads, self.generator.trainable_weights))
        self.d_tracker.update_state(d_loss)
        self.g_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def make_gan():
    """A GAN of two small Sequential parts (6 features, latent 4),
    compiled with an Adam optimizer for each."""
    model = GAN(
        keras.Sequential([keras.Input((6,)),
                          keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)]),
        keras.Sequential([keras.Input((4,)),
                          keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(6)]))
    model.compile(keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2))
    return model


class Sampling(keras.layers.Layer):
    """Keras' VAE example's sampling layer: `z_mean + exp(z_log_var / 2) *
    eps`, `eps` drawn from its own `SeedGenerator`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        eps = keras.random.normal(keras.ops.shape(z_mean),
                                  seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * eps


class VAE(keras.Model):
    """Keras' VAE example's shape: no `call`; a `train_step` whose loss is
    written by hand (the batch mean of each row's summed squared error,
    the mean KL divergence, as `ops.mean` computes them), plus a Keras
    loss object's term (`MeanAbsoluteError`: Keras divides its gradient
    by the replicas) and a penalty on a weight computed by hand (the same
    on every replica: on one device it counts once)."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_tracker = keras.metrics.Mean(name="loss")
        self.kl_tracker = keras.metrics.Mean(name="kl_loss")
        self.mae = keras.losses.MeanAbsoluteError()

    @property
    def metrics(self):
        return [self.total_tracker, self.kl_tracker]

    def train_step(self, data):
        ops = keras.ops
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            rec = self.decoder(z)
            rec_loss = ops.mean(ops.sum(ops.square(data - rec), axis=1))
            kl = -0.5 * (1 + z_log_var - ops.square(z_mean)
                         - ops.exp(z_log_var))
            kl = ops.mean(ops.sum(kl, axis=1))
            penalty = 1e-2 * ops.sum(ops.square(
                self.decoder.layers[-1].kernel))
            total = rec_loss + kl + 0.5 * self.mae(data, rec) + penalty
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_tracker.update_state(total)
        self.kl_tracker.update_state(kl)
        return {m.name: m.result() for m in self.metrics}


def make_vae(features=6, loss_scale=False):
    """A VAE of `features` features (latent 2), SGD with momentum (the
    replicas' gradient sum shows in full, where Adam would hide a
    factor), inside a `LossScaleOptimizer` with `loss_scale` (under a
    strategy it applies its inner optimizer in other threads)."""
    inputs = keras.Input((features,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    z_mean, z_log_var = keras.layers.Dense(2)(h), keras.layers.Dense(2)(h)
    encoder = keras.Model(inputs, [z_mean, z_log_var,
                                   Sampling()([z_mean, z_log_var])])
    latent = keras.Input((2,))
    decoder = keras.Model(latent, keras.layers.Dense(features)(
        keras.layers.Dense(8, activation="tanh")(latent)))
    model = VAE(encoder, decoder)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer)
                  if loss_scale else optimizer)
    return model
