"""An independent encoder-decoder for the numerics tests: torch's own `nn.Transformer` (pre-LN,
GELU, final encoder and decoder norms) given meshrun's initial weights, and a plain training
step over a whole padded global batch: sum of token losses / count of non-pad targets, one backward.

It shares with meshrun only the weights' values and the batch; attention, masks, block order,
the loss and the gradient norm are torch's or written here from their definitions.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import final_weights, losses, max_weight_diff, read_metrics, run_meshrun, tiny
from plain_reference import config_from_set_args
from torch import nn

from meshrun.data.dataset import open_dataset
from meshrun.data.pairs import prepare_pairs
from meshrun.models.encdec import EncDec, sinusoids, source_len, split_lengths
from meshrun.parallel.materialise import materialise_part

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "nobler"]


def lopsided_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Word sequences -> the same words reversed, 1 to 8 words (2 to ~60 bytes): microbatches of
    very different target-token counts."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.choice([1, 1, 2, 6, 8]))]
        pairs.append((" ".join(words), " ".join(reversed(words))))
    return pairs


def prepare_lopsided(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 lopsided pairs prepared as a pairs folder (10% validation)."""
    out = tmp_path_factory.mktemp("pairs") / "reverse"
    prepare_pairs(lopsided_pairs(200), out, val_fraction=0.1)
    return out


def train_encdec(pairs_dir: Path, run: Path, settings: dict[str, object], **overrides: object) -> Path:
    """`meshrun train` of the tiny job `settings` describes (overrides win); returns the run folder."""
    run_meshrun(["train", *tiny(pairs_dir, run, **{**settings, **overrides})], tmp_path=run.parent)
    return run


def torch_first_step(pairs_dir: Path, settings: dict[str, object]) -> tuple[TorchEncDec, torch.Tensor, torch.Tensor]:
    """torch's nn.Transformer with the initial weights of the job `settings` describes, and that
    job's first global batch (for assert_step_one_matches)."""
    cfg = config_from_set_args(tiny(pairs_dir, "unused", **settings))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    assert isinstance(model, EncDec)
    data = open_dataset(
        cfg.data, pairs_dir, "train", seq_len=cfg.model.seq_len, seed=cfg.train.seed, source_len=source_len(cfg.model)
    )
    return TorchEncDec(model), *data.batch(0, cfg.train.global_batch)


class TorchEncDec(nn.Module):
    def __init__(self, model: EncDec) -> None:
        super().__init__()
        c = model.cfg
        self.source_len, self.tied = split_lengths(c)[0], c.tie_embeddings
        self.emb = nn.Embedding(c.vocab_size, c.dim)
        self.pos = nn.Embedding(max(split_lengths(c)), c.dim) if c.positions == "learned" else None
        self.transformer = nn.Transformer(
            c.dim,
            c.num_heads,
            model.num_encoder,
            c.num_layers - model.num_encoder,
            dim_feedforward=4 * c.dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.head = None if self.tied else nn.Linear(c.dim, c.vocab_size, bias=False)
        self.load_from(model)

    @torch.no_grad()
    def load_from(self, model: EncDec) -> None:
        w = {name: p.detach().clone() for name, p in model.state_dict().items()}
        self.emb.weight.copy_(w["embed.tok.weight"])
        if self.pos is not None:
            self.pos.weight.copy_(w["embed.pos.weight"])
        if self.head is not None:
            self.head.weight.copy_(w["head.weight"])
        enc, dec = self.transformer.encoder, self.transformer.decoder
        for i in range(model.num_encoder):
            self._layer(enc.layers[i], w, f"blocks.{i}.", {"norm1": "ln1", "norm2": "ln2"}, {"self_attn": "attn"})
        for j, layer in enumerate(dec.layers):
            self._layer(
                layer,
                w,
                f"blocks.{model.num_encoder + j}.",
                {"norm1": "ln1", "norm2": "ln2", "norm3": "ln3"},
                {"self_attn": "attn", "multihead_attn": "cross"},
            )
        self._copy(enc.norm, w, f"blocks.{model.num_encoder - 1}.out_norm.")
        self._copy(dec.norm, w, "norm.")

    def _layer(self, layer: nn.Module, w: dict, prefix: str, norms: dict, attentions: dict) -> None:
        for theirs, ours in norms.items():
            self._copy(getattr(layer, theirs), w, f"{prefix}{ours}.")
        for theirs, ours in attentions.items():
            mha = getattr(layer, theirs)
            mha.in_proj_weight.copy_(torch.cat([w[f"{prefix}{ours}.{m}.weight"] for m in "qkv"]))
            mha.in_proj_bias.copy_(torch.cat([w[f"{prefix}{ours}.{m}.bias"] for m in "qkv"]))
            self._copy(mha.out_proj, w, f"{prefix}{ours}.proj.")
        self._copy(layer.linear1, w, f"{prefix}mlp.fc.")
        self._copy(layer.linear2, w, f"{prefix}mlp.proj.")

    @staticmethod
    def _copy(module: nn.Module, w: dict, prefix: str) -> None:
        module.weight.copy_(w[prefix + "weight"])
        module.bias.copy_(w[prefix + "bias"])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        length, dim = ids.shape[1], self.emb.weight.shape[1]
        positions = self.pos.weight[:length] if self.pos is not None else sinusoids(length, dim, ids.device)
        return self.emb(ids) + positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, target = x[:, : self.source_len], x[:, self.source_len :]
        pad = source == 0  # key_padding_mask: True = ignore
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        h = self.transformer(
            self._embed(source),
            self._embed(target),
            tgt_mask=causal,
            src_key_padding_mask=pad,
            memory_key_padding_mask=pad,
            tgt_is_causal=True,
        )
        return F.linear(h, self.emb.weight) if self.tied else self.head(h)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies / number of non-pad (-100) targets."""
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum()


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, gradient norm) of one backward over the whole global batch."""
    model.zero_grad()
    loss = token_loss(model(x), y)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


def mean_of_microbatch_means(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int) -> float:
    """The normalisation the token-count rule replaces (what a wrong implementation would log)."""
    with torch.no_grad():
        means = [token_loss(model(xm), ym) for xm, ym in zip(x.split(micro_batch), y.split(micro_batch))]
    return torch.stack(means).mean().item()


def assert_step_one_matches(run: Path, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, micro_batch: int) -> None:
    """The run's logged step-1 loss and pre-clip gradient norm equal `model`'s plain step on the
    whole global batch (x, y) to 1e-5, on microbatches of very different target-token counts,
    where a mean of per-microbatch means would be off by far more than that."""
    counts = [int((ym != -100).sum()) for ym in y.split(micro_batch)]
    assert max(counts) > 3 * min(counts), counts
    plain_loss, plain_norm = plain_step(model, x, y)
    first = read_metrics(run)[0]
    assert first["loss"] == pytest.approx(plain_loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(plain_norm, rel=1e-5)
    wrong = mean_of_microbatch_means(model, x, y, micro_batch)
    assert abs(wrong - plain_loss) > 20 * 1e-5 * plain_loss, "the batch cannot tell the normalisations apart"


def assert_same_training(run: Path, reference: Path) -> None:
    """A layout's 10 clipped steps equal one process's: weights to 1e-5, every logged loss."""
    assert min(row["grad_norm"] for row in read_metrics(run) if "grad_norm" in row) > 0.5, "clipping must be active"
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)
