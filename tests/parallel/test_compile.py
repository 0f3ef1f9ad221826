"""train.compile: each block compiled with torch.compile trains the same numbers as eager, in one
process, under dp2 x pp2 1F1B, FSDP, pp2 ZBV (the backward in two passes) and tp2; a block that cannot compile runs eager after one
warning (auto) or stops the run in one line (true).

Tolerances, measured on a 2-core x86 CPU (inductor fuses and reorders the blocks' float32
reductions): the step-1 grad norm equals the plain-torch reference's exactly in all three layouts
(every step's within 1.7e-7 relative; the suite's 1e-5 asserted), weights after 10 clipped AdamW
steps within 1.8e-6 of the reference (the suite's 1e-5 asserted); a family's block gradients
within 2e-9 of eager (1e-6 asserted). Compiling costs ~15 s a process on a cold
cache: every launch here shares one inductor cache (TORCHINDUCTOR_CACHE_DIR), so only the first
compiles and the others load the same graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import final_weights, grad_norms, max_weight_diff, meshrun_env, run_meshrun, tiny
from plain_reference import assert_grad_norms_match
from test_checkpoint import interrupted_copy
from torch import nn

from meshrun.config.schema import load_config, validate
from meshrun.errors import RunError
from meshrun.parallel.compile import apply_compile, compile_enabled, compile_failures, is_compiled
from meshrun.parallel.materialise import materialise_part

# Clipping active every step (lr 3e-3, clip 0.5): a wrong gradient scale would show in the weights.
BASE = {"train.global_batch": 16, "train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5, "train.compile": True}
ROWS = {
    "one-process-selective": {"recompute": "selective", "checkpoint.interval": 5},
    "dp2-pp2-1f1b-every2": {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "recompute": "every:2"},
    "fsdp-dp2-full": {"parallel.dp": 2, "parallel.dp_mode": "fsdp", "recompute": "full"},
    "pp2-zbv": {"parallel.pp": 2, "parallel.schedule": "zbv"},  # the backward split in two passes
    "tp2": {"parallel.tp": 2},  # the blocks' DTensor hooks inside the compiled graph
}
PLAIN = {k: v for k, v in BASE.items() if k != "train.compile"}


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(scope="module")
def consoles() -> dict[str, str]:
    """Each row's console output (stderr), by row."""
    return {}


@pytest.fixture(scope="module")
def rows(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, inductor_cache: Path, consoles: dict[str, str]
) -> Callable[[str], Path]:
    """`rows(name)`: that row's finished compiled run, trained the first time a test asks for it."""
    tmp = tmp_path_factory.mktemp("compile-rows")

    def get(name: str) -> Path:
        run = tmp / name
        if name not in consoles:
            env = meshrun_env(tmp, TORCHINDUCTOR_CACHE_DIR=str(inductor_cache))
            args = ["train", *tiny(data_dir, run, **{**BASE, **ROWS[name]})]
            consoles[name] = run_meshrun(args, tmp_path=tmp, env=env, timeout=420).stderr
        return run

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_compiled_layout_trains_the_plain_torch_numbers(row: str, rows, plain_reference) -> None:
    run, reference = rows(row), plain_reference(**PLAIN)
    assert_grad_norms_match(grad_norms(run)[:1], reference.grad_norms[:1])
    assert max_weight_diff(final_weights(run), reference.weights) < 1e-5


@pytest.mark.timeout(900)
def test_an_eager_run_resumes_a_compiled_checkpoint(rows, data_dir: Path, tmp_path: Path, plain_reference) -> None:
    """Compiling leaves parameter names alone: an eager rerun continues from step 5 of a compiled run."""
    run = interrupted_copy(rows("one-process-selective"), tmp_path / "run", at_step=5)
    out = run_meshrun(["train", *tiny(data_dir, run, **{**ROWS["one-process-selective"], **PLAIN})], tmp_path=tmp_path)
    assert "resumed from" in out.stderr and "train.compile" not in out.stderr
    assert max_weight_diff(final_weights(run), plain_reference(**PLAIN).weights) < 1e-5


def test_the_console_says_the_first_step_compiles(rows, consoles: dict[str, str], inductor_cache: Path) -> None:
    rows("dp2-pp2-1f1b-every2")
    console = consoles["dp2-pp2-1f1b-every2"]
    said = f"[meshrun] train.compile: the first step compiles each block (inductor cache {inductor_cache})"
    assert console.count(said) == 1  # rank 0 only
    assert "[meshrun] step 1 compiled and ran in " in console


