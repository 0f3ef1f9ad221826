"""Pictures of a run, written as PNG into the run directory (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from meshrun.files.atomic import atomic_target


def save_figure(fig: Any, path: Path, *, replace: bool = True) -> None:
    """Write a picture atomically (a crash never leaves half a PNG) and release the figure.
    `replace=False`: a file the user named, never written over (FileExistsError)."""
    with atomic_target(path, replace=replace) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)


def plot_loss(rows: list[dict[str, Any]], path: Path, *, run: str = "") -> None:
    """Train and validation loss against step, titled with the run's name."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(f"{run}: loss" if run else "loss", fontsize=10)
    for key, style in (("loss", "-"), ("val_loss", "o--")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), style, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


def plot_timeline(timeline: dict[int, Any], path: Path, *, title: str, bubble: float) -> None:
    """Pipeline ranks x time: one bar per forward (F) / backward (B, or I + W when split) action;
    `bubble` is the measured one the run logged for this step (mean over all ranks)."""
    ranks = sorted(timeline)
    fig, ax = plt.subplots(figsize=(10, 1.3 + 0.5 * len(ranks)), layout="constrained")
    for rank in ranks:
        for action in timeline[rank].actions:
            width = (action.end - action.start) * 1e3
            ax.barh(rank, width, left=action.start * 1e3, color=_COLOURS[action.kind], edgecolor="white", height=0.8)
            ax.text(
                action.start * 1e3 + width / 2,
                rank,
                f"{action.kind}{action.microbatch}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(ranks, [_stage_label(r, timeline[r].actions) for r in ranks])
    ax.set_ylim(ranks[-1] + 0.5, ranks[0] - 0.5)  # rank 0 on top, no empty band below the last rank
    ax.set_xlim(0, max(t.offset + t.wall for t in timeline.values()) * 1e3)  # idle ends are bubble too
    ax.set_xlabel("time in step (ms), all stages on one clock")
    ax.set_title(f"{title} measured bubble {bubble:.1%}", fontsize=10)
    kinds = sorted({a.kind for t in timeline.values() for a in t.actions}, key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLOURS[k]) for k in kinds]
    ax.legend(
        handles, [names[k] for k in kinds], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )  # beside the bars: never over them or the axis label
    save_figure(fig, path)


def _stage_label(rank: int, actions: list[Any]) -> str:
    """A pipeline rank's row, named by the stages it runs (several with virtual stages)."""
    stages = sorted({a.stage for a in actions}) or [rank]
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
