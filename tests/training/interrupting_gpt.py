"""A GPT that, at its k-th embedding forward, asks to stop (SIGUSR1 to itself), raises or dies: the
ways a run ends, on cue.

Used through `model.factory: interrupting_gpt:build`. MESHRUN_TEST_SIGNAL_AT=k,
MESHRUN_TEST_RAISE_AT=k or MESHRUN_TEST_KILL_AT=k (SIGKILL, mid-step: only the rank's first worker,
not a replacement under launch.recovery peer, unless MESHRUN_TEST_KILL_EVERY is set: each of them)
(1-based, counted per process); MESHRUN_TEST_ON_RANK=r limits it to one rank (RANK, as torchrun sets
it; a lone process is rank 0). MESHRUN_TEST_KILL_SENDING=r: rank r's first worker is SIGKILLed when
its state is asked for while it recovers (a survivor about to send a replacement its state).
"""

from __future__ import annotations

import os
import signal

import torch

from meshrun.config.schema import ModelConfig
from meshrun.launcher import progress
from meshrun.models.gpt import GPT, Embedding

_calls = {"forward": 0}


class InterruptingEmbedding(Embedding):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _calls["forward"] += 1
        on_this_rank = os.environ.get("RANK", "0") == os.environ.get(
            "MESHRUN_TEST_ON_RANK", os.environ.get("RANK", "0")
        )
        if on_this_rank and _calls["forward"] == int(os.environ.get("MESHRUN_TEST_SIGNAL_AT", "0")):
            os.kill(os.getpid(), signal.SIGUSR1)  # what Slurm's warning or a scheduler sends
        if on_this_rank and _calls["forward"] == int(os.environ.get("MESHRUN_TEST_RAISE_AT", "0")):
            raise RuntimeError(f"interrupting_gpt: failing on cue at forward {_calls['forward']}")
        first = os.environ.get("MESHRUN_WORKER_ROLE", "first") == "first" or "MESHRUN_TEST_KILL_EVERY" in os.environ
        if on_this_rank and first and _calls["forward"] == int(os.environ.get("MESHRUN_TEST_KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(idx)


class InterruptingGPT(GPT):
    def state_dict(self, *args, **kwargs):
        first = os.environ.get("MESHRUN_WORKER_ROLE", "first") == "first"
        sending = os.environ.get("MESHRUN_TEST_KILL_SENDING") == os.environ.get("RANK", "0")
        if first and sending and progress.current().phase == "recovering":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)


def build(cfg: ModelConfig) -> GPT:
    model = InterruptingGPT(cfg)
    model.embed = InterruptingEmbedding(cfg)  # same parameter names as the plain GPT
    return model
