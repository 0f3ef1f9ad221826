"""train.compile: each block compiled with torch.compile trains the same numbers as eager, in one
process, under dp2 x pp2 1F1B, FSDP, pp2 ZBV (two stages a rank, the backward in two passes: the
one path compile.py takes for every split-backward schedule, zero-bubble's too, whose order of
stage calls test_pipeline.py proves eager), tp2 with sequence parallel; the encoder-decoder under
pp2 GPipe; fp16 with the GradScaler (an overflowing step skipped); a block that cannot compile runs
eager after one warning (auto) or stops the run in one line (true).

Tolerances, measured on a 2-core x86 CPU (inductor fuses and reorders the blocks' float32
reductions): the step-1 grad norm equals the plain-torch reference's exactly in every layout row
(every step's within 2.5e-7 relative; the suite's 1e-5 asserted), weights after 10 clipped AdamW
steps within 2.1e-6 of the reference (the suite's 1e-5 asserted); the compiled encoder-decoder
pipeline's step-1 loss and grad norm within 8.6e-8 of nn.Transformer's (1e-5 asserted); a family's
block gradients within 2e-9 of eager (1e-6 asserted). Compiling costs ~15 s a process on a cold
cache: every launch here shares one inductor cache (TORCHINDUCTOR_CACHE_DIR), so only the first
launch of a graph (fp32, TP, TP with sequence parallel, fp16, each family) compiles it and the
others load it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    final_weights,
    grad_norms,
    max_weight_diff,
    meshrun_in_process,
    read_metrics,
    tiny,
    train_job,
)
from encdec_reference import assert_step_one_matches, torch_first_step
from plain_reference import assert_grad_norms_match
from test_checkpoint import interrupted_copy
from test_encdec_parity import ENCDEC
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
    "pp2-zbv": {"parallel.pp": 2, "parallel.schedule": "zbv"},  # the backward split in two passes, 2 stages a rank
    "tp2-sequence-parallel": {"parallel.tp": 2, "parallel.sequence_parallel": True},
}
PLAIN = {k: v for k, v in BASE.items() if k != "train.compile"}


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor")


def train_compiled(args: list[str], *, tmp_path: Path, inductor_cache: Path, **env: str) -> str:
    """train_job (one process: in this one, else torchrun) with the shared inductor cache and `env`
    set; what the job printed on stderr."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache), **env}.items():
            patch.setenv(key, value)
        return train_job(args, tmp_path=tmp_path, timeout=420).stderr


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
            args = tiny(data_dir, run, **{**BASE, **ROWS[name]})
            consoles[name] = train_compiled(args, tmp_path=tmp, inductor_cache=inductor_cache)
        return run

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_compiled_layout_trains_the_plain_torch_numbers(
    row: str, rows, consoles: dict[str, str], plain_reference
) -> None:
    run, reference = rows(row), plain_reference(**PLAIN)
    assert "[meshrun] step 1 compiled and ran in " in consoles[row]
    assert_grad_norms_match(grad_norms(run)[:1], reference.grad_norms[:1])
    assert max_weight_diff(final_weights(run), reference.weights) < 1e-5


@pytest.mark.timeout(900)
def test_an_eager_run_resumes_a_compiled_checkpoint(rows, data_dir: Path, tmp_path: Path, plain_reference) -> None:
    """Compiling leaves parameter names alone: an eager rerun continues from step 5 of a compiled run."""
    run = interrupted_copy(rows("one-process-selective"), tmp_path / "run", at_step=5)
    args = ["train", *tiny(data_dir, run, **{**ROWS["one-process-selective"], **PLAIN})]
    out = meshrun_in_process(args, tmp_path=tmp_path)  # eager, one process: meshrun trains it in this one
    assert "resumed from" in out.stderr and "train.compile" not in out.stderr
    assert max_weight_diff(final_weights(run), plain_reference(**PLAIN).weights) < 1e-5


def test_the_console_says_the_first_step_compiles(rows, consoles: dict[str, str], inductor_cache: Path) -> None:
    rows("dp2-pp2-1f1b-every2")
    console = consoles["dp2-pp2-1f1b-every2"]
    said = f"[meshrun] train.compile: the first step compiles each block (inductor cache {inductor_cache})"
    assert console.count(said) == 1  # rank 0 only
    assert "[meshrun] step 1 compiled and ran in " in console


