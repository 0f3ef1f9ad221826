"""A GPT that, at its k-th embedding forward, asks to stop (SIGUSR1 to itself), raises or dies: the
ways a run ends, on cue.

Used through `model.factory: interrupting_gpt:build`. MESHRUN_TEST_SIGNAL_AT=k,
MESHRUN_TEST_RAISE_AT=k or MESHRUN_TEST_KILL_AT=k (SIGKILL, mid-step: only the rank's first worker,
not a replacement under launch.recovery peer, unless MESHRUN_TEST_KILL_EVERY is set: each of them)
(1-based, counted per process); MESHRUN_TEST_PAUSE_AT=k: the first worker makes the file
MESHRUN_TEST_PAUSED and waits there (for its node to be killed); MESHRUN_TEST_ON_RANK=r limits it to one rank (RANK, as torchrun sets
it; a lone process is rank 0). MESHRUN_TEST_KILL_SENDING=r: rank r's first worker is SIGKILLed when
its state is asked for while it recovers (a survivor about to send a replacement its state).
MESHRUN_TEST_KILL_RECEIVING=RANK:FILE: that rank's replacement is SIGKILLed as it takes its state
(once: FILE is made first).
Outside the step, each once in a run (a marker file in MESHRUN_TEST_ONCE_DIR remembers it), on
whichever worker holds the rank then: MESHRUN_TEST_KILL_IN=RANK:PHASE:STEP[,...] SIGKILLs it as it
enters PHASE (launcher/progress.py's: log, eval, checkpoint) after step STEP;
MESHRUN_TEST_KILL_AFTER_COMMIT=RANK:STEP[,...] as step STEP's commit returns (launch.recovery peer:
every rank's gradients final, no optimizer stepped there yet); MESHRUN_TEST_KILL_RECEIVING=RANK as a
replacement takes its state.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from meshrun.config.schema import ModelConfig
from meshrun.launcher import progress
from meshrun.models.gpt import GPT, Embedding
from meshrun.training import recovery

_calls = {"forward": 0}


def _kill_once(variable: str, *where: object) -> None:
    """SIGKILL this process if `variable` names its rank at `where`, the first time in the run."""
    here = ":".join(map(str, (os.environ.get("RANK", "0"), *where)))
    if here in os.environ.get(variable, "").split(","):
        try:
            (Path(os.environ["MESHRUN_TEST_ONCE_DIR"]) / f"{variable}-{here.replace(':', '-')}").touch(exist_ok=False)
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _killing_mark(mark):
    def marked(phase: str, *args, **kwargs) -> None:
        _kill_once("MESHRUN_TEST_KILL_IN", phase, progress.current().step)
        mark(phase, *args, **kwargs)

    return marked


def _killing_commit(commit):
    def committed(self, *loss: torch.Tensor) -> torch.Tensor:
        losses = commit(self, *loss)
        _kill_once("MESHRUN_TEST_KILL_AFTER_COMMIT", progress.current().step)
        return losses

    return committed


if "MESHRUN_TEST_KILL_IN" in os.environ:
    progress.mark = _killing_mark(progress.mark)
if "MESHRUN_TEST_KILL_AFTER_COMMIT" in os.environ:
    recovery.PeerRecovery.commit = _killing_commit(recovery.PeerRecovery.commit)


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
        if on_this_rank and first and _calls["forward"] == int(os.environ.get("MESHRUN_TEST_PAUSE_AT", "0")):
            Path(os.environ["MESHRUN_TEST_PAUSED"]).touch()  # the test kills this worker's whole node now
            signal.pause()
        return super().forward(idx)


class InterruptingGPT(GPT):
    def state_dict(self, *args, **kwargs):
        first = os.environ.get("MESHRUN_WORKER_ROLE", "first") == "first"
        sending = os.environ.get("MESHRUN_TEST_KILL_SENDING") == os.environ.get("RANK", "0")
        if first and sending and progress.current().phase == "recovering":
            os.kill(os.getpid(), signal.SIGKILL)
        if not first:  # a replacement, taking its state
            _kill_once("MESHRUN_TEST_KILL_RECEIVING")
        return super().state_dict(*args, **kwargs)


def build(cfg: ModelConfig) -> GPT:
    model = InterruptingGPT(cfg)
    model.embed = InterruptingEmbedding(cfg)  # same parameter names as the plain GPT
    return model
