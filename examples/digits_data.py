"""The digits data set (bundled with scikit-learn: no download) as tf.data.

Shared by the examples. Every worker builds the same global batches (same
shuffle seed); the strategy gives each replica its own share.
"""

import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def _split():
    """`(x_train, x_test, y_train, y_test)`: pixels in [0, 1], 80/20 split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def datasets(global_batch, test_batch=40, drop_test_remainder=False):
    """Returns `(train, test, num_test)`: batched datasets, 80/20 split."""
    x_train, x_test, y_train, y_test = _split()
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=0)
             .batch(global_batch, drop_remainder=True))
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(
        test_batch, drop_remainder=drop_test_remainder)
    num_test = (len(x_test) // test_batch * test_batch
                if drop_test_remainder else len(x_test))
    return train, test, num_test


def smp_datasets(batch, dp_rank=0, dp_size=1):
    """SMP-style per-replica data: `(train, x_test, y_test)` as in SMP's docs.

    Replica `dp_rank` reads its own shard of the training split, shuffled
    with `seed=dp_rank`, in batches of `batch` with `drop_remainder=True`
    (the batch must divide into microbatches).
    """
    x_train, x_test, y_train, y_test = _split()
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shard(dp_size, dp_rank)
             .shuffle(10000, seed=dp_rank)
             .batch(batch, drop_remainder=True))
    return train, x_test, y_test
