"""What a task's batch and head look like, without its data: the first stage's input, the last
stage's targets and output, and how many positions per sample the head maps. The planner traces
and prices a stage with it (planner/stage_cost.py), `--calibrate`'s probes and `parallel.balance`
feed it random batches (planner/probe.py, parallel/balance.py), and the preflight bound sizes the
last stage's output with it (planner/model_size.py). One record per task, from the config alone;
torch is imported only to make tensors (model_size.py runs before torch is imported). It lives
with the models, below both parallel/ and planner/, which read it.

- causal_lm, seq2seq, masked_lm: token ids (T,) in, a target id (T,) per position (the next token,
  or the masked one), (T, vocab) logits out: the head maps every position.
- classification: token ids (T,) in (no padding: every position a token), one label () per
  sample, (num_labels,) logits out: the head maps one pooled state per sample (B x hidden x labels).
- regression: values (T, features) in, (1 + horizon, features) targets (the last past value, then
  the future: tasks/regression.py), (horizon, features) forecasts out: the head maps the last step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from meshrun.config.schema import Config


@dataclass(frozen=True)
class Values:
    """One sample's tensor: its shape (after the batch dimension) and what it holds."""

    shape: tuple[int, ...]
    ids_below: int | None = None
    """Integer ids in [0, ids_below) (int64); None: float32 values (standardised: standard normal)."""

    def zeros(self, batch: int) -> torch.Tensor:
        """`batch` samples of zeros (what a traced forward reads: shapes and dtypes matter, not values)."""
        import torch

        return torch.zeros((batch, *self.shape), dtype=torch.float32 if self.ids_below is None else torch.long)

    def random(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """`batch` random samples (what a timed probe or a balancer runs on)."""
        import torch

        if self.ids_below is None:
            return torch.randn((batch, *self.shape), generator=generator)
        return torch.randint(0, self.ids_below, (batch, *self.shape), generator=generator)


@dataclass(frozen=True)
class TaskIO:
    """A task's batch and head, per sample."""

    inputs: Values  # the first stage's input
    targets: Values  # what the last stage's loss compares its output with
    output: tuple[int, ...]  # the last stage's output (logits or forecasts), fp32 in the loss
    head_positions: int  # positions the head maps per sample: seq_len for token logits, 1 pooled / last step
    reads: str  # what the model reads and writes, for --dry-run ("vocab 256", "2 features per step, ...")
    per_output_row: bool = False
    """Token logits: a target id per row of the output (an encoder-decoder's cover its target part only)."""

    @property
    def output_values(self) -> int:
        return prod(self.output)

    def targets_of(self, output: torch.Tensor) -> torch.Tensor:
        """Zero targets for a traced last-stage output (the loss's shapes and dtypes)."""
        if not self.per_output_row:
            return self.targets.zeros(output.shape[0])
        import torch

        return torch.zeros(output.shape[:-1], dtype=torch.long)

    def batch(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch of `count` samples: (the first stage's input, the last stage's targets)."""
        return self.inputs.random(count, generator), self.targets.random(count, generator)


def _tokens(cfg: Config, vocab: int) -> TaskIO:
    t = cfg.model.seq_len
    ids = Values((t,), ids_below=vocab)
    return TaskIO(ids, ids, output=(t, vocab), head_positions=t, reads=f"vocab {vocab}", per_output_row=True)


def _classification(cfg: Config, vocab: int) -> TaskIO:
    labels = getattr(cfg.model, "num_labels")  # noqa: B009 (check_task: a classifier's section)
    return TaskIO(
        Values((cfg.model.seq_len,), ids_below=vocab),
        Values((), ids_below=labels),
        output=(labels,),
        head_positions=1,
        reads=f"vocab {vocab}, {labels} labels",
    )


def _regression(cfg: Config, vocab: int) -> TaskIO:
    features = getattr(cfg.model, "features")  # noqa: B009 (check_task allows only timeseries, which has them)
    horizon = cfg.task_options.horizon
    return TaskIO(
        Values((cfg.model.seq_len, features)),
        Values((1 + horizon, features)),
        output=(horizon, features),
        head_positions=1,
        reads=f"{features} features per step, forecasts {horizon} steps",
    )


TASK_IO: dict[str, Callable[[Config, int], TaskIO]] = {
    "causal_lm": _tokens,
    "seq2seq": _tokens,
    "masked_lm": _tokens,
    "classification": _classification,
    "regression": _regression,
}


def task_io(cfg: Config, *, vocab: int | None = None) -> TaskIO:
    """The config's task's batch and head.
    `vocab`: the model's vocabulary where the caller has it (model_size.py: a Hugging Face
    config.json read without transformers), else the model's (hf_config.vocab_size)."""
    if vocab is None:
        from meshrun.models.hf_config import vocab_size

        vocab = vocab_size(cfg.model)
    return TASK_IO[cfg.task](cfg, vocab)
