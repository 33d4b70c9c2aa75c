"""The floors of ``docs/architecture.md`` hold: import-linter checks the contracts declared in
``pyproject.toml`` (``[tool.importlinter]``) against every import of the package, through
``.ci/lint_imports.py`` (the checkout laid out as it installs), the documented command."""

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "lint_imports.py"


def _script():
    spec = importlib.util.spec_from_file_location("lint_imports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floors_contracts_are_kept(tmp_path):
    # The documented command, run from outside the checkout as well as from its root (where a
    # bare lint-imports sees ./jaxpaged without server/ and benchmarks/).
    for cwd in (ROOT, tmp_path):
        out = subprocess.run([sys.executable, str(SCRIPT)], cwd=cwd, capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Contracts: 2 kept, 0 broken." in out.stdout, out.stdout


def test_the_contracts_can_fail(tmp_path):
    # A core module importing the engine breaks both contracts (the check is not vacuous): the
    # runner now reaches the engine through SchedulerOutput, and core reaches jax.
    script = _script()
    broken = script.installed_tree(tmp_path)
    with open(broken / "jaxpaged" / "core" / "request.py", "a") as f:
        f.write("\nimport jaxpaged.engine.engine  # noqa: E402\n")
    out = script.lint_imports(broken)
    assert out.returncode == 1 and "0 kept, 2 broken" in out.stdout, out.stdout
    assert "jaxpaged.core is not allowed to import jax:" in out.stdout, out.stdout
    assert "jaxpaged.runner is not allowed to import jaxpaged.engine:" in out.stdout, out.stdout
    assert "jaxpaged.core.request -> jaxpaged.engine.engine" in out.stdout, out.stdout
