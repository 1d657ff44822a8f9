"""Sharded checkpoints: each pipeline stage writes its own weights.

With one pipeline stage per process no process holds the whole model, so
none can write a whole-model file. `save(model, path)` has the first
data-parallel replica of each stage write its stage's weights and optimizer
slots into its own HDF5 shard, and rank 0 write the index. The index is
Keras' own sharded format (`*.weights.json`: a `weight_map` from each
weight group to the shards holding it, read by `keras.Model.load_weights`),
laid out as the wrapped Keras model's own `save_weights` lays out a file.
So:

- a plain Keras model of the same architecture loads it directly:
  `plain.load_weights("ckpt.weights.json")` (build its optimizer first to
  load the optimizer state too, as with any Keras weights file);
- a `DistributedModel` with any number of stages and data-parallel replicas
  loads it (`load`), each process reading only the weights it holds;
- `assemble_checkpoint` (`keras_smp.assemble_checkpoint`) copies it into one
  plain `.weights.h5`, or a `.keras` file of the plain Keras model for
  export, a dataset at a time.

A path ending in `.weights.h5` gets the same shards and index, plus that
file: a small HDF5 file naming the index (`POINTER_ATTR`), so Keras
callbacks that save and test for `*.weights.h5` (`ModelCheckpoint`,
`BackupAndRestore`) keep working. Shards get new names at every save; the
index is replaced last, by rename, and the previous save's shards are
removed after: a process killed while saving leaves the previous
checkpoint loadable. Multi-host jobs need a shared filesystem (every
stage writes into the same folder).

Example (one process, 2 stages; the same code runs one stage per process):

```python
import os, tempfile
import keras, numpy as np
import keras_smp

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)
with strategy.scope():
    model = keras_smp.DistributedModel(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]))
    model.compile(optimizer="adam", loss="mse")
model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=8, verbose=0)
path = os.path.join(tempfile.mkdtemp(), "ckpt.weights.json")
model.save_weights(path)

plain = keras.Sequential([
    keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
plain.load_weights(path)
for a, b in zip(plain.get_weights(), model.get_weights()):
    np.testing.assert_array_equal(a, b)

# One plain Keras file for export, streamed from the shards:
keras_file = os.path.join(tempfile.mkdtemp(), "model.keras")
keras_smp.assemble_checkpoint(path, keras_file, model=model)
exported = keras.models.load_model(keras_file)
x = np.ones((2, 4), "float32")
# Within float32 rounding: the pipeline runs other kernel shapes
# (microbatches), which round differently on some CPUs.
np.testing.assert_allclose(exported.predict(x, verbose=0),
                           model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
```
"""

import json
import os
import shutil
import threading
import time
import zipfile

import h5py
import keras
import numpy as np
import tensorflow as tf

from keras_smp.pipeline import residency
from keras_smp.runtime import keras_private
from keras_smp.runtime import patches
from keras_smp.smp import comms

#: Attribute of a `*.weights.h5` file that points to a sharded checkpoint
#: (the name of its `*.weights.json` index, in the same folder).
POINTER_ATTR = "keras_smp_sharded_index"
FORMAT = 1


def entries(model, own_layout=False, with_optimizer=True):
    """`[(group, key, value, owner)]`: what `save_weights` writes, in its
    order.

    `group` is the HDF5 group of the value (`"layers/dense/vars"`), laid
    out as the wrapped Keras model's own file (the `DistributedModel`
    wrapper adds no level), or with `own_layout` as Keras lays out the
    `DistributedModel` itself in a `.keras` file (`"inner_model/..."`);
    `value` is usually a Keras variable; `owner` the name of the layer (or
    optimizer) saving it.
    """
    recorder = _Recorder()
    visited = _not_saved(model, own_layout)
    for saveable, path in _roots(model, own_layout):
        if with_optimizer or path != "optimizer":
            keras_private.save_state(saveable, recorder, path, visited)
    return recorder.entries


