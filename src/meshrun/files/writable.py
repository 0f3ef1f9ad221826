"""Whether a new file can go where a user points: probed with a real file, found before any work."""

from __future__ import annotations

import tempfile
from pathlib import Path

from meshrun.errors import ConfigError


def check_writable(folder: Path, key: str = "run_dir") -> None:
    """The folder `key` names (or the nearest folder above it that exists) takes a new file."""
    existing, refused = nearest_writable(folder)
    if not existing.is_dir():
        raise ConfigError(f"{key} {folder} lies under {existing}, which is a file; set {key} to a folder path")
    if refused:
        raise ConfigError(
            f"{key} {folder} is not writable ({existing}: {refused}); "
            f"fix its permissions or set {key} to a writable folder"
        )


def nearest_writable(path: Path) -> tuple[Path, str | None]:
    """The nearest path at or above `path` that exists, and why a new file cannot go there (None: it
    can). Probed with a real file: permission bits say nothing for root, and a read-only mount
    refuses root too."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return existing, "not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            return existing, None
    except OSError as exc:
        return existing, exc.strerror or "cannot be written"


def check_writable_parent(flag: str, out: str) -> None:
    """The nearest existing folder above `out` (a path that does not exist yet) takes a new file."""
    folder, refused = nearest_writable(Path(out).absolute().parent)
    if not folder.is_dir():
        raise ConfigError(f"{flag} {out}: {folder} is a file, not a folder; choose another {flag}")
    if refused:
        raise ConfigError(f"{flag} {out}: {folder} is not writable; choose another {flag}")
