"""Pictures of a run, written as PNG into the run directory (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_loss(rows: list[dict[str, Any]], path: Path) -> None:
    """Train and validation loss against step."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("val_loss", "o--")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), style, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
