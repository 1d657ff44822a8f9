"""Tensor parallelism: which layers are split, and how (pure Python).

The Keras-facing API is `keras_smp.tensor_parallelism()` (a scope around
layer construction) and `keras_smp.set_tensor_parallelism(layer)`, in
`keras_smp.tensor.layers`; this module holds what they share with the
Keras patches without TensorFlow: the thread-local scope, the registry of
converters (Keras layer class -> function making a layer of that class
tensor-parallel) and the shard arithmetic.

A layer made tensor-parallel keeps its Keras class's construction, config
and build; only its weights (one shard per tensor-parallel rank) and its
`call` (the shard's part plus one collective) change. Outside an
`SMPStrategy` with `tensor_parallel_degree > 1` it is the plain layer.

Example:

>>> with scope(True):
...     marking()
True
>>> marking()
False
>>> shard_bounds(12, 4, 1)
(3, 6)
>>> shard_bounds(10, 4, 0)
Traceback (most recent call last):
...
ValueError: cannot split 10 across tensor_parallel_degree=4 ranks: 10 is not a multiple of 4. Use a tensor_parallel_degree that divides 10 (1, 2, 5, 10), or change the layer's size.
"""

import contextlib
import threading

_state = threading.local()

#: Functions called with every Keras layer as it is constructed (by the
#: patch of `Layer.__init__`); `keras_smp.tensor.layers` adds the one that
#: converts layers created inside `scope(True)`.
HOOKS = []

#: Functions called with a model before its step functions are made (a
#: patch of Keras' `make_*_function`); they raise on layouts that cannot
#: run.
MODEL_CHECKS = []


# The custom loop's group (`smp.init` with `tensor_parallel_degree > 1`,
# where no strategy carries one). What a trace is in (the model stage,
# split logits) is thread-local, as the marking scope.
_process = {"group": None}


def set_process_group(group):
    """Makes `group` the tensor-parallel group of layers created and
    optimizers stepped without an `SMPStrategy` (`smp.init` sets it)."""
    _process["group"] = group


def process_group():
    """The group `set_process_group` set, or `None`."""
    return _process["group"]


@contextlib.contextmanager
def stage(index):
    """Within: collectives are made for model stage `index` (`@smp.step`
    runs the stages of one process on their own devices; a collective
    group spans one device per process, so each stage has its own)."""
    previous = current_stage()
    _state.stage = index
    try:
        yield
    finally:
        _state.stage = previous


def current_stage():
    """The model stage `stage()` set, or `None`."""
    return getattr(_state, "stage", None)


@contextlib.contextmanager
def keep_logits_split():
    """Within (a train or test step of a model compiled with a
    vocabulary-parallel loss): its output projection keeps its logits
    split by vocabulary, and the loss and metrics reduce over the group."""
    previous = logits_kept_split()
    _state.split_logits = True
    try:
        yield
    finally:
        _state.split_logits = previous


def logits_kept_split():
    """Whether `keep_logits_split()` is active."""
    return getattr(_state, "split_logits", False)


def marking():
    """Whether layers created now are made tensor-parallel."""
    return bool(getattr(_state, "marking", False))


@contextlib.contextmanager
def scope(enabled=True):
    """Layers created inside are (`True`) or are not made tensor-parallel."""
    previous = marking()
    _state.marking = bool(enabled)
    try:
        yield
    finally:
        _state.marking = previous


def on_layer_created(layer):
    """Called for every Keras layer as it is constructed (a patch of
    `Layer.__init__`)."""
    for hook in HOOKS:
        hook(layer)


def check_model(model):
    """Runs `MODEL_CHECKS` on `model`."""
    for check in MODEL_CHECKS:
        check(model)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_bounds(size, parts, index, what=None):
    """`[start, stop)` of shard `index` when `size` is split in `parts`.

    Raises:
        ValueError: `size` is not a multiple of `parts` (naming the fix).
    """
    if size % parts:
        thing = what or str(size)
        raise ValueError(
            f"cannot split {thing} across tensor_parallel_degree={parts} "
            f"ranks: {size} is not a multiple of {parts}. Use a "
            f"tensor_parallel_degree that divides {size} "
            f"({', '.join(map(str, _divisors(size)))}), or change the "
            "layer's size.")
    step = size // parts
    return index * step, (index + 1) * step


def split_einsum(equation):
    """`(input, kernel, output)` letter strings of an `EinsumDense`
    equation such as `"abc,cde->abde"` (an ellipsis counts as one letter).

    >>> split_einsum("...b,bc->...c")
    ('.b', 'bc', '.c')
    """
    lhs, out = equation.replace("...", ".").split("->")
    inp, kernel = lhs.split(",")
    return inp, kernel, out


def column_letter(equation):
    """The kernel letter a column-parallel `EinsumDense` splits: the first
    one of the output that is not in the input (`None` if there is none).

    >>> column_letter("abc,cde->abde")
    'd'
    """
    inp, kernel, out = split_einsum(equation)
    return next((c for c in kernel if c in out and c not in inp), None)


def output_axis(equation, letter):
    """The axis of the output of an `EinsumDense` equation that `letter`
    names: counted from the front when it comes before an ellipsis, from
    the end otherwise (an ellipsis may stand for several axes).

    >>> output_axis("abc,cd->abd", "d"), output_axis("ab...,bc->ac...", "c")
    (-1, 1)
    """
    out = split_einsum(equation)[2]
    index = out.index(letter)
    if "." in out and index < out.index("."):
        return index
    return index - len(out)


def row_letter(equation):
    """The kernel letter a row-parallel `EinsumDense` splits: the first one
    summed over (in the input and the kernel, not in the output).

    >>> row_letter("abcd,cde->abe")
    'c'
    """
    inp, kernel, out = split_einsum(equation)
    return next((c for c in kernel if c in inp and c not in out), None)
