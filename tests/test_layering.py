"""The TensorFlow-free layers stay TensorFlow-free.

config -> topology -> (partition plan -> schedule) are pure Python, and so
are the launcher and the gradient-sync group planning: they can be used and
tested without starting TensorFlow.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT
from conftest import env

PURE_MODULES = [
    "keras_smp/__init__.py",
    "keras_smp/config.py",
    "keras_smp/topology.py",
    "keras_smp/state.py",
    "keras_smp/ranks.py",
    "keras_smp/launch.py",
    "keras_smp/distribute/groups.py",
    "keras_smp/pipeline/partition.py",
    "keras_smp/pipeline/scope.py",
    "keras_smp/pipeline/schedule.py",
    "keras_smp/pipeline/__init__.py",
]


def _top_level_imports(path):
    tree = ast.parse(pathlib.Path(ROOT, path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""


@pytest.mark.parametrize("path", PURE_MODULES)
def test_module_does_not_import_tensorflow_or_keras(path):
    bad = [n for n in _top_level_imports(path)
           if n.split(".")[0] in ("tensorflow", "keras")]
    assert not bad, f"{path} imports {bad}"


def test_import_keras_smp_and_ranks_do_not_load_tensorflow():
    code = ("import sys, keras_smp; keras_smp.rank(); keras_smp.dp_size();"
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
