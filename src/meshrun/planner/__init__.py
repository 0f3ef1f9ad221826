"""`meshrun plan`: which dp x pp x schedule x micro_batch x recompute layout fits and runs fastest.

- `profile`: per pipeline stage, exact parameter / gradient / optimizer bytes (the real model,
  built on the meta device) and the activation bytes one microbatch keeps for backward (one
  forward traced under fake tensors: shapes only, no memory, no compute).
- `memory`: per rank, those bytes times the microbatches each schedule keeps in flight.
- `cost`: step time from FLOPs, the schedule's bubble and dp / pp communication.
- `search`: every layout of N devices, ranked; its CLI is `meshrun.cli.plan`.
- `calibrate`: real steps on this machine fit the efficiency constants the cost model uses.
"""
