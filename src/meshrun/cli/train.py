"""What `meshrun train` does: check everything, then launch workers or be one."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from torch import nn

from meshrun.checkpoint.paths import last_complete_checkpoint, resume_candidates
from meshrun.config.schema import Config
from meshrun.data.locations import data_dir, reads_in_place, training_data_dir
from meshrun.data.prepare import default_sources, is_prepared, prepare
from meshrun.data.storage import read_meta
from meshrun.errors import ConfigError, RunError
from meshrun.files.atomic import DiskFull
from meshrun.files.console import say
from meshrun.files.json_reader import read_json
from meshrun.hardware.device import local_device, rank_memory_bytes
from meshrun.hardware.precision import resolve_precision
from meshrun.launcher import progress
from meshrun.launcher.hang import HangWatchdog, Place, check_report_folder, clear_reports, hang_summary
from meshrun.launcher.lifetime import PARENT_PID, die_with_parent
from meshrun.launcher.logs import LOGS_ENV, divert_worker_notes, log_dir, log_failure
from meshrun.launcher.outcome import (
    RECORD,
    Interrupted,
    Outcome,
    clear_record,
    failed_in,
    launcher_exit_code,
    read_error,
    read_record,
    write_record,
)
from meshrun.launcher.rendezvous import RendezvousWatch
from meshrun.launcher.run_lock import HELD_ENV, RunDirLock, hold_run_dir, worker_job
from meshrun.launcher.torchrun import (
    RDZV_TIMEOUT_EXIT,
    check_torchrun_ending,
    in_launched_worker,
    run_tmpdir,
    run_torchrun,
    timeout_message,
    torchrun_argv,
    waiting_line,
    worker_env,
)
from meshrun.models.encdec import source_len
from meshrun.models.hf_config import is_hf, load_hf_config
from meshrun.models.protocol import pretrained_dir
from meshrun.parallel.mesh import Mesh, init_mesh, shutdown
from meshrun.parallel.stages import static_split
from meshrun.preflight import check_data_fits, check_run_dir

if TYPE_CHECKING:
    from meshrun.training.trainer import Trainer


def ensure_data(cfg: Config) -> Path:
    """Prepare the embedded corpus (or `data.sources`) on first use; never touch existing data.
    Other formats and mixtures are read in place. (`preflight.check_data_source` has refused a
    `data.dir` with nothing to prepare.)"""
    path = data_dir(cfg)
    if cfg.data.pairs and not reads_in_place(cfg) and not is_prepared(path):
        from meshrun.data.pairs import example_pairs, prepare_pairs, read_pairs

        say(f"preparing text pairs in {path} (first use)")
        prepare_pairs(
            read_pairs(cfg.data.sources) if cfg.data.sources else example_pairs(),
            path,
            val_fraction=cfg.data.val_fraction,
            reuse=True,  # another job on this data.dir may have prepared it meanwhile
        )
        check_data_fits(cfg, path)
    elif not reads_in_place(cfg) and not is_prepared(path):
        tokenizer = cfg.data.tokenizer or "byte"
        say(f"preparing {tokenizer} data in {path} (first use)")
        trained = tokenizer.startswith("bpe:")
        prepare(
            cfg.data.sources or default_sources(),
            path,
            val_fraction=cfg.data.val_fraction,
            tokenizer="byte" if trained else tokenizer,
            train_tokenizer=tokenizer if trained else None,
            reuse=True,
        )
        check_data_fits(cfg, path)  # data that was already there was checked by `preflight`
    return path


def sample_prompt(cfg: Config) -> str:
    """A `sample --prompt` that fits what the run trained on, for its `next:` line: a source to
    translate for pairs data or an encoder-decoder (a function name, for the built-in example),
    code for the embedded standard-library corpus, a placeholder for the user's own text."""
    meta = read_meta(training_data_dir(cfg)) or {}
    if source_len(cfg.model) is not None or meta.get("format") == "pairs":
        return "get_terminal_size" if cfg.data.pairs and not cfg.data.sources else "SOURCE TEXT"
    embedded = not (cfg.data.sources or reads_in_place(cfg) or cfg.data.dir)
    return "def " if embedded else "TEXT TO CONTINUE"