def _not_saved(model, own_layout=False):
    """Ids of what the wrapped model holds but does not train with: the
    optimizer it was compiled with before wrapping (a KerasHub task
    compiles itself), when the `DistributedModel` was compiled with
    another. Its group would be the wrapper's optimizer's ("optimizer"):
    written twice ("Unable to create link (name already exists)")."""
    inner = getattr(model, "inner_model", None)
    own = getattr(inner, "optimizer", None)
    if inner is None or own_layout or own is None or own is getattr(
            model, "optimizer", None):
        return set()
    return {id(own)}


def _roots(model, own_layout=False):
    inner = getattr(model, "inner_model", None)
    if inner is None or own_layout:  # e.g. a subclassed DistributedModel
        return [(model, "")]
    roots = [(inner, "")]
    if getattr(model, "optimizer", None) is not None:
        roots.append((model.optimizer, "optimizer"))
    return roots


class _Recorder(keras_private.H5IOStore):
    """A weight store recording `(group, key, value)`; writes nothing."""

    def __init__(self):  # pylint: disable=super-init-not-called
        self.entries = []
        self._group = "vars"
        self._owner = None

    def __bool__(self):
        return True

    def make(self, path, metadata=None):
        self._group = f"{path}/vars" if path else "vars"
        self._owner = (metadata or {}).get("name")
        return self

    def __setitem__(self, key, value):
        self.entries.append((self._group, str(key), value, self._owner))

    def close(self):
        pass


def _stage_of_entries(model, items):
    """The pipeline stage owning each entry: a weight's home stage, an
    optimizer slot's (or other state made for one weight: Adafactor's
    factors) weight's, other values (step counter, loss scale) stage 0's;
    a value a layer computes, its layer's stage."""
    graph = model.staged_graph
    home = graph.home_stage()
    layer_stage = {}
    for s in range(graph.num_stages):
        for node in graph.stage_nodes(s):
            layer_stage.setdefault(getattr(node.operation, "name", None), s)
    optimizer = getattr(model, "optimizer", None)
    slots = residency.slot_references(optimizer)
    slots.update(keras_private.per_weight_state(optimizer))
    stages = []
    for _, _, value, owner in items:
        # A tensor-parallel layer saves whole weights gathered from its
        # shards, each knowing its variable.
        source = getattr(value, "source", None)
        value = value if source is None else source
        if isinstance(value, keras.Variable):
            ref = slots.get(id(value))
            stage = home.get(id(ref if ref is not None else value), 0)
        else:
            stage = layer_stage.get(owner, 0)
        stages.append(stage)
    return stages


def _layout(model):
    """`(rank, writes(stage) -> bool)` for this process."""
    rt = model._smp_runtime()  # pylint: disable=protected-access
    rank = rt.topology.rank if rt is not None else 0
    if model._smp_residency() is not None:  # pylint: disable=protected-access
        links = model._smp_links()  # pylint: disable=protected-access
        return rank, lambda s: links.holds(s) and links.replica == 0
    return rank, lambda s: rank == 0


def _base(filepath):
    name = os.path.basename(filepath)
    for suffix in (".weights.json", ".weights.h5"):
        if name.endswith(suffix):
            base = name[:-len(suffix)]
            if ".weights" in base:
                # Keras' reader derives the shard names by removing every
                # ".weights" from the index's name.
                raise ValueError(
                    f"A sharded checkpoint's name may contain '.weights' "
                    f"only as its suffix; received {filepath!r}. Rename "
                    "it, e.g. 'model.weights.json'.")
            return base
    raise ValueError(
        f"A sharded checkpoint's path must end in '.weights.json' (or "
        f"'.weights.h5'); received {filepath!r}.")


def _to_numpy(value):
    # A tensor-parallel shard (an optimizer slot of a split weight: the
    # weights come gathered already) is written whole.
    array = (patches.whole_value(value) if patches.split_of(value)
             else keras.ops.convert_to_numpy(value))
    if array.size == 0 and getattr(value, "shape", None) is not None and (
            int(np.prod(value.shape)) > 0):
        raise RuntimeError(
            f"Sharded save: {getattr(value, 'path', value)!r} has no "
            "values in the process that should write it (an internal "
            "error: please report it).")
    return array


