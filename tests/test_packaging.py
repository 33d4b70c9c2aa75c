"""The installed names: server/ and benchmarks/ import as jaxpaged.server / jaxpaged.benchmarks.

No generic top-level ``server`` or ``benchmarks`` may come with the distribution, and an editable
install must import from a folder that holds a clone named ``jaxpaged`` (issue 20, item 7).
"""

import filecmp
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Repository folder -> the package name it installs as (pyproject.toml package-dir).
INSTALLED_AS = {"jaxpaged": "jaxpaged", "server": "jaxpaged.server",
                "benchmarks": "jaxpaged.benchmarks", "pallas_kernels": "pallas_kernels"}
#: Folders of data only (no __init__.py), installed as package data under these names.
DATA_PACKAGES = {"jaxpaged.configs": "configs"}


def _pyproject_setuptools() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _is_repo_file(path: str, repo: Path, relative: str) -> bool:
    """Whether ``path`` is ``repo/relative``: the file itself (editable) or a copy (a wheel)."""
    resolved = Path(path).resolve()
    return resolved == repo / relative or filecmp.cmp(resolved, repo / relative, shallow=False)


def test_package_list_is_every_package_folder_under_its_installed_name():
    found = set()
    for folder, name in INSTALLED_AS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *parts)))
    config = _pyproject_setuptools()
    assert sorted(config["packages"]) == sorted(found | set(DATA_PACKAGES))
    assert config["package-dir"] == {"jaxpaged.server": "server",
                                     "jaxpaged.benchmarks": "benchmarks", **DATA_PACKAGES}


def test_mapped_subpackages_import_from_their_repository_folders():
    app = importlib.import_module("jaxpaged.server.app")
    throughput = importlib.import_module("jaxpaged.benchmarks.throughput")
    kernels_bench = importlib.import_module("jaxpaged.benchmarks.kernels.paged_attention")
    assert _is_repo_file(app.__file__, REPO, "server/app.py")
    assert _is_repo_file(throughput.__file__, REPO, "benchmarks/throughput.py")
    assert _is_repo_file(kernels_bench.__file__, REPO, "benchmarks/kernels/paged_attention.py")


def test_distribution_provides_no_top_level_server_or_benchmarks():
    top_level = distribution("jaxpaged").read_text("top_level.txt").split()
    assert sorted(top_level) == ["jaxpaged", "pallas_kernels"]
    provided = sorted(name for name, dists in packages_distributions().items()
                      if "jaxpaged" in dists)
    assert provided == ["jaxpaged", "pallas_kernels"]


def _probe(python: str, cwd: Path, repo: Path) -> dict:
    """Imports jaxpaged in a fresh interpreter run in ``cwd``; what it found, as a dict."""
    code = (
        "import importlib.util, json, jaxpaged, jaxpaged.server.app, jaxpaged.benchmarks.datasets\n"
        "from jaxpaged import LLM\n"
        "def origin(name):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    return spec.origin if spec else None\n"
        "print(json.dumps({'LLM': LLM.__name__, 'package': jaxpaged.__file__,\n"
        "    'app': jaxpaged.server.app.__file__, 'w1': jaxpaged.benchmarks.datasets.W1_PATH,\n"
        "    'server': origin('server'), 'benchmarks': origin('benchmarks')}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["LLM"] == "LLM"
    assert _is_repo_file(found["app"], repo, "server/app.py")
    assert Path(found["w1"]).resolve() == repo / "configs" / "workloads" / "w1.json"
    for name in ("server", "benchmarks"):
        assert found[name] is None or not Path(found[name]).resolve().is_relative_to(repo)
    return found


def test_installed_copy_imports_outside_the_repository(tmp_path):
    found = _probe(sys.executable, tmp_path, REPO)
    assert _is_repo_file(found["package"], REPO, "jaxpaged/__init__.py")


@pytest.mark.slow
def test_editable_install_imports_beside_a_clone_named_jaxpaged(tmp_path):
    # A clone at ~/jaxpaged used from ~: the working directory's jaxpaged/ (the clone's root,
    # no __init__.py) is a namespace-package candidate that must not shadow the install.
    clone = tmp_path / "home" / "jaxpaged"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    keep = ("pyproject.toml", "setup.cfg", "README.md", "configs/workloads/w1.json",
            *(f"{folder}/" for folder in INSTALLED_AS))
    for rel in listed:
        if rel.startswith(keep) and (REPO / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, clone / rel)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-c", purelib], capture_output=True, text=True,
                          check=True).stdout.strip()
    # The dependencies come from this interpreter's site-packages (a plain path entry: its own
    # .pth files, this checkout's editable install among them, are not run).
    Path(site, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(clone)],
                   check=True, capture_output=True, timeout=600)
    found = _probe(python, clone.parent, clone)
    assert Path(found["package"]).resolve() == clone / "jaxpaged" / "__init__.py"


@pytest.mark.slow
def test_wheel_holds_the_mapped_packages_and_the_configs(tmp_path):
    # A non-editable install finds configs/ (model shapes, the W1 workload) beside its
    # benchmarks as the checkout does: the wheel must carry it as jaxpaged/configs.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("jaxpaged-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for rel in ("configs/workloads/w1.json", "configs/models/stories110m-shape/config.json",
                "configs/tokenizers/llama2/tokenizer.json", "server/app.py",
                "benchmarks/datasets.py"):
        assert f"jaxpaged/{rel}" in names, rel
    assert not any(n.startswith(("server/", "benchmarks/", "configs/")) for n in names)
