"""Which checkpoint a run resumes from, and what it says when none can be: the checks the launcher
runs before any worker and the trainer's reading of a checkpoint's recorded layout and length."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from meshrun.checkpoint.dcp import read_manifest, verify
from meshrun.checkpoint.paths import (
    CONFIG,
    MANIFEST,
    checkpoint_root,
    complete_checkpoints,
    newest_first,
    resume_candidates,
    step_of,
)
from meshrun.checkpoint.safe_reader import SafeReader
from meshrun.errors import CheckpointError, ConfigError, DamagedCheckpointError
from meshrun.files.json_reader import read_json
from meshrun.models.lora import check_same_base, is_adapter
from meshrun.parallel.layout import Layout
from meshrun.versions import installed_versions


def unloadable_reason(path: Path, error: CheckpointError) -> str:
    """Why a checkpoint did not load, telling another torch / meshrun apart from a damaged file."""
    try:
        written = read_json(path / MANIFEST).get("versions")
    except (OSError, ValueError, AttributeError):
        written = None
    here = installed_versions()
    if isinstance(error, DamagedCheckpointError):
        return str(error)
    if isinstance(written, dict) and written != here:

        def show(v: dict) -> str:
            return f"torch {v.get('torch')} / meshrun {v.get('meshrun')}"

        return (
            f"it was written by {show(written)}, this is {show(here)} ({error}); resume with the versions that wrote it"
        )
    if written is None:
        return f"{error} (written by an older meshrun that recorded no versions)"
    return str(error)


def no_checkpoint_loads(run_dir: str | Path, failures: list[tuple[Path, CheckpointError]]) -> ConfigError:
    """The error when checkpoints exist but none loads: a fresh start must be asked for."""
    first, error = failures[0]
    return ConfigError(
        f"none of the {len(failures)} checkpoints in {checkpoint_root(run_dir)} loads; the one saved last, "
        f"{first.name}, does not: {unloadable_reason(first, error)}. Nothing was changed. To start from step 0 on purpose, "
        f"set a new run_dir (or move {checkpoint_root(run_dir)} aside)"
    )


def check_resumable(
    run_dir: str | Path, resume: str, model: nn.Module, *, base: dict[str, str] | None = None
) -> Path | None:
    """Before spawning workers: the checkpoint to resume from verifies and fits `model` (a meta-device
    model: only names and shapes are compared), so a run that cannot resume stops here. Returns
    that checkpoint (None: there is none to resume). `base`: a LoRA run's frozen base
    (models.lora.base_identity): only the adapters are compared, and a checkpoint trained on other
    weights is refused (not passed over for an older one: they all are)."""
    failures: list[tuple[Path, CheckpointError]] = []
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if base is None or is_adapter(name)}
    for path in resume_candidates(run_dir, resume):
        try:
            verify(path)
            if base is not None:
                fix = "set model.hf to the folder they were trained on, or start a new run_dir"
                check_same_base(path, read_manifest(path).get("base"), base, fix=fix)
            saved = SafeReader(path).read_metadata().state_dict_metadata
            for name, shape in shapes.items():
                if name not in saved or tuple(getattr(saved[name], "size", ())) != shape:
                    raise CheckpointError(
                        f"checkpoint {path} holds no {name} of shape {list(shape)}; it is of another model"
                    )
            return path
        except CheckpointError as exc:
            failures.append((path, exc))
    if failures and resume == "auto":
        raise no_checkpoint_loads(run_dir, failures)
    if failures:  # the last candidate is the checkpoint train.resume names
        raise ConfigError(f"train.resume {resume}: {unloadable_reason(*failures[-1])}")
    return None


def newer_than(run_dir: str | Path, step: int) -> tuple[Path, ...]:
    """The run's complete checkpoints after `step` (what a resume from `step` must not delete)."""
    return tuple(p for p in complete_checkpoints(run_dir) if step_of(p) > step)


def saved_degrees(path: Path) -> dict[str, int] | None:
    """The mesh degrees by axis (as Layout.mesh_degrees names them: pp, dp, then any later axis, each
    also its config key) of the job that wrote a checkpoint (None if its config is unreadable): they
    alone place ranks at coordinates, and a rank's RNG state continues only on the rank at the same
    coordinates (tp ranks share a dropout stream). An axis the writer's config lacks had degree 1."""
    try:
        parallel = read_json(Path(path) / CONFIG)["parallel"]
        names = Layout().mesh_degrees
        return {axis: int(parallel[axis] if axis in ("pp", "dp") else parallel.get(axis, 1)) for axis in names}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_train_steps(path: Path) -> int | None:
    """train.steps of the job that wrote a checkpoint, the length its lr schedule had (None if unreadable)."""
    try:
        return int(read_json(Path(path) / CONFIG)["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_dir(run_or_checkpoint: str | Path) -> Path:
    """A checkpoint folder given itself or a run directory (the checkpoint a rerun would resume)."""
    path = Path(run_or_checkpoint)
    if (path / MANIFEST).is_file():
        return path
    found = newest_first(path)
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint folder nor a run directory with checkpoints")
    return found[0]
