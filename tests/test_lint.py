"""The linter configured in ``pyproject.toml`` (``[tool.ruff]``) passes, and no module of the
package or the server outgrows one job (docs/architecture.md: small modules, at most 400 lines)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Most lines a module of jaxpaged/ or server/ may have.
MAX_LINES = 400


def test_ruff_passes():
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    out = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in ("jaxpaged", "server") for p in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 100                       # the walk found the package
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
