"""`meshrun plan`: the ranked table, `--write`, `--calibrate` and `--run` (argument checks that need
no torch live in cli.py and run first)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from meshrun.config.schema import Config, check_code_trusted, load_config
from meshrun.data.locations import data_dir
from meshrun.errors import ConfigError
from meshrun.files.atomic import write_atomic
from meshrun.files.console import say
from meshrun.files.json_reader import read_json
from meshrun.hardware.peaks import PCIE4_LINKS_GBS, device_by_short_name, links_gbs
from meshrun.hardware.precision import choose_precision, resolve_precision
from meshrun.metrics.record import read_metrics_rows
from meshrun.models.task_io import task_io
from meshrun.parallel.compile import inductor_cache_dir
from meshrun.planner import calibrate as calibration
from meshrun.planner.cost import Efficiency, Hardware
from meshrun.planner.documents import describe as describe_documents
from meshrun.planner.documents import document_rows
from meshrun.planner.experts import routing_note
from meshrun.planner.long_context import HOST_GBS
from meshrun.planner.model_size import check_model_size
from meshrun.planner.search import Prediction, compiles, predict, rank_layouts
from meshrun.preflight import preflight
from meshrun.versions import check_extras

GIB = 1024**3


def hardware(args: argparse.Namespace, requested: str) -> tuple[Hardware, str]:
    """The device named by --gpu (or the calibrated one) with --memory-gb / link overrides, and the
    precision planned on it: `auto` resolved by the rule training applies (`choose_precision`),
    to this machine's CPU for `cpu`, to the table's GPU otherwise (bf16 where it has bf16 tensor cores)."""
    name = args.gpu or _calibrated_device(args)
    per_node = max(1, args.gpus // args.nodes)
    if name.lower() == "cpu":
        memory = (
            args.memory_gb * GIB
            if args.memory_gb
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / args.gpus
        )
        precision = resolve_precision(requested, torch.device("cpu")).precision
        return Hardware("cpu", memory, None, args.intra_gbs or 10.0, args.inter_gbs or 1.25, per_node), precision
    try:
        spec = device_by_short_name(name)
    except KeyError as exc:
        if args.gpu is None:  # the name came from the calibration file, not the command line
            path = _calibration_path(args, "cpu")
            raise ConfigError(f"{path} names its device {name!r}, which meshrun does not know; pass --gpu") from None
        raise ConfigError(f"--gpu: {exc.args[0]}, or cpu; for another device pass --memory-gb and calibrate") from None
    precision = choose_precision(
        requested, native_bf16=spec.bf16_tflops is not None, gpu=True, hardware=spec.key
    ).precision
    peak = spec.peak(precision)
    if peak is None:
        raise ConfigError(f"--gpu {name}: {spec.key} has no dense {precision} peak; set precision=fp16 or fp32")
    intra, inter = links_gbs(spec)
    memory = args.memory_gb * GIB if args.memory_gb else spec.memory_gib * GIB
    return Hardware(
        spec.key, memory, peak * 1e12, args.intra_gbs or intra, args.inter_gbs or inter, per_node
    ), precision


def _calibration_path(args: argparse.Namespace, device: str) -> Path:
    return Path(args.calibration) if args.calibration else calibration.default_path(device)


def _calibrated_device(args: argparse.Namespace) -> str:
    path = _calibration_path(args, "cpu")
    if path.is_file():
        return calibration.load_calibration(path)[0]
    raise ConfigError("pass --gpu (e.g. --gpu h100), or run `meshrun plan --calibrate CONFIG` on this machine first")


def efficiency(args: argparse.Namespace, hw: Hardware) -> tuple[Efficiency, str]:
    """Calibrated constants for this device when saved, else the defaults (and where they came from)."""
    path = _calibration_path(args, hw.name)
    if path.is_file():
        device, eff = calibration.load_calibration(path)
        if device == hw.name or args.calibration:  # a file named explicitly is the user's choice
            return eff, f"calibrated ({path})"
    if hw.peak_flops is None:
        raise ConfigError(f"no peak FLOP/s for {hw.name}: run `meshrun plan --calibrate CONFIG` here first")
    return Efficiency(), f"default efficiency {Efficiency().flops_fraction:.0%} of peak (not calibrated)"


def compile_note(cfg: Config, hw: Hardware, eff: Efficiency) -> str:
    """How the plan treats train.compile: off, on at the calibrated factor, or on but planned as eager."""
    if not compiles(cfg, hw):
        return f"compile: off (train.compile {str(cfg.train.compile).lower()} on {hw.name}), eager"
    if eff.compiled_compute is None:
        return "compile: not measured, planned as eager (`meshrun plan --calibrate` of this config on the device measures it)"
    return f"compiled: x{eff.compiled_compute:.2f} compute (measured by --calibrate)"


def task_line(cfg: Config) -> str:
    """Which task was planned, and the head and loss it priced (models/task_io.py)."""
    io = task_io(cfg)
    places = "every position" if io.head_positions == cfg.model.seq_len else f"{io.head_positions} per sample"
    output = " x ".join(str(n) for n in io.output)
    return f"task {cfg.task} ({io.reads}; head and loss priced on its output, {output} per sample, from {places})"


def _gib(n: float) -> str:
    return f"{n / GIB:.3g}"


def table(predictions: list[Prediction], top: int) -> str:
    head = (
        f"{'#':>3} {'tp':>2} {'dp':>3} {'dp mode':<7} {'pp':>3} {'schedule':<20} {'mb':>3} {'m':>3} {'recompute':<9} "
        f"{'param':>7} {'grad':>7} {'optim':>7} {'act':>7} {'bwd':>7} {'buf':>7} {'base':>5} {'total GiB':>9} {'fits':<4} "
        f"{'step s':>9} {'bubble':>6} {'tok/s':>10} {'MFU':>6} {'cp':>2} {'offload':<7} {'host GiB':>8}"
    )
    lines = [head, "-" * len(head)]
    shown = [p for p in predictions if p.fits][:top] + [p for p in predictions if not p.fits][:top]
    for i, p in enumerate(shown, 1):
        lab, mem = p.label, p.memory
        mfu = f"{p.mfu:.1%}" if p.mfu is not None else "-"
        lines.append(
            f"{i:>3} {lab['tp']:>2} {lab['dp']:>3} {lab['dp_mode']:<7} {lab['pp']:>3} {lab['schedule']:<20} "
            f"{lab['micro_batch']:>3} {lab['microbatches']:>3} {lab['recompute']:<9} {_gib(mem.params):>7} "
            f"{_gib(mem.grads):>7} {_gib(mem.optimizer):>7} {_gib(mem.activations):>7} {_gib(mem.backward):>7} "
            f"{_gib(mem.buffers):>7} "
            f"{_gib(mem.baseline):>5} {_gib(mem.total):>9} {'yes' if p.fits else 'NO':<4} {p.time.total:>9.4g} "
            f"{p.time.bubble_fraction:>6.1%} {p.tokens_per_s:>10.4g} {mfu:>6} {lab['cp']:>2} {lab['offload']:<7} "
            f"{_gib(mem.host):>8}"
        )
    return "\n".join(lines)


def rank_terms(prediction: Prediction) -> str:
    """Every pp rank's memory as its named terms (dp, cp and tp ranks of a pp rank hold alike), its
    host memory where it offloads, and the step's share in cp's all-to-alls and offload's copies."""
    lines = []
    for rank, mem in enumerate(prediction.ranks):
        terms = " + ".join(
            f"{name} {_gib(value)}" + (f" ({mem.in_flight} in flight)" if name == "activations" else "")
            for name, value in mem.terms().items()
        )
        host = f"; host (offloaded activations) {_gib(mem.host)} GiB" if mem.host else ""
        lines.append(f"  pp rank {rank}: {terms} = {_gib(mem.total)} GiB{host}")
    time = prediction.time
    if time.context or time.host:
        lines.append(
            f"  of the step's {time.total:.4g} s: cp all-to-alls {time.context:.4g} s, offload copies not hidden "
            f"{time.host:.4g} s (long_context.py: HOST_GBS {HOST_GBS:g} GB/s assumed)"
        )
    return "\n".join(lines)


