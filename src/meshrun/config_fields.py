"""Building blocks of the config schema, shared by config.py and layout.py: the section base and
number types that refuse YAML booleans."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


def no_bool(value: Any) -> Any:
    """YAML `true` is not the number 1: `steps: true` must not mean one step."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")  # noqa: TRY004 (pydantic reports ValueError)
    return value


def lowercase(value: Any) -> Any:
    """Choices are matched case-insensitively: `BF16` and `1F1B` mean bf16 and 1f1b."""
    return value.lower() if isinstance(value, str) else value


Int = Annotated[int, BeforeValidator(no_bool)]
Float = Annotated[float, BeforeValidator(no_bool)]


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
