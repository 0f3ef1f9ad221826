"""Bad input: every malformed config or override is refused with one line and exit code 2,
before any worker exists.

Each row goes through `meshrun.cli.main`, the entry point users run. Rows that fail in the
config layer run as real `python -m meshrun` subprocesses (they exit before torch is
imported, so they are cheap); rows that need the job layer (model, layout, data, run dir)
run in-process with a tripwire on the two ways a worker can start, and a few of them also
run as subprocesses so the real launch path is covered end to end.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import meshrun_env, run_meshrun, tiny
from meshrun import cli, job

FACTORY_MODULE = '''
from torch import nn


def not_a_protocol_model(cfg):
    """Returns a plain module: no embed / blocks / norm / head / init_weights / flops_per_token."""
    return nn.Linear(cfg.dim, cfg.dim)
'''


@dataclass
class Ctx:
    """What a row may use: the shared test dataset and a private folder."""

    data_dir: Path
    tmp: Path

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    def set(self, **overrides: object) -> list[str]:
        """`--set` arguments for a tiny valid job, with `overrides` (dotted keys via __)."""
        return tiny(self.data_dir, self.run_dir, **{k.replace("__", "."): v for k, v in overrides.items()})

    def folder(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path


@dataclass
class Case:
    id: str
    argv: Callable[[Ctx], list[str]]
    expect: tuple[str, ...]
    subprocess: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _pp(**overrides: object) -> Callable[[Ctx], list[str]]:
    return lambda c: ["train", *c.set(**overrides)]


CASES = [
    # --- YAML and overrides ---
    Case("yaml-malformed", lambda c: ["train", str(c.write("bad.yaml", "model:\n  dim: 32\n  num_heads: [2,\n")), *c.set()],
         ("bad.yaml is not valid YAML at line 4",), subprocess=True),
    Case("yaml-tab", lambda c: ["train", str(c.write("tab.yaml", "train:\n\tlr: 1\n")), *c.set()],
         ("tab.yaml is not valid YAML at line 2",), subprocess=True),
    Case("yaml-list", lambda c: ["train", str(c.write("list.yaml", "- model\n- train\n")), *c.set()],
         ("list.yaml must be a YAML mapping",), subprocess=True),
    Case("config-missing", lambda c: ["train", str(c.tmp / "nope.yaml"), *c.set()],
         ("cannot read config file", "nope.yaml", "No such file"), subprocess=True),
    Case("set-without-equals", lambda c: ["train", *c.set(), "--set", "train.lr"],
         ("--set 'train.lr' must look like key.path=value",), subprocess=True),
    Case("set-empty-key", lambda c: ["train", *c.set(), "--set", "=3"],
         ("must look like key.path=value",), subprocess=True),
    Case("set-into-scalar", lambda c: ["train", *c.set(), "--set", "precision.dtype=bf16"],
         ("--set precision.dtype: precision is not a section",), subprocess=True),
    # --- unknown keys ---
    Case("unknown-top-level", lambda c: ["train", *c.set(), "--set", "trian.lr=1e-3"],
         ("unknown config key trian", "did you mean train?"), subprocess=True),
    Case("unknown-nested", lambda c: ["train", *c.set(), "--set", "train.lrr=1e-3"],
         ("unknown config key train.lrr", "did you mean train.lr?"), subprocess=True),
    Case("unknown-nested-in-yaml", lambda c: ["train", str(c.write("typo.yaml", "model:\n  num_layer: 2\n")), *c.set()],
         ("unknown config key model.num_layer", "did you mean model.num_layers?"), subprocess=True),
    Case("unknown-no-close-match", lambda c: ["train", *c.set(), "--set", "tracker.zzzz=1"],
         ("unknown config key tracker.zzzz", "known keys: mode, project"), subprocess=True),
    # --- types and ranges ---
    Case("lr-not-a-number", lambda c: ["train", *c.set(train__lr="abc")],
         ("invalid train.lr", "valid number", '"abc"'), subprocess=True),
    Case("layers-fractional", lambda c: ["train", *c.set(model__num_layers=2.5)],
         ("invalid model.num_layers", "valid integer", "2.5"), subprocess=True),
    Case("steps-negative", lambda c: ["train", *c.set(train__steps=-1)],
         ("invalid train.steps", "greater than or equal to 1", "-1"), subprocess=True),
    Case("micro-batch-zero", lambda c: ["train", *c.set(train__micro_batch=0)],
         ("invalid train.micro_batch", "greater than or equal to 1"), subprocess=True),
    Case("lr-zero", lambda c: ["train", *c.set(train__lr=0)],
         ("invalid train.lr", "greater than 0"), subprocess=True),
    Case("section-not-mapping", lambda c: ["train", *c.set(), "--set", "train=3"],
         ("invalid train", "valid dictionary"), subprocess=True),
    Case("heads-do-not-divide-dim", lambda c: ["train", *c.set(model__dim=32, model__num_heads=3)],
         ("model.num_heads (3) must divide model.dim (32)", "change one of these keys"), subprocess=True),
    Case("precision-unknown", lambda c: ["train", *c.set(precision="fp8")],
         ("invalid precision", "'fp32', 'bf16' or 'fp16'", '"fp8"'), subprocess=True),
    Case("recompute-every-0", lambda c: ["train", *c.set(recompute="every:0")],
         ("invalid recompute", "every:N with N >= 1", "'every:0'"), subprocess=True),
    Case("recompute-foo", lambda c: ["train", *c.set(recompute="foo")],
         ("invalid recompute", "none, full, selective", "'foo'"), subprocess=True),
    Case("schedule-unknown", lambda c: ["train", *c.set(parallel__schedule="pipedream")],
         ("invalid parallel.schedule", "'1f1b'"), subprocess=True),
    Case("batch-not-divisible", lambda c: ["train", *c.set(train__global_batch=10, train__micro_batch=2, parallel__dp=2)],
         ("train.global_batch (10) must be a multiple of train.micro_batch x parallel.dp", "2 x 2 = 4"), subprocess=True),
    # --- model (job layer) ---
    Case("model-name-unknown", lambda c: ["train", *c.set(model__name="llama")],
         ("invalid model.name 'llama'", "choose one of gpt", "model.factory")),
    Case("factory-raises", lambda c: ["train", *c.set(model__factory="torch.nn:Linear")],
         ("model.factory torch.nn:Linear failed: TypeError",)),
    Case("factory-no-colon", lambda c: ["train", *c.set(model__factory="mymodels.build")],
         ("invalid model.factory 'mymodels.build'", "package.module:function")),
    Case("factory-module-missing", lambda c: ["train", *c.set(model__factory="no_such_module_xyz:build")],
         ("invalid model.factory 'no_such_module_xyz:build'", "No module named 'no_such_module_xyz'"), subprocess=True),
    Case("factory-function-missing", lambda c: ["train", *c.set(model__factory="json:no_such_function")],
         ("invalid model.factory 'json:no_such_function'", "no_such_function"),),
    Case("factory-not-protocol", lambda c: (c.write("mt_factory.py", FACTORY_MODULE), ["train", *c.set(model__factory="mt_factory:not_a_protocol_model")])[1],
         ("model from mt_factory:not_a_protocol_model does not follow the model protocol", "embed", "blocks"),
         subprocess=True),
    # --- pipeline layout (job layer) ---
    Case("pp-more-than-layers", _pp(parallel__pp=8, train__global_batch=16, train__micro_batch=2),
         ("8 pipeline stages", "model.num_layers is 4", "parallel.pp")),
    Case("stage-layers-missing-block", _pp(parallel__pp=2, parallel__stage_layers="[[0],[1,2]]"),
         ("parallel.stage_layers must list blocks 0..3 each exactly once",)),
    Case("stage-layers-duplicate", _pp(parallel__pp=2, parallel__stage_layers="[[0,1],[1,2,3]]"),
         ("parallel.stage_layers must list blocks 0..3 each exactly once", "[[0, 1], [1, 2, 3]]")),
    Case("stage-layers-wrong-count", _pp(parallel__pp=2, parallel__stage_layers="[[0],[1],[2,3]]"),
         ("parallel.stage_layers has 3 stages but the pipeline has 2",)),
    Case("1f1b-too-few-microbatches", _pp(parallel__pp=4, train__global_batch=4, train__micro_batch=2),
         ("schedule 1f1b needs at least parallel.pp = 4 microbatches, got 2", "train.global_batch")),
    Case("interleaved-not-multiple-of-pp", _pp(parallel__pp=2, parallel__schedule="interleaved-1f1b", model__num_layers=8,
                                               train__global_batch=6, train__micro_batch=2),
         ("schedule interleaved-1f1b needs microbatches to be a multiple of parallel.pp = 2, got 3",)),
    Case("virtual-stages-with-1f1b", _pp(parallel__pp=2, parallel__virtual_stages=2),
         ("parallel.virtual_stages must be 1 for schedule 1f1b",)),
    Case("zero-bubble-with-dp", _pp(parallel__pp=2, parallel__dp=2, parallel__schedule="zero-bubble", model__num_layers=4,
                                    train__global_batch=8, train__micro_batch=2),
         ("zero-bubble with parallel.dp > 1 is refused", "parallel.dp=1"), subprocess=True),
    # --- data (job layer, only on the real training path) ---
    Case("data-dir-empty", lambda c: ["train", *c.set(data__dir=c.folder("empty"))],
         ("holds no prepared dataset", "meshrun prepare-data --out"), subprocess=True),
    Case("data-dir-missing", lambda c: ["train", *c.set(data__dir=c.tmp / "nowhere")],
         ("data.dir", "nowhere holds no prepared dataset", "prepare-data")),
    Case("data-smaller-than-seq-len",
         lambda c: ["train", *c.set(model__seq_len=json.loads((c.data_dir / "meta.json").read_text())["train_tokens"])],
         ("(train) holds", "fewer than model.seq_len + 1", "prepare more text or lower model.seq_len")),
    Case("data-empty-files", lambda c: (c.write("zero/train.bin", b""), c.write("zero/val.bin", b""),
                                        ["train", *c.set(data__dir=c.tmp / "zero")])[-1],
         ("train.bin holds 0 tokens", "model.seq_len + 1")),
    # --- run dir and world size ---
    Case("run-dir-is-a-file", lambda c: (c.write("run", "not a folder"), ["train", *c.set()])[1],
         ("run_dir", "is a file, not a folder",)),
    Case("world-size-mismatch", lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
         ("world size 3 does not match parallel.dp x parallel.pp = 1 x 1", "launch 1 processes"),
         subprocess=True, env={"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}),
]


def _ids(cases: list[Case]) -> list[str]:
    assert len({c.id for c in cases}) == len(cases), "duplicate case ids"
    return [c.id for c in cases]


def _assert_refused(rc: int, err: str, expect: tuple[str, ...]) -> None:
    assert rc == 2, f"exit {rc}, stderr: {err}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{err}"
    assert lines[0].startswith("meshrun: error: "), lines[0]
    for fragment in expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "starting" not in err and "Traceback" not in err


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """In-process rows: a worker starting (here, or via torchrun) fails the test at once."""

    def tripwire(*args: object, **kwargs: object) -> int:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(job, "run_worker", tripwire)  # one process: the worker runs here
    monkeypatch.setattr(job, "run_torchrun", tripwire)  # several: torchrun is started
    for name, value in meshrun_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))  # for the user factory module rows write


@pytest.mark.parametrize("dp", [1, 2], ids=["in-process-worker", "torchrun"])
def test_tripwire_catches_a_valid_job(dp: int, data_dir: Path, tmp_path: Path, no_workers: None) -> None:
    """The tripwire is live on both launch paths, so a refused row that started work would fail."""
    ctx = Ctx(data_dir, tmp_path)
    with pytest.raises(AssertionError, match="a worker was started"):
        cli.main(["train", *ctx.set(parallel__dp=dp)])


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 20
    assert sum(c.subprocess for c in CASES) >= 5


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_refused_in_process(case: Case, data_dir: Path, tmp_path: Path, no_workers: None,
                            capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = Ctx(data_dir, tmp_path)
    argv = case.argv(ctx)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(argv)
    _assert_refused(rc, capsys.readouterr().err, case.expect)
    if not ctx.run_dir.is_file():
        assert not ctx.run_dir.exists(), "a refused job created its run dir"


@pytest.mark.parametrize("case", [c for c in CASES if c.subprocess], ids=_ids([c for c in CASES if c.subprocess]))
def test_refused_by_real_cli(case: Case, data_dir: Path, tmp_path: Path) -> None:
    ctx = Ctx(data_dir, tmp_path)
    env = meshrun_env(tmp_path, **case.env)
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"  # for the user factory module rows write
    result = run_meshrun(case.argv(ctx), tmp_path=tmp_path, env=env, timeout=60, check=False)
    _assert_refused(result.returncode, result.stderr, case.expect)
    assert result.stdout == ""
    if not ctx.run_dir.is_file():
        assert not ctx.run_dir.exists(), "a refused job created its run dir"


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_existing_run_is_refused_and_untouched(data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"mine": true}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = _snapshot(run_dir)
    result = run_meshrun(["train", *tiny(data_dir, run_dir)], tmp_path=tmp_path, timeout=60, check=False)
    _assert_refused(result.returncode, result.stderr, ("run_dir", "already holds files that are not a meshrun run",
                                                       "set run_dir to a new folder"))
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("override,fragments", [
    ("train.resume=none", ("already holds a run", "set train.resume=auto to continue it, or a new run_dir")),
    ("model.dim=64", ("holds a run of a different model", "model.dim is 32 there, 64 here")),
])
def test_existing_run_is_not_continued_wrongly(override: str, fragments: tuple[str, ...], data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_meshrun(["train", *tiny(data_dir, run_dir, **{"train.steps": 1})], tmp_path=tmp_path)
    before = _snapshot(run_dir)
    result = run_meshrun(["train", *tiny(data_dir, run_dir), f"--set={override}"], tmp_path=tmp_path, timeout=60, check=False)
    _assert_refused(result.returncode, result.stderr, fragments)
    assert _snapshot(run_dir) == before
