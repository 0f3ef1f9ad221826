"""Building blocks of the config schema, shared by config.py and layout.py: the section base and
number types that refuse YAML booleans."""

from __future__ import annotations

import os
import types
from functools import cache
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, model_validator

from meshrun.config.safe_yaml import as_written, plain


def no_bool(value: Any) -> Any:
    """YAML `true` is not the number 1: `steps: true` must not mean one step."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")  # noqa: TRY004 (pydantic reports ValueError)
    return value


def is_text(annotation: Any) -> bool:
    """A field typed as text: str, str | None, list[str]."""
    if annotation is str:
        return True
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return is_text(args[0])
    if origin in (Union, types.UnionType):
        return any(is_text(a) for a in args) and all(is_text(a) or a is type(None) for a in args)
    return origin is list and all(is_text(a) for a in args)


def lowercase(value: Any) -> Any:
    """Choices are matched case-insensitively: `BF16` and `1F1B` mean bf16 and 1f1b."""
    return value.lower() if isinstance(value, str) else value


Int = Annotated[int, BeforeValidator(no_bool)]
Float = Annotated[float, BeforeValidator(no_bool)]
# A path key: a leading `~` is the user's home folder, for every path key alike (as a shell would
# expand it, which it does not inside YAML or after `--set key=`); environment variables are not expanded.
PathText = Annotated[str, AfterValidator(os.path.expanduser)]


class Section(BaseModel):
    """A config section: unknown keys are errors, every field has a docstring, assignments are checked."""

    # coerce_numbers_to_str: `--set run_dir=2024` or `tracker.name=42` are names, not numbers
    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        coerce_numbers_to_str=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _text_as_written(cls, data: Any) -> Any:
        """Keys typed as text take numbers as the user wrote them (`run_dir: 2024_01`, `0123`), not
        as YAML 1.1 reads them (202401, 83): see safe_yaml.WrittenInt."""
        if not isinstance(data, dict):
            return data
        text_keys, free_keys = _text_fields(cls), _free_form_fields(cls)
        return {
            key: as_written(value) if key in text_keys else plain(value) if key in free_keys else value
            for key, value in data.items()
        }


@cache
def _text_fields(section: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in section.model_fields.items() if is_text(field.annotation))


@cache
def _free_form_fields(section: type[BaseModel]) -> frozenset[str]:
    """Fields of arbitrary mappings (kept as given, so their numbers are made plain here)."""
    return frozenset(
        name
        for name, field in section.model_fields.items()
        if dict in (get_origin(field.annotation), *map(get_origin, get_args(field.annotation)))
    )
