"""LoRA (model.lora) on a Hugging Face Llama: one process equals peft's own `get_peft_model` on
transformers' LlamaForCausalLM given the same adapters (step-1 loss and pre-clip norm, the adapters
after 10 clipped AdamW steps, the base bit-identical), every layout equals one process, every rank's
live base stays the folder's and FSDP2 shards only the adapters, and bad input is refused in one
line before any worker.

Launches: the one-process and bf16 references train in this process; each other layout is one
launch shared by every test that reads it (`runs`); refusals and exports run the CLI in process."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    final_weights,
    finish_meshrun,
    in_process_trainer,
    losses,
    max_weight_diff,
    meshrun_env,
    meshrun_in_process,
    read_metrics,
    run_meshrun,
    tiny,
    train_job,
)
from hf_models import SEQ_LEN, backward_microbatches, load_reference, make_model
from plain_reference import config_from_set_args, cosine_lr
from test_hf import interrupted

from meshrun.config.schema import Config
from meshrun.data.dataset import TokenDataset

LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.target_modules": "all-linear"}
# Clipping active every step, adapters moving visibly (~0.02). AdamW's first steps move each entry by
# about lr x sign(grad): eps 1e-6 keeps an entry whose gradient is at rounding level (A's, while B is
# near zero) from moving by lr on a flipped sign, which fp32 rounding alone would decide.
BASE = {
    "model.seq_len": SEQ_LEN,
    "train.global_batch": 16,
    "train.micro_batch": 4,  # 4 microbatches (2 a rank at dp2): accumulation in every layout, half the calls of 8
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.05,
    "train.eps": 1e-6,
    "checkpoint.interval": 5,
}
LAYOUTS = {
    "one-process": {},
    "dp2-pp2-1f1b": {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b"},
    "fsdp-dp2": {"parallel.dp": 2, "parallel.dp_mode": "fsdp"},
    "dp2-pp2-interleaved-fsdp-recompute": {
        "parallel.dp": 2,
        "parallel.dp_mode": "fsdp",
        "parallel.pp": 2,
        "parallel.schedule": "interleaved-1f1b",
        "recompute": "full",
    },
    # the input and weight halves of backward apart: a frozen base has no weight half; ZBV: the same
    # split, two stages a rank in a V
    "pp2-zero-bubble": {"parallel.pp": 2, "parallel.schedule": "zero-bubble"},
    "pp2-zbv": {"parallel.pp": 2, "parallel.schedule": "zbv"},
    "pp2-looped-bfs": {"parallel.pp": 2, "parallel.schedule": "looped-bfs"},  # interleaved's chunks, breadth first
    "fp16": {"precision": "fp16"},  # one process: the GradScaler over adapter gradients only
    "tp2": {"parallel.tp": 2},
    "dp2-tp2-pp2-sp": {
        "parallel.dp": 2,
        "parallel.tp": 2,
        "parallel.pp": 2,
        "parallel.schedule": "1f1b",
        "parallel.sequence_parallel": True,
    },
    "bf16-fsdp-dp2": {"parallel.dp": 2, "parallel.dp_mode": "fsdp", "precision": "bf16"},  # on the bf16 folder
}
BF16 = {"precision": "bf16"}  # model.lora.base_dtype auto: the base as the folder stores it (bf16), under autocast


def lora_args(data_dir: Path, run: Path | str, model_dir: Path, **overrides: object) -> list[str]:
    return tiny(data_dir, run, **{**BASE, "model.hf": model_dir, **LORA, **overrides})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings: the frozen matrix on the first and last pipeline stage needs no gradient sum."""
    return make_model("llama", tmp_path_factory.mktemp("hf") / "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Llama saved in bf16, as released models are."""
    return make_model("llama", tmp_path_factory.mktemp("hf") / "llama-bf16", tie_word_embeddings=True, dtype="bfloat16")


WORKER = Path(__file__).with_name("lora_worker.py")
LIVE = (
    "fsdp-dp2",
    "dp2-pp2-interleaved-fsdp-recompute",
    "dp2-tp2-pp2-sp",
)  # trained by lora_worker.py: every rank's live parameters read back


def train_live(args: list[str], out: Path, *, nproc: int) -> None:
    """The job `args` trained by `nproc` torchrun workers of lora_worker.py (each rank's parameters to `out`)."""
    out.mkdir()
    argv = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = meshrun_env(out, PYTHONPATH=str(WORKER.parents[2] / "src"))
    with subprocess.Popen(
        [*argv, str(WORKER), str(out), *(a.removeprefix("--set=") for a in args)],
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        finish_meshrun(proc)


@pytest.fixture(scope="module")
def runs(
    llama_dir: Path, bf16_dir: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """`runs(layout)`: a 10-step LoRA run, trained on first use (bf16-*: on the bf16 folder; LIVE:
    by lora_worker.py, every rank's parameters after training read by `live_params`)."""
    root, done = tmp_path_factory.mktemp("lora-runs"), {}

    def get(layout: str) -> Path:
        if layout not in done:
            run, folder = root / layout, bf16_dir if layout.startswith("bf16-") else llama_dir
            args = lora_args(data_dir, run, folder, **LAYOUTS[layout])
            if layout in LIVE:
                train_live(args, root / f"{layout}-live", nproc=config_from_set_args(args).world_size)
            else:
                train_job(args, tmp_path=root)
            done[layout] = run
        return done[layout]

    return get


def live_params(run: Path) -> list[dict]:
    """Each rank's parameters after training, as lora_worker.py read them (a LIVE layout's run)."""
    out = run.with_name(f"{run.name}-live")
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank-*.json"), key=lambda p: int(p.stem[5:]))]


def peft_name(ours: str) -> str:
    """meshrun's parameter name -> the same tensor's in peft's PeftModel over LlamaForCausalLM."""
    hf = re.sub(r"^blocks\.", "model.layers.", ours)
    hf = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(hf, hf)
    return "base_model.model." + hf.replace("head.weight", "lm_head.weight")


def initial_model(data_dir: Path, llama_dir: Path, **overrides: object):
    """meshrun's one-process model as a run starts it (the folder's base, adapters drawn per name)."""
    from meshrun.parallel.materialise import materialise_part

    cfg = config_from_set_args(lora_args(data_dir, "unused", llama_dir, **overrides))
    return materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True), cfg


def peft_model_with(
    ours: torch.nn.Module, cfg: Config, folder: Path, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """peft's get_peft_model over transformers' model of `folder` loaded in `dtype` (its adapters
    fp32 whatever the base's: peft's autocast_adapter_dtype), with `cfg.model.lora`'s config
    (all-linear) and meshrun's adapters `ours` copied in."""
    from peft import LoraConfig, get_peft_model

    lora = cfg.model.lora
    assert lora is not None
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules="all-linear")
    model = get_peft_model(load_reference(folder, dtype), config)
    theirs = dict(model.named_parameters())
    adapters = {peft_name(k): v for k, v in ours.named_parameters() if v.requires_grad}
    assert adapters.keys() == {k for k, v in theirs.items() if v.requires_grad}, "peft adapts other modules"
    with torch.no_grad():
        for name, value in adapters.items():
            theirs[name].copy_(value)
    return model


def peft_reference(data_dir: Path, llama_dir: Path, *, steps: int, base: torch.dtype = torch.float32, bf16=False):
    """peft on transformers' own model, no meshrun code in the step: get_peft_model with the same
    LoraConfig, meshrun's initial adapters copied in; per step the whole window's loss (HF shifts the
    labels), one backward per microbatch, norm clipped over the adapters, torch's AdamW (not fused).
    `base`: the dtype transformers loads the base in; `bf16`: forwards under bf16 autocast."""
    ours, cfg = initial_model(data_dir, llama_dir)
    train = cfg.train
    model = peft_model_with(ours, cfg, llama_dir, base).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, betas=train.betas, eps=train.eps, foreach=False)
    for group in optimizer.param_groups:
        group["weight_decay"] = train.weight_decay  # every adapter is a matrix: all decayed
    data, first = TokenDataset(data_dir, "train", seq_len=SEQ_LEN, seed=train.seed), None
    num_microbatches = train.global_batch // train.micro_batch
    for step in range(steps):
        x, y = data.batch(step * train.global_batch, train.global_batch)
        total = backward_microbatches(model, x, y, num_microbatches, autocast=bf16)
        norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip).item()
        first = first or (total, norm)
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, lr=train.lr, warmup=train.warmup_steps, steps=steps, floor=train.min_lr_ratio)
        optimizer.step()
        optimizer.zero_grad()
    return first, {k: v.detach() for k, v in model.named_parameters()}


