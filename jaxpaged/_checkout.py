"""``jaxpaged.server`` and ``jaxpaged.benchmarks`` when jaxpaged is imported from its checkout.

The repository keeps ``server/`` and ``benchmarks/`` beside ``jaxpaged/`` (the design card's
layout); ``pyproject.toml`` maps them into the package (``[tool.setuptools] package-dir``), so
every installed copy, a wheel or the editable link tree, has them inside its ``jaxpaged/``
folder. When the repository root is on ``sys.path`` ahead of the installed copy (it is the
working directory of ``python -m pytest`` or ``python -m jaxpaged.cli``), Python imports
``./jaxpaged`` itself, which has no ``server/``. For that case only, :func:`install` appends a
meta-path finder that maps exactly those two names to the checkout's folders, as setuptools' own
editable finder does for a package-dir mapping (``setuptools/command/editable_wheel.py``,
``_EditableFinder``). It is a finder rather than an entry in ``jaxpaged.__path__``, which would
also expose every other folder of the repository root (``tests``, ``pallas_kernels``, ...) as
a ``jaxpaged.`` submodule.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

#: Subpackages that live in a top-level folder of the repository, by their name in jaxpaged.
MAPPED_SUBPACKAGES = ("server", "benchmarks")


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``jaxpaged.<name>`` for each name of :data:`MAPPED_SUBPACKAGES` in ``root/<name>``.

    Args:
        root: the repository root (the folder holding ``pyproject.toml`` and ``jaxpaged/``).
    """

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        """The package spec of ``root/<name>/__init__.py``, or None for any other module."""
        parent, _, name = fullname.partition(".")
        if parent != "jaxpaged" or name not in MAPPED_SUBPACKAGES:
            return None
        folder = self.root / name
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install(package_dir: Path) -> None:
    """Appends a :class:`CheckoutFinder` to ``sys.meta_path`` if ``package_dir`` is a checkout's.

    Args:
        package_dir: the folder of the imported ``jaxpaged`` package. Nothing happens when it
            holds ``server/`` (an installed copy) or its parent is not the repository root, nor
            a second time.
    """
    root = package_dir.parent
    if (package_dir / "server").is_dir() or not (root / "pyproject.toml").is_file():
        return
    if not all((root / name / "__init__.py").is_file() for name in MAPPED_SUBPACKAGES):
        return
    if not any(isinstance(finder, CheckoutFinder) for finder in sys.meta_path):
        sys.meta_path.append(CheckoutFinder(root))
