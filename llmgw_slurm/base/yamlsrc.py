"""YAML loading that remembers where every key and value was written.

Config errors must name a file and a line, so instead of plain Python values
this module returns a small tree (:class:`YMap`, :class:`YSeq`, :class:`YScalar`)
whose every node knows its 1-based line. Only the safe loader is used: no
Python tags, no object construction. Anything that goes wrong while reading
(a missing file, bad UTF-8, a YAML syntax error, duplicate keys, a tag we do
not accept, a recursive alias) becomes a :class:`~llmgw_slurm.base.errors.ConfigError`
naming the file and line; no other exception escapes :func:`load_yaml` or
:func:`parse_yaml`.

Two YAML 1.1 habits are worked around here because they bite config files:

- keys are always read as their source text, so ``on:`` or ``yes:`` stay the
  strings ``"on"``/``"yes"`` instead of becoming ``True``;
- every scalar keeps its source text (:attr:`YScalar.text`) next to the value
  PyYAML resolved, so ``4:00:00`` (which YAML 1.1 reads as the base-60 integer
  14400) can still be read as a Slurm time, and ``0.90`` passed as an engine
  argument stays ``"0.90"``.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
import yaml.constructor
import yaml.nodes

from llmgw_slurm.base.errors import ConfigError, ConfigErrors

__all__ = [
    "YEntry",
    "YMap",
    "YNode",
    "YScalar",
    "YSeq",
    "describe",
    "from_plain",
    "load_yaml",
    "parse_yaml",
    "to_plain",
]

# Scalar values a YScalar may hold after PyYAML resolved it.
ScalarValue = str | int | float | bool | None | datetime.date | datetime.datetime | bytes

# An alias-heavy document ("billion laughs") expands exponentially once turned
# into a tree; a config file has a few hundred nodes, so this cap is generous
# and keeps a hostile or broken file from eating the login node's memory.
MAX_NODES = 200_000

_STD = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(
    _STD + t for t in ("str", "int", "float", "bool", "null", "timestamp", "binary")
)


@dataclass(frozen=True)
class YScalar:
    """A scalar: its resolved ``value``, source ``text``, and whether it was quoted."""

    value: ScalarValue
    text: str
    line: int | None
    quoted: bool = False


@dataclass(frozen=True)
class YEntry:
    """One ``key: value`` of a mapping.

    ``origin`` is set when the entry was merged in from somewhere else (the
    catalog's ``defaults:`` block): it is the dotted path of the mapping the
    entry was written in, so errors point at where the value really is.
    """

    key: str
    key_line: int | None
    value: YNode
    origin: str | None = None


@dataclass(frozen=True)
class YMap:
    """A mapping with string keys, in file order, keys unique."""

    entries: tuple[YEntry, ...]
    line: int | None

    def get(self, key: str) -> YEntry | None:
        for entry in self.entries:
            if entry.key == key:
                return entry
        return None

    def keys(self) -> list[str]:
        return [e.key for e in self.entries]

    def __iter__(self) -> Iterator[YEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class YSeq:
    """A sequence."""

    items: tuple[YNode, ...]
    line: int | None

    def __iter__(self) -> Iterator[YNode]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


YNode = YScalar | YMap | YSeq


def describe(node: YNode) -> str:
    """A person's name for what a node holds: "a mapping", "the integer 3", ..."""
    if isinstance(node, YMap):
        return "a mapping"
    if isinstance(node, YSeq):
        return "a list"
    v = node.value
    if v is None:
        return "nothing (null)"
    if isinstance(v, bool):
        return f"the boolean {node.text}"
    if isinstance(v, int):
        return f"the integer {node.text}"
    if isinstance(v, float):
        return f"the number {node.text}"
    if isinstance(v, datetime.date):
        return f"the date {node.text}"
    if isinstance(v, bytes):
        return "binary data"
    text = v if len(v) <= 60 else v[:57] + "..."
    return f"the string {text!r}"


def load_yaml(path: str | Path) -> YNode | None:
    """Read and parse one YAML file; None when it holds no document.

    Raises ConfigError (a missing or unreadable file, bad encoding) or
    ConfigErrors (everything wrong in the document, collected).
    """
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError("file not found", file=file) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, expected a YAML file", file=file) from None
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", file=file) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"not valid UTF-8 (byte {err.start}); save the file as UTF-8", file=file, line=line
        ) from None
    return parse_yaml(text, file)


