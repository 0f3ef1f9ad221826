"""Progress lines for people: one prefix, on stderr, flushed (workers' output interleaves)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def say(message: str) -> None:
    print(f"[meshrun] {message}", file=sys.stderr, flush=True)


def next_steps(run_dir: str, *, offline_wandb: bool) -> str:
    """What to do with a finished run, with its path: the commands people look up next."""
    run = shlex.quote(run_dir)
    commands = [
        f"meshrun sample {run} --prompt 'def '",
        f"meshrun export {run} --out {shlex.quote(str(Path(run_dir) / 'model.safetensors'))}",
        f"meshrun report {run}",
    ]
    if offline_wandb:
        commands.append(f"wandb sync {shlex.quote(str(Path(run_dir) / 'wandb'))}/offline-run-*")
    return "next: " + "  |  ".join(commands)