def describe_split(cfg: Config) -> list[str] | None:
    """Blocks held by each pipeline rank, for display (None: no pipeline, or measured at start)."""
    par = cfg.parallel
    split = static_split(cfg) if par.pp > 1 else None
    if split is None:
        return None
    return [" + ".join(str(split[s]) for s in cfg.layout.stages_of(rank)) for rank in range(par.pp)]


def describe_layout(cfg: Config) -> list[str]:
    """The rank order, the schedule's stages, and each pipeline rank's ranks, stages and blocks."""
    layout, par = cfg.layout, cfg.parallel
    lines = ["layout:", f"  {layout.grid()}"]
    if par.pp > 1:
        split_over = f", each split over its {par.tp} tp ranks" if par.tp > 1 else ""
        lines.append(
            f"  schedule {par.schedule}: {layout.num_stages} stages, {layout.per_rank} a pipeline rank{split_over}"
        )
    split = describe_split(cfg)
    for rank in range(par.pp):
        stages = f", stages {layout.stages_of(rank)}" if layout.per_rank > 1 else ""
        blocks = f", blocks {split[rank]}" if split else ""
        lines.append(f"  pipeline rank {rank}: ranks {layout.ranks_of_pp_rank(rank)}{stages}{blocks}")
    return lines


# what a Hugging Face model takes from its own config.json, not from these keys of `model`
_HF_IGNORES = ("name", "num_layers", "dim", "num_heads", "vocab_size")


def describe_model(cfg: Config, model: nn.Module) -> list[str]:
    """The shape of the model that will train (a Hugging Face one's own, not the built-in
    defaults), its parameter count and where its weights come from."""
    if is_hf(cfg.model):
        hf = load_hf_config(cfg.model)
        source = f"{hf.model_type} from {cfg.model.hf or 'model.hf_config'}"
        shape = (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.vocab_size)
    else:
        source = cfg.model.factory or cfg.model.name
        shape = (cfg.model.num_layers, cfg.model.dim, cfg.model.num_heads, cfg.model.vocab_size)
    layers, dim, heads, vocab = shape
    params = sum(p.numel() for p in model.parameters())  # a tied matrix once
    return [
        "model:",
        f"  {source}: {layers} blocks, dim {dim}, {heads} heads, vocab {vocab}, seq_len {cfg.model.seq_len}",
        f"  {params:,} parameters; {init_line(cfg, model)}",
    ]


def describe_job(cfg: Config, model: nn.Module) -> str:
    """The resolved config, the model, the process layout and the batch maths (for --dry-run)."""
    from meshrun.parallel.fsdp import describe_data_parallel  # torch.distributed.fsdp: --dry-run only
    from meshrun.planner.layout_memory import rank_state_bytes

    par, train = cfg.parallel, cfg.train
    resolved = cfg.model_dump(mode="json")
    if is_hf(cfg.model):
        resolved["model"] = {k: v for k, v in resolved["model"].items() if k not in _HF_IGNORES}
    lines = [yaml.safe_dump(resolved, sort_keys=False).rstrip(), "", *describe_layout(cfg)]
    lines += describe_model(cfg, model)
    lines += [
        "batch:",
        (
            f"  global batch {train.global_batch} samples = micro batch {train.micro_batch} x dp {par.dp} "
            f"x accumulation steps {cfg.accumulation_steps}"
        ),
        f"  tokens per step {cfg.tokens_per_step} (seq_len {cfg.model.seq_len})",
    ]
    lines += describe_data_parallel(cfg)
    states = rank_state_bytes(cfg) or []  # none when the split is measured at start
    lines += [
        f"  pipeline rank {r}: per rank params {_mib(s.params)} + grads {_mib(s.grads)} + "
        f"optimizer {_mib(s.optimizer)} = {_mib(s.params + s.grads + s.optimizer)}"
        for r, s in enumerate(states)
    ]
    lines += memory_warnings([s.params + s.grads + s.optimizer for s in states], *rank_memory_bytes(cfg.nproc_per_node))
    choice = resolve_precision(cfg.precision, local_device())
    lines += ["precision:", f"  {choice.reason}"] + ([f"  warning: {choice.warning}"] if choice.warning else [])
    return "\n".join(lines)


