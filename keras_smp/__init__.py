"""keras-smp: model and data parallelism for Keras 3 on TensorFlow."""

__version__ = "0.1.0"