def new_run_dir(source: str, out: Path) -> str:
    """A run_dir for the written job: beside the source config's, named after the written file
    (`runs/best` for best.yaml), with -2, -3, ... until no folder of that name exists: running the
    proposed config starts a new run, never resumes or overwrites the source's (or any other)."""
    parent, name = Path(source).parent, out.stem
    candidate, n = parent / name, 1
    while candidate.exists() or candidate == Path(source):
        n += 1
        candidate = parent / f"{name}-{n}"
    return str(candidate)


def layout_comment(prediction: Prediction, hw: Hardware, precision: str, run_dir: str) -> str:
    """The header of a written config: the layout chosen, what was predicted for it, its run_dir."""
    lab, mem, cfg = prediction.label, prediction.memory, prediction.cfg
    layout = (
        f"{cfg.layout.text()}, micro_batch {lab['micro_batch']} x "
        f"{lab['microbatches']} microbatches, recompute {lab['recompute']}"
    )
    memory = (
        f"{_gib(mem.total)} GiB (params {_gib(mem.params)}, grads {_gib(mem.grads)}, "
        f"optimizer {_gib(mem.optimizer)}, activations {_gib(mem.activations)}, backward {_gib(mem.backward)})"
    )
    speed = f"{prediction.time.total:.4g} s per step, {prediction.tokens_per_s:.4g} tokens/s"
    return (
        f"# written by meshrun plan: the best fitting layout for {cfg.world_size} x {hw.name}, {precision}\n"
        f"# layout: {layout}\n"
        f"# predicted per rank: {memory}; {speed}\n"
        f"# run_dir: {run_dir}, a new folder (the source config's was {cfg.run_dir})\n"
    )


