"""Reading config YAML defensively, so every malformed file gets one line instead of a hang,
a traceback or a silent surprise.

- bounded: at most `MAX_CONFIG_BYTES` (64 KiB) are read (`/dev/zero` as a config ends at once);
- text: the bytes must be UTF-8 without NUL (a binary file is named as such);
- no alias bombs or recursive anchors: the document, with aliases expanded, may hold at most
  `MAX_VALUES` values, and no value may contain itself;
- no duplicate keys: YAML lets the last one win (a duplicated section silently replaced the
  whole section); here it is an error naming the dotted key and both lines;
- YAML 1.2 booleans: only true/false. YAML 1.1 also reads yes/no/on/off as booleans, which
  turned `tracker.mode: off` into `false`; here they stay words and validation names the
  valid values;
- numbers keep the text as written (`WrittenInt`, `WrittenFloat`): YAML 1.1 reads `2024_01` as
  202401, `0123` as octal 83, `1:30` as 90 (base 60) and `0x1F` as 31, so a key typed as text
  (a path, a name, an id) takes the text instead (config_fields.Section); no dates either
  (`2024-01-01` stays text).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from meshrun.errors import ConfigError

MAX_CONFIG_BYTES = 64 << 10  # a meshrun config is a few hundred bytes; parsing 64 KiB takes < 1 s
MAX_VALUES = 10_000  # values after alias expansion; the full schema has about 70
MAX_FLOW_DEPTH = 32  # nested [ ] / { }: PyYAML's scanner is quadratic in this depth
_BOOL_TAG = "tag:yaml.org,2002:bool"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"


class WrittenInt(int):
    """An integer read from YAML, with its text as written (`text`)."""

    text: str


class WrittenFloat(float):
    """A float read from YAML, with its text as written (`text`)."""

    text: str


def plain(value: Any) -> Any:
    """Free-form values (model.options, model.hf_config) as plain Python numbers, at any depth."""
    if isinstance(value, (WrittenInt, WrittenFloat)):
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return [plain(item) for item in value] if isinstance(value, list) else value


def as_written(value: Any) -> Any:
    """For a key typed as text: numbers as the user wrote them (in lists too); the rest unchanged."""
    if isinstance(value, (WrittenInt, WrittenFloat)):
        return value.text
    if isinstance(value, list):
        return [as_written(item) for item in value]
    return value


class ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # pyright: ignore[reportGeneralTypeIssues] (libyaml's parser when present: 50x faster)
    """SafeLoader with YAML 1.2 booleans (true/false only)."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL_TAG, _TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _construct_int(loader: Any, node: Node) -> WrittenInt:
    number = WrittenInt(loader.construct_yaml_int(node))
    number.text = str(node.value)
    return number


def _construct_float(loader: Any, node: Node) -> WrittenFloat:
    number = WrittenFloat(loader.construct_yaml_float(node))
    number.text = str(node.value)
    return number


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def read_config_file(path: str | Path) -> str:
    """The file's text, refusing huge, binary and non-UTF-8 files."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is larger than 64 KiB, so it is not a meshrun config; pass a YAML config file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); pass a YAML config file"
        ) from None
    if "\x00" in text:
        raise ConfigError(f"config file {path} holds NUL bytes (a binary file?); pass a YAML config file")
    return text


def parse_document(text: str, where: str) -> Any:
    """One YAML document -> Python values; None for an empty (or comment-only) document."""
    if _flow_too_deep(text):
        raise ConfigError(f"{where} is nested too deeply to be a meshrun config; flatten it")
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_values(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{where} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply to be a meshrun config; flatten it") from None
    finally:
        loader.dispose()


def _flow_too_deep(text: str) -> bool:
    """Flow brackets nest deeper than MAX_FLOW_DEPTH (quotes ignored: over-counting is harmless)."""
    depth = 0
    for bracket in re.finditer(r"[\[\]{}]", text):
        depth = depth + 1 if bracket.group() in "[{" else max(depth - 1, 0)
        if depth > MAX_FLOW_DEPTH:
            return True
    return False


def _check_values(root: Node, where: str) -> None:
    """Walk the composed document as if aliases were expanded: refuse cycles, documents that
    expand past MAX_VALUES, and keys given twice in one mapping."""
    count = 0
    todo: list[tuple[Node, str, frozenset[int]]] = [(root, "", frozenset())]
    while todo:
        node, path, ancestors = todo.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(
                f"{where} holds more than {MAX_VALUES} values, counting what YAML aliases repeat (an alias bomb?); "
                "a meshrun config has about 100"
            )
        if id(node) in ancestors:
            line = node.start_mark.line + 1
            raise ConfigError(
                f"{where}: {path or 'the document'} contains itself (recursive YAML anchor at line {line}); remove the alias"
            )
        inside = ancestors | {id(node)}
        if isinstance(node, SequenceNode):
            todo += [(item, f"{path}[{i}]", inside) for i, item in enumerate(node.value)]
        elif isinstance(node, MappingNode):
            todo += _mapping_children(node, path, inside, where)


def _mapping_children(
    node: MappingNode, path: str, inside: frozenset[int], where: str
) -> list[tuple[Node, str, frozenset[int]]]:
    first_line: dict[str, int] = {}
    children = []
    for key, value in node.value:
        name = str(key.value) if key.tag != _MERGE_TAG else "<<"
        dotted = f"{path}.{name}" if path else name
        if name != "<<" and name in first_line:
            raise ConfigError(
                f"{where}: key {dotted} appears twice (lines {first_line[name]} and {key.start_mark.line + 1}); keep one"
            )
        first_line[name] = key.start_mark.line + 1
        children.append((value, dotted, inside))
    return children
