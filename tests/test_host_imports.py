"""The host side of the engine imports no JAX, and ``layers/`` does not import ``engine/``."""

import pathlib
import subprocess
import sys
import textwrap

#: The modules of ``jaxpaged/engine/`` that drive the device (they build or run a
#: ``ModelRunner``); every other module there is host code and must load without JAX.
DEVICE_ENGINE_MODULES = {"engine", "startup", "async_engine", "data_parallel", "follower"}
ENGINE_DIR = pathlib.Path(__file__).resolve().parents[1] / "jaxpaged" / "engine"

#: The host modules that must load without JAX (DESIGN.md: host bookkeeping is plain Python):
#: the scheduler, KV cache manager, requests, output processor and detokenizer, and every
#: other module of ``engine/`` but the device-driving ones, plus the host types they share.
HOST_MODULES = sorted(f"jaxpaged.engine.{p.stem}" for p in ENGINE_DIR.glob("*.py")
                      if p.stem not in DEVICE_ENGINE_MODULES | {"__init__"}) + [
    "jaxpaged.runner.output", "jaxpaged.constants"]


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


def test_host_modules_import_no_jax():
    # The list is the host side the architecture names, not an empty or partial glob.
    assert {"jaxpaged.engine.scheduler", "jaxpaged.engine.kv_cache_manager",
            "jaxpaged.engine.request", "jaxpaged.engine.output_processor",
            "jaxpaged.engine.detokenizer", "jaxpaged.engine.scheduler_output"} <= set(HOST_MODULES)
    assert all((ENGINE_DIR / f"{m}.py").exists() for m in DEVICE_ENGINE_MODULES)
    loaded = _loaded_after_import(HOST_MODULES)
    assert "jaxpaged" in loaded                 # the imports did run
    assert not loaded & {"jax", "jaxlib", "flax", "pallas_kernels"}, loaded


def test_layers_do_not_import_engine():
    code = textwrap.dedent("""
        import sys
        import jaxpaged.layers.attention, jaxpaged.models.llama
        print(sorted(m for m in sys.modules if m.startswith("jaxpaged.engine")))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
