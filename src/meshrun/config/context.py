"""What context parallelism (`parallel.cp`) needs of a job, checked before any worker: torch-free.

Each rank of a cp group holds seq_len / cp positions of every sample (seq_len / (cp x tp) under
sequence parallel); inside attention an all-to-all gives it every position of heads / (tp x cp) of
the heads (parallel/context.py). So the heads, query and key/value alike, divide by tp x cp
(key/value heads are not repeated to make them divide), and the sequence lengths by cp (x tp).
Only causal decoders run it: the built-in GPT and the Hugging Face decoders named in `CP_HF_TYPES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshrun.errors import ConfigError

if TYPE_CHECKING:
    from meshrun.config.topology import ParallelConfig

CP_FAMILIES = ("gpt", "hf")  # model families whose attention parallel/context.py splits
CP_HF_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2")  # Hugging Face decoders among them
CP_TASKS = ("causal_lm",)
WORKS = f"the built-in gpt or a Hugging Face {', '.join(CP_HF_TYPES)} decoder, task causal_lm"


def unsupported(family: str, task: str, model_type: str | None = None) -> str | None:
    """What in a job context parallelism does not run (None: everything it holds)."""
    if family not in CP_FAMILIES:
        return "a model.factory model" if family == "factory" else f"model.name {family}"
    if model_type is not None and model_type not in CP_HF_TYPES:
        return f"Hugging Face model_type {model_type}"
    return None if task in CP_TASKS else f"task {task}"


def check_context_split(
    par: ParallelConfig,
    *,
    refused: str | None,
    heads: Mapping[str, int],
    sequences: Mapping[str, int],
) -> None:
    """parallel.cp > 1 only where nothing is `refused` (`unsupported`); the heads (after tp) and the
    sequence lengths (x tp under sequence parallel) divisible by cp."""
    cp, tp = par.cp, par.tp
    if cp == 1:
        return
    if refused is not None:
        raise ConfigError(f"parallel.cp {cp} is not supported for {refused}; it works with {WORKS}; set parallel.cp=1")
    for key, count in heads.items():
        if count % (tp * cp):
            split = f"parallel.tp x parallel.cp ({tp} x {cp} = {tp * cp})" if tp > 1 else f"parallel.cp ({cp})"
            raise ConfigError(
                f"{key} ({count}) must be divisible by {split}: each cp rank attends with whole heads "
                "(key/value heads are not repeated); change one of these keys"
            )
    shards = cp * (tp if par.sequence_parallel else 1)
    for key, length in sequences.items():
        if length % shards:
            split = f"parallel.cp x parallel.tp ({cp} x {tp} = {shards})" if shards > cp else f"parallel.cp ({cp})"
            raise ConfigError(f"{key} ({length}) must be divisible by {split}; change one of these keys")
