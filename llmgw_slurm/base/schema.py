"""Typed loading of YAML trees into frozen dataclasses, collecting every error.

The dataclasses in :mod:`llmgw_slurm.config` and :mod:`llmgw_slurm.catalog`
are the schema: a field's name is its YAML key, its annotation the accepted
type, its default the default, and ``metadata=rule(...)`` adds bounds,
patterns or a custom parser. So defaults and validation live in one place and
the set of valid keys can never drift from the dataclass.

Optional hooks on a schema class:

``schema_fill_defaults(cls, values: dict[str, Any]) -> None`` (classmethod)
    fills defaults that depend on other fields, before construction;
``schema_problems(self) -> list[tuple[str, str]]``
    cross-field checks after construction: (field name, message) pairs.

Nothing here raises while walking: every problem is recorded in a
:class:`Ctx` with the file, line and dotted field path, and the caller raises
them together.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import re
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from llmgw_slurm.base import durations
from llmgw_slurm.base.durations import DURATION_HELP
from llmgw_slurm.base.errors import ConfigError, ConfigErrors
from llmgw_slurm.base.yamlsrc import YEntry, YMap, YNode, YScalar, YSeq, describe, load_yaml

__all__ = [
    "INVALID",
    "Ctx",
    "FrozenMap",
    "Invalid",
    "build",
    "join",
    "load_file",
    "parse_duration",
    "parse_size",
    "rule",
    "scalar_text",
]


class FrozenMap(dict[str, Any]):
    """A dict that refuses changes and can be hashed: mappings inside frozen
    config dataclasses (``engine.env``, ``tracing.headers``) stay frozen, and the
    dataclasses stay hashable. Still a dict for ``json.dumps`` and ``asdict``."""

    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("config mappings are read-only; build a new one with dict(...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        # copy/deepcopy/pickle would otherwise rebuild it item by item through
        # __setitem__, which refuses.
        return (FrozenMap, (dict(self),))

    def __repr__(self) -> str:
        return repr(dict(self))


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


# Returned instead of a value when the value was wrong (the error is recorded).
INVALID: Any = _Invalid()


class Invalid(Exception):
    """Raised by a parser for one value; the builder records it with file:line:field."""


# A custom parser gets the node and the context and returns the value.
Parser = Callable[[YNode, "Ctx"], object]


def rule(
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    pattern: str | None = None,
    pattern_help: str = "",
    key_pattern: str | None = None,
    key_help: str = "",
    parse: Parser | None = None,
) -> dict[str, Any]:
    """Field metadata: bounds (ge/le/gt), a regex for strings (and list items
    and mapping values), a regex for mapping keys, or a custom ``parse``
    function that reads the node and raises :class:`Invalid` with a message."""
    return {
        "ge": ge,
        "le": le,
        "gt": gt,
        "pattern": re.compile(pattern) if pattern else None,
        "pattern_help": pattern_help,
        "key_pattern": re.compile(key_pattern) if key_pattern else None,
        "key_help": key_help,
        "parse": parse,
    }


class Ctx:
    """Where we are reading (file, base folder for relative paths) and what went wrong."""

    def __init__(
        self, file: str | None, base_dir: Path | None = None, *, ignore_unknown: bool = False
    ) -> None:
        self.file = file
        self.base_dir = base_dir
        # ignore_unknown: keys the schema does not know are skipped and listed in
        # ``ignored`` instead of being errors. For data another version of this
        # code wrote (the replica spec from a newer daemon), never for a person's file.
        self.ignore_unknown = ignore_unknown
        self.ignored: list[str] = []
        self.errors: list[ConfigError] = []
        self._seen: set[tuple[int | None, str, str]] = set()

    def add(self, message: str, line: int | None, field: str) -> None:
        # A bad value in the catalog's `defaults:` is merged into every model;
        # report it once.
        key = (line, field, message)
        if key in self._seen:
            return
        self._seen.add(key)
        self.errors.append(ConfigError(message, file=self.file, line=line, field=field))

    def raise_if_errors(self) -> None:
        if self.errors:
            self.errors.sort(key=lambda e: e.line or 0)
            raise ConfigErrors(self.errors)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def is_null(node: YNode | None) -> bool:
    return node is None or (isinstance(node, YScalar) and node.value is None)


def scalar_text(node: YNode) -> str:
    """A string value; numbers and dates are taken as written (``0.90`` stays ``0.90``).

    Booleans and null are refused: YAML 1.1 reads ``on``/``no``/``yes`` as
    booleans, and silently passing ``True`` where a word was meant is worse
    than asking for quotes.
    """
    if not isinstance(node, YScalar):
        raise Invalid(f"expected a string, got {describe(node)}")
    v = node.value
    if isinstance(v, str):
        if "\x00" in v:
            raise Invalid("a NUL character is not allowed here")
        return v
    if isinstance(v, bool) or v is None:
        hint = f' (write "{node.text}" in quotes if you mean the text)' if v is not None else ""
        raise Invalid(f"expected a string, got {describe(node)}{hint}")
    if isinstance(v, int | float | datetime.date):
        return node.text
    raise Invalid(f"expected a string, got {describe(node)}")


def parse_duration(node: YNode, ctx: Ctx) -> float:
    """Seconds, from ``30s``/``15m``/``4h``/``1d``/``1h30m``, ``H:MM:SS`` or a plain
    number (:func:`llmgw_slurm.base.durations.parse_duration`)."""
    if not isinstance(node, YScalar) or isinstance(node.value, bool) or node.value is None:
        raise Invalid(f"expected {DURATION_HELP}; got {describe(node)}")
    # The text as written: YAML 1.1 reads 4:00:00 as the base-60 integer 14400.
    text = node.text.strip()
    if isinstance(node.value, int | float) and ":" not in text:
        value = float(node.value)
        if not math.isfinite(value) or value < 0:
            raise Invalid(f"a duration must be zero or more; got {text!r}")
        return value
    try:
        return durations.parse_duration(text)
    except ValueError as err:
        raise Invalid(str(err)) from None


_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(node: YNode, ctx: Ctx) -> int:
    """Bytes, from a whole number or ``512K``/``16M``/``16MiB``/``1G`` (binary multiples)."""
    help_ = "a size in bytes, or with a unit: 512K, 16M, 16MiB, 1G"
    if not isinstance(node, YScalar) or isinstance(node.value, bool) or node.value is None:
        raise Invalid(f"expected {help_}; got {describe(node)}")
    if isinstance(node.value, int):
        return node.value
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", node.text.strip().lower())
    if not m:
        raise Invalid(f"cannot read {node.text!r} as a size; expected {help_}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(get_args(tp)[0]).removeprefix('a ')}s"
    if origin in (Mapping, dict):
        return f"a mapping of names to {_type_name(get_args(tp)[1]).removeprefix('a ')}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {
        str: "a string",
        int: "a whole number",
        float: "a number",
        bool: "true or false",
        Path: "a path",
    }.get(tp, str(tp))


def _check_bounds(value: float, meta: Mapping[str, Any]) -> None:
    ge, le, gt = meta.get("ge"), meta.get("le"), meta.get("gt")
    if ge is not None and value < ge:
        raise Invalid(f"must be at least {ge:g}; got {value:g}")
    if gt is not None and value <= gt:
        raise Invalid(f"must be more than {gt:g}; got {value:g}")
    if le is not None and value > le:
        raise Invalid(f"must be at most {le:g}; got {value:g}")


def _check_pattern(value: str, meta: Mapping[str, Any]) -> None:
    pat = meta.get("pattern")
    if pat is not None and not pat.fullmatch(value):
        help_ = meta.get("pattern_help") or f"a string matching {pat.pattern}"
        raise Invalid(f"{value!r} is not valid: expected {help_}")


def _line(node: YNode | None, fallback: int | None) -> int | None:
    if node is None:
        return fallback
    return node.line if node.line is not None else fallback


def convert(
    tp: Any, node: YNode, path: str, ctx: Ctx, meta: Mapping[str, Any], line: int | None
) -> Any:
    """Convert ``node`` to type ``tp``; on error record it and return INVALID."""
    where = _line(node, line)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if is_null(node) and len(args) < len(get_args(tp)):
            return None
        if len(args) != 1:  # pragma: no cover - the schema never does this
            raise TypeError(f"unsupported union {tp}")
        return convert(args[0], node, path, ctx, meta, line)
    try:
        parse = meta.get("parse")
        if parse is not None:
            value = parse(node, ctx)
            if isinstance(value, int | float) and not isinstance(value, bool):
                _check_bounds(value, meta)
            return value
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return build(tp, node, path, ctx, line=where)
        if origin is tuple:
            return _convert_list(tp, node, path, ctx, meta, where)
        if origin in (Mapping, dict):
            return _convert_map(tp, node, path, ctx, meta, where)
        return _convert_scalar(tp, node, ctx, meta)
    except Invalid as err:
        ctx.add(str(err), where, path)
        return INVALID


def _null_refused(tp: Any, meta: Mapping[str, Any]) -> Invalid:
    if meta.get("_item"):
        return Invalid(f"expected {_type_name(tp)}, got nothing (null)")
    return Invalid(f"expected {_type_name(tp)}, got nothing (null); remove the key for the default")


def _convert_scalar(tp: Any, node: YNode, ctx: Ctx, meta: Mapping[str, Any]) -> Any:
    if is_null(node):
        raise _null_refused(tp, meta)
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if isinstance(node, YScalar) and isinstance(node.value, str) and node.value in choices:
            return node.value
        got = describe(node)
        close = ""
        if isinstance(node, YScalar):
            match = difflib.get_close_matches(node.text, [str(c) for c in choices], n=1)
            close = f"; did you mean {match[0]!r}?" if match else ""
        raise Invalid(f"expected one of: {', '.join(map(str, choices))}; got {got}{close}")
    if tp is str:
        text = scalar_text(node)
        _check_pattern(text, meta)
        return text
    if tp is Path:
        if not isinstance(node, YScalar) or isinstance(node.value, bool):
            raise Invalid(f"expected a path, got {describe(node)}")
        text = scalar_text(node)
        if not text.strip():
            raise Invalid("expected a path, got an empty string")
        try:
            p = Path(text).expanduser()
        except RuntimeError:
            raise Invalid(f"cannot expand {text!r}: no such user or no home directory") from None
        if not p.is_absolute() and ctx.base_dir is not None:
            # Relative to the config file, not to wherever the daemon was started.
            p = ctx.base_dir / p
        return p
    v = node.value if isinstance(node, YScalar) else None
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise Invalid(f"expected true or false, got {describe(node)}")
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            _check_bounds(v, meta)
            return v
        raise Invalid(f"expected a whole number, got {describe(node)}")
    if tp is float:
        if isinstance(v, int | float) and not isinstance(v, bool):
            _check_bounds(float(v), meta)
            return float(v)
        raise Invalid(f"expected a number, got {describe(node)}")
    raise TypeError(f"schema type {tp!r} is not supported")  # pragma: no cover


def _convert_list(
    tp: Any, node: YNode, path: str, ctx: Ctx, meta: Mapping[str, Any], line: int | None
) -> Any:
    if is_null(node):
        return ()
    if not isinstance(node, YSeq):
        raise Invalid(f"expected {_type_name(tp)}, got {describe(node)}")
    item_tp = get_args(tp)[0]
    out = []
    ok = True
    for i, item in enumerate(node.items):
        v = convert(item_tp, item, f"{path}[{i}]", ctx, {**meta, "_item": True}, line)
        ok = ok and v is not INVALID
        out.append(v)
    return tuple(out) if ok else INVALID


def _convert_map(
    tp: Any, node: YNode, path: str, ctx: Ctx, meta: Mapping[str, Any], line: int | None
) -> Any:
    if is_null(node):
        return FrozenMap()
    if not isinstance(node, YMap):
        raise Invalid(f"expected {_type_name(tp)}, got {describe(node)}")
    value_tp = get_args(tp)[1]
    key_pat = meta.get("key_pattern")
    out: dict[str, Any] = {}
    ok = True
    for entry in node.entries:
        sub = join(entry.origin or path, entry.key)
        if key_pat is not None and not key_pat.fullmatch(entry.key):
            help_ = meta.get("key_help") or f"a name matching {key_pat.pattern}"
            ctx.add(f"{entry.key!r} is not a valid name: expected {help_}", entry.key_line, sub)
            ok = False
            continue
        v = convert(value_tp, entry.value, sub, ctx, {**meta, "_item": True}, entry.key_line)
        ok = ok and v is not INVALID
        out[entry.key] = v
    return FrozenMap(out) if ok else INVALID


def schema_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def unknown_key_message(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key {key!r}{hint} (valid keys: {', '.join(sorted(valid))})"


def build(cls: type[Any], node: YNode | None, path: str, ctx: Ctx, *, line: int | None) -> Any:
    """Build dataclass ``cls`` from a mapping node; INVALID (errors recorded) when wrong."""
    if node is None or is_null(node):
        node = YMap((), line)
    if not isinstance(node, YMap):
        keys = ", ".join(schema_keys(cls))
        ctx.add(
            f"expected a mapping with keys {keys}; got {describe(node)}", _line(node, line), path
        )
        return INVALID
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    valid = list(fields)
    ok = True
    for given in node.entries:
        if given.key not in fields:
            sub = join(given.origin or path, given.key)
            if ctx.ignore_unknown:
                ctx.ignored.append(sub)
                continue
            ctx.add(unknown_key_message(given.key, valid), given.key_line, sub)
            ok = False
    values: dict[str, Any] = {}
    for name, f in fields.items():
        entry = node.get(name)
        if entry is None:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                ctx.add(f"missing required key {name!r}", node.line, join(path, name))
                ok = False
            continue
        sub = join(entry.origin or path, name)
        v = convert(hints[name], entry.value, sub, ctx, f.metadata, entry.key_line)
        if v is INVALID:
            ok = False
        else:
            values[name] = v
    if not ok:
        return INVALID
    fill = getattr(cls, "schema_fill_defaults", None)
    if fill is not None:
        fill(values)
    obj = cls(**values)
    problems = getattr(obj, "schema_problems", None)
    if problems is not None:
        found: list[tuple[str, str]] = problems()
        for name, message in found:
            where, sub = _locate(node, path, name)
            ctx.add(message, where, sub)
        if found:
            return INVALID
    return obj


def _locate(node: YMap, path: str, name: str) -> tuple[int | None, str]:
    """Line and dotted path of ``name`` in ``node``: a key, ``key[3]`` or ``key.sub``."""
    m = re.fullmatch(r"(\w+)(?:\[(\d+)\]|\.(.+))?", name)
    key = m.group(1) if m else name
    at = node.get(key)
    if at is None:
        return node.line, join(path, name)
    line = _entry_line(at, node.line)
    if m and m.group(2) is not None and isinstance(at.value, YSeq):
        idx = int(m.group(2))
        if idx < len(at.value.items):
            line = _line(at.value.items[idx], line)
    elif m and m.group(3) is not None and isinstance(at.value, YMap):
        sub_entry = at.value.get(m.group(3))
        if sub_entry is not None:
            return sub_entry.key_line, join(
                sub_entry.origin or join(at.origin or path, key), m.group(3)
            )
    return line, join(at.origin or path, name)


def _entry_line(entry: YEntry | None, fallback: int | None) -> int | None:
    if entry is None:
        return fallback
    return _line(entry.value, entry.key_line)


def load_file(cls: type[Any], path: str | Path, what: str) -> Any:
    """Load one YAML file into dataclass ``cls``; raises ConfigError(s) with every problem.

    ``what`` names the file's role for the empty-file message ("server config").
    Relative paths inside the file are taken relative to the file's folder.
    """
    file = str(path)
    root = load_yaml(path)
    ctx = Ctx(file, Path(path).absolute().parent)
    if root is None:
        keys = ", ".join(schema_keys(cls))
        raise ConfigErrors(
            [ConfigError(f"file is empty; a {what} is a mapping with keys: {keys}", file=file)]
        )
    if not isinstance(root, YMap):
        keys = ", ".join(schema_keys(cls))
        ctx.add(f"expected a mapping with keys {keys}; got {describe(root)}", root.line, "")
        ctx.raise_if_errors()
    obj = build(cls, root, "", ctx, line=1)
    ctx.raise_if_errors()
    return obj
