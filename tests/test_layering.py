"""The layering is a test, not a convention.

Data flows one way through five layers; a module may import its own layer
and the layers below it, never one above, and the import graph (imports
inside functions included) has no cycles:

0. pure Python, no TensorFlow or Keras: config, topology, ranks, state,
   launch, the schedule and partition plan, the runtime's key allocator,
   stage layout and placement settings, the gradient-sync group planning;
1. the TensorFlow runtime: process set-up, error translation, the Keras /
   TensorFlow patches, the wrappers of private TensorFlow and Keras APIs;
2. the engines: gradient sync (`distribute/`) and the pipeline runtime,
   transports, steps (`pipeline/`);
3. SageMaker smp's API (`smp/`);
4. the Keras-facing classes (`SMPStrategy`, `DistributedModel`) and the
   notebook launcher.

Every module of the package must be given a layer here, so a new module
is placed deliberately.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT
from conftest import env

PACKAGE = pathlib.Path(ROOT, "keras_smp")

LAYERS = {
    0: [
        "keras_smp", "keras_smp.config", "keras_smp.topology",
        "keras_smp.ranks", "keras_smp.state", "keras_smp.launch",
        "keras_smp.rendezvous",
        "keras_smp.runtime", "keras_smp.runtime.keys",
        "keras_smp.runtime.malloc",
        "keras_smp.runtime.calls",
        "keras_smp.runtime.layout", "keras_smp.runtime.placement",
        "keras_smp.distribute.groups", "keras_smp.pipeline",
        "keras_smp.pipeline.schedule", "keras_smp.pipeline.partition",
        "keras_smp.pipeline.scope", "keras_smp.tensor",
    ],
    1: [
        "keras_smp.runtime.process", "keras_smp.runtime.errors",
        "keras_smp.runtime.patches", "keras_smp.runtime.tf_private",
        "keras_smp.runtime.keras_private", "keras_smp.runtime.deferred",
        "keras_smp.runtime.xla", "keras_smp.runtime.tracing",
        "keras_smp.runtime.shutdown", "keras_smp.runtime.agreement",
        "keras_smp.runtime.loss_shares", "keras_smp.runtime.data_end",
        "keras_smp.runtime.data_order", "keras_smp.runtime.sparse",
        "keras_smp.runtime.split_draws",
    ],
    2: [
        "keras_smp.distribute", "keras_smp.distribute.allreduce",
        "keras_smp.distribute.fusion", "keras_smp.distribute.horovod",
        "keras_smp.distribute.compression",
        "keras_smp.pipeline.backward", "keras_smp.pipeline.microbatch",
        "keras_smp.pipeline.runtime", "keras_smp.pipeline.transport",
        "keras_smp.pipeline.graph", "keras_smp.pipeline.step",
        "keras_smp.pipeline.recompute",
        "keras_smp.pipeline.residency", "keras_smp.pipeline.profiling",
        "keras_smp.tensor.ops", "keras_smp.tensor.layers",
        "keras_smp.tensor.losses",
    ],
    3: [
        "keras_smp.smp", "keras_smp.smp.custom_loop",
        "keras_smp.smp.checkpoint", "keras_smp.smp.comms",
        "keras_smp.pipeline.shards",
    ],
    4: [
        "keras_smp.distribute.strategy", "keras_smp.pipeline.model",
        "keras_smp.smp.setup",
        "keras_smp.notebook",
    ],
}
LAYER_OF = {m: layer for layer, mods in LAYERS.items() for m in mods}
PURE_MODULES = LAYERS[0]


def _module_name(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name):
    """Every module `name` imports, anywhere in the file (absolute names)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            yield base
            for alias in node.names:  # `from pkg import module`
                yield f"{base}.{alias.name}"


def _internal_imports(name):
    """keras_smp modules imported by `name` (resolved to existing modules)."""
    out = set()
    for target in _imports(name):
        if target in MODULES and target != name:
            out.add(target)
    return out


def test_every_module_has_a_layer():
    missing = sorted(set(MODULES) - set(LAYER_OF))
    stale = sorted(set(LAYER_OF) - set(MODULES))
    assert not missing, f"give these modules a layer in LAYERS: {missing}"
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_layer_above_it(name):
    mine = LAYER_OF.get(name)
    assert mine is not None, f"{name} has no layer"
    above = sorted(t for t in _internal_imports(name)
                   if LAYER_OF.get(t, -1) > mine)
    assert not above, (
        f"{name} (layer {mine}) imports {above} from layer(s) "
        f"{sorted({LAYER_OF[t] for t in above})}: move the code down, or "
        "decide by attributes instead of importing")


def test_import_graph_has_no_cycles():
    graph = {m: _internal_imports(m) for m in MODULES}
    # A package importing its own submodules (re-exports) is not a cycle
    # of behaviour; everything else counts.
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if m.startswith(t + "."):  # a module importing its package
                continue
            if state.get(t) == "open":
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("name", PURE_MODULES)
def test_pure_modules_do_not_import_tensorflow_or_keras(name):
    bad = [n for n in _imports(name)
           if n.split(".")[0] in ("tensorflow", "keras")]
    assert not bad, f"{name} imports {bad}"


def test_private_tf_and_keras_apis_only_through_their_wrappers():
    wrappers = {"keras_smp.runtime.tf_private",
                "keras_smp.runtime.keras_private"}
    offenders = {}
    for name in MODULES:
        if name in wrappers:
            continue
        bad = [n for n in _imports(name)
               if n.startswith(("tensorflow.python", "tensorflow.core",
                                "keras.src"))]
        if bad:
            offenders[name] = bad
    assert not offenders, (
        "import private TensorFlow/Keras APIs through "
        f"keras_smp.runtime.tf_private / keras_private: {offenders}")


def test_import_keras_smp_and_ranks_do_not_load_tensorflow():
    code = ("import sys, keras_smp; keras_smp.rank(); keras_smp.dp_size();"
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
