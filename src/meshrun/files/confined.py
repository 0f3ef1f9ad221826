"""Paths named inside files from elsewhere (a safetensors index, a checkpoint manifest, a
dataset's meta.json) stay inside the folder that holds the file: an entry like
`../../etc/passwd`, an absolute path, or a symlink pointing out is refused, never opened.
"""

from __future__ import annotations

from pathlib import Path

from meshrun.errors import ConfigError


def confined(folder: Path, entry: str, *, source: Path, within: Path | None = None) -> Path:
    """`folder / entry`, resolved (symlinks followed), when it lies inside `folder` (or inside
    `within`, a wider folder the caller trusts, e.g. a hub cache whose snapshots link into its
    blobs/); else one line naming the file that lists the entry (`source`) and the entry
    (ConfigError, exit 2)."""
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise ConfigError(f"{source}: entry {entry!r} is not a file name; the file is damaged")
    root = (within or folder).resolve()
    try:
        path = (folder.resolve() / entry).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ConfigError(f"{source}: entry {entry!r} cannot be resolved ({exc}); the file is damaged") from None
    if not path.is_relative_to(root):
        raise ConfigError(
            f"{source}: entry {entry!r} leads outside {within or folder} (to {path}); "
            "meshrun reads only files inside that folder"
        )
    return path
