"""The floors of ``docs/architecture.md`` hold: import-linter checks the contracts declared in
``pyproject.toml`` (``[tool.importlinter]``) against every import of the package."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Where each package lives in the checkout -> where it lives once installed (pyproject.toml's
#: package-dir: server/ and benchmarks/ become jaxpaged.server and jaxpaged.benchmarks).
LAYOUT = {"jaxpaged": "jaxpaged", "server": "jaxpaged/server",
          "benchmarks": "jaxpaged/benchmarks", "pallas_kernels": "pallas_kernels"}


def installed_tree(dest: pathlib.Path) -> pathlib.Path:
    """The ``.py`` files of the checkout laid out as the installed package is."""
    for src, dst in LAYOUT.items():
        shutil.copytree(ROOT / src, dest / dst, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
                            os.path.isfile(os.path.join(d, n)) and not n.endswith(".py"))])
    return dest


def lint_imports(tree: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``lint-imports`` over ``tree`` with the checkout's contracts."""
    linter = pathlib.Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(linter), "--no-cache", *args, str(ROOT / "pyproject.toml")],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return installed_tree(tmp_path_factory.mktemp("installed"))


def test_the_floors_contracts_are_kept(tree):
    out = lint_imports(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 2 kept, 0 broken." in out.stdout, out.stdout


def test_the_contracts_can_fail(tree, tmp_path):
    # A core module importing the engine breaks both contracts (the check is not vacuous): the
    # runner now reaches the engine through SchedulerOutput, and core reaches jax.
    broken = installed_tree(tmp_path)
    with open(broken / "jaxpaged" / "core" / "request.py", "a") as f:
        f.write("\nimport jaxpaged.engine.engine  # noqa: E402\n")
    out = lint_imports(broken)
    assert out.returncode == 1 and "0 kept, 2 broken" in out.stdout, out.stdout
    assert "jaxpaged.core is not allowed to import jax:" in out.stdout, out.stdout
    assert "jaxpaged.runner is not allowed to import jaxpaged.engine:" in out.stdout, out.stdout
    assert "jaxpaged.core.request -> jaxpaged.engine.engine" in out.stdout, out.stdout
