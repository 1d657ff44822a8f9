"""The documentation site builds with `mkdocs build --strict` (as in CI).

Strict mode fails on broken links between pages, missing nav entries and
API-reference entries (generated from docstrings) that cannot be found.
"""

import subprocess
import sys

from conftest import ROOT
from conftest import env


def test_mkdocs_builds_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
         str(tmp_path / "site")], cwd=ROOT, env=env(), capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("SMPStrategy", "DistributedModel", "CheckpointManager",
                 "notebook_launcher", "executed_timeline", "StepOutput"):
        assert name in api, name