def test_one_process_equals_peft(runs, llama_dir: Path, data_dir: Path) -> None:
    run = runs("one-process")
    (loss, grad_norm), theirs = peft_reference(data_dir, llama_dir, steps=10)
    metrics = read_metrics(run)[0]
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert metrics["grad_norm"] > BASE["train.grad_clip"], "clipping must be active for the test to mean anything"
    ours = final_weights(run)
    adapters = [k for k in ours if ".lora_" in k]
    assert adapters and len(ours) > len(adapters)
    for name in adapters:
        torch.testing.assert_close(ours[name], theirs[peft_name(name)], rtol=1e-5, atol=1e-5, msg=name)
    moved = max((ours[k] - initial_model(data_dir, llama_dir)[0].state_dict()[k]).abs().max().item() for k in adapters)
    assert moved > 1e-3, "the adapters must move for the comparison to mean anything"
    for name in (k for k in ours if ".lora_" not in k):  # the base: never written
        assert torch.equal(ours[name], theirs[peft_name(name)]), name


def test_flops_count_the_frozen_base_at_4_per_weight(runs, llama_dir: Path) -> None:
    """The FLOPs per token behind tflops and MFU, counted here from config.json: 4 per frozen weight
    (forward and input gradient; norms and the tied head included, the embedding lookup not), 6 per
    adapter weight, and causal attention 12 x layers x heads x head_dim x length."""
    c = json.loads((llama_dir / "config.json").read_text())
    h, q, kv, inter, r = (
        c["hidden_size"],
        c["num_attention_heads"] * c["head_dim"],
        c["num_key_value_heads"] * c["head_dim"],
        c["intermediate_size"],
        LORA["model.lora.r"],
    )
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # (in, out) of q k v o gate up down
    per_layer = sum(i * o for i, o in shapes) + 2 * h  # the two norms
    frozen = c["num_hidden_layers"] * per_layer + h + c["vocab_size"] * h  # final norm, tied head
    adapters = c["num_hidden_layers"] * sum(r * (i + o) for i, o in shapes)
    attention = 12 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * SEQ_LEN
    row = read_metrics(runs("one-process"))[0]
    assert row["tflops"] * 1e12 / row["tokens_per_s"] == pytest.approx(4 * frozen + 6 * adapters + attention, rel=1e-9)