def parse_yaml(text: str, file: str) -> YNode | None:
    """Parse YAML text; None when it holds no document (empty or only comments)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else None
        what = " ".join(p for p in (err.context, err.problem) if p) or "invalid YAML"
        raise ConfigError(f"YAML syntax error: {what}", file=file, line=line) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"YAML syntax error: {err}", file=file) from None
    except RecursionError:
        raise ConfigError("YAML nested too deeply", file=file) from None
    if root is None:
        return None
    conv = _Converter(file)
    try:
        tree = conv.convert(root, ())
    except RecursionError:
        raise ConfigError("YAML nested too deeply", file=file) from None
    except _TooBig:
        raise ConfigErrors(conv.errors) from None
    if conv.errors:
        raise ConfigErrors(conv.errors)
    return tree


class _TooBig(Exception):
    pass


class _Converter:
    def __init__(self, file: str) -> None:
        self.file = file
        self.errors: list[ConfigError] = []
        self.count = 0
        # A throwaway constructor: it only turns scalar nodes into values.
        self.ctor = yaml.constructor.SafeConstructor()

    def err(self, msg: str, node: yaml.nodes.Node) -> None:
        self.errors.append(ConfigError(msg, file=self.file, line=node.start_mark.line + 1))

    def convert(self, node: yaml.nodes.Node, stack: tuple[int, ...]) -> YNode:
        line = node.start_mark.line + 1
        self.count += 1
        if self.count > MAX_NODES:
            self.err(f"document expands to more than {MAX_NODES} values (alias bomb?)", node)
            raise _TooBig
        if id(node) in stack:
            self.err("an alias refers to a node that contains it (recursive alias)", node)
            return YScalar(None, "", line)
        if isinstance(node, yaml.nodes.ScalarNode):
            return self.scalar(node)
        if not node.tag.startswith(_STD):
            self.err(f"YAML tag {node.tag} is not supported here", node)
            return YScalar(None, "", line)
        inner = (*stack, id(node))
        if isinstance(node, yaml.nodes.SequenceNode):
            if node.tag != _STD + "seq":
                self.err(f"YAML tag {node.tag} is not supported here; use a plain list", node)
            return YSeq(tuple(self.convert(item, inner) for item in node.value), line)
        assert isinstance(node, yaml.nodes.MappingNode)
        if node.tag != _STD + "map":
            self.err(f"YAML tag {node.tag} is not supported here; use a plain mapping", node)
        return self.mapping(node, inner)

    def scalar(self, node: yaml.nodes.ScalarNode) -> YScalar:
        line = node.start_mark.line + 1
        quoted = node.style in ("'", '"', "|", ">")
        if node.tag not in _SCALAR_TAGS:
            self.err(f"YAML tag {node.tag} is not supported here", node)
            return YScalar(None, node.value, line, quoted)
        try:
            value = self.ctor.construct_object(node, deep=True)
        except Exception as err:
            # PyYAML's constructors fail in assorted ways on odd input
            # (`!!int ""` is an IndexError): whatever it is, the value is unreadable.
            kind = node.tag.removeprefix(_STD)
            why = f": {err}" if isinstance(err, ValueError | yaml.YAMLError) else ""
            self.err(f"cannot read {node.value!r} as {kind}{why}", node)
            return YScalar(None, node.value, line, quoted)
        if isinstance(value, float) and not math.isfinite(value):
            # .inf/.nan are never a sensible setting; keep them as text so the
            # schema reports a type error with the line.
            return YScalar(node.value, node.value, line, quoted)
        if not isinstance(value, ScalarValue):
            self.err(f"cannot read value {node.value!r}", node)
            return YScalar(None, node.value, line, quoted)
        return YScalar(value, node.value, line, quoted)

    def mapping(self, node: yaml.nodes.MappingNode, stack: tuple[int, ...]) -> YMap:
        line = node.start_mark.line + 1
        entries: dict[str, YEntry] = {}
        merged: list[YEntry] = []
        for key_node, value_node in node.value:
            if key_node.tag == _STD + "merge":
                merged.extend(self.merge_source(value_node, stack))
                continue
            if not isinstance(key_node, yaml.nodes.ScalarNode) or key_node.tag not in (
                _STD + "str",
                _STD + "int",
                _STD + "bool",
                _STD + "float",
                _STD + "null",
            ):
                self.err("a mapping key must be a plain name, not a list or mapping", key_node)
                continue
            # The source text, never the resolved value: `on:` is the key "on".
            key = key_node.value
            key_line = key_node.start_mark.line + 1
            if key in entries:
                self.err(
                    f"duplicate key {key!r} (first at line {entries[key].key_line}); "
                    "each key may appear once",
                    key_node,
                )
                continue
            entries[key] = YEntry(key, key_line, self.convert(value_node, stack))
        # YAML merge keys (`<<: *base`): explicit keys win over merged ones.
        for entry in merged:
            entries.setdefault(entry.key, entry)
        return YMap(tuple(entries.values()), line)

    def merge_source(self, node: yaml.nodes.Node, stack: tuple[int, ...]) -> list[YEntry]:
        sources: Sequence[yaml.nodes.Node]
        sources = node.value if isinstance(node, yaml.nodes.SequenceNode) else [node]
        out: list[YEntry] = []
        for src in sources:
            conv = self.convert(src, stack)
            if not isinstance(conv, YMap):
                self.err("a merge key (<<) needs a mapping or a list of mappings", src)
                continue
            out.extend(e for e in conv.entries if all(o.key != e.key for o in out))
        return out


def from_plain(data: object) -> YNode:
    """Turn plain Python data (from JSON, say) into a tree without line numbers.

    Raises TypeError for values JSON/YAML cannot hold (callers that take
    outside input convert that into a ConfigError).
    """
    if isinstance(data, Mapping):
        entries = []
        for k, v in data.items():
            if not isinstance(k, str):
                raise TypeError(f"mapping keys must be strings, got {k!r}")
            entries.append(YEntry(k, None, from_plain(v)))
        return YMap(tuple(entries), None)
    if isinstance(data, list | tuple):
        return YSeq(tuple(from_plain(v) for v in data), None)
    if data is None or isinstance(data, str | int | float | bool):
        if data is None:
            text = "null"
        else:
            text = str(data).lower() if isinstance(data, bool) else str(data)
        return YScalar(data, text, None, quoted=isinstance(data, str))
    raise TypeError(f"cannot represent {type(data).__name__} in a config tree")


def to_plain(node: YNode) -> object:
    """The plain Python value of a tree (for debugging and tests)."""
    if isinstance(node, YMap):
        return {e.key: to_plain(e.value) for e in node.entries}
    if isinstance(node, YSeq):
        return [to_plain(i) for i in node.items]
    return node.value
