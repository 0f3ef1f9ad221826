"""Numeric series for regression: columns of .csv / .parquet files, standardised, cut into windows
of `seq_len` past values that predict the next `horizon` values.

Each file is one series (its rows in time order; several columns are one multivariate series), and
windows never cross files. Validation is the tail of each series: the last
max(horizon, val_fraction x rows) rows are the targets of validation windows (whose inputs may
reach back into the training rows, as a forecast from the present would), and training windows end
before them. Each column is standardised with the mean and standard deviation of the training rows
only (nothing of the validation tail leaks into training), stored in meta.json to turn forecasts
back into the data's units.

Layout (meta.json "format" and "task": "regression"): `values.bin`, little-endian float32
(rows x columns, the series end to end, standardised); meta.json lists each series' rows, offset
and first validation row, the columns, their mean and std, and the seq_len and horizon checked.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.prepare import _check_out, publishing
from meshrun.data.tables import column_names, table_files, table_rows
from meshrun.errors import ConfigError
from meshrun.files.confined import confined

VALUE_DTYPE = np.dtype("<f4")
EXAMPLE_COLUMNS: tuple[str, ...] = ("load", "temperature")  # example_series's columns
_HINT = "pass --columns (and --time-column) naming its columns"


@dataclass(frozen=True)
class Series:
    source: Path
    values: np.ndarray  # (rows, columns) float64, in the file's units


def read_series(
    sources: Sequence[str], *, columns: Sequence[str], time_column: str | None
) -> tuple[list[Series], list[str]]:
    """(one series per file, the value columns). `columns` empty: every column but the time column.
    A value that is not a finite number, or a time not after the previous row's, is refused at its row."""
    files = table_files(sources)
    if any(path.name.lower().endswith((".jsonl", ".jsonl.gz")) for path in files):
        raise ConfigError("--task regression reads .csv or .parquet files (a column per series); convert the .jsonl")
    if not columns:
        columns = [name for name in column_names(files[0]) if name != time_column]
        if not columns:
            raise ConfigError(f"{files[0]} has no value columns besides the time column; {_HINT}")
    series = []
    for path in files:
        rows = list(series_rows(path, columns=columns, time_column=time_column, hint=_HINT))
        series.append(Series(path, np.array(rows, dtype=np.float64).reshape(len(rows), len(columns))))
    return series, list(columns)


def series_rows(path: Path, *, columns: Sequence[str], time_column: str | None, hint: str) -> Iterator[list[float]]:
    """Each row's values of `columns`, in time order: a value that is not a finite number, or a time
    not after the previous row's, refused at its row (`hint`: which flag names a missing column)."""
    previous = None
    for where, cells in table_rows(path, [*columns, *([time_column] if time_column else [])], hint=hint):
        values = [_number(cell, where, name) for cell, name in zip(cells, columns)]
        if time_column:
            previous = _time(cells[-1], where, time_column, previous)
        yield values


def recent_rows(path: Path, meta: dict[str, Any], *, count: int) -> np.ndarray:
    """The last `count` rows of a table with a prepared folder's columns (its meta.json), standardised
    as they were: (count, columns) float32. Every row is checked as prepare-data checks it; only
    `count` rows are held, however long the file."""
    try:
        columns, time_column = [str(c) for c in meta["columns"]], meta.get("time_column")
        mean, std = np.array(meta["mean"], dtype=np.float64), np.array(meta["std"], dtype=np.float64)
        if (
            mean.shape != (len(columns),)
            or std.shape != mean.shape
            or not (np.isfinite(mean).all() and (std > 0).all())
        ):
            raise ValueError("its mean and std are not one finite number per column")
        if time_column is not None and not isinstance(time_column, str):
            raise ValueError(f"time_column {time_column!r} is no column name")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the data card's meta.json does not describe its columns ({exc}); it is damaged") from None
    trained = ", ".join(columns) + (f" and time column {time_column}" if time_column else "")
    hint = f"the model reads the columns it was trained on ({trained})"
    rows = collections.deque(series_rows(path, columns=columns, time_column=time_column, hint=hint), maxlen=count)
    if len(rows) < count:
        raise ConfigError(
            f"{path} has {len(rows)} rows; the model reads the last model.seq_len = {count}: give at least {count} rows"
        )
    return ((np.array(rows, dtype=np.float64) - mean) / std).astype(np.float32)