def memory_warnings(state_bytes: list[int], device_bytes: int, device: str) -> list[str]:
    """--dry-run lines for pipeline ranks whose training state (as printed above them) exceeds
    `device_bytes`, the memory one rank has here (`device` says which)."""
    return [
        f"  warning: pipeline rank {rank} needs ~{need / 2**30:.1f} GiB of training state per rank, more than "
        f"{device}; use more pipeline stages, parallel.dp_mode=fsdp or a smaller model"
        for rank, need in enumerate(state_bytes)
        if need > device_bytes
    ]


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def train(cfg: Config, worker_args: list[str], model: nn.Module) -> int:
    """Be a worker (under torchrun) or launch them; `model` is the one `preflight` built (meta).
    Returns the exit code for the run's outcome (see meshrun.launcher.outcome)."""
    if in_launched_worker():
        die_with_parent(signal.SIGKILL)  # the agent that started this worker is gone: so is the job
        with worker_hold(cfg):
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                ensure_data(cfg)
            run_worker(cfg)
        return 0  # stopped on request too: torchrun restarts a group that exits non-zero
    try:
        with hold_run_dir(Path(cfg.run_dir), job=launcher_job(cfg), role="meshrun train") as lock:
            # again, now held: a job that ended meanwhile may have left a config.json this one would run over
            check_run_dir(cfg)
            return launch(cfg, worker_args, model, lock=lock)
    except KeyboardInterrupt:  # Ctrl-C in one process, or passed on to torchrun's workers
        raise Interrupted(Path(cfg.run_dir)) from None


def launcher_job(cfg: Config) -> str:
    """This launch's job, as every node's launcher names it (meshrun.launcher.run_lock)."""
    launch = cfg.launch
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:  # a private rendezvous: a job of its own
        return f"standalone {uuid.uuid4().hex[:12]}"
    return f"{launch.rdzv_id} at {launch.rdzv_endpoint}"


@contextlib.contextmanager
def worker_hold(cfg: Config) -> Iterator[None]:
    """A worker holds the run_dir for its job, unless its launcher does (torchrun started by hand)."""
    if HELD_ENV in os.environ:
        yield
        return
    with hold_run_dir(Path(cfg.run_dir), job=worker_job(), role=f"worker rank {os.environ['RANK']}"):
        check_run_dir(cfg)
        yield


