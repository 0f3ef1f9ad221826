"""The torch meshrun is tested with, checked at start: DCP's pickled metadata classes and the
pipelining internals meshrun relies on change between torch releases, so an untested torch
fails later in confusing ways (or loads a checkpoint differently)."""

from __future__ import annotations

import importlib.metadata
import re

from meshrun.errors import ConfigError

SUPPORTED_TORCH = (2, 13)  # (major, minor); pyproject.toml declares the same: torch>=2.13,<2.14
TORCH_REQUIREMENT = f"torch>={SUPPORTED_TORCH[0]}.{SUPPORTED_TORCH[1]},<{SUPPORTED_TORCH[0]}.{SUPPORTED_TORCH[1] + 1}"


def check_torch_version(version: str) -> None:
    """Refuse a torch outside the tested range; `version` as pip reports it (e.g. 2.13.0+cu128)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) != SUPPORTED_TORCH:
        raise ConfigError(
            f"torch {version} is not supported: meshrun is tested with {TORCH_REQUIREMENT}; "
            f"install it with `pip install '{TORCH_REQUIREMENT}'` (the CUDA build for your GPUs)"
        )


def installed_torch_version() -> str:
    """The installed torch's version from its package metadata, without importing torch (slow)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"torch is not installed; install it with `pip install '{TORCH_REQUIREMENT}'`") from None


def installed_versions() -> dict[str, str]:
    """torch and meshrun versions, recorded in every checkpoint's manifest."""
    from meshrun import __version__

    return {"torch": installed_torch_version(), "meshrun": __version__}
