"""Layers that add losses in `call` (`add_loss()`), for the workers."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="added_losses")
class Penalty(keras.layers.Layer):
    """The identity, adding 0.01 x the mean square of its input as a loss
    (a custom layer's `add_loss()` in `call`)."""

    def call(self, x):
        self.add_loss(0.01 * ops.mean(ops.square(x)))
        return x


@keras.saving.register_keras_serializable(package="added_losses")
class Reconstruction(keras.layers.Layer):
    """Adds the mean square error between its two inputs as a loss and
    returns the second (an autoencoder's loss, added in `call`)."""

    def call(self, inputs):
        x, x_hat = inputs
        self.add_loss(ops.mean(ops.square(x - x_hat)))
        return x_hat


def _penalize(layer, x):
    """Adds 0.01 x the mean square of `x` as a loss of `layer`: `add_loss()`
    called from a helper function, outside the layer's class."""
    layer.add_loss(0.01 * ops.mean(ops.square(x)))


@keras.saving.register_keras_serializable(package="added_losses")
class HelperPenalty(keras.layers.Layer):
    """`Penalty`, whose loss a helper function adds (its class's code does
    not show the `add_loss()` call)."""

    def call(self, x):
        _penalize(self, x)
        return x
