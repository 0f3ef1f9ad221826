"""Greedy and beam-search decoding for the encoder-decoder (one process, e.g. `meshrun sample`).

Each step runs the whole model on [source | decoder input so far, padded]: the decoder is
causal, so padding after the last real position changes nothing, and the model stays free of
decoding caches. Ids are the data's (tokenizer id + 3; 0 pad, 1 BOS, 2 EOS: data/pairs.py).
"""

from __future__ import annotations

import torch

from meshrun.data.pairs import BOS, EOS, PAD
from meshrun.models.encdec import EncDec, split_lengths


@torch.no_grad()
def decode(model: EncDec, source: list[int], *, beam: int = 1, max_tokens: int | None = None) -> list[int]:
    """The most likely target ids (without BOS/EOS) for `source`; beam=1 is greedy."""
    source_len, target_len = split_lengths(model.cfg)
    steps = min(max_tokens or target_len, target_len)
    src = torch.full((1, source_len), PAD, dtype=torch.long)
    src[0, : min(len(source), source_len)] = torch.tensor(source[:source_len], dtype=torch.long)
    beams: list[tuple[list[int], float]] = [([BOS], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(steps):
        x = torch.full((len(beams), source_len + target_len), PAD, dtype=torch.long)
        x[:, :source_len] = src
        for row, (ids, _) in enumerate(beams):
            x[row, source_len : source_len + len(ids)] = torch.tensor(ids)
        logits = model(x).float()  # (beams, T, V)
        last = torch.tensor([len(ids) - 1 for ids, _ in beams])
        logprobs = torch.log_softmax(logits[torch.arange(len(beams)), last], dim=-1)  # (beams, V)
        candidates = []
        for row, (ids, score) in enumerate(beams):
            values, tokens = logprobs[row].topk(beam)
            candidates += [([*ids, int(t)], score + float(v)) for v, t in zip(values, tokens)]
        candidates.sort(key=lambda c: c[1], reverse=True)
        beams = []
        for ids, score in candidates[:beam]:
            (finished if ids[-1] == EOS else beams).append((ids, score))
        if not beams or (finished and max(s for _, s in finished) >= beams[0][1]):
            break  # scores only fall as tokens are added: no open beam can overtake the best finished one
    best = max(finished + beams, key=lambda c: c[1])[0]
    return [t for t in best[1:] if t != EOS]