def launch(cfg: Config, worker_args: list[str], model: nn.Module, *, lock: RunDirLock) -> int:
    """This node's part of the job: data, the resume check, then one process or torchrun. Nothing
    in the run directory changes before the run is known to train (a complete run: nothing to do)."""
    run_dir = Path(cfg.run_dir)
    ensure_data(cfg)
    if resume_candidates(cfg.run_dir, cfg.train.resume):  # cannot resume: stop before any worker exists
        from meshrun.checkpoint.dcp import read_manifest  # torch.distributed.checkpoint: only when needed
        from meshrun.checkpoint.resume import check_resumable

        resume_from = check_resumable(cfg.run_dir, cfg.train.resume, model)
        step = read_manifest(resume_from).get("step") if resume_from is not None else None
        if isinstance(step, int) and step >= cfg.train.steps:
            say(f"run already complete: {resume_from} is at step {step} (train.steps {cfg.train.steps}); nothing to do")
            return 0
    done = completed_steps(run_dir) if cfg.train.resume == "auto" else None  # a named one: a rollback
    if done is not None and done >= cfg.train.steps:  # finished after its newest checkpoint (at_end off)
        say(
            f"run already complete: its summary.json records step {done} (train.steps {cfg.train.steps}); nothing to do"
        )
        return 0
    check_report_folder(run_dir)
    clear_reports(run_dir)  # an earlier launch's hang reports must not be read as this one's
    if cfg.world_size == 1 and cfg.launch.nnodes == 1 and cfg.launch.max_restarts == 0:
        return run_worker(cfg).exit_code  # one process needs no torchrun (nor its restarts)
    argv = torchrun_argv(cfg, worker_args)
    say(f"starting {cfg.world_size} workers: {' '.join(argv[1:])}")
    watch = RendezvousWatch(cfg) if cfg.launch.nnodes > 1 else None
    if watch is not None:
        say(waiting_line(cfg))
        watch.start()
    clear_record(run_dir)  # nor its outcome
    env = {**worker_env(cfg), PARENT_PID: str(os.getpid()), HELD_ENV: lock.job, LOGS_ENV: str(log_dir(run_dir))}
    try:
        with run_tmpdir(env):
            code, relayed = run_torchrun(argv, env=env, lock=lock)
    finally:
        if watch is not None:
            watch.stop()
    outcome = read_record(run_dir)
    stop = check_torchrun_ending(run_dir, outcome, code, relayed)
    hung = None  # a failure recorded after the hang's trigger is its consequence (a peer's collective broke)
    if outcome in (None, Outcome.FAILED):
        hung = hang_summary(run_dir, cfg.launch.hang_timeout, record=run_dir / RECORD)
    if hung is not None:
        lines, error = hung
        for line in lines:
            say(line)
        raise error
    if outcome is None and code == RDZV_TIMEOUT_EXIT:
        raise RunError(timeout_message(cfg, watch.state() if watch is not None else "one node"))
    if outcome is Outcome.FAILED and (error := read_error(run_dir)):
        raise error  # the workers' reason, as the last line (their lines may interleave above)
    return launcher_exit_code(outcome, code, stop_relayed=stop is not None)


