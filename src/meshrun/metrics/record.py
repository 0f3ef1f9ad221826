"""A run's record read back (metrics.jsonl, summary.json) and the whole-run figures drawn from it.

Readers (`meshrun report`, `plan --run`, a resumed run's summary and loss.png) take what a crash
leaves: a last line cut short mid-write is skipped with a warning naming the file and the line.
Anything else that is not what meshrun writes is refused in one line naming the file: a figure
computed from it would be wrong without saying so.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from meshrun.errors import ConfigError
from meshrun.files.console import say
from meshrun.files.json_reader import read_json
from meshrun.parallel.layout import PLACE_AXES

LARGEST_COUNT = 2**63  # meshrun's counts are int64; a larger integer is no count it wrote
STRAGGLER = ("straggler/rank", "straggler/pp", "straggler/dp", "straggler/ratio")  # written together
TEXT_KEYS = ("recovered_ranks",)  # the only words in a row: a recovery event's ranks ("0", "1, 3")
MAX_TEXT = 200


def _is_value(key: str, value: Any) -> bool:
    """A number meshrun could have written, or, under TEXT_KEYS, a short line of text."""
    if key in TEXT_KEYS:
        return isinstance(value, str) and len(value) <= MAX_TEXT and value.isprintable()
    return _is_number(value)


def _is_number(value: Any) -> bool:
    """A JSON number meshrun could have written: no bool, no integer beyond a float's range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, float) or abs(value) < LARGEST_COUNT


def _is_duration_or_share(key: str) -> bool:
    """Keys whose value is seconds, a rate or a ratio the report sums and divides: finite, >= 0
    (a loss may be NaN or inf: a diverged run logs it)."""
    return key.startswith(("time/", "straggler/")) or key.endswith("_s")


def _row_problem(row: Any) -> str | None:
    """Why a parsed line is not a metrics row (a step count and numbers), or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < LARGEST_COUNT:
        return f"step {_shown(step)} is not a step count"
    bad = next((key for key, value in row.items() if not _is_value(key, value)), None)
    if bad is not None:
        return f"{_shown(bad)} is {_shown(row[bad])}, not a number"
    bad = next((k for k, v in row.items() if _is_duration_or_share(k) and not 0 <= v < math.inf), None)
    if bad is not None:
        return f"{_shown(bad)} is {_shown(row[bad])}, not a finite number >= 0"
    missing = [key for key in STRAGGLER if key not in row]
    if len(missing) < len(STRAGGLER) and missing:
        return f"{missing[0]} is missing beside the other straggler/ values"
    bad = next((key for key in STRAGGLER[:3] if key in row and not isinstance(row[key], int)), None)
    return None if bad is None else f"{bad} is {_shown(row[bad])}, not a rank or index"


def _shown(value: Any) -> str:
    """A value from a file, for a one-line message: escaped (no control characters) and short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_metrics_rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows in file order ([] when there is none)."""
    if not path.is_file():
        return []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # the last is "" after a complete row
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); pass a run directory meshrun wrote") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
            if number == len(lines) and isinstance(exc, json.JSONDecodeError):  # no newline: cut short mid-write
                say(f"warning: {path} line {number} is cut short (a run stopped or still writing); skipped")
                continue
            why = (
                f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
                if isinstance(exc, json.JSONDecodeError)
                else type(exc).__name__
            )
            raise ConfigError(f"{path} line {number} is not JSON ({why}); fix or remove that line") from None
        if problem := _row_problem(row):
            raise ConfigError(f"{path} line {number} is not a metrics row meshrun wrote ({problem}); fix or remove it")
        rows.append(row)
    return rows


class SummaryRecord(BaseModel):
    """The summary.json fields readers use, with their types; other fields are kept as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    steps: int | None = None
    final_loss: float | None = None
    final_val_loss: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None
    peak_memory_gb_per_stage: list[float] | None = None
    bubble: float | None = None
    layout: str | None = None
    precision: str | None = None
    measured_from_step: int | None = None


def read_summary(path: Path) -> dict[str, Any] | None:
    """summary.json as written (None: the run has not completed)."""
    if not path.is_file():
        return None
    fix = "move it aside (the run is then reported as not finished)"
    try:
        summary = read_json(path)
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path} is not a summary meshrun wrote ({type(exc).__name__}: {exc}); {fix}") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{path} is not a summary meshrun wrote (a JSON {type(summary).__name__}); {fix}")
    try:
        SummaryRecord.model_validate(summary)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ConfigError(f"{path} is not a summary meshrun wrote ({where}: {error['msg'].lower()}); {fix}") from None
    return summary


def run_totals(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Whole-run figures from every row (all segments of a resumed run): tokens/s, TFLOP/s and MFU
    over every log window but the first (it pays for warm-up: allocations, pipeline shape
    inference), weighted by each window's training seconds; those seconds and the seconds spent
    in validation and checkpoints (never part of a window), in total; the peak memory."""
    windows = [row for row in rows if "train_s" in row]
    timed = windows[1:] or windows
    seconds = sum(row["train_s"] for row in timed)
    totals: dict[str, float] = {}
    for key in ("tokens_per_s", "tflops", "mfu"):
        if timed and seconds > 0 and all(key in row for row in timed):
            totals[key] = sum(row[key] * row["train_s"] for row in timed) / seconds
    totals["train_s"] = sum(row["train_s"] for row in windows)
    totals["eval_s"] = sum(row.get("eval_s", 0.0) for row in rows)
    totals["checkpoint_s"] = sum(row.get("checkpoint_s", 0.0) for row in rows)
    if memory := [row["memory_gb"] for row in windows if "memory_gb" in row]:
        totals["peak_memory_gb"] = max(memory)
    return totals


def time_split_totals(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each part's share of the time of every rank over every logged window ({}: a run from before
    the time split). Keys are the parts (data, compute, wait, ...)."""
    seconds: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("time/rank") and key.endswith("_s"):
                part = key.rsplit("/", 1)[1].removesuffix("_s")
                seconds[part] = seconds.get(part, 0.0) + value
    total = sum(seconds.values())
    return {part: s / total for part, s in seconds.items()} if total > 0 else {}


def slowest_rank(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The rank slowest in the most logged windows: its rank, its index on each axis the rows record
    (dp, tp, pp; runs from before tp was recorded hold dp and pp), in how many windows of how many,
    and its median compute ratio to the median rank over those (None: never measured)."""
    named = [row for row in rows if "straggler/rank" in row]
    if not named:
        return None
    ranks = [row["straggler/rank"] for row in named]
    rank = max(set(ranks), key=ranks.count)
    mine = [row for row in named if row["straggler/rank"] == rank]
    return {
        "rank": rank,
        **{axis: mine[0][f"straggler/{axis}"] for axis in PLACE_AXES if f"straggler/{axis}" in mine[0]},
        "windows": len(mine),
        "of": len(named),
        "ratio": statistics.median(row["straggler/ratio"] for row in mine),
    }