def write_config(prediction: Prediction, out: Path, hw: Hardware, precision: str) -> str:
    """The proposed job as a new YAML file: the layout comment, then the keys that differ from
    the defaults, with a run_dir of its own (see new_run_dir), which is returned."""
    run_dir = new_run_dir(prediction.cfg.run_dir, out)
    cfg = prediction.cfg.model_copy(update={"run_dir": run_dir})
    text = yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = layout_comment(prediction, hw, precision, run_dir)
    write_atomic(out, header + text, replace=False)  # never overwrite (checked before, refused here too)
    return run_dir


def _every(seconds: float, what: str) -> Callable[[str], None]:
    """A progress callback that says at most one line per `seconds` (stderr)."""
    last = [time.monotonic()]

    def progress(message: str) -> None:
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            say(f"{what}: {message}")

    return progress


def run_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.calibrate:  # a compiled probe caches in meshrun's folder: set before torch._dynamo loads (it sets /tmp)
        inductor_cache_dir()
    preflight(cfg, scope="model")  # the model builds, before any layout is profiled
    if args.calibrate:
        return _calibrate(args, cfg)
    if args.run:
        return compare_run(args)
    hw, precision = hardware(args, cfg.precision)
    eff, source = efficiency(args, hw)
    documents = document_rows(cfg)
    ranked = rank_layouts(
        cfg,
        args.gpus,
        hw,
        eff,
        precision=precision,
        margin=args.margin,
        progress=_every(2.0, "planning"),
        attention_length=None if documents is None else documents.attention_length,
    )
    if not ranked:
        raise ConfigError(
            f"no layout of {args.gpus} devices divides train.global_batch ({cfg.train.global_batch}) "
            "and the model's blocks; change --gpus or train.global_batch"
        )
    print(
        f"meshrun plan: {task_line(cfg)}; {args.gpus} x {hw.name} ({args.nodes} node(s)), {hw.memory_bytes / GIB:.1f} GiB per device "
        f"with a {args.margin:.0%} margin, {precision}, global batch {cfg.train.global_batch}; {source}"
        + ("; sequence parallel where tp > 1" if cfg.parallel.sequence_parallel else "")
    )
    print(compile_note(cfg, hw, eff))
    if (routing := routing_note(cfg)) is not None:
        print(routing)
    if documents is not None:
        print(describe_documents(documents, cfg, str(data_dir(cfg))))
    print(table(ranked, args.top))
    fitting = [p for p in ranked if p.fits]
    baseline = "measured by --calibrate" if source.startswith("calibrated") else "an estimate, hardware/peaks.py"
    print(f"memory per rank of #1 (GiB; the runtime's baseline is {baseline}):")
    print(rank_terms(ranked[0]))
    if args.write:
        if not fitting:
            raise ConfigError("no layout fits in memory, nothing written; add devices or raise --memory-gb")
        run_dir = write_config(fitting[0], Path(args.write), hw, precision)
        print(f"wrote {args.write} (run_dir {run_dir}: a new folder)")
    return 0


