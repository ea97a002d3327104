"""Typed changes to nested frozen dataclasses: the one edge where text (``--set``, TOML, flags) becomes settings.

Every value is coerced to the annotation of the field it sets, with pydantic's validators (``TypeAdapter``): a
bool accepts true/false/1/0/yes/no in any case, an int refuses 2.5, a ``Literal`` names its choices on a typo,
a ``dict`` or ``tuple`` given as text is read as JSON. The dataclass's own ``__post_init__`` then checks the
values together. Every failure is a ``ConfigError`` of one line naming the setting, so the CLI can print it and
exit 2. The core never sees a string where a bool belongs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, TypeVar

import tomli_w
from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting that cannot be used, in one line that names it and what to do."""


def field_types(cls: Any) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (``from __future__ import annotations`` leaves text)."""
    return _field_types(cls)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (itself, False)."""
    if typing.get_origin(tp) in (UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not NoneType]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True  # noqa: UP007
    return tp, False


def is_section(tp: Any) -> bool:
    """Whether a field's type is a nested settings section (a dataclass) rather than a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def coerce(tp: Any, value: object, path: str) -> object:
    """``value`` as the type ``tp`` of the setting ``path``.

    Text (from ``--set`` or a flag) is parsed for containers (JSON) and for ``none``/``null`` where the type
    admits None. A bool is never taken for a number.

    Raises:
        ConfigError: the value does not fit the type.
    """
    inner, optional = _strip_optional(tp)
    if isinstance(value, str):
        text = value.strip()
        if optional and text.lower() in ("none", "null", ""):
            return None
        if typing.get_origin(inner) in (dict, tuple, list):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise ConfigError(f"{path}: {value!r} is not JSON; give it as JSON, e.g. "
                                  f"{_example(inner)}") from None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path} cannot be empty")
    if isinstance(value, bool) and inner in (int, float):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    try:
        return _adapter(inner).validate_python(value)
    except ValidationError as e:
        error = e.errors()[0]
        where = "".join(f"[{loc!r}]" for loc in error["loc"])
        raise ConfigError(f"{path}{where}: {error['msg']} (got {value!r})") from None


def _example(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is dict:
        return '{"name": 1}'
    return "[1, 2]" if origin in (tuple, list) else "1"


def _unknown(cls: type, name: str, path: str) -> ConfigError:
    names = ", ".join(f.name for f in dataclasses.fields(cls))
    return ConfigError(f"unknown setting {path!r}; the settings of {path.rpartition('.')[0] or 'the top level'} "
                       f"are: {names}")


def apply_changes(cfg: T, changes: Mapping[str, object]) -> T:
    """``cfg`` with dotted-path changes applied, each coerced to its field's type, e.g.
    ``{"optim.lr": "1e-3", "surrogate.input_grad": "false"}``. The changes of one section apply together, so
    settings that must agree (``model.d_model`` and ``model.d_latent``) may change in any order.

    Raises:
        ConfigError: an unknown path, a value of the wrong type, or settings that do not fit together.
    """
    tree: dict[str, Any] = {}
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node, section = tree, type(cfg)
        for i, name in enumerate(parents):
            types = field_types(section)
            if i == len(parents) - 1 and name in types and _is_mapping(types[name]):
                break  # one entry of a mapping setting: ``sync.periods.backbone``
            if name not in types or not is_section(types[name]):
                raise _unknown(section, name, ".".join(parents[: i + 1]))
            node, section = node.setdefault(name, {}), types[name]
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parents[: i + 1])} is set both as a value and as a section")
        types = field_types(section)
        if parents and parents[-1] in types and _is_mapping(types[parents[-1]]):
            name = parents[-1]
            entry = coerce(typing.get_args(_strip_optional(types[name])[0])[1], value, path)
            current = node.get(name)
            if current is None:
                current = node[name] = _Value(dict(_current(cfg, parents)))
            if not isinstance(current, _Value) or not isinstance(current.value, dict):
                raise ConfigError(f"{'.'.join(parents)} is set both as a value and as a section")
            current.value[leaf] = entry
            continue
        if leaf not in types:
            raise _unknown(section, leaf, path)
        if is_section(types[leaf]):
            if not isinstance(value, types[leaf]):  # a whole section only as the section itself (from code)
                raise ConfigError(f"{path} is a section; set one of its settings, e.g. "
                                  f"{path}.{_first_field(types[leaf])}")
            node[leaf] = _Value(value)
            continue
        node[leaf] = _Value(coerce(types[leaf], value, path))
    return _rebuilt_tree(cfg, tree, "")


@dataclasses.dataclass(frozen=True)
class _Value:
    value: object


def _is_mapping(tp: Any) -> bool:
    """Whether a field holds a mapping whose entries are set one by one (``sync.periods.backbone=50``)."""
    return typing.get_origin(_strip_optional(tp)[0]) is dict


def _current(cfg: object, path: Sequence[str]) -> Mapping[str, object]:
    """The value at ``path`` in ``cfg`` ({} where it is None)."""
    value: Any = cfg
    for name in path:
        value = getattr(value, name)
    return value or {}


def _rebuilt_tree(obj: Any, tree: Mapping[str, Any], prefix: str) -> Any:
    change = {name: sub.value if isinstance(sub, _Value) else _rebuilt_tree(getattr(obj, name), sub, f"{prefix}{name}.")
              for name, sub in tree.items()}
    if not change:
        return obj
    try:
        return dataclasses.replace(obj, **change)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        at_fault = _at_fault(obj, change, tree, prefix)
        raise ConfigError(str(e) if str(e).startswith(at_fault) else f"{at_fault}: {e}") from None


def _at_fault(obj: Any, change: Mapping[str, object], tree: Mapping[str, Any], prefix: str) -> str:
    """The settings of ``change`` that ``obj`` refuses (what an error names): those refused each on its own, or,
    when only their combination is refused (one bound against another), all of them."""
    alone = []
    for name, value in change.items():
        try:
            dataclasses.replace(obj, **{name: value})
        except (ValueError, TypeError):
            alone.append(name)
    names = alone or list(change)
    return ", ".join(p for name in sorted(names) for p in _leaves({name: tree[name]}, prefix))


def _leaves(tree: Mapping[str, Any], prefix: str) -> list[str]:
    """Every setting path a change tree sets (what an error of the whole change names)."""
    out: list[str] = []
    for name, sub in sorted(tree.items()):
        out += [f"{prefix}{name}"] if isinstance(sub, _Value) else _leaves(sub, f"{prefix}{name}.")
    return out


def _first_field(cls: type) -> str:
    return dataclasses.fields(cls)[0].name


def parse_sets(items: Sequence[str]) -> dict[str, str]:
    """``["optim.lr=1e-3", ...]`` -> ``{"optim.lr": "1e-3"}`` (text; ``apply_changes`` coerces it).

    Raises:
        ConfigError: an item without ``=``.
    """
    changes: dict[str, str] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set expects PATH=VALUE (e.g. surrogate.input_grad=false), got {item!r}")
        changes[path.strip()] = raw
    return changes


def set_args(changes: Mapping[str, object] | None) -> list[str]:
    """``{"optim.lr": "1e-3"}`` -> ``["--set", "optim.lr=1e-3"]``: ``parse_sets``' inverse, for a node's command
    line."""
    return [word for path, value in (changes or {}).items() for word in ("--set", f"{path}={value}")]


def table_changes(cls: type, table: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """A TOML table read against the dataclass ``cls`` -> dotted changes: sub-tables become paths where the field
    is a section, and stay values where the field holds a mapping (``sync.periods``).

    Raises:
        ConfigError: a key that names no setting.
    """
    types = field_types(cls)
    out: dict[str, object] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if key not in types:
            raise _unknown(cls, key, path)
        if is_section(types[key]):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path} is a section: write it as a table [{path}]")
            out.update(table_changes(types[key], value, f"{path}."))
        else:
            out[path] = value
    return out


def to_table(cfg: object) -> dict[str, Any]:
    """A dataclass as TOML-ready data: sections as tables (after the values), None left out, paths as text."""
    values: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            sections[f.name] = to_table(value)
        elif value is not None:
            values[f.name] = _plain(value)
    return {**values, **sections}


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def to_toml(cfg: object) -> str:
    """``cfg`` as a TOML document that ``--config`` reads back to the same settings."""
    return tomli_w.dumps(to_table(cfg))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), read from the source: what
    ``parallax config show --explain`` prints beside each setting. {} where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _toml_value(value: object) -> str:
    """One value as TOML text, a mapping as an inline table."""
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return tomli_w.dumps({"v": value}).partition(" = ")[2].strip()


def _comment(text: str, width: int = 100) -> list[str]:
    """``text`` as comment lines, each paragraph re-wrapped."""
    paragraphs = [" ".join(para.split()) for para in text.split("\n\n")]
    return [f"# {line}".rstrip() for para in paragraphs if para for line in textwrap.wrap(para, width)]


def to_explained_toml(cfg: object, prefix: str = "") -> str:
    """``cfg`` as ``to_toml`` writes it, each setting under its docstring as comments (``--config`` reads it back
    to the same settings; a setting left unset is a comment)."""
    lines: list[str] = []
    docs = field_docs(typing.cast(type, type(cfg)))
    sections = []
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            sections.append((f.name, value))
            continue
        lines += _comment(docs.get(f.name, ""))
        lines.append(f"{f.name} = {_toml_value(_plain(value))}" if value is not None else f"# {f.name}: not set")
        lines.append("")
    for name, value in sections:
        path = f"{prefix}{name}"
        doc = inspect.getdoc(type(value)) or ""
        lines += [*_comment(doc.split("\n\n")[0]), f"[{path}]", ""]
        lines.append(to_explained_toml(value, f"{path}."))
    return "\n".join(lines)
