"""Writing files so a reader sees the old bytes or the new ones, never a fragment.

The one helper every file meshrun writes into a run, data or output folder goes through: a
temporary name unique to this process and call (two jobs, or two ranks, never share one), flushed
to disk, renamed over the target, the folder entry made durable. A failed write removes its own
temporary file and leaves the target as it was; a full disk is one line naming the file and the
device, not a traceback. Every file gets the mode a plain `open` gives it (umask respected),
whatever mode the writer gave its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from meshrun.errors import RunError


def temporary_name(path: Path) -> Path:
    """A sibling name no other process or call uses: `.NAME.PID.RANDOM.tmp`."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_atomic(path: str | Path, data: str | bytes, *, replace: bool = True) -> Path:
    """Replace `path` with `data` in one rename; on any failure the old file stays untouched.
    `replace=False`: a new file only (see atomic_target)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    with atomic_target(path, replace=replace) as tmp, open(tmp, "wb") as file:
        file.write(payload)
    return path


@contextlib.contextmanager
def atomic_target(path: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """A temporary path to write `path`'s new content to (by any writer: savefig, save_file, ...);
    it replaces `path` only when the block ends without an error. `replace=False`: an output the
    user named, never written over, even one that appeared while this was being written
    (FileExistsError)."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        os.chmod(tmp, new_file_mode())  # a writer's own temporary mode (safetensors': 0600) is not the file's
        _fsync(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
        _fsync_folder(path.parent)
    except OSError as err:
        _remove(tmp)
        raise disk_error(err, path) from err
    except BaseException:
        _remove(tmp)
        raise


def new_file_mode() -> int:
    """The mode `open` gives a new file under this process's umask (0644 under the usual 022).
    Read from /proc where it exists: setting the umask to read it races other threads' writes."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def publish_folder(tmp: Path, final: Path) -> Path:
    """Rename the fully written folder `tmp` to `final` (absent, or an empty folder), every file in
    it made durable first: a reader sees all of it or nothing, even after a power cut. A folder
    with anything in it is never replaced (the rename fails)."""
    try:
        for path in sorted(tmp.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # files before folders
            _fsync_folder(path) if path.is_dir() else _fsync(path)
        _fsync_folder(tmp)
        os.rename(tmp, final)
        _fsync_folder(final.parent)
    except OSError as err:
        raise disk_error(err, final) from err
    return final


class DiskFull(RunError):
    """No space left (or over quota) while writing a file: one line naming the device and the file."""


def disk_error(err: OSError, path: Path) -> OSError | DiskFull:
    """A full disk (or quota) as one line naming the device and the file; other errors as they are."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on {device_of(path)} while writing {path}")
    return err


def device_of(path: Path) -> str:
    """The mount point holding `path` (what `df` names), for messages about a full disk."""
    probe = path.resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    while not os.path.ismount(probe) and probe != probe.parent:
        probe = probe.parent
    return str(probe)


def _link_new(tmp: Path, path: Path) -> None:
    """`tmp` becomes `path` unless `path` exists: a hard link fails then, in one step."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links on this filesystem (FAT, some network mounts): look, then rename
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    _remove(tmp)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder; the rename stands
        _fsync(folder)


def _remove(tmp: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
