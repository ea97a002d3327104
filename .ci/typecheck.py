#!/usr/bin/env python3
"""Type-check the sources with mypy; the settings (strict on protocol/ and dht/) live in pyproject.toml.

Why a tree of symlinks: the project installs its top-level folders under one import name through
setuptools' package-dir mapping (``parallax`` -> common/, ``parallax.node`` -> node/, ...). mypy finds
modules on the file system only: it cannot follow the editable install's import hook, and no folder
named ``parallax`` exists. Checking a regular (non-editable) install would check copies in
site-packages and need a reinstall after every edit. So this script lays out build/typecheck/parallax/
as symlinks to the real folders, read from the same mapping in pyproject.toml (one source of truth),
runs mypy on it (``mypy_path`` points there), and rewrites the paths mypy prints back to the real
files: errors read ``node/net/gossip.py:12: ...``, not a path inside the tree.

The same tree lets editors follow the imports: ``pyrightconfig.json`` (pyright, Pylance) names it as an extra
import root, so ``python .ci/typecheck.py --tree-only`` once after cloning is enough (folders are linked whole:
new modules appear by themselves, except new files of common/).

Usage: ``python .ci/typecheck.py [extra mypy arguments]``; the exit status is mypy's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = Path("build") / "typecheck"  # relative to ROOT, as mypy prints it; mypy_path in pyproject.toml
ROOT_PACKAGE = "parallax"
_TREE_PATH = re.compile(re.escape(str(TREE) + os.sep) + r"\S+?\.pyi?\b")


def build_tree() -> None:
    """Recreate build/typecheck/ from ``[tool.setuptools] package-dir`` in pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    tree = ROOT / TREE
    shutil.rmtree(tree, ignore_errors=True)
    # The root package's folder (common/) also holds the sub-packages' places, so it becomes a real
    # folder of per-file links; every other mapped package is one link to its folder.
    root_dir = tree / ROOT_PACKAGE
    root_dir.mkdir(parents=True)
    for entry in sorted((ROOT / package_dir[ROOT_PACKAGE]).iterdir()):
        if entry.name != "__pycache__":
            (root_dir / entry.name).symlink_to(entry)
    for name, folder in sorted(package_dir.items()):
        if name != ROOT_PACKAGE:
            (tree.joinpath(*name.split("."))).symlink_to(ROOT / folder, target_is_directory=True)


def _real_path(match: re.Match[str]) -> str:
    return os.path.relpath(os.path.realpath(ROOT / match.group(0)), ROOT)


def main(argv: list[str]) -> int:
    build_tree()
    if argv == ["--tree-only"]:  # for editors: pyrightconfig.json names the tree as an extra import root
        print(f"laid out {TREE}{os.sep}{ROOT_PACKAGE}")
        return 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "mypy", *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(_TREE_PATH.sub(_real_path, line))
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
