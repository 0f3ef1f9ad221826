"""JSON files meshrun did not necessarily write (a checkpoint's manifest and config, a dataset's
meta.json, a model folder's config.json): read with the size bounded before reading and every way
the content can be wrong reported as a ValueError, which each caller turns into its one line.
(`json.loads` raises RecursionError, not ValueError, on deeply nested input.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 * 2**20  # far above any config, manifest or index meshrun or transformers writes


def read_json(path: Path, *, limit: int = MAX_JSON_BYTES) -> Any:
    """The parsed content of `path`; ValueError when it is over `limit` bytes, not UTF-8, not JSON,
    or nested too deeply to parse. OSError (missing, unreadable) as it is."""
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path.name} is {size} bytes, over the {limit // 2**20} MiB a JSON file here may have")
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        raise ValueError(f"{path.name} is nested too deeply to be a JSON file meshrun reads") from None