def _check_one_path(model, filepath, call):
    """With one stage per process every process must name the same file:
    each stage writes its shard beside the others' and rank 0 the index
    naming them. Paths with the rank in them gave an index naming shards
    that were elsewhere (no error until it was loaded). A `ValueError` on
    every process, before anything is written. (Otherwise rank 0 writes
    it all: other ranks' paths do not matter, as in Keras.)"""
    if model._smp_residency() is None:  # pylint: disable=protected-access
        return
    paths = comms.allgather(filepath)
    if len(set(paths)) > 1:
        raise ValueError(
            f"{call}: every process of the job must pass the same path (with "
            "one pipeline stage per process each writes its stage's part "
            "beside the others', and rank 0 the file naming them); "
            "received " + ", ".join(f"rank {r}: {p!r}"
                                    for r, p in enumerate(paths))
            + ". Pass one path on every rank (keras-smp writes each file "
            "once).")


def save(model, filepath, own_layout=False, with_optimizer=True):
    """Writes a sharded checkpoint of `model` (a `DistributedModel`).

    A collective: every process of the job calls it. Returns the path of
    the index (`*.weights.json`). `own_layout`, `with_optimizer`: see
    `entries` (`with_optimizer=False`: the weights only).
    """
    filepath = os.path.abspath(os.fspath(filepath))
    _check_one_path(model, filepath, "save_weights")
    folder, base = os.path.dirname(filepath), _base(filepath)
    rank, writes = _layout(model)
    error = None
    try:
        items = entries(model, own_layout, with_optimizer)
        stages = _stage_of_entries(model, items)
    except Exception as e:  # pylint: disable=broad-except
        error = f"rank {rank}: {type(e).__name__}: {e}"
    _raise_any(comms.allgather(error), filepath)
    num_stages = model.staged_graph.num_stages
    first = comms.share(
        _first_number(folder, base, num_stages) if rank == 0 else None)
    names = [_shard_name(base, first + s) for s in range(num_stages)]
    error = None
    try:
        os.makedirs(folder, exist_ok=True)
        for s in range(num_stages):
            mine = [e for e, st in zip(items, stages) if st == s
                    and not residency.is_local(e[2])]
            if mine:  # replicas that do not write read alike (collectives)
                _write_shard(os.path.join(folder, names[s])
                             if writes(s) else None, mine)
    except Exception as e:  # pylint: disable=broad-except
        error = f"rank {rank}: {type(e).__name__}: {e}"
    errors = [e for e in comms.allgather(error) if e]
    if not errors and rank == 0:
        try:
            _write_index(filepath, folder, base, items, stages, names)
        except Exception as e:  # pylint: disable=broad-except
            errors = [f"rank 0: {type(e).__name__}: {e}"]
    _raise_any(comms.share(errors), filepath)
    return os.path.join(folder, base + ".weights.json")


def save_keras(model, filepath):
    """Writes `model` (a `DistributedModel`) as one `.keras` file, streamed.

    What `model.save("x.keras")` writes (the `DistributedModel`'s
    configuration, compile configuration, weights and optimizer state,
    assets), without any process holding the whole model: each stage
    writes its shard into a temporary folder beside `filepath` (the
    sharded checkpoint's writer, laid out as Keras lays out the
    `DistributedModel` in a `.keras` file), then rank 0 copies the shards
    into the archive one weight at a time, replaces `filepath` (rename)
    and removes the folder. A collective: every process calls it. Multi-
    host jobs need `filepath` on a filesystem every host shares.
    """
    filepath = os.path.abspath(os.fspath(filepath))
    return _from_shards(
        model, filepath, lambda index, staging: _replace(
            filepath, lambda tmp: _write_keras_archive(tmp, model, index)),
        own_layout=True, with_optimizer=True,
        failed=f"Saving {filepath!r} failed (the previous file there, if "
               "any, is unchanged)")


