"""The planner's fast paths against its exact one: every stage composed from one- and two-block
traces (stage_pieces.py), and microbatches beyond 2 grown affinely, equal the stage traced whole
at that micro_batch, field by field (fake tensors: no memory, deterministic, single process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from measure_memory import layout_config

from meshrun.config.schema import load_config
from meshrun.planner.layout_memory import layout_split
from meshrun.planner.stage_cost import _trace_stages, profile_stages

LLAMA = (
    "model.hf_config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 64}"
)
LAYOUTS = {
    "single-none-mb4": ["train.global_batch=4", "train.micro_batch=4"],
    "single-every2-mb3": ["train.global_batch=6", "train.micro_batch=3", "recompute=every:2"],
    "pp2-full-mb2": ["parallel.pp=2", "train.global_batch=4", "train.micro_batch=2", "recompute=full"],
    "pp2-interleaved-every2-mb4": [
        "parallel.pp=2",
        "parallel.schedule=interleaved-1f1b",
        "train.global_batch=8",
        "train.micro_batch=4",
        "recompute=every:2",
    ],
    "tp2-pp2-mb4-bf16": [
        "parallel.pp=2",
        "parallel.tp=2",
        "train.global_batch=8",
        "train.micro_batch=4",
        "precision=bf16",
    ],
    "llama-pp2-mb4": [LLAMA, "parallel.pp=2", "train.global_batch=8", "train.micro_batch=4"],
    "llama-tp2-pp2-sp-every2-mb4": [
        LLAMA,
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.global_batch=8",
        "train.micro_batch=4",
        "recompute=every:2",
    ],
}
CLASSIFY = ["task=classification", "model.name=encoder", "model.num_labels=3"]
REGRESS = ["task=regression", "model.name=timeseries", "model.features=2", "model.horizon=3", "task_options.horizon=3"]
LAYOUTS |= {
    "classify-pp2-every2-mb4": [
        *CLASSIFY,
        "parallel.pp=2",
        "train.global_batch=8",
        "train.micro_batch=4",
        "recompute=every:2",
    ],
    "regress-tp2-pp2-sp-mb4": [*REGRESS, *LAYOUTS["llama-tp2-pp2-sp-every2-mb4"][1:]],
}
SP_PP = ["parallel.pp=2", "parallel.tp=2", "train.global_batch=4", "train.micro_batch=2"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_composed_stages_equal_whole_stage_traces(name: str) -> None:
    cfg = layout_config(LAYOUTS[name])
    split, micro_batch = layout_split(cfg), cfg.train.micro_batch
    composed = profile_stages(cfg, split, micro_batch, cfg.precision)
    traced = _trace_stages(cfg, split, micro_batch, cfg.precision)
    assert composed == traced
    assert all(stage.activation_bytes > 0 and stage.hidden_bytes > 0 for stage in composed)


def test_tensor_parallel_shrinks_state_flops_and_activations() -> None:
    """A tp rank holds about half the matrices, computes half the FLOPs and keeps less for backward
    (the column-split activations), but not half (norm inputs and residuals stay whole)."""
    one, two = (
        profile_stages(
            layout_config(["train.global_batch=4", "train.micro_batch=2", f"parallel.tp={tp}"]),
            [[0, 1, 2, 3]],
            2,
            "fp32",
        )[0]
        for tp in (1, 2)
    )
    assert 0.45 < two.param_bytes / one.param_bytes < 0.6
    assert two.flops_per_token == pytest.approx(one.flops_per_token / 2)
    assert 0.5 < two.activation_bytes / one.activation_bytes < 0.9


def test_a_model_handing_on_a_state_tuple_is_profiled() -> None:
    """The encoder-decoder's stages pass (encoder, decoder, mask) on, and its logits cover the
    target only: each later stage is traced on that tuple, the loss on the logits' rows; at tp 2
    with sequence parallel both hidden states go on split by position (the mask whole)."""
    path = Path(__file__).parents[2] / "configs" / "encdec-example.yaml"
    plain, split = (
        profile_stages(cfg, layout_split(cfg), cfg.train.micro_batch, "fp32")
        for cfg in (
            load_config(path, ["parallel.dp=1", "parallel.pp=2", *tp])
            for tp in ([], ["parallel.tp=2", "parallel.sequence_parallel=true"])
        )
    )
    assert len(plain) == 2 and all(s.activation_bytes > 0 for s in plain)
    assert plain[0].boundary_bytes > 0 and plain[1].boundary_bytes == 0
    mask = 16 * 24 * 8  # micro_batch x source_len, int64
    assert (split[0].boundary_bytes - mask) * 2 == plain[0].boundary_bytes - mask


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_tasks_head_and_loss_are_priced_on_its_output(task: str) -> None:
    """Counted here from the model's sizes (dim d 32, seq_len T 16, 4 blocks over 2 stages, micro_batch
    4): the last stage's extra training FLOPs per token over the first's are its final norm (2d) and
    its head, which maps one state per sample (a pooled classifier: d x labels + labels; a forecast:
    d x horizon x features + horizon x features), so 1/T of a token's; the regression's first stage
    also projects each step's features (features x d + d; a token table is a lookup). The backward
    term is the fp32 gradient of the head's output, twice (task_io.py, stage_cost.py)."""
    d, t, mb = 32, 16, 4
    cfg = layout_config(
        [
            *(CLASSIFY if task == "classification" else REGRESS),
            "parallel.pp=2",
            "train.global_batch=8",
            f"train.micro_batch={mb}",
        ]
    )
    first, last = profile_stages(cfg, [[0, 1], [2, 3]], mb, "fp32")
    out = 3 if task == "classification" else 3 * 2  # labels, or horizon x features
    projection = 0 if task == "classification" else 2 * d + d
    assert last.model_flops_per_token - first.model_flops_per_token == pytest.approx(
        6 * (2 * d + (d * out + out) / t - projection)
    )
    assert (first.backward_bytes, last.backward_bytes) == (0, 2 * 4 * mb * out)