FAMILIES = {
    "hf-llama": {"model": {"hf": "HF_DIR", "seq_len": 16}},
    "encdec": {
        "model": {"name": "encdec", "num_layers": 4, "seq_len": 32, "source_len": 16, "vocab_size": 260, "dim": 32}
    },
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_blocks_compile_to_eager_gradients(family: str, tmp_path: Path, inductor_cache, monkeypatch) -> None:
    """The HF decoder layers and the encoder-decoder's blocks compile whole (no block falls back)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
    section = copy.deepcopy(FAMILIES[family])
    if family == "hf-llama":
        from transformers import AutoConfig, AutoModelForCausalLM

        small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
        config = AutoConfig.for_model("llama", **small, num_key_value_heads=2, vocab_size=256)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(tmp_path / "hf")
        section["model"]["hf"] = str(tmp_path / "hf")
    cfg = validate(section)
    eager = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    compiled, warnings = copy.deepcopy(eager), []
    apply_compile(compiled.blocks, strict=False, warn=warnings.append)
    tokens = torch.randint(0, 256, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    for model in (eager, compiled):
        model(tokens).float().square().mean().backward()
    assert warnings == [] and is_compiled(compiled.blocks)
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6), name


class Breaks(nn.Module):
    """A block dynamo cannot capture whole: its forward leaves the graph for Python numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(x.tolist())


def test_a_block_that_cannot_compile_runs_eager_with_one_warning_under_auto() -> None:
    blocks, warnings = nn.ModuleDict({"0": Breaks()}), []
    apply_compile(blocks, strict=False, warn=warnings.append)
    x = torch.arange(3.0)
    assert torch.equal(blocks["0"](x), x * x) and torch.equal(blocks["0"](x), x * x)
    assert len(warnings) == 1 and warnings[0].startswith("warning: block 0 runs eager, torch.compile failed:")


def test_a_block_that_cannot_compile_stops_an_explicit_compile_in_one_line() -> None:
    blocks = nn.ModuleDict({"3": Breaks()})
    apply_compile(blocks, strict=True, warn=lambda line: pytest.fail(f"warned instead of stopping: {line}"))
    with pytest.raises(RunError) as failed:
        blocks["3"](torch.arange(3.0))
    message = str(failed.value)
    assert message.startswith("train.compile: block 3 cannot compile (") and "\n" not in message


def test_torchs_donated_buffer_flag_exists() -> None:
    """keep_saved_buffers sets a private flag (torch._functorch.config.donated_buffer) that the
    split-backward schedules need under compile: an upgrade that drops it fails here."""
    import torch._functorch.config as functorch_config

    assert isinstance(functorch_config.donated_buffer, bool)


def test_torchs_compile_failure_type_is_where_meshrun_catches_it() -> None:
    """compile_failures names a private torch class (torch._dynamo.exc): an upgrade that moves it
    fails here, not in a user's run."""
    with pytest.raises(compile_failures()):
        torch.compile(Breaks(), fullgraph=True)(torch.arange(3.0))


def test_auto_compiles_on_cuda_only() -> None:
    assert load_config(None).train.compile == "auto"
    assert compile_enabled("auto", torch.device("cuda")) and not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled(True, torch.device("cpu")) and not compile_enabled(False, torch.device("cuda"))


def test_a_compiling_block_marks_progress_that_the_watchdog_waits_longer_for(tmp_path: Path) -> None:
    """The first call of a compiled block marks the phase `compile`, which the hang watchdog allows
    SLOW_FACTOR x launch.hang_timeout, as it does the warm-up step (here: a later step, resumed)."""
    from meshrun.launcher import progress
    from meshrun.launcher.hang import SLOW_FACTOR, HangWatchdog, Place

    class AddOne(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    blocks = nn.ModuleDict({"7": AddOne()})
    apply_compile(blocks, strict=True, warn=print)
    progress.mark("forward", step=5)
    blocks["7"](torch.zeros(2))
    now = progress.current()  # nothing marked since the block's first call
    assert now.phase == "compile" and now.detail.startswith("block 7: torch.compile")
    watchdog = HangWatchdog(tmp_path, Place(rank=0, pp_rank=0, dp_rank=0, stages=(0,)), timeout=10, attempt=0)
    later = progress.Progress(step=9, phase="compile", first_step=5)
    assert watchdog.limit(later) == 10 * SLOW_FACTOR
    assert watchdog.limit(progress.Progress(step=9, phase="forward", first_step=5)) == 10


def test_workers_share_one_per_user_inductor_cache_unless_the_user_named_one(monkeypatch, tmp_path: Path) -> None:
    from meshrun.launcher.torchrun import INDUCTOR_CACHE_ENV, inductor_cache, worker_env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert worker_env(load_config(None))[INDUCTOR_CACHE_ENV] == str(tmp_path / "meshrun" / "inductor")
    assert inductor_cache({INDUCTOR_CACHE_ENV: "/scratch/mine"}) == "/scratch/mine"