def completed_steps(run_dir: Path) -> int | None:
    """The steps a completed run's summary.json records (None: not completed, or not readable):
    with checkpoint.at_end off, its newest checkpoint is older than the run's end."""
    try:
        steps = read_json(run_dir / "summary.json").get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def run_worker(cfg: Config) -> Outcome:
    """The worker's training entry: trains, and returns and records how the run ended."""
    from meshrun.training.trainer import Trainer  # heavy imports only in workers

    if in_launched_worker():  # Ctrl-C: torchrun passes SIGINT on; end at once, as every rank does,
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not with tracebacks of peers gone mid-collective
    run_dir = Path(cfg.run_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if in_launched_worker():  # torch's notes (DTensor's) go to this rank's log, not the console
        divert_worker_notes(run_dir, int(os.environ["RANK"]))
    progress.mark_init("joining the process group")
    watchdog, rank, trainer, failing = start_watchdog(cfg), 0, None, False
    try:
        mesh = init_mesh(cfg.layout, join_timeout=cfg.launch.rdzv_timeout)
        rank = mesh.rank
        progress.mark_init("the first collective: every node's data prepared")
        torch.distributed.barrier()  # data prepared by every node's local rank 0
        cfg = with_resolved_precision(cfg, mesh)
        progress.mark_init("building the model and initialising its weights")
        trainer = Trainer(cfg, mesh, data_dir(cfg))
        if rank == 0 and trainer.start_step == 0:  # a resumed run said where it resumed from
            say(init_line(cfg, trainer.flops_model))
        outcome = trainer.train()
    except ConfigError:
        raise  # refused before training (e.g. no checkpoint loads): the run directory stays as it was
    except DiskFull as full:  # anywhere (a checkpoint, metrics.jsonl, a picture): say what a rerun resumes
        failing, failed = True, RunError(f"{full}; {last_complete_checkpoint(run_dir)}")
        record_failure(run_dir, failed, attempt=attempt)
        raise failed from None
    except Exception as exc:
        failing = True
        if not in_launched_worker() or HELD_ENV not in os.environ:  # one process, or torchrun without
            record_failure(run_dir, exc, attempt=attempt)  # meshrun's launcher (none to say it): its own words
            raise
        raise SystemExit(worker_failed(run_dir, rank, exc, attempt=attempt)) from None
    finally:
        close_worker(trainer, failing=failing)
        if watchdog is not None:
            watchdog.stop()
    if rank == 0:
        write_record(run_dir, outcome, attempt=attempt)
    return outcome


def start_watchdog(cfg: Config) -> HangWatchdog | None:
    """This worker's hang watchdog (launch.hang_timeout 0: none), armed before it joins the process
    group: its place comes from the layout and its rank, not from the group."""
    if not cfg.launch.hang_timeout:
        return None
    rank = int(os.environ.get("RANK", "0"))
    place = Place.of(cfg.layout, rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    one_process = not in_launched_worker()  # its own launcher: it says the summary itself
    watchdog = HangWatchdog(
        Path(cfg.run_dir), place, timeout=cfg.launch.hang_timeout, attempt=attempt, summarise=one_process
    )
    watchdog.start()
    return watchdog


def close_worker(trainer: Trainer | None, *, failing: bool) -> None:
    """The trainer's and the process group's cleanup. After a failure, what they raise (a stop
    request's all-reduce still in flight when a peer was lost) would only bury the failure's line."""
    quietly = contextlib.suppress(Exception) if failing else contextlib.nullcontext()
    if trainer is not None:
        with quietly:
            trainer.close()
    with quietly:
        shutdown()


def init_line(cfg: Config, model: nn.Module) -> str:
    """Where a new run's weights come from, in one line (`model`: the whole model, any device)."""
    source = pretrained_dir(model)
    if source is not None:
        return f"weights loaded from {source} ({len(model.state_dict())} tensors)"
    if cfg.model.factory is not None:  # its init_weights may load weights of its own
        return f"weights from {cfg.model.factory}'s init_weights (seed {cfg.train.seed})"
    return f"random init (seed {cfg.train.seed})"


def worker_failed(run_dir: Path, rank: int, exc: Exception, *, attempt: int) -> int:
    """A launched worker's failure as a few lines, not one traceback per rank (a lost peer breaks
    every other rank's collective): the traceback goes to this rank's log, the first rank of the
    attempt to fail records its one-line cause, which the launcher repeats last, and says it now
    if torchrun will restart the workers. Returns the exit status (non-zero: torchrun restarts)."""
    cause = log_failure(run_dir, rank, exc, attempt=attempt)
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if attempt < restarts and not failed_in(run_dir, attempt):
        say(f"{cause}; torchrun restarts the workers (attempt {attempt + 2} of {restarts + 1})")
    record_failure(run_dir, exc, cause=cause, attempt=attempt)
    return 1


def record_failure(run_dir: Path, exc: BaseException, *, cause: str | None = None, attempt: int = 0) -> None:
    """Any rank that fails says so, with its one-line `cause`; a RunError's own line wins over
    a peer's earlier cause (the launcher says it last)."""
    error = " ".join(str(exc).split()) if isinstance(exc, RunError) else cause
    if not isinstance(exc, RunError) and failed_in(run_dir, attempt):
        return  # a peer failed first (this rank's collective broke with it): its record, and reason, stay
    with contextlib.suppress(OSError, RunError):  # the error itself matters more than its record (a full disk)
        write_record(run_dir, Outcome.FAILED, error=error, attempt=attempt)


def with_resolved_precision(cfg: Config, mesh: Mesh) -> Config:
    """The config with `precision` resolved for this hardware (what config.json and the tracker
    record). Rank 0 says what was chosen and why; all ranks must agree (mixed hardware with
    `auto` could pick different dtypes for the stages of one pipeline)."""
    choice = resolve_precision(cfg.precision, mesh.device)
    choices: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(choices, choice.precision)
    if len(set(choices)) > 1:
        raise RunError(
            f"precision {cfg.precision} means {' / '.join(sorted(set(map(str, choices))))} on different nodes "
            "(their hardware differs); set precision explicitly"
        )
    if mesh.rank == 0:
        say(choice.reason)
        if choice.warning:
            say(f"warning: {choice.warning}")
    return cfg.model_copy(update={"precision": choice.precision})