@pytest.mark.parametrize(
    "layout",
    [
        "dp2-pp2-1f1b",
        "fsdp-dp2",
        "dp2-pp2-interleaved-fsdp-recompute",
        "pp2-zero-bubble",
        "pp2-zbv",
        "pp2-looped-bfs",
        "tp2",
        "dp2-tp2-pp2-sp",
    ],
)
def test_layout_equals_one_process(layout: str, runs) -> None:
    """The adapters train alike under DDP and FSDP2 (only they have gradients to reduce), and under
    pipelines (the tied matrix, frozen, spans the first and last stage) with recompute."""
    run, reference = runs(layout), runs("one-process")
    ours, one = final_weights(run), final_weights(reference)
    assert max_weight_diff(ours, one) < 1e-5
    assert all(torch.equal(ours[k], one[k]) for k in ours if ".lora_" not in k), "a base weight was written"
    norms = [[row["grad_norm"] for row in read_metrics(r) if "grad_norm" in row] for r in (run, reference)]
    assert len(norms[0]) == 10 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)


@pytest.mark.parametrize("layout", LIVE)
def test_every_ranks_base_is_the_folders_and_fsdp_gathers_only_adapters(
    layout: str, runs, llama_dir: Path, data_dir: Path
) -> None:
    """After training, every rank's live base is bit-identical to the folder's (tp shards gathered),
    and FSDP2 left the frozen base out: a plain tensor (tp's DTensor under tp) whole on every dp
    rank, never all-gathered nor reduce-scattered, while the adapters are sharded over dp."""
    from lora_worker import digest

    ranks = live_params(runs(layout))
    assert len(ranks) == config_from_set_args(lora_args(data_dir, "unused", llama_dir, **LAYOUTS[layout])).world_size
    folder = {name: digest(p) for name, p in initial_model(data_dir, llama_dir)[0].named_parameters()}
    for rank, found in enumerate(ranks):
        base = {name: held for name, held in found.items() if ".lora_" not in name}
        adapters = {name: held for name, held in found.items() if ".lora_" in name}
        assert base and all(held["sha256"] == folder[name] for name, held in base.items()), f"rank {rank}"
        assert {str(held["mesh"]) for held in base.values()} <= {"None", "['tp']"}, f"rank {rank}"
        assert adapters and all("dp_shard" in held["mesh"] for held in adapters.values()), f"rank {rank}"