def export_from_shards(model, save_path, input_signature,
                       format="tf_saved_model", verbose=None, **kwargs):
    """Exports `model` (a `DistributedModel`) as an unpartitioned
    inference artifact (Keras' `export`, any `format`; a SavedModel by
    default), without gathering it into every process.

    Each stage writes its weights (not its optimizer state) into a shard
    in a temporary folder beside `save_path`; rank 0 alone builds the
    plain Keras model from them (streamed into a `.keras` file, then
    loaded: rank 0 holds its stage plus the whole model's weights, which
    serving needs) and exports it; the folder is removed. A collective.
    """
    save_path = os.path.abspath(os.fspath(save_path))

    def export(index, staging):
        keras_file = os.path.join(staging, "plain.keras")
        _assemble_keras(index, keras_file, model)
        plain = keras.models.load_model(keras_file, compile=False)
        plain.export(save_path, format=format, verbose=verbose,
                     input_signature=input_signature, **kwargs)

    return _from_shards(model, save_path, export, own_layout=False,
                        with_optimizer=False,
                        failed=f"Exporting {save_path!r} failed",
                        call="export")


def _from_shards(model, target, work, own_layout, with_optimizer, failed,
                 call="save"):
    """Every stage writes its shard into a temporary folder beside
    `target`; rank 0 runs `work(index, folder)` while the others wait
    (`_while_telling_the_others`); the folder is removed. A collective:
    raises `RuntimeError` starting with `failed` on every process when
    anything fails."""
    _check_one_path(model, target, call)
    folder, name = os.path.split(target)
    rank, _ = _layout(model)
    token = comms.share(
        f"{os.getpid()}-{time.time_ns()}" if rank == 0 else None)
    staging = os.path.join(folder, f".{name}.shards-{token}")
    try:
        index = save(model, os.path.join(staging, "model.weights.json"),
                     own_layout=own_layout, with_optimizer=with_optimizer)
        if rank == 0:
            error = _while_telling_the_others(
                lambda: work(index, staging),
                model._smp_config().collective_timeout_seconds)
        else:
            error = _WORKING
            while error == _WORKING:
                error = comms.share(None)
        if error:
            raise RuntimeError(f"{failed}: {error}")
    finally:
        comms.barrier()  # every process is done with the shards
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    return target


_WORKING = "keras-smp: rank 0 is still writing"


def _while_telling_the_others(work, timeout_seconds):
    """Rank 0: runs `work()` in a thread, broadcasting `_WORKING` to the
    other ranks well within their collective timeout (one process copying
    a whole model may take longer), then the outcome: None, or the error
    text. The other ranks loop on `comms.share` until it is not
    `_WORKING`."""
    outcome = []

    def run():
        try:
            work()
            outcome.append(None)
        except Exception as e:  # pylint: disable=broad-except
            outcome.append(f"rank 0: {type(e).__name__}: {e}")

    thread = threading.Thread(target=run, name="keras-smp-save",
                              daemon=True)
    thread.start()
    interval = max(1.0, min(30.0, float(timeout_seconds or 120) / 4))
    while True:
        thread.join(interval)
        if not thread.is_alive():
            return comms.share(outcome[0])
        comms.share(_WORKING)


def _write_keras_archive(path, model, index):
    """Writes the `.keras` zip `path`: `model`'s configuration and assets,
    and the weights of the sharded checkpoint `index`, one at a time."""
    config_json, metadata_json = keras_private.model_json(model)
    weights = path + ".weights.h5"
    try:
        _assemble_h5(index, weights)
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(keras_private.KERAS_METADATA, metadata_json)
            zf.writestr(keras_private.KERAS_CONFIG, config_json)
            zf.write(weights, keras_private.KERAS_WEIGHTS)
            assets = keras_private.assets_store(zf)
            try:
                keras_private.save_state(model, _Recorder(), "", set(),
                                         assets_store=assets)
            finally:
                assets.close()
    finally:
        if os.path.exists(weights):
            os.remove(weights)


def _raise_any(errors, filepath):
    errors = [e for e in errors if e]
    if errors:
        raise RuntimeError(
            f"Saving the sharded checkpoint {filepath!r} failed (the "
            "previous checkpoint there, if any, is unchanged): "
            + "; ".join(errors))