ENCDEC_MODEL = {key.removeprefix("model."): value for key, value in ENCDEC.items() if key.startswith("model.")}
FAMILIES = {
    "hf-llama": {"model": {"hf": "HF_DIR", "seq_len": 16}},
    # the pipeline test's model below (with tiny's width and heads): its run finds these graphs in the cache
    "encdec": {"model": {"dim": 32, "num_heads": 2, **ENCDEC_MODEL}},
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


@pytest.mark.timeout(600)
def test_a_compiled_encoder_decoder_pipeline_equals_torch_transformer(
    lopsided_dir: Path, tmp_path: Path, inductor_cache: Path
) -> None:
    """pp2 GPipe on the encoder-decoder, compiled (the encoder's blocks on one rank, the decoder's on
    the other, cross-attending to the encoder output the pipeline carries): step 1's loss and grad
    norm equal torch's nn.Transformer on the whole global batch. Its blocks are the family test's
    shapes above, whose graphs the shared cache then holds."""
    run = tmp_path / "run"
    layout = {"parallel.pp": 2, "parallel.schedule": "gpipe", "train.steps": 2, "train.compile": True}
    args = tiny(lopsided_dir, run, **{**ENCDEC, **layout})
    assert "step 1 compiled and ran in " in train_compiled(args, tmp_path=tmp_path, inductor_cache=inductor_cache)
    assert_step_one_matches(run, *torch_first_step(lopsided_dir, ENCDEC), micro_batch=2)


@pytest.mark.timeout(600)
def test_compiled_fp16_trains_eagers_losses_and_skips_an_overflowing_step(
    data_dir: Path, tmp_path: Path, inductor_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 autocast and the GradScaler around compiled blocks: step 3's gradients overflow (an inf
        injected in the embedding's backward, faulty_gpt.py); the compiled run skips that step and
        halves its scale as the eager run does, and its losses and grad norms stay near eager's.

    fp16 tolerances, measured (2-core x86, 5 steps): losses within 1.4e-6 relative of eager, step 1
    equal; grad norms within 2.2e-5 (inductor keeps a fused kernel's intermediates in fp32 where eager
    rounds each op's output to fp16, eps 9.8e-4). Asserted: losses 1e-4, norms 1e-3 (~50x measured);
    a scale applied twice or not undone moves the norm by far more."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import faulty_gpt  # both one-process runs train in this process: its count of backwards goes on

    job = {"train.steps": 5, "precision": "fp16", "model.factory": "faulty_gpt:build"}  # 4 microbatches a step
    metrics = {}
    for compile_ in (True, False):
        run, ninth = tmp_path / f"compile-{compile_}", str(faulty_gpt._calls["backward"] + 9)  # step 3's first
        args = tiny(data_dir, run, **job, **{"train.compile": compile_})
        train_compiled(args, tmp_path=tmp_path, inductor_cache=inductor_cache, MESHRUN_TEST_INF_AT=ninth)
        metrics[compile_] = [r for r in read_metrics(run) if "skipped_steps" in r]
    for rows in metrics.values():
        assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
        assert rows[2]["loss_scale"] == rows[1]["loss_scale"] / 2
    for compiled, eager in zip(metrics[True], metrics[False]):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4)
        if compiled["step"] != 3:  # the overflowing step's norm is nan in both
            assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-3)


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
    from meshrun.parallel.layout import Layout

    class AddOne(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    blocks = nn.ModuleDict({"7": AddOne()})
    apply_compile(blocks, strict=True, warn=print)
    progress.mark("forward", step=5)
    blocks["7"](torch.zeros(2))
    now = progress.current()  # nothing marked since the block's first call
    assert now.phase == "compile" and now.detail.startswith("block 7: torch.compile")
    watchdog = HangWatchdog(tmp_path, Place.of(Layout(), 0), timeout=10, attempt=0)
    later = progress.Progress(step=9, phase="compile", first_step=5)
    assert watchdog.limit(later) == 10 * SLOW_FACTOR
    assert watchdog.limit(progress.Progress(step=9, phase="forward", first_step=5)) == 10


def test_workers_share_one_per_user_inductor_cache_unless_the_user_named_one(monkeypatch, tmp_path: Path) -> None:
    from meshrun.launcher.torchrun import INDUCTOR_CACHE_ENV, inductor_cache, worker_env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert worker_env(load_config(None))[INDUCTOR_CACHE_ENV] == str(tmp_path / "meshrun" / "inductor")
    assert inductor_cache({INDUCTOR_CACHE_ENV: "/scratch/mine"}) == "/scratch/mine"