def _number(cell: Any, where: str, column: str) -> float:
    """A cell as a finite float; text that is no number, an empty cell, NaN or inf is refused."""
    try:
        value = float(cell) if not isinstance(cell, bool) and cell is not None and str(cell).strip() else None
    except (TypeError, ValueError):
        value = None
    if value is None:
        shown = "an empty cell" if cell is None or not str(cell).strip() else repr(cell)
        raise ConfigError(f"{where}: column {column!r} holds {shown}, not a number; fix or drop the row")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: column {column!r} is {value} (not finite); fill in a value or drop the row")
    return value


def _time(cell: Any, where: str, column: str, previous: Any) -> Any:
    """A time (a number, an ISO date or datetime) after the previous row's: rows must be in time order."""
    if isinstance(cell, (int, float, datetime)) and not isinstance(cell, bool):
        value = cell
    else:
        try:
            value = float(cell) if _numeric_text(cell) else datetime.fromisoformat(str(cell).strip())
        except ValueError:
            raise ConfigError(
                f"{where}: time column {column!r} holds {cell!r}, neither a number nor an ISO date (2024-01-31)"
            ) from None
    try:
        in_order = previous is None or value > previous
    except TypeError:  # a number after a date, or a date with a zone after one without
        raise ConfigError(f"{where}: time column {column!r} mixes kinds of time ({cell!r}); use one") from None
    if not in_order:
        raise ConfigError(
            f"{where}: time {cell!r} in column {column!r} is not after the previous row's; sort the rows by time "
            "(each file is one series)"
        )
    return value


def _numeric_text(cell: Any) -> bool:
    try:
        float(str(cell))
    except ValueError:
        return False
    return True


def held_out_rows(num_rows: int, *, horizon: int, val_fraction: float) -> int:
    """Rows at the end of a series whose values only validation windows predict."""
    return max(horizon, round(num_rows * val_fraction))


def check_lengths(series: list[Series], *, seq_len: int, horizon: int, val_fraction: float) -> None:
    """Each series holds a training window and a validation window."""
    need = seq_len + horizon
    for one in series:
        rows = len(one.values)
        held = held_out_rows(rows, horizon=horizon, val_fraction=val_fraction)
        if rows < need:
            raise ConfigError(
                f"{one.source} has {rows} rows, fewer than seq_len + horizon = {seq_len} + {horizon}; "
                "add rows, or lower --seq-len / --horizon"
            )
        if rows - held < need:
            raise ConfigError(
                f"{one.source} has {rows} rows: after its last {held} rows are held out for validation, "
                f"{rows - held} remain, fewer than seq_len + horizon = {need} for one training window; "
                "add rows, or lower --seq-len / --horizon / --val-fraction"
            )


