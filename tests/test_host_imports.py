"""``jaxpaged.core``, the host step contract, imports without JAX (DESIGN.md: host bookkeeping is
plain Python). The other floors' rules are import-linter contracts (``tests/test_layering.py``)."""

import pathlib
import subprocess
import sys
import textwrap

CORE_DIR = pathlib.Path(__file__).resolve().parents[1] / "jaxpaged" / "core"

#: Every module of ``jaxpaged/core/``, found on disk (no list to keep).
CORE_MODULES = sorted(
    ".".join(("jaxpaged", "core", *p.relative_to(CORE_DIR).with_suffix("").parts))
    .removesuffix(".__init__") for p in CORE_DIR.rglob("*.py"))


def _loaded_after_import(modules: list[str]) -> set[str]:
    """Top-level module names in ``sys.modules`` of a fresh interpreter after importing
    ``modules``."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(" ".join(sorted({{m.split(".")[0] for m in sys.modules}})))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_core_imports_no_jax():
    # The glob found the step contract, not an empty or partial folder.
    assert {"jaxpaged.core.scheduler", "jaxpaged.core.kv_cache_manager",
            "jaxpaged.core.request", "jaxpaged.core.output_processor",
            "jaxpaged.core.detokenizer", "jaxpaged.core.scheduler_output",
            "jaxpaged.core.runner_output", "jaxpaged.core.spec_decode.scheduling"
            } <= set(CORE_MODULES)
    loaded = _loaded_after_import(CORE_MODULES)
    assert "jaxpaged" in loaded                 # the imports did run
    assert not loaded & {"jax", "jaxlib", "flax", "pallas_kernels"}, loaded
