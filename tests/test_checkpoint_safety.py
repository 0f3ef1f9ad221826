"""Checkpoints never choose code to run, never reach outside their folder, and a run whose
checkpoints all fail to load stops without changing anything (no silent restart from step 0)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import meshrun_env, meshrun_in_process, run_meshrun, tiny, train_job
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from meshrun.checkpoint.dcp import _crc32, full_model_state, load, verify
from meshrun.config.schema import Config
from meshrun.errors import CheckpointError, ConfigError
from meshrun.launcher.run_lock import LOCK
from meshrun.models.families import build_model

STEPS = {"train.steps": 12, "checkpoint.interval": 4, "checkpoint.keep": 3}
CKPTS = ("step-00000004", "step-00000008", "step-00000012")


@pytest.fixture(scope="module")
def finished(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-process run with checkpoints at steps 4, 8 and 12."""
    run = tmp_path_factory.mktemp("safety") / "run"
    train_job(tiny(data_dir, run, **STEPS), tmp_path=run.parent)
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but the job lock's, which each launch rewrites with its own pid."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK)
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def forge(ckpt: Path, name: str, target: Path | None = None) -> None:
    """Make the manifest agree with the file now at `name` (or with `target`): an attacker's copy."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    source = target or ckpt / name
    manifest["files"][name] = {"bytes": source.stat().st_size, "crc32": _crc32(source)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def meta_model(run: Path, **model: object) -> torch.nn.Module:
    cfg = Config.model_validate(json.loads((run / "config.json").read_text()))
    return build_model(cfg.model.model_copy(update=model))


# ---- item 2: no code from a checkpoint, nothing read from outside it -------------------------------


@pytest.fixture
def planted(finished: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint folder carrying a module and a config.json naming it (manifest forged to match)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(finished / "checkpoints" / CKPTS[-1], ckpt)
    marker = tmp_path / "code-ran"
    (ckpt / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom meshrun.models.gpt import GPT as build\n"
    )
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["factory"] = "planted:build"
    (ckpt / "config.json").write_text(json.dumps(config))
    forge(ckpt, "config.json")
    return ckpt, marker


@pytest.mark.parametrize("command", [["sample", ".", "--tokens", "4"], ["export", ".", "--out", "../m.safetensors"]])
def test_checkpoint_named_factory_is_not_imported(command: list[str], planted: tuple[Path, Path]) -> None:
    ckpt, marker = planted  # run from inside the folder, which is on PYTHONPATH: the module is importable
    result = run_meshrun(command, tmp_path=ckpt, env=meshrun_env(ckpt, PYTHONPATH=str(ckpt)), check=False, timeout=120)
    assert not marker.exists(), "the checkpoint's module was imported"
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "planted:build" in result.stderr and "--trust-code" in result.stderr


def test_factory_runs_when_the_user_names_it(planted: tuple[Path, Path]) -> None:
    ckpt, marker = planted
    result = run_meshrun(  # a factory's module is found on PYTHONPATH (the working folder is not searched)
        ["sample", ".", "--tokens", "4", "--set", "model.factory=planted:build"],
        tmp_path=ckpt,
        env=meshrun_env(ckpt, PYTHONPATH=str(ckpt)),
        timeout=120,
    )
    assert marker.exists() and result.stdout.startswith("def ")


@pytest.mark.parametrize("entry", ["../../outside.bin", "/etc/hostname", "sub/../../x"])
def test_manifest_entries_outside_the_folder_are_refused(entry: str, finished: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "a" / "ckpt"
    shutil.copytree(finished / "checkpoints" / CKPTS[-1], ckpt)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    forge(ckpt, entry, target=outside)  # size and crc32 match: only the name gives it away
    with pytest.raises(CheckpointError, match="not a file inside the folder"):
        verify(ckpt)


def test_a_symlinked_checkpoint_file_is_refused(finished: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(finished / "checkpoints" / CKPTS[-1], ckpt)
    shard = next(ckpt.glob("__0_*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(shard, outside)
    shard.symlink_to(outside)  # same bytes, but read from outside the folder
    with pytest.raises(CheckpointError, match="not a file inside the folder"):
        verify(ckpt)


class Payload:
    """A pickle that creates `marker` when unpickled without restriction."""

    def __init__(self, marker: Path) -> None:
        self.code = f"open({str(marker)!r}, 'w').close()"

    def __reduce__(self) -> tuple:
        return exec, (self.code,)


def plant_pickle(finished: Path, tmp_path: Path, key: str) -> tuple[Path, Path]:
    """A checkpoint whose `.metadata` declares `key` a bytes item, its bytes a pickle that creates a
    marker file (what DCP's default planner unpickles with weights_only=False); manifest forged."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from meshrun.checkpoint.safe_reader import SafeReader

    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    shutil.copytree(finished / "checkpoints" / CKPTS[-1], ckpt)
    metadata = SafeReader(ckpt).read_metadata()
    payload = ckpt / "__0_1.distcp"
    torch.save(Payload(marker), payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(payload.name, 0, payload.stat().st_size)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    forge(ckpt, ".metadata")
    forge(ckpt, payload.name)
    return ckpt, marker


@pytest.mark.parametrize("key", ["embed.tok.weight", "progress.samples_seen"])
def test_a_pickled_item_in_a_checkpoint_is_never_unpickled(key: str, finished: Path, tmp_path: Path) -> None:
    """Export and sample load model keys, a resumed run every key: each load refuses the index."""
    ckpt, marker = plant_pickle(finished, tmp_path, key)
    model = meta_model(finished).to_empty(device="cpu")
    state = {**model.state_dict(), "progress.samples_seen": torch.tensor(0)}
    with pytest.raises(CheckpointError) as refused:
        load(state, ckpt)
    assert not marker.exists(), "the checkpoint's pickle ran"
    assert str(ckpt / ".metadata") in str(refused.value) and "\n" not in str(refused.value)


def test_resume_from_a_checkpoint_with_a_pickled_item_is_refused_before_workers(finished: Path, tmp_path: Path) -> None:
    """train.resume=PATH: the launcher's check refuses it (the run trained on with exit 0 before)."""
    from meshrun.checkpoint.resume import check_resumable

    ckpt, marker = plant_pickle(finished, tmp_path, "progress.samples_seen")
    with pytest.raises(ConfigError, match=r"train\.resume .*\.metadata.*pickled"):
        check_resumable(tmp_path / "new-run", str(ckpt), meta_model(finished))
    assert not marker.exists()


def test_export_refuses_a_checkpoint_with_a_pickled_item(finished: Path, tmp_path: Path) -> None:
    ckpt, marker = plant_pickle(finished, tmp_path, "embed.tok.weight")
    result = meshrun_in_process(["export", ckpt, "--out", "m.safetensors"], tmp_path=tmp_path, check=False)
    assert not marker.exists(), "the checkpoint's pickle ran"
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert str(ckpt / ".metadata") in result.stderr and not (tmp_path / "m.safetensors").exists()


def test_export_of_a_renamed_checkpoint_folder_names_its_step(finished: Path, tmp_path: Path) -> None:
    """A checkpoint copied to a folder not named step-N exports, and the line says the step its
    manifest records (it wrote the file, then crashed reading the step from the name)."""
    ckpt = shutil.copytree(finished / "checkpoints" / CKPTS[-1], tmp_path / "best model")
    result = meshrun_in_process(["export", ckpt, "--out", "m.safetensors"], tmp_path=tmp_path)
    assert result.stdout.startswith(f"exported step {int(CKPTS[-1].split('-')[1])} ({ckpt}) to "), result.stdout
    assert (tmp_path / "m.safetensors").is_file()


def test_a_transformed_entry_is_refused(finished: Path, tmp_path: Path) -> None:
    """meshrun writes no compressed (transformed) entries: one would be decompressed unbounded."""
    from meshrun.checkpoint.safe_reader import SafeReader

    ckpt = shutil.copytree(finished / "checkpoints" / CKPTS[-1], tmp_path / "ckpt")
    metadata = SafeReader(ckpt).read_metadata()
    next(iter(metadata.storage_data.values())).transform_descriptors = ["zstd/1"]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    forge(ckpt, ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata.*zstd/1"):
        verify(ckpt)


def test_an_allowed_class_called_with_forged_arguments_is_one_refusal(finished: Path, tmp_path: Path) -> None:
    """The allowlist admits PosixPath; `PosixPath(1)` raises TypeError while unpickling: a refusal
    naming the index, not a traceback."""
    ckpt = shutil.copytree(finished / "checkpoints" / CKPTS[-1], tmp_path / "ckpt")
    # pickle protocol 2 by hand: GLOBAL pathlib.PosixPath, (1,), REDUCE, STOP
    (ckpt / ".metadata").write_bytes(b"\x80\x02cpathlib\nPosixPath\nK\x01\x85R.")
    forge(ckpt, ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata.*TypeError"):
        verify(ckpt)


def test_a_manifest_nested_too_deeply_is_one_refusal(finished: Path, tmp_path: Path) -> None:
    """json.loads raises RecursionError (not ValueError) on deep nesting: still one refusal."""
    ckpt = shutil.copytree(finished / "checkpoints" / CKPTS[-1], tmp_path / "ckpt")
    (ckpt / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        verify(ckpt)


# ---- item 3: checkpoints that exist but cannot be loaded --------------------------------------------


def broken_copy(finished: Path, tmp_path: Path) -> Path:
    """The run with every checkpoint damaged, and its summary gone (as if interrupted)."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    for name in CKPTS:
        truncate(next((run / "checkpoints" / name).glob("__0_*.distcp")))
    return run


def test_no_loadable_checkpoint_stops_and_changes_nothing(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    run = broken_copy(finished, tmp_path)
    before = snapshot(run)
    result = meshrun_in_process(["train", *tiny(data_dir, run, **STEPS)], tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "step-00000012" in result.stderr and "truncated" in result.stderr and "new run_dir" in result.stderr
    assert snapshot(run) == before  # metrics.jsonl, every checkpoint, latest: byte-identical


def test_workers_under_torchrun_stop_too(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    """Launched by torchrun itself (Slurm, launch/torchrun.sh): the worker refuses, files untouched."""
    run = broken_copy(finished, tmp_path)
    before = snapshot(run)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "meshrun"]
    result = subprocess.run(
        [*torchrun, "train", *tiny(data_dir, run, **STEPS)],
        cwd=tmp_path,
        env=meshrun_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode != 0
    assert "meshrun: error: none of the 3 checkpoints" in result.stderr and "step-00000012" in result.stderr
    assert snapshot(run) == before


def test_another_versions_checkpoint_is_told_apart_from_a_corrupt_one(finished: Path, tmp_path: Path) -> None:
    from meshrun.checkpoint.resume import check_resumable

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for name in CKPTS:  # an index this torch cannot read, written by other versions (manifest agrees)
        ckpt = run / "checkpoints" / name
        (ckpt / ".metadata").write_bytes(b"\x80\x04cnew_torch.checkpoint\nMetadataV9\n.")
        forge(ckpt, ".metadata")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["versions"] = {"torch": "2.99.0", "meshrun": "9.0.0"}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"written by torch 2\.99\.0 / meshrun 9\.0\.0, this is torch 2\.13"):
        check_resumable(run, "auto", meta_model(run))
    truncate(run / "checkpoints" / CKPTS[-1] / ".metadata")
    with pytest.raises(ConfigError, match=r"step-00000012, does not: checkpoint file .*truncated") as damaged:
        check_resumable(run, "auto", meta_model(run))
    assert "written by" not in str(damaged.value)


def test_manifest_records_the_versions(finished: Path) -> None:
    import meshrun

    manifest = json.loads((finished / "checkpoints" / CKPTS[-1] / "manifest.json").read_text())
    assert manifest["versions"] == {"torch": torch.__version__, "meshrun": meshrun.__version__}


def test_dcp_errors_are_checkpoint_errors(finished: Path) -> None:
    """DCP's CheckpointException derives from BaseException: it must not escape as a traceback."""
    wider = meta_model(finished, dim=64).to_empty(device="cpu")
    with pytest.raises(CheckpointError, match="cannot load checkpoint"):
        full_model_state(wider, finished / "checkpoints" / CKPTS[-1])


def test_resuming_another_model_is_one_line(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    ckpt = finished / "checkpoints" / CKPTS[-1]
    args = tiny(data_dir, tmp_path / "new", **{"model.dim": 64, "train.resume": ckpt})
    result = meshrun_in_process(["train", *args], tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "another model" in result.stderr


def test_retention_keeps_checkpoints_newer_than_the_resumed_one(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    for name in CKPTS[1:]:  # 8 and 12 fail, 4 loads: the run resumes from 4 and saves 8 and 12 again
        truncate(next((run / "checkpoints" / name).glob("__0_*.distcp")))
    unloadable = {name: snapshot(run / "checkpoints" / name) for name in CKPTS[1:]}
    result = train_job(tiny(data_dir, run, **STEPS), tmp_path=tmp_path)
    assert "resumed from" in result.stderr and "step-00000004" in result.stderr
    for name, files in unloadable.items():
        assert snapshot(run / "checkpoints" / f"{name}.kept-1") == files  # kept, moved aside
    assert {p.name for p in (run / "checkpoints").iterdir()} >= {*CKPTS, "latest"}


# ---- train.resume=PATH: a starting point, not a place to go back to ----------------------------------


def test_rerunning_a_run_started_from_a_checkpoint_continues_it(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    """A torchrun restart, a Slurm requeue or a rerun repeats the command, train.resume included: it
    must continue from the run's own newest checkpoint, not train again from the named one."""
    args = tiny(data_dir, tmp_path / "b", **{**STEPS, "train.resume": finished / "checkpoints" / CKPTS[0]})
    train_job(args, tmp_path=tmp_path)
    before = snapshot(tmp_path / "b")
    again = meshrun_in_process(["train", *args], tmp_path=tmp_path)
    assert f"run already complete: {tmp_path / 'b' / 'checkpoints' / CKPTS[-1]} is at step 12" in again.stderr
    assert snapshot(tmp_path / "b") == before  # nothing trained again, no metrics row dropped


def test_another_runs_checkpoint_is_not_loaded_into_a_run(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other" / CKPTS[0]
    shutil.copytree(finished, run)
    shutil.copytree(finished / "checkpoints" / CKPTS[0], other)
    before = snapshot(run)
    result = meshrun_in_process(
        ["train", *tiny(data_dir, run, **{**STEPS, "train.resume": other})], tmp_path=tmp_path, check=False
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "already holds a run" in result.stderr and "set a new run_dir" in result.stderr
    assert snapshot(run) == before


def test_auto_after_a_rollback_continues_the_rolled_back_branch(finished: Path, data_dir: Path, tmp_path: Path) -> None:
    """Rolled back to step 4 and trained to 8, the run's saved-last checkpoint is the new step 8:
    `auto`, export and sample continue from it, not from the old branch's higher step 12 (kept)."""
    from meshrun.checkpoint.resume import checkpoint_dir

    run = shutil.copytree(finished, tmp_path / "run")
    old_12 = snapshot(run / "checkpoints" / CKPTS[-1])
    back = {**STEPS, "train.steps": 8, "train.resume": run / "checkpoints" / CKPTS[0]}
    train_job(tiny(data_dir, run, **back), tmp_path=tmp_path)
    assert checkpoint_dir(run) == run / "checkpoints" / CKPTS[1]
    again = train_job(tiny(data_dir, run, **STEPS), tmp_path=tmp_path)
    assert f"resumed from {run / 'checkpoints' / CKPTS[1]} at step 8\n" in again.stderr
    assert snapshot(run / "checkpoints" / f"{CKPTS[-1]}.kept-1") == old_12  # the old branch, moved aside


def test_a_latest_file_that_is_not_text_falls_back_to_the_step_order(finished: Path, tmp_path: Path) -> None:
    from meshrun.checkpoint.paths import newest_first

    run = shutil.copytree(finished, tmp_path / "run")
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    assert [p.name for p in newest_first(run)] == list(CKPTS[::-1])


# ---- indexes whose chunks do not tile a tensor: refused before anything loads ----------------------

WEIGHT = "embed.tok.weight"  # (vocab, dim): one chunk in a one-process checkpoint


def forge_index(ckpt: Path, change: Callable[[list, dict, tuple[int, ...]], None], name: str = WEIGHT) -> Path:
    """`ckpt` with the index entry of tensor `name` changed by `change(chunks, storage, shape)`
    (the storage map: chunk index -> file, offset, length), its manifest forged to match."""
    from meshrun.checkpoint.safe_reader import SafeReader

    metadata = SafeReader(ckpt).read_metadata()
    entry = metadata.state_dict_metadata[name]
    change(entry.chunks, metadata.storage_data, tuple(entry.size))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    forge(ckpt, ".metadata")
    return ckpt


def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def outside(chunks: list, storage: dict, shape: tuple[int, ...]) -> None:
    chunks[0] = chunk((0, 0), (shape[0] + 1, shape[1]))  # one row past the end


def overlapping(chunks: list, storage: dict, shape: tuple[int, ...]) -> None:
    chunks.append(chunk((1, 0), (1, shape[1])))  # row 1 twice, stored as the first bytes of the whole
    storage[MetadataIndex(WEIGHT, (1, 0))] = storage[MetadataIndex(WEIGHT, (0, 0))]


def holed(chunks: list, storage: dict, shape: tuple[int, ...]) -> None:
    chunks[0] = chunk((0, 0), (shape[0] - 1, shape[1]))  # the last row is in no chunk


def unstored(chunks: list, storage: dict, shape: tuple[int, ...]) -> None:
    chunks[:] = [chunk((0, 0), (1, shape[1])), chunk((1, 0), (shape[0] - 1, shape[1]))]  # the second: no entry


def short(chunks: list, storage: dict, shape: tuple[int, ...]) -> None:
    key = MetadataIndex(WEIGHT, (0, 0))
    storage[key] = dataclasses.replace(storage[key], length=16)  # fewer bytes than the chunk holds


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (outside, r"its chunk at offsets \[0, 0\] of sizes \[257, 32\] lies outside it"),
        (overlapping, r"its chunks \(2\) overlap at element \[1, 0\]"),
        (holed, r"its chunks \(1\) leave a hole at element \[255, 0\] \(they cover 8160 elements of 8192\)"),
        (unstored, r"its chunk at offsets \[1, 0\] of sizes \[255, 32\] has no stored bytes"),
        (
            short,
            r"its chunk at offsets \[0, 0\] of sizes \[256, 32\] is stored as 16 bytes at offset \d+ of '__0_0.distcp' \(\d+ bytes\), too few for its 32768",
        ),
    ],
)
def test_an_index_whose_chunks_do_not_tile_a_tensor_is_refused(
    change, says: str, finished: Path, tmp_path: Path
) -> None:
    """DCP loads what the index lists: a chunk outside the tensor, an overlap, a hole or a chunk
    without bytes loaded as garbage or fresh initialisation, with exit 0 (export, resume)."""
    ckpt = forge_index(shutil.copytree(finished / "checkpoints" / CKPTS[-1], tmp_path / "ckpt"), change)
    with pytest.raises(CheckpointError, match=rf"\.metadata: tensor '{WEIGHT}' of shape \[256, 32\]: {says}"):
        verify(ckpt)


def test_export_refuses_a_tensor_with_a_hole(finished: Path, tmp_path: Path) -> None:
    ckpt = forge_index(shutil.copytree(finished / "checkpoints" / CKPTS[-1], tmp_path / "ckpt"), holed)
    result = meshrun_in_process(["export", ckpt, "--out", "m.safetensors"], tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"tensor '{WEIGHT}'" in result.stderr and "hole" in result.stderr
    assert not (tmp_path / "m.safetensors").exists()


@pytest.fixture(scope="module")
def tp2_checkpoint(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-2 checkpoint of a tp2 run: its split matrices stored as two chunks each."""
    run = tmp_path_factory.mktemp("tp2") / "run"
    train_job(tiny(data_dir, run, **{"parallel.tp": 2, "train.steps": 2}), tmp_path=run.parent)
    return run / "checkpoints" / "step-00000002"


def test_a_tp2_checkpoint_with_a_shard_dropped_is_refused_at_tp1(
    tp2_checkpoint: Path, finished: Path, tmp_path: Path
) -> None:
    """Resumed at tp1, the dropped half stayed at its fresh initialisation: now refused before workers."""
    from meshrun.checkpoint.resume import check_resumable
    from meshrun.checkpoint.safe_reader import SafeReader

    ckpt = shutil.copytree(tp2_checkpoint, tmp_path / "ckpt")
    check_resumable(tmp_path / "whole", str(ckpt), meta_model(finished))  # two chunks that tile: loads
    entries = SafeReader(ckpt).read_metadata().state_dict_metadata
    name = next(n for n, e in entries.items() if len(getattr(e, "chunks", ())) == 2 and not n.startswith("state."))

    def drop_second(chunks: list, storage: dict, shape: tuple[int, ...]) -> None:
        storage.pop(MetadataIndex(name, chunks.pop().offsets))

    forge_index(ckpt, drop_second, name)
    with pytest.raises(ConfigError, match=rf"train\.resume .*tensor '{re.escape(name)}' .*leave a hole"):
        check_resumable(tmp_path / "new-run", str(ckpt), meta_model(finished))