def prepare_regression(
    series: list[Series],
    columns: list[str],
    out: str | Path,
    *,
    seq_len: int,
    horizon: int,
    val_fraction: float = 0.05,
    time_column: str | None = None,
) -> dict[str, Any]:
    """Standardise and store `series` in a new folder `out` (atomically); returns meta.json."""
    out = Path(out)
    check_lengths(series, seq_len=seq_len, horizon=horizon, val_fraction=val_fraction)
    cuts = [len(s.values) - held_out_rows(len(s.values), horizon=horizon, val_fraction=val_fraction) for s in series]
    training = np.concatenate([s.values[:cut] for s, cut in zip(series, cuts)])
    mean, std = training.mean(axis=0), training.std(axis=0)
    flat = [name for name, spread in zip(columns, std) if not spread > 0]
    if flat:
        raise ConfigError(
            f"column {flat[0]!r} is constant over the training rows: it predicts nothing; drop it from --columns"
        )
    _check_out(out)
    root = Path(os.path.commonpath([one.source.parent for one in series]))
    records, offset = [], 0
    with publishing(out) as staging:
        with open(staging / "values.bin", "wb") as f:
            for one, cut in zip(series, cuts):
                f.write(((one.values - mean) / std).astype(VALUE_DTYPE).tobytes())
                records.append(
                    {
                        "source": one.source.relative_to(root).as_posix(),
                        "rows": len(one.values),
                        "offset": offset,
                        "val_start": cut,
                    }
                )
                offset += len(one.values)
        meta = {
            "format": "regression",
            "task": "regression",
            "dtype": VALUE_DTYPE.str,
            "columns": columns,
            "time_column": time_column,
            "mean": mean.tolist(),
            "std": std.tolist(),
            "seq_len": seq_len,
            "horizon": horizon,
            "rows": offset,
            "series": records,
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


class Windows:
    """The (inputs, targets) windows of one split of a prepared folder, standardised: window k is
    `seq_len` rows of one series and the `horizon` rows after them; train windows' targets end before
    their series' validation rows, val windows' targets lie in them."""

    def __init__(self, folder: str | Path, split: str, meta: dict[str, Any], *, seq_len: int, horizon: int) -> None:
        folder = Path(folder)
        try:
            num_columns, num_rows = len(meta["columns"]), int(meta["rows"])
            path = confined(folder, "values.bin", source=folder / "meta.json")
            if path.stat().st_size != num_rows * num_columns * VALUE_DTYPE.itemsize:  # sized before it is mapped
                raise ValueError(
                    f"values.bin is {path.stat().st_size} bytes, not {num_rows} rows x {num_columns} float32"
                )
            self.values = np.memmap(path, dtype=VALUE_DTYPE, mode="r", shape=(num_rows, num_columns))
            spans = [(int(s["offset"]), int(s["rows"]), int(s["val_start"])) for s in meta["series"]]
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise ConfigError(
                f"{folder / 'meta.json'} does not describe its values ({exc}); prepare the data again"
            ) from None
        self.seq_len, self.horizon = seq_len, horizon
        starts: list[np.ndarray] = []  # each window's first row, in values.bin
        for offset, rows, val_start in spans:
            first_target = np.arange(seq_len, rows - horizon + 1)  # the row each window's targets start at
            keep = first_target + horizon <= val_start if split == "train" else first_target >= val_start
            starts.append(offset + first_target[keep] - seq_len)
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        if not len(self.starts):
            raise ConfigError(
                f"{folder} has no {split} window of seq_len {seq_len} + horizon {horizon}; prepare it for these lengths"
            )

    def __len__(self) -> int:
        return len(self.starts)

    def window(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs (seq_len, columns), targets (horizon, columns)) of window k."""
        start = int(self.starts[k])
        rows = self.values[start : start + self.seq_len + self.horizon]
        return rows[: self.seq_len], rows[self.seq_len :]


def example_series(num_rows: int = 3000) -> Series:
    """The no-download regression example, generated (seeded, the same on every machine): a daily
    `load` with a yearly and a weekly cycle, a slow trend and AR(1) noise, and a `temperature` that
    follows the yearly cycle with its own noise. Forecasting `load` beats repeating the last value
    only by learning the cycles."""
    import random

    rng = random.Random(1337)
    rows, noise = [], 0.0
    for day in range(num_rows):
        year, week = math.sin(2 * math.pi * day / 365.25), math.sin(2 * math.pi * day / 7)
        noise = 0.7 * noise + rng.gauss(0.0, 1.0)
        temperature = 12 + 9 * year + rng.gauss(0.0, 1.5)
        rows.append([100 + 0.01 * day - 15 * year + 8 * week + 2 * noise, temperature])
    return Series(Path("generated"), np.array(rows, dtype=np.float64))
