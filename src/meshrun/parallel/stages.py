"""Pure stage planning: which Transformer blocks each pipeline stage owns.

Stages hold contiguous blocks in order, every block exactly once, at least one block each.
When splitting evenly the embedding (first stage) and head (last stage) each weigh one block:
8 blocks over 4 stages gives [0], [1, 2, 3], [4, 5, 6], [7].
"""

from __future__ import annotations

from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.models.hf_config import is_hf, num_layers
from meshrun.parallel.layout import Layout

# parallel.schedule -> the name torch.distributed.pipelining.get_schedule_class knows it by. The
# classes and their rules are torch's (meshrun.parallel.pipeline); what the planner needs before
# torch is imported is below, and tests/parallel/test_schedules_from_torch.py holds it to torch's.
TORCH_SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "zero-bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
}
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv")  # weight gradients apart from DDP's hooks


def even_split(num_layers: int, num_stages: int, *, source: str = "model.num_layers") -> list[list[int]]:
    """Contiguous blocks per stage, balancing blocks + embedding (stage 0) + head (last stage)."""
    if num_stages > num_layers:
        raise ConfigError(
            f"{num_stages} pipeline stages need at least as many blocks, but {source} is {num_layers}; "
            "lower parallel.pp / parallel.virtual_stages or add layers"
        )
    units = num_layers + 2  # embedding and head weigh one block each
    bounds, start = [], 0
    for stage in range(num_stages):
        end_unit = round(units * (stage + 1) / num_stages)
        end = min(end_unit - 1, num_layers - (num_stages - stage - 1))  # unit 0 is the embedding
        end = max(end, start + 1)  # at least one block per stage
        bounds.append(list(range(start, end)))
        start = end
    bounds[-1].extend(range(start, num_layers))
    return bounds


def check_split(split: list[list[int]], num_layers: int, num_stages: int) -> list[list[int]]:
    """An explicit `parallel.stage_layers`: contiguous, in order, covering every block once."""
    if len(split) != num_stages:
        raise ConfigError(f"parallel.stage_layers has {len(split)} stages but the pipeline has {num_stages}")
    flat = [layer for stage in split for layer in stage]
    if any(not stage for stage in split):
        raise ConfigError("parallel.stage_layers: every stage needs at least one block")
    if flat != list(range(num_layers)):
        raise ConfigError(
            f"parallel.stage_layers must list blocks 0..{num_layers - 1} each exactly once, in order; got {split}"
        )
    return split


def sizes_to_split(sizes: list[int]) -> list[list[int]]:
    split, start = [], 0
    for size in sizes:
        split.append(list(range(start, start + size)))
        start += size
    return split


def check_microbatches(schedule: str, num_microbatches: int, pp: int) -> None:
    """A fast, torch-free answer to the microbatch rule of torch's schedule constructor, stated
    as torch states it. The constructor at worker start stays the authority; test_schedules_from_torch
    checks over a grid that this refuses exactly what torch refuses."""
    rounds = max(1, num_microbatches // pp)
    if schedule == "1f1b" and num_microbatches < pp:
        rule = f"at least parallel.pp = {pp} microbatches"
    elif schedule in ("interleaved-1f1b", "zero-bubble") and num_microbatches % rounds:
        rule = f"a multiple of the number of rounds (microbatches // parallel.pp = {rounds}) of microbatches"
    else:
        return
    raise ConfigError(
        f"schedule {schedule} needs {rule}, got {num_microbatches} "
        "(microbatches = train.global_batch / (train.micro_batch x parallel.dp))"
    )


def static_split(cfg: Config) -> list[list[int]] | None:
    """Blocks of every pipeline stage when known without measuring (explicit or even); None when
    `parallel.balance` asks for a measured split. Refuses impossible splits either way."""
    par = cfg.parallel
    num_stages = Layout.of(par).num_stages
    layers = num_layers(cfg.model)
    if par.stage_layers is not None:
        return check_split(par.stage_layers, layers, num_stages)
    source = "the Hugging Face config's num_hidden_layers" if is_hf(cfg.model) else "model.num_layers"
    split = even_split(layers, num_stages, source=source)  # also refuses more stages than blocks
    return split if par.balance == "even" else None


def validate_layout(cfg: Config) -> None:
    """Every layout check that needs no process: run before spawning workers."""
    par = cfg.parallel
    if par.pp == 1:
        return
    static_split(cfg)
    check_microbatches(par.schedule, cfg.accumulation_steps, par.pp)
    if par.schedule in SPLIT_BACKWARD_SCHEDULES and cfg.recompute == "selective":
        raise ConfigError(
            f"schedule {par.schedule} with recompute selective is refused: torch's selective checkpointing allows one "
            "backward through a block, and this schedule runs two (input gradients, then weight gradients); "
            "set recompute to full or none, or use interleaved-1f1b"
        )
    if par.schedule == "zbv" and cfg.train.eval_interval:
        raise ConfigError(
            "schedule zbv cannot evaluate: torch 2.13's zbv eval() fails on the stage without backward "
            "(\"can't steal_bwd_input\"); set train.eval_interval=0, or use zero-bubble or interleaved-1f1b"
        )