def _calibrate(args: argparse.Namespace, cfg: Config) -> int:
    import torch

    from meshrun.hardware.device import local_device

    device = calibration.device_name(local_device())
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hw, precision = _probe_hardware(args, device, cfg.precision)
    max_ranks = torch.cuda.device_count() if torch.cuda.is_available() else 2  # CPU ranks share its cores
    eff, rows, warnings = calibration.calibrate(
        cfg,
        hw,
        precision=precision,
        steps=args.steps,
        rounds=args.rounds,
        max_ranks=max_ranks,
        shared_machine=device == "cpu",
    )
    path = _calibration_path(args, device)
    calibration.save_calibration(path, device, precision, eff, rows)
    assert eff.achieved_flops is not None  # calibrate measures it
    for row in rows:
        print(
            f"dp {row['dp']} {row.get('dp_mode', 'ddp'):<4} pp {row['pp']} micro_batch {row['micro_batch']} x {row['microbatches']:<2} recompute "
            f"{row['recompute']:<5} {row['flops'] / 1e9:8.3f} GFLOP {row['seconds'] * 1e3:9.2f} ms/step (median of "
            + ", ".join(f"{t * 1e3:.1f}" for t in row["rounds"])
            + ")"
            + (" compiled" if row["compile"] else "")
        )
    shared = (
        f"2 ranks compute {eff.slowdown(2):.2f}x as long as 1" if eff.parallel_devices else "2 ranks no slower than 1"
    )
    print(
        f"{device}: {eff.achieved_flops / 1e9:.2f} GFLOP/s achieved, {eff.action_s * 1e3:.3f} ms per forward or "
        f"backward (whole model), recomputed FLOPs cost {eff.recompute_cost:.2f}x, "
        f"{eff.step_s * 1e3:.3f} ms per step, {eff.p2p_s * 1e3:.3f} ms per message, "
        f"{eff.shard_s * 1e3:.3f} ms per FSDP collective, a logged step +{eff.log_s * 1e3:.3f} ms "
        f"(+{eff.timeline_share:.0%} under pp: its timeline), "
        f"{eff.runtime_bytes / 2**20:.0f} MiB per rank before its model, {precision}, "
        f"{shared}; saved to {path}"
    )
    if eff.compiled_compute is not None:
        print(f"compiled: x{eff.compiled_compute:.2f} compute (train.compile {str(cfg.train.compile).lower()})")
    else:
        print(f"compile: not measured (train.compile {str(cfg.train.compile).lower()} is off on {device})")
    for warning in warnings:
        say(f"warning: {warning}")
    return 0


def _probe_hardware(args: argparse.Namespace, device: str, requested: str) -> tuple[Hardware, str]:
    """The calibrated device's links (bandwidth terms the fit subtracts) and precision; a GPU the
    table does not know gets PCIe-class links and is planned later with --memory-gb."""
    probe_args = argparse.Namespace(**{**vars(args), "gpu": device, "gpus": 2, "nodes": 1, "memory_gb": None})
    try:
        return hardware(probe_args, requested)
    except ConfigError:
        precision = resolve_precision(requested, torch.device("cuda")).precision
        intra, inter = PCIE4_LINKS_GBS
        return Hardware(device, float("inf"), None, args.intra_gbs or intra, args.inter_gbs or inter, 2), precision