@pytest.fixture(scope="module")
def bf16_run(bf16_dir: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One process on the bf16 folder at precision bf16, trained in this process: the run directory,
    and the live model's parameters and AdamW state's dtypes after its 10 steps."""
    run = tmp_path_factory.mktemp("lora-bf16") / "run"
    with in_process_trainer(data_dir, run, **{**BASE, "model.hf": bf16_dir, **LORA, **BF16}) as trainer:
        trainer.train()
        live = {name: p.detach().clone() for name, p in trainer.model.parts[0].named_parameters()}
        moments = {t.dtype for o in trainer.optimizers.optimizers for state in o.state.values() for t in state.values()}
    return run, live, moments


def test_bf16_base_beside_fp32_adapters_equals_peft(bf16_run, bf16_dir: Path, data_dir: Path) -> None:
    """A bf16 folder at precision bf16 (base_dtype auto): the live base is bf16, bit-identical to the
    folder after training, and priced so by the planner (2 bytes a weight); adapters and AdamW state
    fp32. peft on transformers' model loaded in bf16 (peft upcasts its adapters to fp32) under the
    same autocast gives the same step-1 loss and grad norm and adapters after 10 steps, within
    bf16's rounding (the two forwards round differently: meshrun's rotary and loss are its own);
    the same peft over an fp32 base lands further away than that tolerance."""
    from meshrun.parallel.materialise import build_stage
    from meshrun.planner.layout_memory import layout_memory
    from meshrun.planner.stage_cost import state_bytes

    run, live, moments = bf16_run
    base = {k: v for k, v in live.items() if ".lora_" not in k}
    adapters = {k: v for k, v in live.items() if ".lora_" in k}
    assert {v.dtype for v in base.values()} == {torch.bfloat16}
    assert {v.dtype for v in adapters.values()} == {torch.float32} and moments == {torch.float32}
    cfg = config_from_set_args(lora_args(data_dir, "unused", bf16_dir, **BF16))
    planned = state_bytes(build_stage(cfg, layers=None, first=True, last=True), cfg.train)
    weights = sum(v.numel() for v in base.values()), sum(v.numel() for v in adapters.values())
    assert planned[0] == sum(v.nbytes for v in live.values()) == 2 * weights[0] + 4 * weights[1]
    auto = config_from_set_args(lora_args(data_dir, "unused", bf16_dir, precision="auto"))
    for precision, size in (("bf16", 2), ("fp32", 4)):  # meshrun plan: auto resolved for the device planned
        assert layout_memory(auto, precision).ranks[0].params == size * weights[0] + 4 * weights[1], precision
    (loss, grad_norm), theirs = peft_reference(data_dir, bf16_dir, steps=10, base=torch.bfloat16, bf16=True)
    for name, value in base.items():  # peft's base as transformers loaded it: the folder's
        assert torch.equal(value, theirs[peft_name(name)]), name
    metrics = read_metrics(run)[0]
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert max((v - theirs[peft_name(k)]).abs().max().item() for k, v in adapters.items()) < 1e-5  # 1.4e-7 seen
    _, fp32_base = peft_reference(data_dir, bf16_dir, steps=10, bf16=True)
    assert max((v - fp32_base[peft_name(k)]).abs().max().item() for k, v in adapters.items()) > 1e-3  # 7e-3 seen


def test_sample_and_merged_export_keep_a_bf16_base(bf16_run, bf16_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """`sample` and `export` of the bf16 run build the base as training held it: bf16, bit-identical
    to the live base, beside its fp32 adapters; `export --hf --merge` writes bf16 weights (config.json
    says so) equal bit for bit to peft's merge_and_unload over transformers' bf16 model: the base as
    the folder stores it, never upcast and cast back."""
    from safetensors.torch import load_file

    from meshrun.cli.use_checkpoint import load_full_model

    run, live, _ = bf16_run
    ours, cfg, _ = load_full_model(run)
    for name, value in ours.named_parameters():
        assert value.dtype == live[name].dtype and torch.equal(value, live[name]), name
    out = tmp_path / "merged"
    meshrun_in_process(["export", run, "--hf", out, "--merge"], tmp_path=tmp_path)
    merged = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in merged.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # safe_merge, as meshrun merges: W + (B A x alpha / r rounded to bf16), rounded (the default,
    # unsafe merge adds the fp32 delta in place and rounds once: 1 bf16 ulp apart at most)
    theirs = peft_model_with(ours, cfg, bf16_dir, torch.bfloat16).merge_and_unload(safe_merge=True).state_dict()
    assert merged.keys() <= theirs.keys() and all(torch.equal(merged[k], theirs[k]) for k in merged)


def test_bf16_base_under_fsdp_equals_one_process(runs, bf16_run) -> None:
    """FSDP2 over dp2 shards the fp32 adapters, leaves the bf16 base whole, and equals the one process: step-1 loss and grad norm to
    1e-5, the adapters after 10 steps to 1e-4 and every loss to 1e-4, not fp32's 1e-5. Each rank's
    half batch rounds its bf16 activations alike, but the adapters' gradients are summed in another
    order, and each step's bf16 forward can round that difference up (at 4 microbatches of 2 a rank,
    adapters 1.2e-5 apart after 10 steps, the last grad norms 0.2%; at BASE's 2 of 4, 1.5e-8 and 1e-7;
    an fp32 base lands 7e-3 away)."""
    run, reference = runs("bf16-fsdp-dp2"), bf16_run[0]
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-4
    assert losses(run) == pytest.approx(losses(reference), abs=1e-4)
    first = [read_metrics(r)[0] for r in (run, reference)]
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], rel=1e-5)
    assert first[0]["grad_norm"] == pytest.approx(first[1]["grad_norm"], rel=1e-5)


def test_checkpoints_hold_the_adapters_only(runs, llama_dir: Path, data_dir: Path) -> None:
    """A LoRA checkpoint's index (written as dp2 x pp2) holds the adapters, their AdamW state, the
    counters and RNG states, and no base tensor: 3x the adapters' bytes. Its manifest names the
    base folder and its digest."""
    from meshrun.checkpoint.safe_reader import SafeReader
    from meshrun.models.hf_weights import weights_digest

    folder = runs("dp2-pp2-1f1b") / "checkpoints" / "step-00000010"
    saved = SafeReader(folder).read_metadata().state_dict_metadata
    adapters = {k: v for k, v in initial_model(data_dir, llama_dir)[0].state_dict().items() if ".lora_" in k}
    moments = {f"state.{k}.{m}" for k in adapters for m in ("exp_avg", "exp_avg_sq")}
    steps = {f"state.{k}.step" for k in adapters}
    assert {k for k in saved if not k.startswith(("progress.", "rng."))} == adapters.keys() | moments | steps
    stored = sum(saved[k].size.numel() * saved[k].properties.dtype.itemsize for k in adapters.keys() | moments)
    assert stored == 3 * sum(v.nbytes for v in adapters.values())
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["base"] == {"path": str(llama_dir.absolute()), "sha256": weights_digest(llama_dir)}


def test_resume_onto_other_weights_is_refused(runs, llama_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """A run started from another run's LoRA checkpoint (train.resume) with the same architecture but
    other weights (another seed: headers alike, values not) is refused in one line, exit 2, before
    any worker; a copy of the base folder elsewhere holds the same weights and is accepted."""
    checkpoint = runs("one-process") / "checkpoints" / "step-00000010"
    other = make_model("llama", tmp_path / "other", seed=1, tie_word_embeddings=True)
    copy = shutil.copytree(llama_dir, tmp_path / "copy")
    sha = json.loads((checkpoint / "manifest.json").read_text())["base"]["sha256"]
    for base in (other, copy):
        args = lora_args(data_dir, tmp_path / f"run-{base.name}", base, **{"train.resume": checkpoint})
        done = meshrun_in_process(["train", *args], tmp_path=tmp_path, check=False)
        if base == copy:
            assert done.returncode == 0 and "run already complete" in done.stderr, done.stderr
            continue
        expect = (
            f"meshrun: error: checkpoint {checkpoint} holds LoRA adapters trained on the base {llama_dir.absolute()} "
            f"(sha256 {sha[:12]}), but model.hf {other.absolute()} holds other weights (sha256 "
        )
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert done.stderr.startswith(expect), done.stderr
        assert done.stderr.strip().endswith("set model.hf to the folder they were trained on, or start a new run_dir")
        assert not any((tmp_path / f"run-{base.name}").iterdir())  # held while checked, nothing written


def test_resharded_resume(runs, llama_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """A tp2 LoRA run stopped at step 5 (its adapters split over tp: B of q, A of o by halves) resumes
    as dp2 x pp2 under GPipe, tp1, to the one-process run's adapters (1e-5), base untouched, and
    steps 6-10's gradient norms equal the one process's (1e-5): GPipe's equality too."""
    run = interrupted(runs("tp2"), tmp_path / "run", at_step=5)
    gpipe = {**LAYOUTS["dp2-pp2-1f1b"], "parallel.schedule": "gpipe"}
    done = run_meshrun(["train", *lora_args(data_dir, run, llama_dir, **gpipe)], tmp_path=tmp_path)
    assert "resumed from" in done.stderr
    resumed, reference = final_weights(run), final_weights(runs("one-process"))
    assert max_weight_diff(resumed, reference) < 1e-5
    assert all(torch.equal(resumed[k], reference[k]) for k in resumed if ".lora_" not in k)
    norms = [[row["grad_norm"] for row in read_metrics(r) if "grad_norm" in row] for r in (run, runs("one-process"))]
    assert len(norms[0]) == 10 and norms[0][5:] == pytest.approx(norms[1][5:], rel=1e-5)


