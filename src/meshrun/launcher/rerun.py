"""What a rerun in a run directory that already holds a run may change, and when it is refused.

A run directory has one history: its config.json, metrics.jsonl, summary.json and checkpoints
describe one run. A rerun continues that run, or is refused in one line before anything in the
folder changes; it never trains another run over it. `RESUMABLE` is the one list of what a
rerun may change (how the same training runs, not what it computes); every other key must equal
the recorded config.json. No torch: the launcher checks this before any worker exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshrun.checkpoint.paths import resume_candidates
from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.launcher.outcome import Outcome, read_record

# A key, or a whole section, that a rerun may set differently from the run's config.json, and why.
RESUMABLE: dict[str, str] = {
    "train.steps": "the run continues to a later step (or is found complete at an earlier one)",
    "train.micro_batch": "how a rank's share of the global batch is split into microbatches: same samples, same loss",
    "train.log_interval": "how often metrics are logged, not what is trained",
    "train.eval_interval": "how often validation is measured, not what is trained",
    "train.eval_batches": "how much validation is measured, not what is trained",
    "train.resume": "where the run first started; a rerun continues from its own checkpoints (another run's are refused)",
    "checkpoint": "when checkpoints are written (in the background or not) and how many are kept",
    "parallel": "the layout: checkpoints reshard on load and every dp x pp split trains on the same global batches",
    "launch": "how the processes are started: nodes, rendezvous, restarts",
    "precision": "`auto` resolves per machine (config.json records the result): a resume on other hardware may differ",
    "recompute": "trades memory for compute; the gradients are the same",
    "train.compile": "how the blocks run (compiled or eager): the same parameters, the same gradients to rounding",
    "tracker": "where the metric rows go",
    "metrics": "what is measured and drawn (peak FLOP/s for MFU, plots)",
    "profile": "which steps are traced",
    "run_dir": "the same folder may be named by another path (relative, absolute, through a link)",
}


def resumable(key: str) -> bool:
    """`key` (dotted) or a section above it is in RESUMABLE."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in RESUMABLE for n in range(1, len(parts) + 1))


def changed_keys(recorded: Config, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted keys a rerun may not change whose values differ: key -> (recorded, now)."""
    before, now = _flat_keys(recorded.model_dump(mode="json")), _flat_keys(cfg.model_dump(mode="json"))
    return {
        key: (before.get(key), now.get(key))
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key) and not resumable(key)
    }


def _flat_keys(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, dict) and value:
            flat.update(_flat_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_rerun(run_dir: Path, recorded: Config, cfg: Config) -> None:
    """A rerun continues the recorded run: the same settings but RESUMABLE ones, and something to
    continue from when that run finished (else it would train from step 0 over its record)."""
    elsewhere = "start a new run elsewhere with --set run_dir=NEW"
    if changed := changed_keys(recorded, cfg):
        shown = "; ".join(f"{key} is {was!r} there, {now!r} here" for key, (was, now) in list(changed.items())[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise ConfigError(
            f"run_dir {run_dir} holds a run with other settings ({shown}{more}); a rerun continues the run its "
            f"config.json records and may change only how it runs (steps, intervals, layout, tracking); use the "
            f"recorded values, or {elsewhere}"
        )
    finished = read_record(run_dir) is Outcome.COMPLETED or (run_dir / "summary.json").exists()
    if finished and not resume_candidates(run_dir, cfg.train.resume):
        raise ConfigError(
            f"run_dir {run_dir} holds a finished run with no checkpoint to continue from: training again would "
            f"start at step 0 over its metrics and summary; {elsewhere} (checkpoint.at_end=true keeps a final one)"
        )
