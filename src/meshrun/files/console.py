"""Progress lines for people: one prefix, on stderr, flushed (workers' output interleaves)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def say(message: str) -> None:
    print(f"[meshrun] {message}", file=sys.stderr, flush=True)


def next_steps(run_dir: str, *, offline_wandb: bool, prompt: str | None, hf: bool) -> str:
    """What to do with a finished run, with its path: the commands people look up next, fitted to
    the run (`prompt`: one like its training text, None: a model that does not generate text; `hf`:
    a Hugging Face model, exported as a folder from_pretrained loads)."""
    run = shlex.quote(run_dir)
    export = (
        f"--hf {shlex.quote(str(Path(run_dir) / 'hf'))}"
        if hf
        else f"--out {shlex.quote(str(Path(run_dir) / 'model.safetensors'))}"
    )
    commands = [
        *([] if prompt is None else [f"meshrun sample {run} --prompt {shlex.quote(prompt)}"]),
        f"meshrun export {run} {export}",
        f"meshrun report {run}",
    ]
    if offline_wandb:
        commands.append(f"wandb sync {shlex.quote(str(Path(run_dir) / 'wandb'))}/offline-run-*")
    return "next: " + "  |  ".join(commands)