@pytest.mark.parametrize(
    "overrides,expect",
    [
        (
            {"model.lora.target_modules": "[qproj]"},
            (
                "model.lora.target_modules: 'qproj' matches no module of this model; its linear layers are down_proj, "
                "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
            ),
        ),
        ({"model.lora.r": 0}, "invalid model.lora.r: Input should be greater than or equal to 1 (got 0)"),
        (
            {"model.lora.target_modules": "[input_layernorm]"},
            (
                "model.lora.target_modules: 'input_layernorm' names blocks.0.input_layernorm, a LlamaRMSNorm: meshrun's "
                "LoRA adapts nn.Linear layers only (this model's: down_proj, gate_proj, k_proj, o_proj, q_proj, "
                "up_proj, v_proj)"
            ),
        ),
        (
            {"parallel.tp": 2, "model.lora.dropout": 0.1},
            "model.lora.dropout under parallel.tp > 1 is not built yet: set model.lora.dropout=0",
        ),
    ],
    ids=["no-such-module", "rank-0", "not-linear", "tp-dropout"],
)
def test_bad_lora_is_refused_before_any_worker(
    overrides: dict, expect: str, llama_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    done = meshrun_in_process(
        ["train", *lora_args(data_dir, run, llama_dir, **overrides)], tmp_path=tmp_path, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"meshrun: error: {expect}"]
    assert not run.exists()


@pytest.mark.parametrize(
    "targets,expect",
    [
        ("[head]", "pipeline stage 0 (blocks 0-3) holds no module they name"),
        ("[blocks.0.self_attn.q_proj]", "pipeline stage 1 (blocks 4-7) holds no module they name"),
    ],
    ids=["head-only", "first-block-only"],
)
def test_a_pipeline_stage_without_adapters_is_refused(
    targets: str, expect: str, data_dir: Path, tmp_path: Path
) -> None:
    """Under pp every stage needs an adapter (a stage with nothing to train fails inside DDP or the
    optimizer): the untied head's only, or one block's only, are refused before any worker."""
    model = make_model("llama", tmp_path / "untied")
    args = lora_args(data_dir, tmp_path / "run", model, **{"model.lora.target_modules": targets, "parallel.pp": 2})
    done = meshrun_in_process(["train", *args], tmp_path=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    fix = "name modules every block has (e.g. q_proj, v_proj), or set parallel.pp=1"
    line = f"model.lora.target_modules: {expect}, and under parallel.pp a stage with nothing to train cannot run; {fix}"
    assert done.stderr.strip().splitlines() == [f"meshrun: error: {line}"]
    assert not (tmp_path / "run").exists()


def test_an_adapter_tp_does_not_split_is_refused(data_dir: Path, tmp_path: Path) -> None:
    """Under tp the adapters are split with column- and row-parallel layers: the untied head (split
    by vocabulary for the vocabulary-parallel loss) is refused before any worker."""
    model = make_model("llama", tmp_path / "untied")
    args = lora_args(data_dir, tmp_path / "run", model, **{"model.lora.target_modules": "[head]", "parallel.tp": 2})
    done = meshrun_in_process(["train", *args], tmp_path=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    line = (
        "model.lora.target_modules names head, which parallel.tp splits as vocab_head: adapters are split with "
        "column- and row-parallel layers only; leave it out of target_modules or set parallel.tp=1"
    )
    assert done.stderr.strip().splitlines() == [f"meshrun: error: {line}"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["gpt", "gpt2"])
def test_a_model_lora_cannot_wrap_is_refused(model: str, data_dir: Path, tmp_path: Path) -> None:
    """The built-in families are refused by the schema; GPT-2's Conv1D projections by preflight."""
    source = {"model.hf": make_model("gpt2", tmp_path / "gpt2")} if model == "gpt2" else {}
    lora = {"model.lora.target_modules": "[c_attn]" if model == "gpt2" else "[qkv]"}
    done = meshrun_in_process(
        ["train", *tiny(data_dir, tmp_path / "run", **source, **lora)], tmp_path=tmp_path, check=False
    )
    assert done.returncode == 2, done.stderr
    expect = (
        "names blocks.0.attn.c_attn, a Conv1D: meshrun's LoRA adapts nn.Linear layers only"
        if model == "gpt2"
        else "model.lora adapts Hugging Face models (model.hf / model.hf_config) only, not model.name gpt yet"
    )
    assert len(done.stderr.strip().splitlines()) == 1 and expect in done.stderr


def test_adapter_export_loads_in_peft(runs, llama_dir: Path, tmp_path: Path) -> None:
    """Adapters trained as dp2 x pp2, exported with --adapter: peft loads them onto transformers'
    Llama from the base folder without a warning, and gives meshrun's logits."""
    import warnings

    from peft import PeftModel

    from meshrun.cli.use_checkpoint import load_full_model

    run, out = runs("dp2-pp2-1f1b"), tmp_path / "adapter"
    meshrun_in_process(["export", str(run), "--adapter", str(out)], tmp_path=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = PeftModel.from_pretrained(load_reference(llama_dir), out).eval()
    # transformers' own deprecation notes (is_gradient_checkpointing, which peft calls) are not about the files
    assert [str(w.message) for w in caught if not issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
    ours = load_full_model(run)[0]
    tokens = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=tokens).logits - ours(tokens)).abs().max().item() < 1e-5


def test_merged_export_loads_in_transformers(runs, llama_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """`export --hf OUT --merge` of the dp2 x pp2 run: transformers loads the folder as a plain
    Llama whose logits equal meshrun's model with its adapters (1e-5) and not the base's. --hf
    without --merge (it would drop the adapters), --merge without --hf, and --merge of a run that
    trained every weight are refused in one line."""
    from meshrun.cli.use_checkpoint import load_full_model
    from meshrun.errors import ConfigError
    from meshrun.models.families import build_model
    from meshrun.models.hf_export import export_hf

    run, out = runs("dp2-pp2-1f1b"), tmp_path / "merged"
    done = meshrun_in_process(["export", str(run), "--hf", str(out), "--merge"], tmp_path=tmp_path)
    assert "as a Hugging Face model (the LoRA adapters merged into its weights)" in done.stdout
    merged, base, ours = load_reference(out).eval(), load_reference(llama_dir).eval(), load_full_model(run)[0]
    assert not any(".lora_" in name or "base_layer" in name for name, _ in merged.named_parameters())
    tokens = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = merged(input_ids=tokens).logits
        assert (logits - ours(tokens)).abs().max().item() < 1e-5
        assert (logits - base(input_ids=tokens).logits).abs().max().item() > 1e-3, "the adapters must matter"
    for flags, expect in [
        (["--hf", str(tmp_path / "hf")], "writes full weights with the adapters merged in: add --merge, or export"),
        (["--adapter", str(tmp_path / "a"), "--merge"], "--merge goes with --hf OUT_DIR"),
    ]:
        done = meshrun_in_process(["export", str(run), *flags], tmp_path=tmp_path, check=False)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and expect in done.stderr
    full = config_from_set_args(tiny(data_dir, "unused", **{"model.hf": llama_dir})).model
    with pytest.raises(ConfigError, match="this run trained every weight: drop --merge"):
        export_hf(build_model(full), full, tmp_path / "full", merge=True)


def peft_counts(folder: Path) -> tuple[int, int]:
    """(trainable, total) parameters by peft's own count over transformers' model with LORA's config."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    return get_peft_model(load_reference(folder), config).get_nb_trainable_parameters()


def test_metrics_report_peft_counts_and_the_trainable_state(runs, llama_dir: Path, data_dir: Path) -> None:
    """Every metrics row and summary.json give peft's trainable and total parameters and the largest
    rank's trainable state (adapter params + grads + AdamW state): as the planner prices it in one
    process; halved over FSDP2's dp2, while the frozen base is held whole on each rank, as
    `meshrun plan` and --dry-run price it."""
    from meshrun.parallel.materialise import build_stage
    from meshrun.planner.layout_memory import rank_state_bytes
    from meshrun.planner.stage_cost import state_bytes

    trainable, total = peft_counts(llama_dir)
    rows = {layout: [r for r in read_metrics(runs(layout)) if "loss" in r] for layout in ("one-process", "fsdp-dp2")}
    for layout, logged in rows.items():
        summary = json.loads((runs(layout) / "summary.json").read_text())
        for row in (*logged, summary):
            assert (row["trainable_params"], row["params"]) == (trainable, total), layout
        assert summary["trainable_state_bytes"] == logged[-1]["trainable_state_bytes"]
    one, fsdp = rows["one-process"][0], rows["fsdp-dp2"][0]
    cfg = config_from_set_args(lora_args(data_dir, "unused", llama_dir))
    params, grads, optimizer = state_bytes(build_stage(cfg, layers=None, first=True, last=True), cfg.train)
    assert one["trainable_state_bytes"] == 2 * grads + optimizer and one["state_bytes"] == params + grads + optimizer
    frozen = one["state_bytes"] - one["trainable_state_bytes"]
    assert fsdp["state_bytes"] - fsdp["trainable_state_bytes"] == frozen, "the base is whole on every FSDP rank"
    halved = one["trainable_state_bytes"] / 2  # but every rank keeps each AdamW step count (4 bytes)
    assert fsdp["trainable_state_bytes"] == pytest.approx(halved, rel=3e-3)
    planned = rank_state_bytes(config_from_set_args(lora_args(data_dir, "unused", llama_dir, **LAYOUTS["fsdp-dp2"])))
    assert planned is not None and planned[0].params == frozen + grads // 2
    assert fsdp["state_bytes"] == pytest.approx(planned[0].params + planned[0].grads + planned[0].optimizer, rel=1e-3)


def test_dry_run_counts_what_peft_counts(llama_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """--dry-run's trainable and total parameters are peft's own count on transformers' model, and
    the tensors it says are loaded are the folder's (the adapters are drawn, not loaded)."""
    from safetensors import safe_open

    args = lora_args(data_dir, tmp_path / "run", llama_dir)
    done = meshrun_in_process(["train", *args, "--dry-run"], tmp_path=tmp_path)
    trainable, total = peft_counts(llama_dir)
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as f:
        num_tensors = len(list(f.keys()))
    line = f"{total:,} parameters ({trainable:,} trainable: the LoRA adapters); weights loaded from {llama_dir} "
    assert f"{line}({num_tensors} tensors)" in done.stdout


def test_fp16_tracks_fp32_and_leaves_the_base(runs) -> None:
    """fp16 autocast with its GradScaler (the scaler unscales and checks the adapters' gradients,
    the only ones): step 1 within 1% of the fp32 run (fp16 matmuls carry 11 mantissa bits, ~0.05% a
    product), every step finite and trained, the base bit-identical to the fp32 run's (the folder's)."""
    run, reference = runs("fp16"), runs("one-process")
    ours, theirs = losses(run), losses(reference)
    assert len(ours) == 10 and all(map(math.isfinite, ours))
    assert ours[0] == pytest.approx(theirs[0], rel=1e-2)
    assert ours[-1] < ours[0], "fp16 must train"
    weights, one = final_weights(run), final_weights(reference)
    assert all(torch.equal(weights[k], one[k]) for k in one if ".lora_" not in k), "a base weight was written"
    moved = max((weights[k] - one[k]).abs().max().item() for k in one if ".lora_" in k)
    assert 0 < moved < 1e-2, "the fp16 adapters follow the fp32 ones, not bit for bit"
