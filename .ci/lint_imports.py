#!/usr/bin/env python3
"""``lint-imports`` (import-linter) over this checkout laid out as the package installs.

The floors' contracts (``pyproject.toml``, ``[tool.importlinter]``) name ``jaxpaged.server`` and
``jaxpaged.benchmarks``, which live in the checkout as the top-level ``server/`` and
``benchmarks/`` folders (``[tool.setuptools] package-dir``). A bare ``lint-imports`` at the
checkout root builds its graph from ``./jaxpaged``, which has neither, and stops with
"Missing layer". This copies the ``.py`` files into a temporary folder in the installed layout
and runs ``lint-imports`` there with the checkout's contracts, so it sees what a user imports
(the files themselves, not the editable install's link tree, which lags behind added files).

Usage, from anywhere (``tests/test_layering.py`` runs the same)::

    .venv/bin/python .ci/lint_imports.py [lint-imports options, e.g. --verbose]

Exit status: ``lint-imports``'s (0 when every contract is kept).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where each package lives in the checkout -> where it lives once installed.
LAYOUT = {"jaxpaged": "jaxpaged", "server": "jaxpaged/server",
          "benchmarks": "jaxpaged/benchmarks", "pallas_kernels": "pallas_kernels"}


def installed_tree(dest: Path) -> Path:
    """``dest`` filled with the checkout's ``.py`` files in the installed layout."""
    for src, dst in LAYOUT.items():
        shutil.copytree(ROOT / src, dest / dst, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
                            os.path.isfile(os.path.join(d, n)) and not n.endswith(".py"))])
    return dest


def lint_imports(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``lint-imports`` (beside this Python, else on ``PATH``) over ``tree`` with the checkout's
    contracts; its output captured."""
    linter = Path(sys.executable).with_name("lint-imports")
    command = str(linter) if linter.is_file() else shutil.which("lint-imports") or "lint-imports"
    return subprocess.run([command, "--no-cache", *args, str(ROOT / "pyproject.toml")],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="jaxpaged-layers-") as folder:
        out = lint_imports(installed_tree(Path(folder)), *argv)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    return out.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
