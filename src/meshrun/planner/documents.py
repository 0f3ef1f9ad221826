"""What `meshrun plan` knows of documents data (prepare-data --chat / --prompt-completion): the
rows training will read, what they train, their padding and their attention's cost.

Read from the rows themselves, as the trainer will read them: the first block of the train
split's seeded order (data/packed.py: up to BLOCK documents, packed by best-fit decreasing or one
a row), so every number is what the first steps of that run see, not a formula's guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.schema import Config
from meshrun.data.locations import data_dir, reads_in_place
from meshrun.data.storage import DOCUMENTS_FORMAT, read_meta


@dataclass(frozen=True)
class DocumentRows:
    """The rows of the train split's first block."""

    packing: bool
    seq_len: int
    rows: int
    documents: int
    trained: int  # the loss's targets in these rows
    padding: int  # positions that hold no document token
    attention_length: int  # the length whose causal attention costs what these rows' does

    @property
    def padding_share(self) -> float:
        return self.padding / (self.rows * self.seq_len)

    @property
    def trained_share(self) -> float:
        """Trained tokens per position."""
        return self.trained / (self.rows * self.seq_len)


def document_rows(cfg: Config) -> DocumentRows | None:
    """The rows of `cfg`'s data when it is documents data (None for other data, or data not yet
    prepared); a document longer than model.seq_len is refused as training refuses it."""
    folder = data_dir(cfg)
    meta = None if reads_in_place(cfg) else read_meta(folder)
    if meta is None or meta.get("format") != DOCUMENTS_FORMAT:
        return None
    from meshrun.data.packed import PackedDataset

    packing = cfg.data.packing is not False
    data = PackedDataset(folder, "train", seq_len=cfg.model.seq_len, seed=cfg.train.seed, packing=packing)
    block = data.block(0)
    occupancy = data.occupancy(0, len(block))
    return DocumentRows(
        packing=packing,
        seq_len=cfg.model.seq_len,
        rows=len(block),
        documents=sum(len(row.docs) for row in block),
        trained=data.target_tokens(0, len(block)),
        padding=occupancy.padding,
        attention_length=occupancy.attention_length,
    )


def describe(rows: DocumentRows, cfg: Config, where: str) -> str:
    """The lines `meshrun plan` prints for documents data: what a step holds and how it is priced."""
    arranged = "packed whole (best-fit decreasing)" if rows.packing else "one document a row, padded"
    share = rows.trained_share
    return (
        f"documents data ({where}): rows of model.seq_len {rows.seq_len}, {arranged}, "
        f"{rows.documents / rows.rows:.2f} documents a row; per step ({cfg.train.global_batch} rows) "
        f"~{share * cfg.tokens_per_step:.0f} trained tokens ({share:.1%} of positions), "
        f"padding {rows.padding_share:.1%}\n"
        f"attention priced at length {rows.attention_length} of {rows.seq_len} (each document attends only to "
        f"itself; from the first {rows.rows} rows); tokens/s counts positions, trained tokens/s = "
        f"tokens/s x {share:.3f}"
    )
