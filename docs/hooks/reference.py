"""The reference pages, generated from the code at build time so they cannot drift: every config key
(from the pydantic schema: its type, default, allowed values, description and the line meshrun
refuses a bad value with) and every command and flag (from the argparse parser). An MkDocs hook
(mkdocs.yml `hooks:`) adds them to the site and fails the build when a key, a check or a flag has
no description; tests/test_docs.py imports this file for the same check.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from meshrun.cli.parser import build_parser
from meshrun.config.model_sections import SECTIONS, ModelSection
from meshrun.config.schema import Config, default_config_text, validate
from meshrun.errors import ConfigError

# The smallest model section of each family, so that a bad value of one key is what gets refused.
_FAMILY_BASE: dict[str, dict[str, Any]] = {
    "gpt": {},
    "encdec": {"name": "encdec"},
    "encoder": {"name": "encoder"},
    "timeseries": {"name": "timeseries"},
    "hf": {"hf_config": {"model_type": "llama"}},
    "factory": {"factory": "mypkg.models:build"},
}
_FAMILY_TASK = {"encoder": "classification", "timeseries": "regression"}  # a family that trains one task only
_GENERATED = {"reference/config.md": "config_reference", "reference/cli.md": "cli_reference"}


# ---- config keys ---------------------------------------------------------------------------


def _sections() -> Iterator[tuple[str, type[BaseModel], dict[str, Any]]]:
    """(dotted prefix, section class, the data that places a value at that prefix), for every section.
    The model section appears once per family, its shared keys only under gpt."""
    for name, field in Config.model_fields.items():
        if name == "model":
            for family, section in SECTIONS.items():
                task = {"task": _FAMILY_TASK[family]} if family in _FAMILY_TASK else {}
                yield f"model ({family})", section, {"model": dict(_FAMILY_BASE[family]), **task}
        elif _section_class(field.annotation):
            yield name, _section_class(field.annotation), {name: {}}  # type: ignore[misc]
    yield (
        "data.mixture[]",
        _list_item_class(Config, "data", "mixture"),
        {"data": {"mixture": [{"dir": "d", "weight": 1}]}},
    )
    yield "", Config, {}


def _section_class(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _list_item_class(model: type[BaseModel], section: str, key: str) -> type[BaseModel]:
    annotation = _section_class(model.model_fields[section].annotation).model_fields[key].annotation  # type: ignore[union-attr]
    return get_args(annotation)[0]


def _own_fields(prefix: str, section: type[BaseModel]) -> dict[str, FieldInfo]:
    """The leaf keys documented under `prefix` (a family's shared model keys appear under gpt only)."""
    fields = {n: f for n, f in section.model_fields.items() if not _section_class(f.annotation) and n != "model"}
    if prefix.startswith("model (") and section is not SECTIONS["gpt"]:
        fields = {n: f for n, f in fields.items() if n not in ModelSection.model_fields or n == "name"}
    return fields


def _key(prefix: str, name: str, field: FieldInfo) -> str:
    dotted = field.alias or name
    section = prefix.split(" ")[0]
    return f"{section}.{dotted}" if section else dotted


def _type_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_text(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> list[str]:
    """The numeric bounds a field's value must keep (from Field(ge=..., gt=..., ...))."""
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return [f"{words[k]} {getattr(m, k)}" for m in field.metadata for k in words if hasattr(m, k)]


def _bad_value(field: FieldInfo) -> Any:
    """A value the field's own check refuses (None: no simple one)."""
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Ge):
            return meta.ge - 1
        if isinstance(meta, annotated_types.Gt):
            return meta.gt
        if isinstance(meta, (annotated_types.Lt, annotated_types.Le)):
            return getattr(meta, "lt", None) or meta.le + 1  # type: ignore[union-attr]
    literal = [a for a in _flat_args(field.annotation) if get_origin(a) is Literal]
    listed = get_origin(field.annotation) is list
    return (["bogus"] if listed else "bogus") if literal else None


def _flat_args(annotation: Any) -> Iterator[Any]:
    yield annotation
    for arg in get_args(annotation):
        yield from _flat_args(arg)


def _refusal(base: dict[str, Any], prefix: str, name: str, field: FieldInfo) -> str | None:
    """The one line meshrun answers a bad value of this key with, by validating one."""
    bad = _bad_value(field)
    if bad is None:
        return None
    data = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    node = data
    for part in [p for p in prefix.split(" ")[0].replace("[]", "").split(".") if p and p != "model"]:
        node = node[part][0] if isinstance(node[part], list) else node[part]
    node = node.get("model", node) if prefix.startswith("model") else node
    node[field.alias or name] = bad
    try:
        validate(data)
    except ConfigError as exc:
        return f"meshrun: error: {exc}"
    return None


def _validators(section: type[BaseModel]) -> tuple[dict[str, list[str]], list[str]]:
    """Per key, the docstrings of its field validators; and the section's rules across keys."""
    decorators = section.__pydantic_decorators__
    per_key: dict[str, list[str]] = {}
    for validator in decorators.field_validators.values():
        for name in validator.info.fields:
            per_key.setdefault(name, []).append(_doc(validator.func))
    shared = ModelSection.__pydantic_decorators__.model_validators
    inherited = shared if issubclass(section, ModelSection) and section is not SECTIONS["gpt"] else {}
    rules = [
        _doc(v.func) for n, v in decorators.model_validators.items() if n not in inherited and n != "_text_as_written"
    ]
    return per_key, rules


def _doc(func: Any) -> str:
    return " ".join((getattr(func, "__doc__", None) or "").split())


def config_reference() -> str:
    """Every config key, section by section, as markdown."""
    lines = [
        "# Config keys",
        "",
        "Generated from `src/meshrun/config/` at build time. Each key: its type, default, allowed values,",
        "what it means, and the check that refuses a bad value (the line `meshrun` prints, exit 2, before",
        "any worker starts). Set a key in a YAML file or with `--set key.path=value`.",
        "",
        _default_yaml_map(),
    ]
    for prefix, section, base in _sections():
        per_key, rules = _validators(section)
        title = prefix or "top-level keys"
        lines += ["", f"## {title}", ""]
        if section.__doc__ and section is not Config and not section.__doc__.startswith(("A config section", "Usage")):
            lines += [" ".join(section.__doc__.split()), ""]
        for name, field in _own_fields(prefix, section).items():
            lines += _key_entry(prefix, name, field, base, per_key.get(name, []))
        if rules:
            lines += ["", f"**Rules across the keys of {prefix or 'several sections'}:**", ""] + [
                f"- {r}" for r in rules if r
            ]
    return "\n".join(lines) + "\n"


def _key_entry(prefix: str, name: str, field: FieldInfo, base: dict[str, Any], checks: list[str]) -> list[str]:
    key = _key(prefix, name, field)
    default = "required" if field.default is PydanticUndefined else f"`{_plain(field.default)}`"
    facts = [f"type `{_type_text(field.annotation)}`", f"default {default}"]
    facts += [f"allowed {' and '.join(_bounds(field))}"] if _bounds(field) else []
    out = [f"### `{key}`", "", " · ".join(facts), "", " ".join((field.description or "").split()), ""]
    refusal = _refusal(base, prefix, name, field)
    out += [f"Refused: `{refusal}`", ""] if refusal else []
    out += [f"Checked: {check}", ""] if (check := " ".join(checks)) else []
    return out


def _plain(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{...}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(_plain, value))}]"
    return "none" if value is None else str(value)


