"""`meshrun plan`: which tp x dp (ddp / fsdp / hsdp) x pp x schedule x micro_batch x recompute
layout fits and runs fastest.

- `stage_cost` (+ `stage_pieces`): per pipeline stage and tp rank, exact parameter / gradient /
  optimizer bytes (the real model, built on the meta device) and the activation bytes one
  microbatch keeps for backward (forwards traced under fake tensors: shapes only, no memory, no
  compute; a stage composed from one- and two-block pieces; `tp_shapes`: what tp's collectives,
  sequence parallel's included, hand one rank's traced forward; `fake_cpu`: the one fake mode
  every trace runs in, and the fake parameters it hands each).
- `memory`: per rank, named terms: state, activations times the microbatches each schedule keeps
  in flight, communication buffers, the runtime's baseline.
- `cost`: step time from FLOPs and launch floors, the schedule's bubble, dp / tp / pp communication.
- `search`: every layout of N devices, pruned and ranked; its CLI is `meshrun.cli.plan`.
- `calibrate` (+ `probe`): real steps on this machine fit the constants the cost model uses and
  measure its floors.
"""
