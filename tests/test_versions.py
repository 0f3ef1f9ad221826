"""The supported torch range: one declaration (pyproject.toml), one check at start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, meshrun_env, run_meshrun

from meshrun.errors import ConfigError
from meshrun.versions import (
    TORCH_REQUIREMENT,
    check_torch_version,
    installed_torch_version,
)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cu128", "2.13.0+cpu", "2.13.0a0+git1234abc"])
def test_tested_torch_passes(version: str) -> None:
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "2.6.0+cpu", "2.1.3", "3.13.0", "1.13.0", "nightly"])
def test_other_torch_is_refused_with_the_range(version: str) -> None:
    with pytest.raises(ConfigError, match=rf"torch {re.escape(version)} is not supported: .*torch>=2\.13,<2\.14"):
        check_torch_version(version)


def test_the_installed_torch_is_the_declared_one() -> None:
    check_torch_version(installed_torch_version())
    assert f'"{TORCH_REQUIREMENT}"' in (REPO / "pyproject.toml").read_text()


def test_cli_checks_the_installed_torch_before_anything_else(tmp_path: Path) -> None:
    """A torch 2.6 distribution first on the path: what importlib.metadata (and pip) then report."""
    site = tmp_path / "site"
    (site / "torch-2.6.0.dist-info").mkdir(parents=True)
    (site / "torch-2.6.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.6.0\n")
    env = meshrun_env(tmp_path)
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    result = run_meshrun(["train", "--dry-run"], tmp_path=tmp_path, env=env, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.count("\n") == 1 and "torch 2.6.0 is not supported" in result.stderr