def _default_yaml_map() -> str:
    """configs/default.yaml, key by key, each linked to its entry below."""
    data = yaml.safe_load(default_config_text())
    rows = ["## configs/default.yaml, key by key", "", "| key | value in the default job |", "|---|---|"]
    for section, keys in data.items():
        items = keys.items() if isinstance(keys, dict) else [(None, keys)]
        for key, value in items:
            dotted = f"{section}.{key}" if key else section
            rows.append(f"| [`{dotted}`](#{_anchor(dotted)}) | `{_plain(value)}` |")
    return "\n".join(rows)


def _anchor(key: str) -> str:
    """The id MkDocs (toc's default slugify) gives the heading `### \\`key\\``."""
    return "".join(ch for ch in key.lower() if ch.isalnum() or ch in "-_")


# ---- commands and flags --------------------------------------------------------------------


def _commands() -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every `meshrun` subcommand."""
    parser = build_parser()
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name) or "", sub


def _flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    yield from (a for a in parser._actions if not isinstance(a, argparse._HelpAction))


def cli_reference() -> str:
    """Every `meshrun` command and flag, as markdown."""
    lines = ["# Commands and flags", "", "Generated from `src/meshrun/cli/parser.py` at build time.", ""]
    for name, help_text, parser in _commands():
        lines += [f"## meshrun {name}", "", f"{help_text}.", "", f"```text\n{parser.format_usage().strip()}\n```", ""]
        lines += ["| argument | default | meaning |", "|---|---|---|"]
        for action in _flags(parser):
            value = (
                "" if action.nargs == 0 or not action.option_strings else f" {action.metavar or action.dest.upper()}"
            )
            names = (", ".join(action.option_strings) or action.metavar or action.dest) + value
            default = "" if action.default in (None, False, [], argparse.SUPPRESS) else f"`{action.default}`"
            choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices else ""
            required = " (required)" if action.required and action.option_strings else ""
            lines.append(f"| `{names}` | {default} | {(action.help or '').replace('|', '/')}{choices}{required} |")
        lines.append("")
    return "\n".join(lines)


# ---- what lacks a description --------------------------------------------------------------


def undocumented() -> list[str]:
    """Every config key, config check and command-line flag that has no description (empty: all do)."""
    missing = []
    for prefix, section, _ in _sections():
        per_key, rules = _validators(section)
        missing += [
            f"config key {_key(prefix, n, f)}" for n, f in _own_fields(prefix, section).items() if not f.description
        ]
        missing += [f"a check of config key {prefix}.{k}" for k, docs in per_key.items() if not all(docs)]
        missing += [f"a rule across the keys of {prefix or 'the config'}" for r in rules if not r]
    for name, help_text, parser in _commands():
        missing += [f"command meshrun {name}"] if not help_text else []
        missing += [f"flag {a.option_strings or a.dest} of meshrun {name}" for a in _flags(parser) if not a.help]
    return sorted(set(missing))


# ---- the MkDocs hook -----------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages (and bench/README.md) to the site; refuse to build with an undescribed key or flag."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    missing = undocumented()
    if missing:
        raise PluginError("no description (write a field docstring or a flag's help=): " + "; ".join(missing))
    for path, maker in _GENERATED.items():
        files.append(File.generated(config, path, content=globals()[maker]()))
    bench = Path(config["docs_dir"]).parent / "bench" / "README.md"
    files.append(File.generated(config, "benchmarks/details.md", content=bench.read_text()))
    return files
