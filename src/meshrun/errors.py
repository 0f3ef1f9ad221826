"""Errors users can act on. The CLI prints them as one line: ConfigError exits 2, RunError 1."""


class ConfigError(ValueError):
    """A mistake in the user's config or command line: names the key and how to fix it."""


class RunError(RuntimeError):
    """A run that cannot go on (unreadable checkpoint, non-finite loss): says where and what to try."""

    exit_code = 1  # a subclass may say otherwise (a hang: launcher/hang.py)


class CheckpointError(RunError):
    """A checkpoint that cannot be read: names the file."""


class DamagedCheckpointError(CheckpointError):
    """A file differs from the manifest written at save time: missing, truncated or corrupt."""
