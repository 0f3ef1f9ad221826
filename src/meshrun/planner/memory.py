"""Per-rank memory of a layout as a sum of named terms: the state bytes of the stages a rank holds
(parameters, gradients, optimizer; FSDP / HSDP: its shard), the activations of the microbatches
its schedule keeps in flight at the worst moment of a step, the communication buffers, and the
runtime's baseline (what a rank holds before any tensor of the model: a CPU process's resident
torch, a GPU's CUDA context and NCCL buffers).

FSDP shards only what trains: a frozen parameter (model.lora's base; its bytes are a stage's
param_bytes less its grad_bytes) is held whole on every rank and never gathered (parallel/fsdp.py).

Communication buffers: DDP's flat gradient buckets (a second copy of the gradients, dp > 1);
FSDP's unsharded (trainable) parameters while gathered (two blocks' worth, the one computing and the one
prefetched, when it reshards after forward; the whole stage when it does not, as under pp) and its
unsharded gradients (the stage's while microbatches accumulate without reduction, else two
blocks' being reduce-scattered).

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

from meshrun.planner.stage_profile import StageProfile


@dataclass(frozen=True)
class RankMemory:
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int  # communication buffers (see the module docstring)
    baseline: int = 0  # the runtime's own memory (Efficiency.runtime_bytes)
    in_flight: int = 1  # microbatches' activations held at the peak (interleaved: chunks, as stages)
    backward: int = 0  # backward's largest temporaries on top of the activations (StageProfile.backward_bytes)
    host: int = 0  # offloaded activations in host memory (not the device's: not a term; long_context.py)

    @property
    def total(self) -> int:
        return sum(self.terms().values())

    def terms(self) -> dict[str, int]:
        """The named terms, in the order they are printed."""
        names = ("params", "grads", "optimizer", "activations", "backward", "buffers", "baseline")
        return {name: getattr(self, name) for name in names}


def _interleaved_peak(activations: list[int], *, rank: int, pp: int, m: int, zero_bubble: bool) -> tuple[int, int]:
    """Replay one rank's chunk order (torch's `_get_1f1b_rank_ops`): its peak bytes and the chunks
    live at that peak."""
    v = len(activations)
    per_round = m // max(1, m // pp)
    warmup = min(v * m, (v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank))
    lag = rank if zero_bubble else 0  # backwards whose weight half (and tensors) is still pending

    def forward_chunk(op: int) -> int:
        return (op // per_round) % v

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    live = peak = held = peak_held = 0
    pending: list[int] = []
    backward_op = warmup
    for op in range(v * m):
        live, held = live + activations[forward_chunk(op)], held + 1
        if live > peak:
            peak, peak_held = live, held
        if op >= warmup:
            pending.append(backward_chunk(backward_op))
            backward_op += 1
            while len(pending) > lag:
                live, held = live - activations[pending.pop(0)], held - 1
    return peak, peak_held


def in_flight_bytes(schedule: str, activations: list[int], *, rank: int, pp: int, m: int) -> tuple[int, int]:
    """Peak activation bytes on one rank and the microbatches (chunks, interleaved) they belong
    to; `activations` = per microbatch, for each stage it holds."""
    if pp == 1:
        return activations[0], 1
    if schedule == "gpipe":
        return m * activations[0], m
    if schedule == "1f1b":
        return min(m, pp - rank) * activations[0], min(m, pp - rank)
    return _interleaved_peak(activations, rank=rank, pp=pp, m=m, zero_bubble=schedule == "zero-bubble")


def comm_buffers(held: list[StageProfile], *, dp: int, shard: int, regather: bool, m: int) -> int:
    """Bytes of the communication buffers on a rank holding `held` (see the module docstring)."""
    grads = sum(s.grad_bytes for s in held)
    if dp == 1:
        return 0
    if shard == 1:
        return grads
    params = sum(s.grad_bytes for s in held)  # the trainable parameters' bytes: what FSDP gathers
    blocks = max(1, sum(s.blocks for s in held))
    unsharded = 1.0 - 1.0 / shard  # the part of a gathered tensor other ranks hold
    gathered = 2 * params / blocks if regather else params
    reducing = grads if m > 1 or not regather else 2 * grads / blocks
    return int((gathered + reducing) * unsharded)


def rank_memory(
    stages: list[StageProfile],
    local: list[int],
    *,
    schedule: str,
    rank: int,
    pp: int,
    dp: int,
    shard: int,
    m: int,
    regather: bool = False,
    baseline: int = 0,
) -> RankMemory:
    """Memory of the rank at pp position `rank`, holding stages `local` (indices into `stages`), its
    training state split over `shard` ranks (FSDP; FSDP's padding of dim 0 to a multiple is ignored),
    frozen parameters whole."""
    held = [stages[i] for i in local]
    activations, in_flight = in_flight_bytes(schedule, [s.activation_bytes for s in held], rank=rank, pp=pp, m=m)
    frozen = sum(s.param_bytes - s.grad_bytes for s in held)  # a gradient per trainable parameter, in its dtype
    return RankMemory(
        params=frozen + sum(s.grad_bytes for s in held) // shard,
        grads=sum(s.grad_bytes for s in held) // shard,
        optimizer=sum(s.optimizer_bytes for s in held) // shard,
        activations=activations,
        buffers=comm_buffers(held, dp=dp, shard=shard, regather=regather, m=m),
        baseline=baseline,
        in_flight=in_flight,
        backward=max(s.backward_bytes for s in held),
    )
