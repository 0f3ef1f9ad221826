"""Encoder-decoder numerics on padded pairs: one process equals torch's nn.Transformer trained on
the whole global batch (sum of token losses / global target-token count), and dp x pp layouts
equal one process in weights after 10 steps. Microbatches hold very different token counts, so
a mean of per-microbatch means would fail (checked: it differs from the logged loss).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from encdec_reference import (
    TorchEncDec,
    assert_same_training,
    assert_step_one_matches,
    torch_first_step,
    train_encdec,
)

# Tied embeddings (one matrix on the first and last stage), sinusoids; clipping active every step.
ENCDEC = {
    "model.name": "encdec",
    "model.num_layers": 4,
    "model.seq_len": 80,
    "model.source_len": 40,
    "model.vocab_size": 260,
    "model.tie_embeddings": True,
    "model.positions": "sinusoidal",
    "train.global_batch": 16,
    "train.micro_batch": 2,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
}


def train(lopsided_dir: Path, run: Path, **overrides: object) -> Path:
    return train_encdec(lopsided_dir, run, ENCDEC, **overrides)


@pytest.fixture(scope="module")
def reference(lopsided_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(lopsided_dir, tmp_path_factory.mktemp("ref") / "run")


@pytest.fixture(scope="module")
def torch_step(lopsided_dir: Path) -> tuple[TorchEncDec, torch.Tensor, torch.Tensor]:
    """torch's nn.Transformer with meshrun's initial weights, and the first global batch."""
    return torch_first_step(lopsided_dir, ENCDEC)


def test_one_process_step_one_equals_torch_transformer(reference: Path, torch_step) -> None:
    assert_step_one_matches(reference, *torch_step, micro_batch=2)


def test_tensor_parallel_step_one_equals_torch_transformer(torch_step, lopsided_dir: Path, tmp_path: Path) -> None:
    """tp2 x pp2: self- and cross-attention split by heads, the tied matrix split by vocabulary
    (260 over 2) on the first and the last stage, the padded-token loss from sharded logits."""
    layout = {"parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "train.steps": 2}
    assert_step_one_matches(train(lopsided_dir, tmp_path / "run", **layout), *torch_step, micro_batch=2)


def test_sequence_parallel_trains_as_one_process(
    torch_step, reference: Path, lopsided_dir: Path, tmp_path: Path
) -> None:
    """tp2 x pp2 with sequence parallel: the stages pass a rank's source and target positions (the
    mask whole), cross-attention gathers its queries and the encoder output. Step 1 equals torch's
    Transformer; the LayerNorms, the decoder's final one included (it takes the state), see a
    rank's positions, so their weights must get every position's gradient to stay equal to one
    process after 10 clipped steps."""
    layout = {"parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.sequence_parallel": True}
    run = train(lopsided_dir, tmp_path / "run", **layout)
    assert_step_one_matches(run, *torch_step, micro_batch=2)
    assert_same_training(run, reference)


@pytest.mark.parametrize(
    "dp,pp,schedule,recompute",
    [(2, 2, "1f1b", "full"), (1, 4, "gpipe", "selective")],
    ids=["dp2xpp2-1f1b-full", "dp1xpp4-gpipe-selective"],
)
def test_layout_matches_one_process(
    dp: int, pp: int, schedule: str, recompute: str, reference: Path, lopsided_dir: Path, tmp_path: Path
) -> None:
    run = train(
        lopsided_dir,
        tmp_path / "run",
        **{"parallel.dp": dp, "parallel.pp": pp, "parallel.schedule": schedule, "recompute": recompute},
    )
    assert_same_training(run, reference)


def test_sample_translates_with_greedy_and_beam_decoding(reference: Path) -> None:
    """`meshrun sample` on an encoder-decoder checkpoint decodes a target for the prompt (the
    data's byte ids shifted past pad/bos/eos), greedy and with a beam, at most --tokens long."""
    from meshrun.cli.use_checkpoint import load_full_model
    from meshrun.generation.sample import sample
    from meshrun.generation.seq2seq import decode

    model, cfg, _ = load_full_model(reference)
    for beam in (1, 3):
        text = sample(model, cfg, "to be or not", num_tokens=12, temperature=0.0, top_k=None, seed=0, beam=beam)
        ids = decode(model, [b + 3 for b in b"to be or not"], beam=beam, max_tokens=12)
        assert text.encode() == bytes(i - 3 for i in ids if i >= 3) and len(ids) <= 12
