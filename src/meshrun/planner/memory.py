"""Per-rank memory of a layout: state bytes of the stages a rank holds, plus the activations of
the microbatches its schedule keeps in flight at the worst moment of a step.

In flight, per rank (r = pp rank, p = pp, m = microbatches, v = stages per rank):
- no pipeline: one microbatch (forward, backward, next);
- GPipe: all m forwards before any backward;
- 1F1B: min(m, p - r) (warm-up forwards, then one forward per backward);
- interleaved 1F1B / zero bubble: the order torch.distributed.pipelining runs (warm-up of
  (v - 1) x round + k x (p - 1 - r) chunk forwards, then one forward per backward), replayed
  over the chunks' own activation bytes; zero bubble keeps a chunk's tensors until its weight
  backward (W), which lags the input backward by r chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.planner.stage_cost import StageProfile


@dataclass(frozen=True)
class RankMemory:
    params: int
    grads: int
    optimizer: int
    activations: int
    ddp_buckets: int  # DDP's flat gradient buckets (a second copy of the gradients) when dp > 1

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.ddp_buckets


def _interleaved_peak(activations: list[int], *, rank: int, pp: int, m: int, zero_bubble: bool) -> int:
    """Replay one rank's chunk order (torch's `_get_1f1b_rank_ops`) and return its peak bytes."""
    v = len(activations)
    per_round = m // max(1, m // pp)
    warmup = min(v * m, (v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank))
    lag = rank if zero_bubble else 0  # backwards whose weight half (and tensors) is still pending

    def forward_chunk(op: int) -> int:
        return (op // per_round) % v

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    live = peak = 0
    pending: list[int] = []
    backward_op = warmup
    for op in range(v * m):
        live += activations[forward_chunk(op)]
        peak = max(peak, live)
        if op >= warmup:
            pending.append(backward_chunk(backward_op))
            backward_op += 1
            while len(pending) > lag:
                live -= activations[pending.pop(0)]
    return peak


def in_flight_bytes(schedule: str, activations: list[int], *, rank: int, pp: int, m: int) -> int:
    """Peak activation bytes on one rank; `activations` = per microbatch, for each stage it holds."""
    if pp == 1:
        return activations[0]
    if schedule == "gpipe":
        return m * activations[0]
    if schedule == "1f1b":
        return min(m, pp - rank) * activations[0]
    return _interleaved_peak(activations, rank=rank, pp=pp, m=m, zero_bubble=schedule == "zero-bubble")


def rank_memory(
    stages: list[StageProfile], local: list[int], *, schedule: str, rank: int, pp: int, dp: int, shard: int, m: int
) -> RankMemory:
    """Memory of the rank at pp position `rank`, holding stages `local` (indices into `stages`), its
    training state split over `shard` ranks (FSDP; FSDP's padding of dim 0 to a multiple is ignored)."""
    held = [stages[i] for i in local]
    grads = sum(s.grad_bytes for s in held) // shard
    return RankMemory(
        params=sum(s.param_bytes for s in held) // shard,
        grads=grads,
        optimizer=sum(s.optimizer_bytes for s in held) // shard,
        activations=in_flight_bytes(schedule, [s.activation_bytes for s in held], rank=rank, pp=pp, m=m),
        ddp_buckets=grads if dp > 1 and shard == 1 else 0,
    )
