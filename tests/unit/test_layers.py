"""Imports point one way: each layer imports only the layers below it (docs/architecture.md, "Layout").

Read from the source with ``ast`` (imports inside functions count too), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FOLDERS = {"common": "parallax", "protocol": "parallax.protocol", "dht": "parallax.dht", "node": "parallax.node",
           "benchmarks": "parallax.benchmarks", "cli": "parallax.cli"}
"""Source folder -> the package it installs as (pyproject.toml's package-dir)."""

LAYERS: list[set[str]] = [
    {"parallax"},  # the root package: the exception hierarchy
    {"parallax.protocol"},
    {"parallax.dht"},
    {"parallax.node"},  # the node package's own __init__
    {"parallax.node.config"},
    {"parallax.node.model"},
    {"parallax.node.train"},
    {"parallax.node.net"},
    {"parallax.node.outer"},  # the outer rounds: wire format, transport, round, records, state, scheduling
    {"parallax.node.offload"},
    {"parallax.node.sim", "parallax.node.peer"},  # siblings: neither imports the other
    {"parallax.node.export"},  # the trained model out of checkpoints or a live swarm (as a reader peer)
    {"parallax.benchmarks"},
    {"parallax.cli"},
]
"""Lowest first. A module may import its own package and any package of a lower layer."""

FACADES = {("parallax", "parallax.node.export.folder")}
"""Upward imports allowed, each inside a function: ``parallax.load`` is the root package's one entry point to an
exported model, imported when called so that ``import parallax`` stays light."""

PURE_PROTOCOL_ALLOWED = {"cryptography", "msgpack", "numpy", "parallax"}
"""protocol/ is pure (no torch, no hivemind, no sockets): the wire format stays fuzzable byte for byte."""


def _package_of(module: str) -> str:
    """The layer package that holds ``module``: the longest package named in LAYERS that prefixes it."""
    candidates = [p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")]
    return max(candidates, key=len)


def _rank(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def _modules() -> list[tuple[str, Path]]:
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join((package, *parts)), path))
    return out


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports, absolute, with its line number."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # ``from parallax.node.train import composer`` imports the submodule parallax.node.train.composer
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


MODULES = _modules()


def test_every_source_file_is_in_a_layer() -> None:
    assert MODULES, "no source files found"
    for module, _ in MODULES:
        _rank(_package_of(module))  # raises StopIteration when a package is missing from LAYERS


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(module: str, path: Path) -> None:
    own = _package_of(module)
    wrong = []
    for target, line in _imports(module, path):
        if not (target == "parallax" or target.startswith("parallax.")):
            continue
        if any(module == low and (target == high or target.startswith(high + ".")) for low, high in FACADES):
            continue
        if target in {m for m, _ in MODULES} or any(target == p for layer in LAYERS for p in layer):
            package = _package_of(target)
        else:  # a name imported from a module (``from parallax.node.train.data import load_corpus``)
            package = _package_of(target.rpartition(".")[0] or target)
        if package != own and _rank(package) >= _rank(own):
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({package} is not below {own})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("module", "path"), [(m, p) for m, p in MODULES if m.startswith("parallax.protocol")],
                         ids=[m for m, _ in MODULES if m.startswith("parallax.protocol")])
def test_protocol_is_pure(module: str, path: Path) -> None:
    import sys

    outside = []
    for target, line in _imports(module, path):
        top = target.split(".")[0]
        if top and top not in sys.stdlib_module_names and top not in PURE_PROTOCOL_ALLOWED:
            outside.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not outside, "protocol/ must stay pure:\n" + "\n".join(outside)