def save_one_file(model, filepath):
    """Writes every weight of `model` into one `.weights.h5` file (rank 0
    writes, atomically; the other processes read alike, then wait)."""
    filepath = os.path.abspath(os.fspath(filepath))
    rank, _ = _layout(model)
    error = None
    try:
        _write_shard(filepath if rank == 0 else None, entries(model))
    except Exception as e:  # pylint: disable=broad-except
        error = f"rank {rank}: {type(e).__name__}: {e}"
    errors = [e for e in comms.allgather(error) if e]
    if errors:
        raise RuntimeError(f"Saving {filepath!r} failed (the previous file "
                           "there, if any, is unchanged): "
                           + "; ".join(errors))
    return filepath


def _write_shard(path, items):
    """Writes `items` into the HDF5 file `path` atomically; with `path`
    None, only reads them (a replica that does not write: reads may be
    collective)."""
    if path is None:
        for _, _, value, _ in items:
            _to_numpy(value)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path),
                       f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with h5py.File(tmp, "w") as f:
        for group, key, value, _ in items:
            array = _to_numpy(value)
            if keras.backend.standardize_dtype(array.dtype) == "bfloat16":
                ds = f.require_group(group).create_dataset(key, data=array)
                ds.attrs["dtype"] = "bfloat16"
            else:
                f.require_group(group)[key] = array
    os.replace(tmp, path)


def _shard_name(base, number):
    # Keras' reader opens `<base>_00000.weights.h5` first: a placeholder.
    return f"{base}_{number:05d}.weights.h5"


