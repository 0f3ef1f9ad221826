"""Bad input: every malformed config, override or argument is refused with one line and exit
code 2, before any worker exists.

Each row goes through `meshrun.cli.main`, the entry point users run, in-process with a
tripwire on the two ways a worker can start. Rows marked `subprocess` also run as real
`python -m meshrun` processes, so the real launch path is covered end to end. Rows marked
`torch_free` must be answered before torch is imported (that is what makes them fast): all of
them run in one fresh interpreter that checks `sys.modules` after each row.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import WORDS, meshrun_env, meshrun_in_process, run_meshrun, tiny, train_job

from meshrun import cli
from meshrun.cli import train as job
from meshrun.config.schema import load_config
from meshrun.launcher import local as local_launch

FACTORY_MODULE = '''
from torch import nn


def not_a_protocol_model(cfg):
    """Returns a plain module: no embed / blocks / norm / head / init_weights / flops_per_token."""
    return nn.Linear(cfg.dim, cfg.dim)
'''
# 9**7 values once aliases are expanded, from a 200-byte file ("billion laughs")
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdef", "bcdefg")
)
HF_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 256,
}
HF_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# internal names a user must never see in an error line
INTERNAL_WORDS = re.compile(r"[A-Z]\w*Config\b|instance of|Field required|model\.factory gpt\b")


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
    torch_free: bool = False
    cwd: str = "."  # folder under the test's tmp dir to run in


def _pp(**overrides: object) -> Callable[[Ctx], list[str]]:
    return lambda c: ["train", *c.set(**overrides)]


def _file(name: str, text: str | bytes) -> Callable[[Ctx], list[str]]:
    """`train NAME` with a config file holding `text` (plus the tiny job's --set arguments)."""
    return lambda c: ["train", str(c.write(name, text)), *c.set()]


def _module(name: str, text: str, factory: str, *, folder: str = ".") -> Callable[[Ctx], list[str]]:
    """`train` with model.factory=FACTORY from a module NAME.py written in `folder`."""
    return lambda c: (c.write(f"{folder}/{name}.py", text), ["train", *c.set(model__factory=factory)])[1]


def _sample(*args: str) -> Callable[[Ctx], list[str]]:
    return lambda c: ["sample", str(c.folder("ckpt")), *args]


CASES = [
    # --- YAML and overrides ---
    Case(
        "yaml-malformed",
        lambda c: ["train", str(c.write("bad.yaml", "model:\n  dim: 32\n  num_heads: [2,\n")), *c.set()],
        ("bad.yaml is not valid YAML at line 4",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "yaml-tab",
        lambda c: ["train", str(c.write("tab.yaml", "train:\n\tlr: 1\n")), *c.set()],
        ("tab.yaml is not valid YAML at line 2",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "yaml-list",
        lambda c: ["train", str(c.write("list.yaml", "- model\n- train\n")), *c.set()],
        ("list.yaml must be a YAML mapping",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "set-value-not-utf8",  # a latin-1 path from the shell: a UnicodeEncodeError traceback in libyaml
        lambda c: ["train", *c.set(), "--set=data.dir=caf\udce9"],
        ("--set data.dir: the value is not valid UTF-8 text",),
        torch_free=True,
    ),
    Case(
        "rdzv-endpoint-empty-port",  # YAML read `localhost:` as the mapping {localhost: null}
        lambda c: ["train", *c.set(), "--rdzv-endpoint", "localhost:"],
        ("invalid launch.rdzv_endpoint", "HOST[:PORT] with PORT 1-65535", "'localhost:'"),
        torch_free=True,
    ),
    Case(
        "rdzv-endpoint-port-out-of-range",  # torchrun's traceback after "starting workers"
        lambda c: ["train", *c.set(), "--rdzv-endpoint", "localhost:99999"],
        ("invalid launch.rdzv_endpoint", "HOST[:PORT] with PORT 1-65535", "'localhost:99999'"),
        torch_free=True,
    ),
    Case(
        "init-timeout-true",
        lambda c: ["train", *c.set(tracker__init_timeout=True)],
        ("invalid tracker.init_timeout", "got true"),
        torch_free=True,
    ),
    Case(
        "config-missing",
        lambda c: ["train", str(c.tmp / "nope.yaml"), *c.set()],
        ("cannot read config file", "nope.yaml", "No such file"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "set-without-equals",
        lambda c: ["train", *c.set(), "--set", "train.lr"],
        ("--set 'train.lr' must look like key.path=value",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "set-empty-key",
        lambda c: ["train", *c.set(), "--set", "=3"],
        ("must look like key.path=value",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "set-into-scalar",
        lambda c: ["train", *c.set(), "--set", "precision.dtype=bf16"],
        ("--set precision.dtype: precision is not a section",),
        subprocess=True,
        torch_free=True,
    ),
    # --- unknown keys ---
    Case(
        "unknown-top-level",
        lambda c: ["train", *c.set(), "--set", "trian.lr=1e-3"],
        ("unknown config key trian", "did you mean train?"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "unknown-nested",
        lambda c: ["train", *c.set(), "--set", "train.lrr=1e-3"],
        ("unknown config key train.lrr", "did you mean train.lr?"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "unknown-nested-in-yaml",
        lambda c: ["train", str(c.write("typo.yaml", "model:\n  num_layer: 2\n")), *c.set()],
        ("unknown config key model.num_layer", "did you mean model.num_layers?"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "unknown-no-close-match",
        lambda c: ["train", *c.set(), "--set", "tracker.zzzz=1"],
        ("unknown config key tracker.zzzz", "known keys: mode, project"),
        subprocess=True,
        torch_free=True,
    ),
    # --- types and ranges ---
    Case(
        "lr-not-a-number",
        lambda c: ["train", *c.set(train__lr="abc")],
        ("invalid train.lr", "valid number", '"abc"'),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "layers-fractional",
        lambda c: ["train", *c.set(model__num_layers=2.5)],
        ("invalid model.num_layers", "valid integer", "2.5"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "steps-negative",
        lambda c: ["train", *c.set(train__steps=-1)],
        ("invalid train.steps", "greater than or equal to 1", "-1"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "micro-batch-zero",
        lambda c: ["train", *c.set(train__micro_batch=0)],
        ("invalid train.micro_batch", "greater than or equal to 1"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "lr-zero",
        lambda c: ["train", *c.set(train__lr=0)],
        ("invalid train.lr", "greater than 0"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "section-not-mapping",
        lambda c: ["train", *c.set(), "--set", "train=3"],
        ("invalid train", "expected a section of keys", "(got 3)"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "heads-do-not-divide-dim",
        lambda c: ["train", *c.set(model__dim=32, model__num_heads=3)],
        ("model.num_heads (3) must divide model.dim (32)", "change one of these keys"),
        subprocess=True,
        torch_free=True,
    ),
    # --- model sizes: arithmetic on the config, refused before anything is built ---
    Case(
        "layers-absurd",  # a meta model of a billion blocks took minutes and gigabytes
        lambda c: ["train", "--dry-run", *c.set(model__num_layers=1_000_000_000)],
        ("model.num_layers is 1000000000, more blocks than meshrun builds (10000)",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "vocab-absurd-float",  # passed --dry-run (12,500,002,072 MiB per rank) and died in a worker
        lambda c: ["train", "--dry-run", *c.set(model__vocab_size=1e11)],
        ("pipeline rank 0 would need ~", "more than any device could hold (4 TiB)", "model.vocab_size"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "dim-absurd",
        lambda c: ["train", *c.set(model__dim=2**20, model__num_heads=2)],
        ("this model has ~", "more than any device could hold"),
        torch_free=True,
    ),
    Case(
        "hf-config-json-layers-zero",  # was a traceback blaming "model.name gpt"
        lambda c: [
            "train",
            "--dry-run",
            *c.set(model__hf=c.write("m/config.json", json.dumps({**HF_LLAMA, "num_hidden_layers": 0})).parent),
        ],
        ("config.json num_hidden_layers is 0; it must be at least 1",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "hf-config-json-vocab-float",
        lambda c: [
            "train",
            *c.set(model__hf=c.write("m/config.json", json.dumps({**HF_LLAMA, "vocab_size": 1e11})).parent),
        ],
        ("config.json vocab_size is 100000000000.0; it must be a whole number",),
        torch_free=True,
    ),
    Case(
        "precision-unknown",
        lambda c: ["train", *c.set(precision="fp8")],
        ("invalid precision", "'fp32', 'bf16' or 'fp16'", '"fp8"'),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "recompute-every-0",
        lambda c: ["train", *c.set(recompute="every:0")],
        ("invalid recompute", "every:N with N >= 1", "'every:0'"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "recompute-foo",
        lambda c: ["train", *c.set(recompute="foo")],
        ("invalid recompute", "none, full, selective", "'foo'"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "compile-unknown",  # the choices in YAML's words (was: use 'auto', True or False)
        lambda c: ["train", *c.set(train__compile="maybe")],
        ("invalid train.compile: use 'auto', true or false", '"maybe"'),
        torch_free=True,
    ),
    Case(
        "empty-value",  # `--set train.steps=` reads as null (was: "Input should be a valid integer")
        lambda c: ["train", *c.set(train__steps="")],
        ("invalid train.steps: no value given (empty or null)",),
        torch_free=True,
    ),
    Case(
        "schedule-unknown",
        lambda c: ["train", *c.set(parallel__schedule="pipedream")],
        ("invalid parallel.schedule", "'1f1b'"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "batch-not-divisible",
        lambda c: ["train", *c.set(train__global_batch=10, train__micro_batch=2, parallel__dp=2)],
        ("train.global_batch (10) must be a multiple of train.micro_batch x parallel.dp", "2 x 2 = 4"),
        subprocess=True,
        torch_free=True,
    ),
    # --- model (job layer) ---
    Case(
        "model-name-unknown",
        lambda c: ["train", *c.set(model__name="llama")],
        ("invalid model.name 'llama'", "choose one of gpt", "model.factory"),
    ),
    Case(
        "factory-raises",
        lambda c: ["train", *c.set(model__factory="torch.nn:Linear")],
        ("model.factory torch.nn:Linear failed: TypeError",),
    ),
    Case(
        "factory-no-colon",
        lambda c: ["train", *c.set(model__factory="mymodels.build")],
        ("invalid model.factory 'mymodels.build'", "package.module:function"),
    ),
    Case(
        "factory-module-missing",
        lambda c: ["train", *c.set(model__factory="no_such_module_xyz:build")],
        ("invalid model.factory 'no_such_module_xyz:build'", "No module named 'no_such_module_xyz'"),
        subprocess=True,
    ),
    Case(
        "factory-function-missing",
        lambda c: ["train", *c.set(model__factory="json:no_such_function")],
        ("invalid model.factory 'json:no_such_function'", "no_such_function"),
    ),
    Case(
        "factory-not-protocol",
        lambda c: (
            c.write("mt_factory.py", FACTORY_MODULE),
            ["train", *c.set(model__factory="mt_factory:not_a_protocol_model")],
        )[1],
        ("model from mt_factory:not_a_protocol_model does not follow the model protocol", "embed", "blocks"),
        subprocess=True,
    ),
    Case(  # the factory was never called: a user's wrapper (LoRA, a custom head) trained as the plain model
        "factory-with-hf-dir",
        lambda c: [
            "train",
            *c.set(model__hf=c.write("m/config.json", json.dumps(HF_LLAMA)).parent, model__factory="mt:build"),
        ],
        ("set model.factory or model.hf, not both", "load the Hugging Face model inside it", "remove model.hf)"),
        torch_free=True,
    ),
    Case(
        "factory-with-hf-config",
        lambda c: ["train", *c.set(model__hf_config=HF_LLAMA, model__factory="mt:build")],
        ("set model.factory or model.hf_config, not both", "remove model.hf_config"),
        torch_free=True,
    ),
    # --- pipeline layout (job layer) ---
    Case(
        "pp-more-than-layers",
        _pp(parallel__pp=8, train__global_batch=16, train__micro_batch=2),
        ("8 pipeline stages", "model.num_layers is 4", "parallel.pp"),
        torch_free=True,
    ),
    Case(
        "stage-layers-missing-block",
        _pp(parallel__pp=2, parallel__stage_layers="[[0],[1,2]]"),
        ("parallel.stage_layers must list blocks 0..3 each exactly once",),
        torch_free=True,
    ),
    Case(
        "stage-layers-duplicate",
        _pp(parallel__pp=2, parallel__stage_layers="[[0,1],[1,2,3]]"),
        ("parallel.stage_layers must list blocks 0..3 each exactly once", "[[0, 1], [1, 2, 3]]"),
        torch_free=True,
    ),
    Case(
        "stage-layers-wrong-count",
        _pp(parallel__pp=2, parallel__stage_layers="[[0],[1],[2,3]]"),
        ("parallel.stage_layers has 3 stages but the pipeline has 2",),
        torch_free=True,
    ),
    Case(
        "1f1b-too-few-microbatches",
        _pp(parallel__pp=4, train__global_batch=4, train__micro_batch=2),
        ("schedule 1f1b needs at least parallel.pp = 4 microbatches, got 2", "train.global_batch"),
        torch_free=True,
    ),
    # torch's rule (issue 15): a multiple of the rounds, microbatches // pp; 3 on pp 2 runs (test_schedules_from_torch)
    Case(
        "interleaved-not-multiple-of-rounds",
        _pp(
            parallel__pp=2,
            parallel__schedule="interleaved-1f1b",
            model__num_layers=8,
            train__global_batch=10,
            train__micro_batch=2,
        ),
        (
            "schedule interleaved-1f1b needs a multiple of the number of rounds (microbatches // parallel.pp = 2)",
            "got 5",
        ),
        torch_free=True,
    ),
    Case(
        "virtual-stages-with-1f1b",
        _pp(parallel__pp=2, parallel__virtual_stages=2),
        ("parallel.virtual_stages must be 1 for schedule 1f1b",),
        torch_free=True,
    ),
    # --- data (job layer, only on the real training path) ---
    Case(
        "data-dir-empty",
        lambda c: ["train", *c.set(data__dir=c.folder("empty"))],
        ("holds no prepared dataset", "meshrun prepare-data --out"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "data-dir-missing",
        lambda c: ["train", *c.set(data__dir=c.tmp / "nowhere")],
        ("data.dir", "nowhere holds no prepared dataset", "prepare-data"),
        torch_free=True,
    ),
    Case(
        "data-smaller-than-seq-len",
        lambda c: ["train", *c.set(model__seq_len=json.loads((c.data_dir / "meta.json").read_text())["train_tokens"])],
        ("(train) holds", "fewer than model.seq_len + 1", "prepare more text or lower model.seq_len"),
    ),
    Case(
        "data-empty-files",
        lambda c: (
            c.write("zero/train.bin", b""),
            c.write("zero/val.bin", b""),
            ["train", *c.set(data__dir=c.tmp / "zero")],
        )[-1],
        ("train.bin holds 0 tokens", "model.seq_len + 1"),
    ),
    # --- run dir and world size ---
    Case(
        "run-dir-is-a-file",
        lambda c: (c.write("run", "not a folder"), ["train", *c.set()])[1],
        (
            "run_dir",
            "is a file, not a folder",
        ),
        torch_free=True,
    ),
    Case(
        "world-size-mismatch",
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
        ("world size 3 does not match parallel.dp x parallel.pp = 1 x 1", "launch 1 processes"),
        subprocess=True,
        env={"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"},
        torch_free=True,
    ),
    Case(
        "stray-rank-without-master",
        _pp(parallel__dp=2, parallel__pp=2),
        (
            "RANK and WORLD_SIZE are set, so meshrun took this process for a torchrun worker",
            "MASTER_ADDR",
            "unset RANK and WORLD_SIZE",
        ),
        subprocess=True,
        env={"RANK": "0", "WORLD_SIZE": "4"},
        torch_free=True,
    ),
    Case(
        "stray-world-size-not-a-number",
        _pp(),
        ("took this process for a torchrun worker", "WORLD_SIZE='four' is not a number"),
        env={"RANK": "0", "WORLD_SIZE": "four"},
        torch_free=True,
    ),
    Case(
        "stray-rank-beyond-the-world",  # hung in init_process_group, waiting for ranks 0-2
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
        ("took this process for a torchrun worker", "RANK='3' is not a rank below WORLD_SIZE=1"),
        env={"RANK": "3", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29555"},
        torch_free=True,
    ),
    Case(
        "stray-master-port-not-a-port",
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
        ("took this process for a torchrun worker", "MASTER_PORT='abc' is not a port"),
        env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "abc"},
        torch_free=True,
    ),
    Case(
        "stray-master-addr-unresolvable",  # c10d retried for over 100 s with repeated warnings
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
        ("took this process for a torchrun worker", "MASTER_ADDR 'nonexistent.invalid' does not resolve"),
        subprocess=True,
        env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "nonexistent.invalid", "MASTER_PORT": "29555"},
        torch_free=True,
    ),
    *(
        Case(  # `[::1` passed the check (brackets stripped) and torch retried it until its timeout
            f"stray-master-{name}",
            lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
            ("took this process for a torchrun worker", said),
            env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29555", **env},
            torch_free=True,
        )
        for name, env, said in (
            ("addr-bracket-open", {"MASTER_ADDR": "[::1"}, "MASTER_ADDR='[::1' is not an IPv6 address in brackets"),
            ("addr-empty", {"MASTER_ADDR": ""}, "MASTER_ADDR='' is empty"),
            ("addr-space", {"MASTER_ADDR": "local host"}, "MASTER_ADDR='local host' contains spaces"),
            ("addr-bad-ipv6", {"MASTER_ADDR": "::1::2"}, "MASTER_ADDR='::1::2' is not an IPv6 address"),
            ("port-space", {"MASTER_PORT": " 29555"}, "MASTER_PORT=' 29555' is not a port (1-65535)"),
            ("port-zero", {"MASTER_PORT": "0"}, "MASTER_PORT='0' is not a port (1-65535)"),
        )
    ),
    Case(
        "rdzv-endpoint-bracket-open",
        lambda c: ["train", *c.set(), "--rdzv-endpoint", "[::1:29400"],
        ("invalid launch.rdzv_endpoint", "host '[::1:29400' is not an IPv6 address in brackets"),
        torch_free=True,
    ),
    Case(
        "local-addr-with-a-space",
        lambda c: ["train", *c.set(), "--local-addr", "10.0.0 .1"],
        ("invalid launch.local_addr", "'10.0.0 .1' contains spaces"),
        torch_free=True,
    ),
    Case(
        "stray-local-rank-not-a-number",  # a 14-line ValueError traceback
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1)],
        ("took this process for a torchrun worker", "LOCAL_RANK='abc' is not a number"),
        env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"},
        torch_free=True,
    ),
    Case(
        "rdzv-endpoint-unresolvable",  # 36 lines of torchrun warnings and no answer in 75 s
        lambda c: ["train", *c.set(), "--rdzv-endpoint", "nonexistent.invalid:29400"],
        ("--rdzv-endpoint) host 'nonexistent.invalid' does not resolve",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "run-dir-holds-someone-elses-metrics",  # summary.json was deleted, metrics.jsonl truncated
        lambda c: ["train", *c.set(), f"--set=run_dir={c.write('theirs/metrics.jsonl', '{}').parent}"],
        ("run_dir", "already holds metrics.jsonl but no meshrun config.json", "new folder"),
        torch_free=True,
    ),
    Case(  # a path error: found before torch is imported (it took 4 s)
        "model-hf-not-a-folder",
        lambda c: ["train", *c.set(model__hf=str(c.tmp / "no-model"))],
        ("model.hf", "no-model is not a directory", "config.json"),
        torch_free=True,
    ),
    Case(  # settings of a mode the layout does not use: silently ignored before
        "fsdp-setting-under-ddp",
        lambda c: ["train", *c.set(parallel__fsdp_param_dtype="bf16")],
        ("parallel.fsdp_param_dtype is for dp_mode fsdp/hsdp (dp_mode is ddp)", "parallel.dp_mode=fsdp"),
        torch_free=True,
    ),
    Case(
        "virtual-stages-without-a-pipeline",
        lambda c: ["train", *c.set(parallel__virtual_stages=4)],
        ("parallel.virtual_stages is for a pipeline (pp is 1)",),
        torch_free=True,
    ),
    # --- context parallelism (parallel.cp) ---
    Case(  # each cp rank holds seq_len / cp positions
        "cp-seq-len-does-not-divide",
        lambda c: ["train", *c.set(parallel__cp=2, model__seq_len=15)],
        ("model.seq_len (15) must be divisible by parallel.cp (2); change one of these keys",),
        torch_free=True,
    ),
    Case(  # and seq_len / (cp x tp) under sequence parallel
        "cp-sequence-parallel-seq-len-does-not-divide",
        lambda c: [
            "train",
            *c.set(
                parallel__cp=2, parallel__tp=2, parallel__sequence_parallel=True, model__num_heads=4, model__seq_len=18
            ),
        ],
        ("model.seq_len (18) must be divisible by parallel.cp x parallel.tp (2 x 2 = 4)",),
        torch_free=True,
    ),
    Case(  # whole heads per cp rank, after tp's split
        "cp-does-not-divide-heads",
        lambda c: ["train", *c.set(parallel__cp=2, parallel__tp=2, model__num_heads=2)],
        ("model.num_heads (2) must be divisible by parallel.tp x parallel.cp (2 x 2 = 4)", "not repeated"),
        torch_free=True,
    ),
    Case(  # the encoder-decoder's attention is not split by position
        "cp-encdec",
        lambda c: ["train", *c.set(parallel__cp=2, model__name="encdec")],
        ("parallel.cp 2 is not supported for model.name encdec; it works with the built-in gpt or a Hugging Face",),
        torch_free=True,
    ),
    Case(  # key/value heads come from config.json: not repeated to make them divide
        "cp-does-not-divide-hf-kv-heads",
        lambda c: [
            "train",
            *c.set(
                model__hf=c.write("m/config.json", json.dumps({**HF_LLAMA, "num_key_value_heads": 1})).parent,
                parallel__cp=2,
            ),
        ],
        ("num_key_value_heads in", "m/config.json (1) must be divisible by parallel.cp (2)"),
    ),
    Case(  # a block holding the all-to-alls is not one graph
        "cp-strict-compile",
        lambda c: ["train", *c.set(parallel__cp=2, train__compile=True)],
        ("train.compile true compiles each block as one graph, which parallel.cp 2's all-to-alls break",),
        torch_free=True,
    ),
    Case(  # GPT-2's fused attention is not among the decoders cp splits
        "cp-hf-gpt2",
        lambda c: ["train", *c.set(model__hf_config=HF_GPT2, parallel__cp=2)],
        ("parallel.cp 2 is not supported for Hugging Face model_type gpt2; it works with",),
    ),
    # --- activation offload (train.offload_activations) ---
    Case(
        "offload-policy-unknown",
        lambda c: ["train", *c.set(train__offload_activations="every:0")],
        ("invalid train.offload_activations: use true, false or every:N with N >= 1 (got 'every:0')",),
        torch_free=True,
    ),
    Case(  # a block is either recomputed or offloaded
        "offload-with-full-recompute",
        lambda c: ["train", *c.set(train__offload_activations=True, recompute="full")],
        ("train.offload_activations offloads no block: recompute full recomputes every block",),
        torch_free=True,
    ),
    # --- tensor parallelism (parallel.tp) ---
    Case(  # a tp group's ranks are neighbours on one node
        "tp-does-not-divide-nproc-per-node",
        lambda c: [
            "train",
            *c.set(
                parallel__tp=2,
                launch__nnodes=2,
                launch__nproc_per_node=1,
                launch__rdzv_endpoint="localhost:29400",
            ),
        ],
        ("parallel.tp (2) must divide launch.nproc_per_node (1)",),
        torch_free=True,
    ),
    Case(
        "tp-does-not-divide-workers-per-node",
        lambda c: ["train", *c.set(parallel__tp=2, launch__nnodes=2, launch__rdzv_endpoint="localhost:29400")],
        ("parallel.tp (2) must divide the workers per node (1", "launch.nnodes"),
        torch_free=True,
    ),
    Case(  # whole heads per shard
        "tp-does-not-divide-heads",
        lambda c: ["train", *c.set(parallel__tp=4, model__num_heads=2)],
        ("model.num_heads (2) must be divisible by parallel.tp (4)",),
        torch_free=True,
    ),
    Case(  # the encoder-decoder splits whole heads too
        "tp-does-not-divide-encdec-heads",
        lambda c: ["train", *c.set(parallel__tp=2, model__name="encdec", model__num_heads=1)],
        ("model.num_heads (1) must be divisible by parallel.tp (2)",),
        torch_free=True,
    ),
    Case(  # a setting tp 1 does not use is refused, not ignored
        "sequence-parallel-without-tp",
        lambda c: ["train", *c.set(parallel__sequence_parallel=True)],
        ("parallel.sequence_parallel splits activations over the tp ranks but tp is 1", "parallel.tp > 1"),
        torch_free=True,
    ),
    Case(  # each tp rank holds seq_len / tp positions
        "sequence-parallel-seq-len-does-not-divide",
        lambda c: ["train", *c.set(parallel__tp=2, parallel__sequence_parallel=True, model__seq_len=15)],
        ("model.seq_len (15) must be divisible by parallel.tp (2) under parallel.sequence_parallel",),
        torch_free=True,
    ),
    Case(  # ep spanning tp: each tp rank routes seq_len / tp positions
        "ep-over-tp-seq-len-does-not-divide",
        lambda c: ["train", *c.set(parallel__tp=2, parallel__ep=2, model__moe__num_experts=4, model__seq_len=15)],
        ("model.seq_len (15) must be divisible by parallel.tp (2) under parallel.ep 2 spanning tp", "parallel.dp (1)"),
        torch_free=True,
    ),
    Case(  # ep divides dp, or is tp times a divisor of dp: nothing else
        "ep-neither-within-dp-nor-over-tp",
        lambda c: ["train", *c.set(parallel__dp=2, parallel__tp=2, parallel__ep=3, model__moe__num_experts=6)],
        ("parallel.ep (3) must divide parallel.dp (2), or be parallel.tp (2) times a divisor of it",),
        torch_free=True,
    ),
    Case(  # Hugging Face sizes come from config.json: kv heads split whole (grouped-query attention)
        "tp-does-not-divide-hf-kv-heads",
        lambda c: [
            "train",
            *c.set(
                model__hf=c.write("m/config.json", json.dumps({**HF_LLAMA, "num_key_value_heads": 2})).parent,
                parallel__tp=4,
            ),
        ],
        ("num_key_value_heads in", "m/config.json (2) must be divisible by parallel.tp (4)"),
    ),
    Case(  # transformers slices GPT-2's fused c_attn (a Conv1D) by the config's head counts
        "tp-hf-fused-projections",
        lambda c: [
            "train",
            *c.set(
                model__hf_config=HF_GPT2,
                parallel__tp=2,
            ),
        ],
        ("parallel.tp 2: gpt2 fuses its projections (c_attn, a Conv1D of q, k and v)", "set parallel.tp=1", "phi3"),
    ),
    Case(  # Phi-3's fused projections split by their parts: whole kv heads per rank, as for Llama
        "tp-does-not-divide-phi3-kv-heads",
        lambda c: [
            "train",
            *c.set(
                model__hf_config={
                    **HF_LLAMA,
                    "model_type": "phi3",
                    "num_key_value_heads": 2,
                    "pad_token_id": 0,
                    "eos_token_id": 1,
                },
                parallel__tp=4,
            ),
        ],
        ("num_key_value_heads in model.hf_config (2) must be divisible by parallel.tp (4)",),
    ),
    Case(
        "profile-steps-after-the-last",
        lambda c: ["train", *c.set(profile__steps=[100], train__steps=2)],
        ("profile.steps [100] come after the last step (train.steps is 2)",),
        torch_free=True,
    ),
    Case(
        "wandb-mode-env-not-a-mode",  # wandb raised in every worker, even with tracker.mode disabled
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=1, tracker__mode="disabled")],
        ("WANDB_MODE='Offline' is not a wandb mode", "online, offline or disabled"),
        env={"WANDB_MODE": "Offline"},
        torch_free=True,
    ),
    # --- config files that are not YAML configs ---
    Case(
        "config-binary",
        _file("model.bin", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
        ("config file", "model.bin is not UTF-8 text", "byte 0x89 at offset 0"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "config-latin1",
        _file("latin.yaml", "tracker:\n  name: caf\xe9\n".encode("latin-1")),
        ("latin.yaml is not UTF-8 text", "byte 0xe9"),
        torch_free=True,
    ),
    Case(
        "config-nul-bytes",
        _file("nul.yaml", b"train:\n  lr: 0.1\x00\n"),
        ("nul.yaml holds NUL bytes",),
        torch_free=True,
    ),
    Case(
        "config-dev-zero",
        lambda c: ["train", "/dev/zero", *c.set()],
        ("config file /dev/zero is larger than 64 KiB",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "config-huge",
        _file("huge.yaml", "train:\n" + "  # padding\n" * 10_000),
        ("huge.yaml is larger than 64 KiB",),
        torch_free=True,
    ),
    Case(
        "config-is-a-folder",
        lambda c: ["train", str(c.folder("configs")), *c.set()],
        ("cannot read config file", "configs: Is a directory"),
        torch_free=True,
    ),
    Case(
        "config-empty",
        _file("empty.yaml", ""),
        ("empty.yaml is empty (no keys)", "leave out the file"),
        torch_free=True,
    ),
    Case(
        "config-comment-only",
        _file("comments.yaml", "# train:\n#   lr: 0.1\n\n"),
        ("comments.yaml is empty (no keys)",),
        torch_free=True,
    ),
    Case(
        "yaml-recursive-anchor",
        _file("loop.yaml", "train: &t\n  lr: *t\n"),
        ("loop.yaml", "contains itself", "recursive YAML anchor", "remove the alias"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "yaml-alias-bomb",
        _file("bomb.yaml", ALIAS_BOMB),
        ("bomb.yaml holds more than 10000 values", "alias bomb"),
        torch_free=True,
    ),
    Case("yaml-deep-nesting", _file("deep.yaml", "[" * 60_000), ("deep.yaml is nested too deeply",), torch_free=True),
    Case(
        "yaml-duplicate-key",
        _file("dup.yaml", "train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n"),
        ("dup.yaml: key train.lr appears twice (lines 2 and 4); keep one",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "yaml-duplicate-section",
        _file("dupsec.yaml", "train:\n  lr: 0.1\nmodel:\n  dim: 32\ntrain:\n  steps: 3\n"),
        ("key train appears twice (lines 1 and 5)",),
        torch_free=True,
    ),
    Case(
        "yaml-off-is-a-word",
        lambda c: [
            "train",
            str(c.write("off.yaml", "tracker:\n  mode: off\n")),
            *(a for a in c.set() if "tracker.mode" not in a),
        ],
        ("invalid tracker.mode", "'online', 'offline' or 'disabled'", '(got "off")', "did you mean disabled?"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "set-mode-off", lambda c: ["train", *c.set(tracker__mode="off")], ("did you mean disabled?",), torch_free=True
    ),
    Case(
        "set-mode-no",
        lambda c: ["train", *c.set(tracker__mode="no")],
        ('(got "no")', "did you mean disabled?"),
        torch_free=True,
    ),
    # --- values: choices, numbers, names ---
    Case(
        "precision-misspelt",
        lambda c: ["train", *c.set(precision="bf61")],
        ("invalid precision", "'auto', 'fp32', 'bf16' or 'fp16'", "did you mean bf16?"),
        torch_free=True,
    ),
    Case(
        "schedule-misspelt",
        lambda c: ["train", *c.set(parallel__schedule="1FB1")],
        ("invalid parallel.schedule", "did you mean 1f1b?"),
        torch_free=True,
    ),
    Case(
        "betas-one-or-more",
        lambda c: ["train", *c.set(train__betas="[0.9,1.0]")],
        ("invalid train.betas[1]", "less than 1", "1.0"),
        torch_free=True,
    ),
    Case(
        "betas-negative",
        lambda c: ["train", *c.set(train__betas="[-0.1,0.95]")],
        ("invalid train.betas[0]", "greater than or equal to 0"),
        torch_free=True,
    ),
    Case(
        "betas-one-value",
        lambda c: ["train", *c.set(train__betas="[0.9]")],
        ("invalid train.betas", "give two numbers [beta1, beta2], each in [0, 1)"),
        torch_free=True,
    ),
    Case(
        "betas-not-a-list",
        lambda c: ["train", *c.set(train__betas="0.9")],
        ("invalid train.betas", "give two numbers"),
        torch_free=True,
    ),
    Case(
        "optimizer-unknown",
        lambda c: ["train", *c.set(train__optimizer="adagrad")],
        ("invalid train.optimizer", "'adamw', 'adam', 'sgd' or 'rmsprop'", "adagrad"),
        torch_free=True,
    ),
    Case(
        "momentum-for-adamw",  # an option the chosen optimizer does not take is refused, not ignored
        lambda c: ["train", *c.set(train__momentum=0.9)],
        ("train.momentum is an option of sgd and rmsprop, not of train.optimizer adamw",),
        torch_free=True,
    ),
    Case(
        "betas-for-sgd",
        lambda c: ["train", *c.set(train__optimizer="sgd", train__betas="[0.8,0.9]")],
        ("train.betas is an option of adamw and adam, not of train.optimizer sgd",),
        torch_free=True,
    ),
    Case(
        "alpha-for-adam",
        lambda c: ["train", *c.set(train__optimizer="adam", train__alpha=0.9)],
        ("train.alpha is an option of rmsprop, not of train.optimizer adam",),
        torch_free=True,
    ),
    Case(
        "nesterov-without-momentum",
        lambda c: ["train", *c.set(train__optimizer="sgd", train__nesterov=True)],
        ("train.nesterov needs train.momentum > 0",),
        torch_free=True,
    ),
    Case(
        "lr-infinite",
        lambda c: ["train", *c.set(train__lr=".inf")],
        ("invalid train.lr", "finite number"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "lr-nan", lambda c: ["train", *c.set(train__lr=".nan")], ("invalid train.lr", "finite number"), torch_free=True
    ),
    Case(
        "grad-clip-infinite",
        lambda c: ["train", *c.set(train__grad_clip="inf")],
        ("invalid train.grad_clip", "finite"),
        torch_free=True,
    ),
    Case(
        "steps-true",
        lambda c: ["train", *c.set(train__steps="true")],
        ("invalid train.steps", "expected a number, got true"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "dp-false",
        lambda c: ["train", *c.set(parallel__dp="false")],
        ("invalid parallel.dp", "got false"),
        torch_free=True,
    ),
    Case("lr-true", lambda c: ["train", *c.set(train__lr="true")], ("invalid train.lr", "got true"), torch_free=True),
    Case(
        "run-dir-empty",
        lambda c: ["train", *c.set(), "--set", 'run_dir=""'],
        ("invalid run_dir", "is empty", "current directory"),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "run-dir-blank",
        lambda c: ["train", *c.set(), "--set", "run_dir='  '"],
        ("invalid run_dir", "is empty"),
        torch_free=True,
    ),
    Case(
        "section-null",
        _file("null.yaml", "checkpoint:\ntrain:\n  lr: 0.1\n"),
        ("invalid checkpoint", "expected a section of keys", "got null"),
        torch_free=True,
    ),
    # --- dry run checks what a run checks ---
    Case(
        "dry-run-data-dir-missing",
        lambda c: ["train", *c.set(data__dir="/nonexistent"), "--dry-run"],
        ("data.dir /nonexistent holds no prepared dataset",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "dry-run-layout",
        lambda c: ["train", *c.set(parallel__pp=8), "--dry-run"],
        ("8 pipeline stages",),
        torch_free=True,
    ),
    # --- one preflight: slurm and plan refuse what train refuses, before torch is imported ---
    Case(
        "slurm-pp-more-than-layers",
        lambda c: ["slurm", *c.set(parallel__pp=8, train__global_batch=16), "--nodes=2", "--gpus-per-node=4"],
        ("8 pipeline stages", "model.num_layers is 4"),
        torch_free=True,
    ),
    Case(
        "slurm-data-dir-missing",
        lambda c: ["slurm", *c.set(data__dir=c.tmp / "nowhere"), "--nodes=1", "--gpus-per-node=1"],
        ("nowhere holds no prepared dataset",),
        torch_free=True,
    ),
    Case(
        "profile-ranks-beyond-world",
        lambda c: ["train", *c.set(parallel__dp=2, profile__ranks="[0,2]")],
        ("profile.ranks [2] do not exist: ranks are 0 to 1",),
        torch_free=True,
    ),
    Case(
        "nnodes-do-not-divide-workers",
        lambda c: ["train", *c.set(parallel__dp=2), "--nnodes=3", "--rdzv-endpoint=127.0.0.1:1"],
        ("launch.nnodes (3) must divide parallel.dp x parallel.pp (2 x 1 = 2)",),
        torch_free=True,
    ),
    Case(
        "plan-write-exists",
        lambda c: ["plan", *c.set(), "--write", str(c.write("best.yaml", "train:\n  lr: 1\n"))],
        ("--write", "best.yaml already exists"),
        torch_free=True,
    ),
    Case(
        "plan-calibration-missing",  # silently fell back to the default fit
        lambda c: ["plan", *c.set(), "--gpu", "h100", "--calibration", str(c.tmp / "nope.json")],
        ("--calibration", "nope.json is not a file", "--calibrate"),
        torch_free=True,
    ),
    Case(
        "plan-calibration-not-a-record",  # a JSONDecodeError traceback
        lambda c: ["plan", *c.set(), "--gpu", "h100", "--calibration", str(c.write("bad.json", "{"))],
        ("bad.json is not a calibration record", "meshrun plan --calibrate"),
    ),
    Case(
        "plan-calibration-field-not-a-number",  # a TypeError traceback in the cost model, later
        lambda c: [
            "plan",
            *c.set(),
            "--gpu",
            "h100",
            "--calibration",
            str(c.write("odd.json", '{"device": "h100", "achieved_flops": "fast"}')),
        ],
        ("odd.json is not a calibration record", "meshrun plan --calibrate"),
    ),
    *(
        Case(
            f"plan-calibration-{name}",
            lambda c, text=text: ["plan", *c.set(), "--calibration", str(c.write("cal.json", text))],
            ("cal.json is not a calibration record", *expect, "meshrun plan --calibrate"),
        )
        for name, text, expect in (
            # each printed NaN step times, or was a traceback (ZeroDivisionError, OverflowError, RecursionError)
            ("huge", '{"device": "cpu", "step_s": 1e308}', ("step_s is 1e+308, not a measured value from 0 to 1e+06",)),
            ("zero-flops", '{"device": "cpu", "achieved_flops": 0}', ("achieved_flops is 0",)),
            ("zero-devices", '{"device": "cpu", "parallel_devices": 0}', ("parallel_devices is 0",)),
            ("huge-int", '{"device": "cpu", "p2p_s": ' + "9" * 400 + "}", ("p2p_s is 9999",)),
            ("nested", '{"device": "cpu", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", ()),
            ("inf-string", '{"device": "cpu", "achieved_flops": "inf"}', ("achieved_flops is 'inf', not a number",)),
        )
    ),
    Case(
        "plan-calibration-unknown-device",  # blamed --gpu, which was not given
        lambda c: ["plan", *c.set(), "--calibration", str(c.write("cal.json", '{"device": "tpu9"}'))],
        ("cal.json names its device 'tpu9', which meshrun does not know; pass --gpu",),
    ),
    Case(
        "report-run-config-not-a-run",  # a KeyError traceback
        lambda c: ["report", str(c.write("badrun/config.json", "{}").parent)],
        ("badrun/config.json is not a meshrun run's resolved config",),
    ),
    Case(
        "plan-factory-missing",
        lambda c: ["plan", *c.set(model__factory="no_such_module_xyz:build")],
        ("invalid model.factory 'no_such_module_xyz:build'",),
    ),
    Case(
        "dry-run-data-too-small",
        lambda c: [
            "train",
            *c.set(model__seq_len=json.loads((c.data_dir / "meta.json").read_text())["train_tokens"]),
            "--dry-run",
        ],
        ("fewer than model.seq_len + 1",),
    ),
    # --- data prepared on first use ---
    Case(
        "data-tokenizer-misspelt",
        lambda c: ["train", *c.set(data__tokenizer="bpe2048")],
        ("invalid data", "data.tokenizer 'bpe2048'", "use bpe:VOCAB"),
        torch_free=True,
    ),
    Case(
        "zero-bubble-with-selective-recompute",
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=2, parallel__schedule="zbv", recompute="selective")],
        ("schedule zbv with recompute selective is refused", "set recompute to full or none"),
        torch_free=True,
    ),
    Case(
        "zbv-with-evaluation",
        lambda c: ["train", *c.set(parallel__dp=1, parallel__pp=2, parallel__schedule="zbv", train__eval_interval=2)],
        ("schedule zbv cannot evaluate", "train.eval_interval=0"),
        torch_free=True,
    ),
    Case(
        "data-tokenizer-missing-path",
        lambda c: [
            "train",
            *c.set(data__dir=c.tmp / "fresh", data__tokenizer=c.tmp / "no-tokenizer.json"),
            *("--set", f"data.sources=[{c.write('a.txt', 'text')}]"),
        ],
        ("data.tokenizer", "no-tokenizer.json does not exist", "bpe:VOCAB"),
        torch_free=True,
    ),
    Case(
        "data-sources-without-dir",
        lambda c: ["train", *c.set(), "--set", "data.dir=null", "--set", "data.sources=[a.txt]"],
        ("data.sources needs data.dir",),
        torch_free=True,
    ),
    # --- the user's model factory ---
    Case(
        "factory-syntax-error",
        _module("mt_syntax", "def build(cfg)\n    return None\n", "mt_syntax:build"),
        ("invalid model.factory 'mt_syntax:build'", "SyntaxError in", "mt_syntax.py line 1", "fix the module"),
        subprocess=True,
    ),
    Case(
        "factory-import-raises",
        _module("mt_boom", "raise RuntimeError('no GPU here')\n", "mt_boom:build"),
        (
            "invalid model.factory 'mt_boom:build'",
            "importing mt_boom raised RuntimeError: no GPU here",
        ),
    ),
    Case(  # the model names its split; this one declares none
        "tp-model-without-a-plan",
        lambda c: [
            *_module(
                "mt_noplan",
                "from meshrun.models.gpt import GPT\n\n\nclass Whole(GPT):\n"
                "    def tp_plan(self):\n        return None\n\n\n"
                "def build(cfg):\n    return Whole(cfg)\n",
                "mt_noplan:build",
            )(c),
            "--set=parallel.tp=2",
        ],
        (
            "parallel.tp 2: model.factory mt_noplan:build declares no tensor-parallel plan",
            "model.name gpt, encdec, encoder or timeseries",
        ),
    ),
    Case(  # a user model's plan names a style parallel/tensor.py does not know
        "tp-plan-unknown-style",
        lambda c: [
            *_module(
                "mt_badplan",
                "from meshrun.models.gpt import GPT\n\n\nclass Diagonal(GPT):\n"
                "    def tp_plan(self):\n        return {'blocks.*.mlp.fc': 'diagonal'}\n\n\n"
                "def build(cfg):\n    return Diagonal(cfg)\n",
                "mt_badplan:build",
            )(c),
            "--set=parallel.tp=2",
        ],
        ("model.factory mt_badplan:build's tp_plan gives blocks.*.mlp.fc style 'diagonal'", "choose one of colwise"),
    ),
    Case(  # a plan of colwise/rowwise only does not say where activations split by sequence
        "sequence-parallel-plan-without-scatter",
        lambda c: [
            *_module(
                "mt_nosp",
                "from meshrun.models.gpt import GPT\n\n\nclass Plain(GPT):\n"
                "    def tp_plan(self):\n        return {'blocks.*.mlp.fc': 'colwise', 'blocks.*.mlp.proj': 'rowwise'}\n\n\n"
                "def build(cfg):\n    return Plain(cfg)\n",
                "mt_nosp:build",
            )(c),
            "--set=parallel.tp=2",
            "--set=parallel.sequence_parallel=true",
        ],
        ("parallel.sequence_parallel: model.factory mt_nosp:build's tp_plan has no scatter", "sequence_parallel=false"),
    ),
    Case(  # the encoder-decoder splits its source and its target by position
        "sequence-parallel-encdec-source-does-not-divide",
        lambda c: [
            "train",
            *c.set(parallel__tp=2, parallel__sequence_parallel=True, model__name="encdec", model__source_len=7),
        ],
        ("model.source_len (7) must be divisible by parallel.tp (2) under parallel.sequence_parallel",),
        torch_free=True,
    ),
    Case(  # a length bucket's batches are split by position too
        "sequence-parallel-bucket-does-not-divide",
        lambda c: ["train", *c.set(parallel__tp=2, parallel__sequence_parallel=True, data__buckets=[7])],
        ("data.buckets[0] (7) must be divisible by parallel.tp (2) under parallel.sequence_parallel",),
        torch_free=True,
    ),
    Case(
        "factory-sys-exit",
        _module("mt_exit", "import sys\n\ndef build(cfg):\n    sys.exit(3)\n", "mt_exit:build"),
        ("model.factory mt_exit:build called sys.exit(3) while building the model", "raise an exception"),
        subprocess=True,
    ),
    Case(
        "factory-sys-exit-on-import",
        _module("mt_exit_import", "import sys\nsys.exit('bye')\n", "mt_exit_import:build"),
        ("invalid model.factory 'mt_exit_import:build'", "called sys.exit('bye')"),
    ),
    Case(
        "factory-in-current-directory",
        _module("mt_here", "def build(cfg):\n    return None\n", "mt_here:build", folder="workdir"),
        ("No module named 'mt_here'", "mt_here.py is in the current directory", "PYTHONPATH=."),
        cwd="workdir",
    ),
    # --- sample and export arguments ---
    Case("sample-tokens-negative", _sample("--tokens", "-5"), ("--tokens must be at least 1", "-5"), torch_free=True),
    Case(
        "sample-temperature-nan",
        _sample("--temperature", "nan"),
        ("--temperature must be a number in [0, 1000]",),
        torch_free=True,
    ),
    Case(
        "sample-temperature-huge",  # logits / 1e308 made the probabilities nan: a traceback
        _sample("--temperature", "1e308"),
        ("--temperature must be a number in [0, 1000]",),
        torch_free=True,
    ),
    Case(
        "sample-seed-beyond-64-bits",  # torch's manual_seed raised an overflow traceback
        _sample("--seed", "99999999999999999999999"),
        ("--seed must fit in 64 bits",),
        torch_free=True,
    ),
    Case("sample-temperature-negative", _sample("--temperature", "-1"), ("--temperature", "got -1.0"), torch_free=True),
    Case("sample-top-k-negative", _sample("--top-k", "-3"), ("--top-k must be >= 0", "-3"), torch_free=True),
    Case(
        "sample-prompt-not-utf8",
        _sample("--prompt", "def \udcff"),
        ("--prompt is not valid UTF-8",),
        subprocess=True,
        torch_free=True,
    ),
    Case(
        "sample-checkpoint-missing",
        lambda c: ["sample", str(c.tmp / "no-run")],
        ("no-run does not exist",),
        torch_free=True,
    ),
    Case(
        "export-out-under-a-file",
        lambda c: (
            c.write("afile", "x"),
            ["export", str(c.folder("ckpt")), "--out", str(c.tmp / "afile" / "m.safetensors")],
        )[1],
        ("--out", "afile is a file, not a folder", "choose another --out"),
        subprocess=True,
        torch_free=True,
    ),
    Case(  # these were found only after the whole checkpoint was consolidated
        "export-out-exists",
        lambda c: ["export", str(c.folder("ckpt")), "--out", str(c.write("m.pt", "mine"))],
        ("--out", "m.pt already exists", "choose another --out"),
        torch_free=True,
    ),
    Case(
        "export-out-wrong-suffix",
        lambda c: ["export", str(c.folder("ckpt")), "--out", str(c.tmp / "model.bin")],
        (
            "--out",
            "model.bin: use a .safetensors or .pt file name",
        ),
        torch_free=True,
    ),
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
    assert not INTERNAL_WORDS.search(lines[0]), f"internal name in {lines[0]!r}"
    assert "starting" not in err and "Traceback" not in err


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """In-process rows: a worker starting (here, or via torchrun) fails the test at once."""

    def tripwire(*args: object, **kwargs: object) -> int:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(job, "run_worker", tripwire)  # one process: the worker runs here
    monkeypatch.setattr(local_launch, "run_torchrun", tripwire)  # several: torchrun is started
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
    assert len(CASES) >= 80
    assert sum(c.subprocess for c in CASES) >= 5
    assert sum(c.torch_free for c in CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_refused_in_process(
    case: Case,
    data_dir: Path,
    tmp_path: Path,
    no_workers: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctx = Ctx(data_dir, tmp_path)
    argv = case.argv(ctx)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path / case.cwd)
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


TORCH_FREE_RUNNER = """
import json, os, sys
from meshrun import cli
assert "torch" not in sys.modules, "importing meshrun.cli imported torch"
base, results = dict(os.environ), []
for row in json.load(sys.stdin):
    os.environ.clear()
    os.environ.update(base, **row["env"])
    os.chdir(row["cwd"])
    results.append({"id": row["id"], "rc": cli.main(row["argv"]), "torch": "torch" in sys.modules})
    if results[-1]["torch"]:
        break
print(json.dumps(results))
"""


def test_torch_free_rows_are_refused_before_torch_is_imported(data_dir: Path, tmp_path: Path) -> None:
    """Layout, path, environment and argument errors come before `import torch` (seconds on a
    busy machine), so they are answered at once. All rows run in one fresh interpreter, in order;
    after each, torch must still be absent from sys.modules."""
    rows = []
    for case in (c for c in CASES if c.torch_free):
        ctx = Ctx(data_dir, tmp_path / case.id)
        ctx.folder(case.cwd)
        rows.append({"id": case.id, "argv": case.argv(ctx), "env": case.env, "cwd": str(ctx.tmp / case.cwd)})
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_RUNNER],
        input=json.dumps(rows),
        env=meshrun_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert [r["id"] for r in results] == [row["id"] for row in rows], f"stopped after {results[-1]}"
    assert [r["id"] for r in results if r["torch"]] == []
    assert [r["id"] for r in results if r["rc"] != 2] == []


@pytest.mark.parametrize(
    "override,key,value",
    [
        ("precision=BF16", "precision", "bf16"),
        ("parallel.schedule=1F1B", "parallel.schedule", "1f1b"),
        ("parallel.balance=Even", "parallel.balance", "even"),
        ("tracker.mode=Disabled", "tracker.mode", "disabled"),
        ("recompute=EVERY:2", "recompute", "every:2"),
        ("checkpoint.at_end=no", "checkpoint.at_end", False),  # a word for a yes/no key is still fine
        ("tracker.name=off", "tracker.name", "off"),  # YAML 1.1 would have made this False
        ("train.steps=12", "train.steps", 12),
    ],
)
def test_accepted_spellings(override: str, key: str, value: object) -> None:
    cfg = load_config(None, [override])
    section, _, leaf = key.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, leaf) == value


def test_a_mapping_override_sets_its_keys_and_keeps_the_others() -> None:
    default = load_config(None)
    cfg = load_config(None, ["model={dim: 64, num_heads: 8}", "train.betas=[0.8, 0.9]"])
    assert (cfg.model.dim, cfg.model.num_heads) == (64, 8)
    assert (
        cfg.model.model_copy(update={"dim": default.model.dim, "num_heads": default.model.num_heads}) == default.model
    )
    assert cfg.train.betas == (0.8, 0.9)  # a list replaces


@pytest.mark.parametrize("text", ["2024_01", "0123", "1:30", "0x1F", "1e3", "2024-01-01", "007.50"])
def test_text_keys_take_the_text_as_written(text: str, tmp_path: Path) -> None:
    """YAML 1.1 reads these as numbers (202401, octal 83, base-60 90, hex 31, ...) or a date; keys
    typed as text (paths, names, ids) take them as written, in a file and in --set alike."""
    config = tmp_path / "strings.yaml"
    config.write_text(
        f"run_dir: {text}\ntracker: {{name: {text}}}\nlaunch: {{rdzv_id: {text}}}\n"
        f"data: {{dir: {text}, sources: [{text}, b]}}\n"
    )
    overrides = [f"{key}={text}" for key in ("run_dir", "tracker.name", "launch.rdzv_id", "data.dir")]
    for cfg in (load_config(config), load_config(None, [*overrides, f"data.sources=[{text}, b]"])):
        assert (cfg.run_dir, cfg.tracker.name, cfg.launch.rdzv_id, cfg.data.dir) == (text, text, text, text)
        assert cfg.data.sources == [text, "b"]
    assert load_config(None, ["train.steps=0x1F", "model.dim=1_024"]).train.steps == 31  # numbers stay numbers
    options = load_config(None, ["model.options={a: 12, b: [1.5]}"]).model.options  # free-form: plain numbers
    assert (type(options["a"]), type(options["b"][0])) == (int, float)


def test_every_path_key_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_dir: ~/x` was a folder named `~` in the current directory (only model.hf expanded `~`):
    every path key now reads a leading `~` as the home folder, in a file and in --set."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    config = tmp_path / "home.yaml"
    config.write_text(
        "run_dir: ~/run\ndata: {dir: ~/data, sources: [~/text/*.txt], tokenizer: ~/tok.json}\n"
        "train: {resume: ~/ckpt}\ntracker: {name: ~/not-a-path}\n"
    )
    overrides = ["run_dir=~/run", "data.dir=~/data", "data.sources=[~/text/*.txt]", "data.tokenizer=~/tok.json"]
    overrides += ["train.resume=~/ckpt", "tracker.name=~/not-a-path"]
    for cfg in (load_config(config), load_config(None, overrides)):
        assert (cfg.run_dir, cfg.data.dir, cfg.train.resume) == (f"{home}/run", f"{home}/data", f"{home}/ckpt")
        assert (cfg.data.sources, cfg.data.tokenizer) == ([f"{home}/text/*.txt"], f"{home}/tok.json")
        assert cfg.tracker.name == "~/not-a-path"  # a name, not a path
    mixture = load_config(None, ["data.mixture=[{dir: ~/a, weight: 1}]"]).data.mixture
    assert mixture[0].dir == f"{home}/a"


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs: refuses root too (permission bits do not); unmounted afterwards."""
    disk = tmp_path / "ro"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(disk)], check=False, capture_output=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (tests run as root): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_data_dir_to_prepare_on_a_read_only_disk_is_refused(
    read_only_disk: Path, tmp_path: Path, no_workers: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.sources are prepared into data.dir before training: run_dir's writability was checked,
    data.dir's was not (a 26-line traceback)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS) * 50)
    data = read_only_disk / "data"
    argv = ["train", *tiny(data, tmp_path / "run"), f"--set=data.sources=[{corpus}]"]
    assert cli.main(argv) == 2
    _assert_refused(2, capsys.readouterr().err, (f"data.dir {data} is not writable ({read_only_disk}: Read-only",))
    assert not (tmp_path / "run").exists()


def test_cli_flags_keep_their_text(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--rdzv-id 0123 is the id 0123 (it was 83), as the dry run's resolved config shows."""
    run_dir = tmp_path / "2024_01"
    assert cli.main(["train", "--dry-run", *tiny(data_dir, run_dir), "--rdzv-id", "0123"]) == 0
    resolved = capsys.readouterr().out
    assert "rdzv_id: '0123'" in resolved
    assert f"run_dir: {run_dir}" in resolved


def test_yaml_anchors_and_merge_keys_still_work(tmp_path: Path) -> None:
    """Refusing alias bombs and duplicate keys must not refuse ordinary anchors or `<<` merges."""
    config = tmp_path / "anchors.yaml"
    config.write_text("train:\n  <<: {steps: 7, lr: 0.5}\n  lr: 0.002\n  eval_interval: &n 5\n  log_interval: *n\n")
    cfg = load_config(config)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.eval_interval, cfg.train.log_interval) == (7, 0.002, 5, 5)


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_existing_run_is_refused_and_untouched(data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"mine": true}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = _snapshot(run_dir)
    result = run_meshrun(["train", *tiny(data_dir, run_dir)], tmp_path=tmp_path, timeout=60, check=False)
    _assert_refused(
        result.returncode,
        result.stderr,
        ("run_dir", "already holds files that are not a meshrun run", "set run_dir to a new folder"),
    )
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("train.resume=none", ("already holds a run", "set train.resume=auto to continue it, or a new run_dir")),
        ("model.dim=64", ("holds a run of a different model", "model.dim is 32 there, 64 here")),
    ],
)
def test_existing_run_is_not_continued_wrongly(
    override: str, fragments: tuple[str, ...], data_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    train_job(tiny(data_dir, run_dir, **{"train.steps": 1}), tmp_path=tmp_path)
    before = _snapshot(run_dir)
    result = meshrun_in_process(
        ["train", *tiny(data_dir, run_dir), f"--set={override}"], tmp_path=tmp_path, check=False
    )
    _assert_refused(result.returncode, result.stderr, fragments)
    assert _snapshot(run_dir) == before
