"""Greedy and beam decoding of the encoder-decoder, checked against step-by-step scoring."""

from __future__ import annotations

import torch

from meshrun.config.schema import load_config
from meshrun.data.pairs import BOS, EOS, PAD
from meshrun.generation.seq2seq import decode
from meshrun.parallel.materialise import materialise_part

SOURCE = [ord(c) + 3 for c in "get_terminal_size"]


def model_with_seed(seed: int):
    cfg = load_config(
        None,
        [
            "model.name=encdec",
            "model.num_layers=2",
            "model.dim=32",
            "model.num_heads=2",
            "model.seq_len=24",
            "model.source_len=18",
            "model.vocab_size=259",
            f"train.seed={seed}",
        ],
    )
    return materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True).eval()


def log_prob(model, target: list[int], *, ended: bool) -> float:
    """log p(target [+ EOS] | SOURCE) by teacher forcing, written without the decoder's loop."""
    x = torch.full((1, 24), PAD, dtype=torch.long)
    x[0, : len(SOURCE)] = torch.tensor(SOURCE)
    inputs, outputs = [BOS, *target], [*target, EOS] if ended else target
    x[0, 18 : 18 + len(outputs)] = torch.tensor(inputs[: len(outputs)])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].float(), dim=-1)
    return sum(logp[i, t].item() for i, t in enumerate(outputs))


def test_greedy_takes_the_argmax_at_every_step() -> None:
    model = model_with_seed(3)
    out = decode(model, SOURCE, beam=1)
    x = torch.full((1, 24), PAD, dtype=torch.long)
    x[0, : len(SOURCE)] = torch.tensor(SOURCE)
    ids = [BOS]
    with torch.no_grad():
        while len(ids) <= 6:
            x[0, 18 : 18 + len(ids)] = torch.tensor(ids)
            ids.append(int(model(x)[0, len(ids) - 1].argmax()))
            if ids[-1] == EOS:
                break
    assert out == [t for t in ids[1:] if t != EOS][: len(out)] and len(out) == 6  # an untrained model never ends early


def test_beam_finds_a_sequence_at_least_as_likely_as_greedy() -> None:
    model = model_with_seed(5)
    greedy, beam = decode(model, SOURCE, beam=1, max_tokens=4), decode(model, SOURCE, beam=4, max_tokens=4)
    assert len(greedy) == len(beam) == 4
    assert log_prob(model, beam, ended=False) >= log_prob(model, greedy, ended=False) - 1e-6