def _first_number(folder, base, num_stages):
    """The number of this save's first shard: shards of the checkpoint in
    place (its index) are never overwritten, so a save killed midway
    leaves it whole (double buffering)."""
    current = set()
    try:
        index = read_index(os.path.join(folder, base + ".weights.json"))
        for files in index["weight_map"].values():
            for name in [files] if isinstance(files, str) else files:
                current.add(int(name[len(base) + 1:-len(".weights.h5")]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not current or min(current) > num_stages:
        return 1
    return max(current) + 1


def _write_index(filepath, folder, base, items, stages, names):
    weight_map, total = {}, 0
    for (group, _, value, _), stage in zip(items, stages):
        files = weight_map.setdefault("/" + group, [])
        if names[stage] not in files:
            files.append(names[stage])
        shape = getattr(value, "shape", ())
        dtype = keras.backend.standardize_dtype(
            getattr(value, "dtype", "float32"))
        total += int(np.prod(shape)) * np.dtype(
            "float16" if dtype == "bfloat16" else dtype).itemsize
    index = {
        "metadata": {"total_size": total,
                     "keras_smp": {"format": FORMAT, "shards": names}},
        "weight_map": {g: f[0] if len(f) == 1 else f
                       for g, f in weight_map.items()},
    }
    text = json.dumps(index, indent=1)
    json_path = os.path.join(folder, base + ".weights.json")
    placeholder = os.path.join(folder, _shard_name(base, 0))
    if not os.path.exists(placeholder):
        _replace(placeholder, lambda tmp: h5py.File(tmp, "w").close())
    previous = _shard_names(json_path)
    _replace(json_path, lambda tmp: open(tmp, "w").write(text))
    if filepath.endswith(".weights.h5"):
        def pointer(tmp):
            with h5py.File(tmp, "w") as f:
                f.attrs[POINTER_ATTR] = os.path.basename(json_path)
        _replace(filepath, pointer)
    # The new index is in place: the previous save's shards can go.
    keep = set(names) | {_shard_name(base, 0)}
    for name in previous:
        if name not in keep:
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def _shard_names(index_path):
    """The shard files an index names (empty when there is none)."""
    try:
        index = read_index(index_path)
    except (OSError, ValueError):
        return set()
    return _names_in((index or {}).get("weight_map", {}))


def _replace(path, write):
    tmp = os.path.join(os.path.dirname(path),
                       f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


BACKUP_SUFFIX = "-backup"


def keep_as_backup(filepath, backup_path):
    """Keeps the sharded checkpoint at `filepath` as a second checkpoint
    named by `backup_path`, for `BackupAndRestore(double_checkpoint=True)`.

    Keras copies `latest.weights.h5` to `latest.weights.h5.bkp` before
    each save. A sharded checkpoint's `.weights.h5` only names its index,
    which the next save replaces (removing the shards it named): that copy
    would name the new state, or shards no longer there. Here the backup
    gets an index of its own (`<base>-backup.weights.json`) and its own
    names for the shards (hard links where the filesystem allows, else
    copies: saves never rewrite a shard, they write new ones), and
    `backup_path` names that index, so Keras' fallback (`backup_path`
    copied over `filepath`, then loaded) loads it. The previous backup's
    shards are removed after. Call it on one process (rank 0), before the
    save. Returns False when `filepath` is not a sharded checkpoint (Keras'
    copy of a plain file is right), "kept" when it was kept, "unchanged"
    when it cannot be read (a damaged checkpoint is no backup: the last
    backup stays, and so should its training metadata).
    """
    filepath = os.path.abspath(os.fspath(filepath))
    if not os.path.isfile(filepath):
        return False
    try:
        index = read_index(filepath)
        if index is not None:
            _check_readable(os.path.dirname(filepath), index["weight_map"],
                            filepath)
    except (OSError, ValueError, KeyError, TypeError):
        return "unchanged" if is_pointer(filepath) else False
    if index is None:
        return False
    folder = os.path.dirname(filepath)
    backup_base = _base(filepath) + BACKUP_SUFFIX
    renamed = {}
    for name in sorted(_names_in(index["weight_map"])):
        number = int(name[:-len(".weights.h5")].rsplit("_", 1)[1])
        renamed[name] = _shard_name(backup_base, number)
        source = os.path.join(folder, name)
        target = os.path.join(folder, renamed[name])
        if os.path.exists(target) and os.path.samefile(source, target):
            continue  # (the checkpoint in place is the backup already)
        _replace(target, lambda tmp, source=source: _link_or_copy(source,
                                                                   tmp))
    backup = dict(index, weight_map={
        g: renamed[f] if isinstance(f, str) else [renamed[n] for n in f]
        for g, f in index["weight_map"].items()})
    ours = backup.get("metadata", {}).get("keras_smp")
    if ours and "shards" in ours:
        backup["metadata"] = dict(backup["metadata"], keras_smp=dict(
            ours, shards=[renamed.get(n, n) for n in ours["shards"]]))
    json_path = os.path.join(folder, backup_base + ".weights.json")
    previous = _shard_names(json_path)
    placeholder = os.path.join(folder, _shard_name(backup_base, 0))
    if not os.path.exists(placeholder):
        _replace(placeholder, lambda tmp: h5py.File(tmp, "w").close())
    text = json.dumps(backup, indent=1)
    _replace(json_path, lambda tmp: open(tmp, "w").write(text))

    def pointer(tmp):
        with h5py.File(tmp, "w") as f:
            f.attrs[POINTER_ATTR] = os.path.basename(json_path)

    _replace(os.path.abspath(os.fspath(backup_path)), pointer)
    for name in previous - set(renamed.values()):
        try:
            os.remove(os.path.join(folder, name))
        except OSError:
            pass
    return "kept"


def _link_or_copy(source, target):
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _names_in(weight_map):
    names = set()
    for files in weight_map.values():
        names.update([files] if isinstance(files, str) else files)
    return names


def _check_readable(folder, weight_map, filepath):
    """Opens every shard an index names: a missing or damaged one is an
    `OSError` naming it, before any weight is assigned (as Keras' own
    load of a damaged `.weights.h5` fails, so `BackupAndRestore` falls
    back to its previous backup; inside Keras' per-object loading it
    became a `ValueError`)."""
    for name in sorted(_names_in(weight_map)):
        try:
            with h5py.File(os.path.join(folder, name), "r"):
                pass
        except OSError as e:
            raise OSError(
                f"Shard {name!r} of the checkpoint {filepath!r} cannot be "
                f"read: {e}. Copy every file of the checkpoint together; "
                "a damaged checkpoint cannot be loaded.") from e


def read_index(filepath):
    """The index of a sharded checkpoint (`*.weights.json`, or a
    `*.weights.h5` pointing to one), or `None` for another file."""
    filepath = os.fspath(filepath)
    if filepath.endswith(".weights.json"):
        with open(filepath) as f:
            return json.load(f)
    if not h5py.is_hdf5(filepath):
        return None
    with h5py.File(filepath, "r") as f:
        name = f.attrs.get(POINTER_ATTR)
    if name is None:
        return None
    # The pointer names the index beside it (always the current one).
    with open(os.path.join(os.path.dirname(os.path.abspath(filepath)),
                           str(name))) as f:
        return json.load(f)


def is_pointer(filepath):
    """Whether `filepath` is the small HDF5 file naming a sharded
    checkpoint's index (whatever its name)."""
    filepath = os.fspath(filepath)
    try:
        if not h5py.is_hdf5(filepath):
            return False
        with h5py.File(filepath, "r") as f:
            return POINTER_ATTR in f.attrs
    except OSError:
        return False


def is_wrapper_layout(filepath):
    """Whether a `.weights.h5` file was written by Keras' own
    `save_weights` of a `DistributedModel` (an `inner_model` level)."""
    with h5py.File(os.fspath(filepath), "r") as f:
        return "inner_model" in f


def load(model, filepath, skip_mismatch=False):
    """Loads a sharded checkpoint, or a plain Keras `.weights.h5`, into
    `model`, reading only the weights this process holds.

    Other stages' weights are skipped by the caller (`DistributedModel`
    drops assignments to them); a value is read from disk only when it is
    assigned.
    """
    filepath = os.path.abspath(os.fspath(filepath))
    try:
        index = read_index(filepath)
    except ValueError as e:  # (json's error; a damaged HDF5 file: OSError)
        raise OSError(f"The index of the checkpoint {filepath!r} cannot "
                      f"be read: {e}") from e
    folder = os.path.dirname(filepath)
    if index is None:
        files = _OneFile(filepath)
    else:
        _check_readable(folder, index["weight_map"], filepath)
        files = _ShardFiles(folder, index["weight_map"])
    store = _LazyReader(files)
    try:
        visited = _not_saved(model)
        for saveable, path in _roots(model):
            keras_private.load_state(saveable, store, path, visited,
                                     skip_mismatch=skip_mismatch)
    finally:
        files.close()


class _OneFile:
    def __init__(self, path):
        self.file = h5py.File(path, "r")

    def groups(self, group):
        return [self.file] if group in self.file else []

    def close(self):
        self.file.close()


class _ShardFiles:
    def __init__(self, folder, weight_map):
        self.folder = folder
        self.weight_map = weight_map
        self.open = {}

    def groups(self, group):
        names = self.weight_map.get("/" + group, [])
        out = []
        for name in [names] if isinstance(names, str) else names:
            if name not in self.open:
                path = os.path.join(self.folder, name)
                if not os.path.exists(path):
                    raise FileNotFoundError(
                        f"Shard {name!r} of the checkpoint in "
                        f"{self.folder!r} is missing (the index names it "
                        f"for {group!r}); copy every file of the "
                        "checkpoint together.")
                self.open[name] = h5py.File(path, "r")
            if group in self.open[name]:
                out.append(self.open[name])
        return out

    def close(self):
        for f in self.open.values():
            f.close()


class _LazyReader(keras_private.H5IOStore):
    """A Keras weight store whose values are read from disk only when used
    (converted to a tensor or array): assignments dropped for weights of
    other stages read nothing."""

    def __init__(self, files):  # pylint: disable=super-init-not-called
        self.files = files
        self._group = "vars"

    def __bool__(self):
        return True

    def get(self, path):
        self._group = f"{path}/vars" if path else "vars"
        return self

    def has_path(self, path):
        weight_map = getattr(self.files, "weight_map", None)
        if weight_map is None:
            return path in self.files.file
        return any(k == "/" + path or k.startswith(f"/{path}/")
                   for k in weight_map)

    def _datasets(self):
        out = {}
        for f in self.files.groups(self._group):
            for key, ds in f[self._group].items():
                out.setdefault(key, ds)
        return out

    def keys(self):
        return list(self._datasets())

    def __len__(self):
        return len(self._datasets())

    def __contains__(self, key):
        return key in self._datasets()

    def __getitem__(self, key):
        datasets = self._datasets()
        if key not in datasets:
            raise KeyError(
                f"{self._group}/{key} is not in the checkpoint (a different "
                "model architecture?).")
        return LazyArray(datasets[key])

    def close(self):
        pass


class LazyArray:
    """An HDF5 dataset read when converted (`np.asarray`, a tensor)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.shape = tuple(dataset.shape)
        self.dtype = ("bfloat16" if dataset.attrs.get("dtype") == "bfloat16"
                      else dataset.dtype)
        self.ndim = len(self.shape)

    def __array__(self, dtype=None, copy=None):
        array = self.dataset[()]
        if self.dtype == "bfloat16":
            import ml_dtypes

            array = np.asarray(array, dtype=ml_dtypes.bfloat16)
        return np.asarray(array) if dtype is None else array.astype(dtype)


tf.register_tensor_conversion_function(
    LazyArray, lambda value, dtype=None, name=None, as_ref=False:
    tf.convert_to_tensor(np.asarray(value), dtype=dtype, name=name))


def assemble_checkpoint(index_path, out_path, model=None):
    """Copies a sharded checkpoint into one `.weights.h5` or `.keras` file.

    One dataset at a time: the process never holds more than the largest
    weight. A `.weights.h5` is what the wrapped Keras model's own
    `save_weights` writes (`keras.Model.load_weights` of a plain model
    reads it). A `.keras` file is a plain Keras model for export:
    `model`'s architecture (a `DistributedModel`'s wrapped model; only its
    configuration is used, not its weights, so a stage process can write
    it) with the checkpoint's weights, without optimizer state:
    `keras.models.load_model` loads it without keras-smp.

    Args:
        index_path: the checkpoint's `*.weights.json` (or the
            `*.weights.h5` pointing to it).
        out_path: the file to write (`*.weights.h5` or `*.keras`).
        model: the model the checkpoint is of (for `.keras` only).

    See the module's example.
    """
    out_path = os.fspath(out_path)
    if out_path.endswith(".keras"):
        if model is None:
            raise ValueError(
                "assemble_checkpoint: a '.keras' file needs the model's "
                "architecture: pass model=<the DistributedModel or Keras "
                "model the checkpoint is of>.")
        return _assemble_keras(index_path, out_path, model)
    if not out_path.endswith(".weights.h5"):
        raise ValueError(
            f"assemble_checkpoint writes a '.weights.h5' or '.keras' file; "
            f"received out_path={out_path!r}.")
    _replace(os.path.abspath(out_path),
             lambda tmp: _assemble_h5(index_path, tmp))
    return out_path


def _assemble_keras(index_path, out_path, model):
    inner = getattr(model, "inner_model", None) or model
    config_json, metadata_json = keras_private.model_json(inner)

    def write(tmp):
        weights = tmp + ".weights.h5"
        try:
            _assemble_h5(index_path, weights, skip=("/optimizer",))
            with zipfile.ZipFile(tmp, "w") as zf:
                zf.writestr("metadata.json", metadata_json)
                zf.writestr("config.json", config_json)
                zf.write(weights, "model.weights.h5")
        finally:
            if os.path.exists(weights):
                os.remove(weights)

    _replace(os.path.abspath(out_path), write)
    return out_path


def _assemble_h5(index_path, out_path, skip=()):
    index = read_index(index_path)
    if index is None:
        raise ValueError(
            f"{os.fspath(index_path)!r} is not a sharded checkpoint (no "
            "'.weights.json' index, and not a '.weights.h5' pointing to "
            "one).")
    files = _ShardFiles(os.path.dirname(os.path.abspath(
        os.fspath(index_path))), index["weight_map"])
    try:
        with h5py.File(out_path, "w") as out:
            for group in index["weight_map"]:
                if group.startswith(tuple(skip)):
                    continue
                group = group.lstrip("/")
                target = out.require_group(group)
                for f in files.groups(group):
                    for key in f[group]:
                        if key not in target:
                            f.copy(f[group][key], target, name=key)
    finally:
        files.close()
