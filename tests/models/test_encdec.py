"""The built-in encoder-decoder against torch's nn.Transformer, and split into pipeline parts (one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from encdec_reference import TorchEncDec, lopsided_pairs, plain_step

from meshrun.config.schema import load_config
from meshrun.data.pairs import PairsDataset, prepare_pairs
from meshrun.data.storage import read_meta
from meshrun.errors import ConfigError
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.stages import even_split

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pairs") / "reverse"
    prepare_pairs(lopsided_pairs(64), out, val_fraction=0.25)
    return out


def encdec_config(**overrides: object):
    settings = {
        "model.name": "encdec",
        "model.num_layers": 4,
        "model.dim": 32,
        "model.num_heads": 2,
        "model.seq_len": 80,
        "model.vocab_size": 260,
        "precision": "fp32",
        **overrides,
    }
    return load_config(None, [f"{k}={v}" for k, v in settings.items()])


@pytest.mark.parametrize("tied,positions", [(False, "learned"), (True, "sinusoidal")])
def test_logits_and_gradients_equal_torch_transformer(tied: bool, positions: str, pairs_dir: Path) -> None:
    cfg = encdec_config(**{"model.tie_embeddings": tied, "model.positions": positions, "model.encoder_layers": 1})
    model = materialise_part(cfg, CPU, layers=None, first=True, last=True)
    reference = TorchEncDec(model)
    x, y = PairsDataset(pairs_dir, "train", read_meta(pairs_dir), seq_len=80, seed=0, source_len=40).batch(0, 8)
    assert (x[:, :40] == 0).any() and (y == -100).any(), "the batch must be padded for the test to mean anything"
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=2e-5)
    loss, norm = plain_step(model, x, y)
    ref_loss, ref_norm = plain_step(reference, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_chained_equal_the_whole_model(num_stages: int, pairs_dir: Path) -> None:
    """Encoder output, decoder hidden state and the padding mask travel between stages as one tuple."""
    cfg = encdec_config(**{"model.tie_embeddings": True})
    whole = materialise_part(cfg, CPU, layers=None, first=True, last=True)
    split = even_split(4, num_stages)
    parts = [
        materialise_part(cfg, CPU, layers=blocks, first=i == 0, last=i == num_stages - 1)
        for i, blocks in enumerate(split)
    ]
    assert "embed.tok.weight" in dict(parts[-1].named_parameters()) and parts[-1].embed.pos is None
    x, _ = PairsDataset(pairs_dir, "train", read_meta(pairs_dir), seq_len=80, seed=0, source_len=40).batch(0, 4)
    state = x
    for part in parts:
        state = part(*state) if isinstance(state, tuple) else part(state)
    torch.testing.assert_close(state, whole(x), rtol=0, atol=1e-6)


def counted_flops_per_token(model: torch.nn.Module, length: int) -> float:
    """torch's own FLOP counter over one forward + backward of 2 samples of `length` tokens
    (math attention, so its matmuls are counted too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    tokens = torch.randint(3, 260, (2, length), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    return counter.get_total_flops() / (2 * length)


@pytest.mark.parametrize(
    "overrides",
    [
        {"model.name": "gpt", "model.seq_len": 128},
        {"model.source_len": 16},  # encdec: short source, long target
        {"model.source_len": 64},  # long source, short target
    ],
    ids=["gpt", "encdec-short-source", "encdec-long-source"],
)
def test_flops_per_token_matches_torchs_counter_at_every_length(overrides: dict) -> None:
    """MFU's numerator: the model's FLOPs per token agree with torch's FLOP counter at full
    length and on a quarter-length bucket, to the same small excess at both (PaLM's count charges
    the biases it adds to its matmuls; the counter leaves them out: < 3.5% at dim 32)."""
    from meshrun.models.families import flops_at

    cfg = encdec_config(**overrides)
    model = materialise_part(cfg, CPU, layers=None, first=True, last=True)
    full, bucket = (
        flops_at(model, length) / counted_flops_per_token(model, length)
        for length in (cfg.model.seq_len, cfg.model.seq_len // 4)
    )
    assert 1.0 <= full < 1.035 and 1.0 <= bucket < 1.035, (full, bucket)
    assert bucket == pytest.approx(full, abs=0.01)


@pytest.mark.parametrize(
    "overrides,key",
    [({"model.encoder_layers": 4}, "model.encoder_layers"), ({"model.source_len": 80}, "model.source_len")],
)
def test_impossible_split_names_the_key(overrides: dict, key: str) -> None:
    from meshrun.models.families import build_model

    with pytest.raises(ConfigError, match=key):
        build_model(encdec_config(**overrides).model)