def memory_rows(prediction: Prediction, rows: list[dict], *, cpu: bool) -> list[tuple[str, float, float | None]]:
    """(name, predicted GB, measured GB) per pipeline stage: the run's peak `memory_gb/stage{s}`
    against the stage's rank. A CPU run measures its processes' peak resident set (the runtime
    baseline included), a GPU run the bytes torch allocated (tensors only: the baseline left out)."""
    out = []
    for stage, mem in enumerate(prediction.ranks):
        key = f"memory_gb/stage{stage}" if f"memory_gb/stage{stage}" in rows[-1] else "memory_gb"
        measured = [row[key] for row in rows if key in row]
        predicted = (mem.total if cpu else mem.total - mem.baseline) / 1e9
        out.append((f"memory GB, pp rank {stage}", predicted, max(measured) if measured else None))
    return out


def compare_run(args: argparse.Namespace) -> int:
    """A finished run's measured step time, bubble and throughput next to the prediction for its layout."""
    run = Path(args.run)
    try:
        cfg = Config.model_validate(read_json(run / "config.json"))
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        problem = " ".join(str(exc).split())[:300]
        raise ConfigError(f"--run {run}: config.json is not a meshrun run's config ({problem})") from None
    check_code_trusted(cfg, run / "config.json", trust_code=args.trust_code)  # predict builds the run's model
    check_extras(cfg, trains=False)  # the run's model, as export and sample check it: before it is built
    check_model_size(cfg)
    rows = read_metrics_rows(run / "metrics.jsonl")  # step_time_s: training only, validation and checkpoints apart
    timed = [r for r in rows if "step_time_s" in r][1:] or [r for r in rows if "step_time_s" in r]
    if not timed:
        raise ConfigError(f"--run {run}: metrics.jsonl has no step_time_s rows yet; let the run log a window first")
    if all(r.get("train_s") for r in timed):  # seconds over steps, as summary.json and report weigh them
        measured_time = sum(r["train_s"] for r in timed) / sum(r["train_s"] / r["step_time_s"] for r in timed)
    else:  # a run logged before train_s: every window alike
        measured_time = sum(r["step_time_s"] for r in timed) / len(timed)
    bubbles = [r["bubble"] for r in timed if "bubble" in r]
    measured_bubble = sum(bubbles) / len(bubbles) if bubbles else None
    args.gpus = cfg.world_size
    hw, precision = hardware(args, cfg.precision)
    eff, source = efficiency(args, hw)
    documents = document_rows(cfg)  # packed rows: attention priced at their documents' length, as the plan does
    priced = {} if documents is None else {"attention_length": documents.attention_length}
    formula = predict(cfg, hw, eff, precision=precision, margin=args.margin, **priced)
    with_bubble = predict(
        cfg, hw, eff, precision=precision, margin=args.margin, measured_bubble=measured_bubble, **priced
    )
    print(
        f"run {run}: {task_line(cfg)}; {cfg.layout.text()}, micro_batch "
        f"{cfg.train.micro_batch}, recompute {cfg.recompute} on {hw.name}; {source}"
    )
    print(compile_note(cfg, hw, eff))
    if documents is not None:
        print(describe_documents(documents, cfg, str(data_dir(cfg))))
    print(f"{'':<28}{'predicted':>12}{'measured':>12}{'ratio':>10}")
    for name, predicted, measured in (
        ("step time s (bubble formula)", formula.time.total, measured_time),
        ("step time s (measured bubble)", with_bubble.time.total, measured_time),
        ("bubble", formula.time.bubble_fraction, measured_bubble),
        ("tokens/s", formula.tokens_per_s, cfg.tokens_per_step / measured_time),
        *memory_rows(formula, timed, cpu=hw.name == "cpu"),
    ):
        shown = f"{measured:>12.4g}{predicted / measured:>10.3g}" if measured else f"{'-':>12}{'-':>10}"
        print(f"{name:<28}{predicted:>12.4g}{shown}")
    return 0
