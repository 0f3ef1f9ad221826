"""meshrun's workers are forked from a preloaded server (meshrun.launcher.forked): the one place
meshrun reaches into torchrun's module, checked against the installed torch; a real launch's
workers are seen forked in tests/launcher/test_lifetime.py, and every multi-rank test trains
through them."""

from __future__ import annotations

import dataclasses
import inspect

import torch.distributed.launcher.api as launcher_api
import torch.distributed.run as torchrun_module

from meshrun.launcher.forked import MESHRUN_WORKER


def test_torchruns_main_launches_through_its_modules_elastic_launch() -> None:
    """fork_meshrun_workers swaps `torch.distributed.run.elastic_launch`: torchrun's `run` must
    still call it by that name, with the worker command `config_from_args` builds for `-m meshrun`."""
    assert torchrun_module.elastic_launch is launcher_api.elastic_launch
    assert "elastic_launch(" in inspect.getsource(torchrun_module.run)
    args = torchrun_module.parse_args(["--standalone", "--nproc-per-node=2", "-m", "meshrun", "train"])
    _, entrypoint, cmd_args = torchrun_module.config_from_args(args)
    assert [entrypoint, *cmd_args] == [torchrun_module.sys.executable, *MESHRUN_WORKER, "train"]


def test_a_launch_config_takes_a_start_method() -> None:
    assert "start_method" in {field.name for field in dataclasses.fields(launcher_api.LaunchConfig)}
