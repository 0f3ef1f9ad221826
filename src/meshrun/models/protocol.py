"""The model protocol as types, its optional hooks with their defaults, and the forward every
protocol model shares."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from meshrun.models.documents import handed_on, unpack


class ModelProtocol(Protocol):
    """What meshrun reads from a model beyond nn.Module (the protocol in `meshrun.models.families`).

    nn.Module creates these attributes in `__init__`, where a type checker does not look (it
    types a module's unknown attributes as `Tensor | Module`): code that reaches them holds a
    `ProtocolModule`.
    """

    embed: nn.Module | None
    blocks: nn.ModuleDict
    norm: nn.Module | None
    head: nn.Module | None

    def init_weights(self, seed: int) -> None: ...

    def flops_per_token(self, length: int | None = None) -> float: ...


if TYPE_CHECKING:

    class ProtocolModule(nn.Module, ModelProtocol):
        """An nn.Module that follows the model protocol: what `build_model` returns.

        Python has no intersection type (`nn.Module & ModelProtocol`); this class spells one for
        the type checker only. At run time it is `nn.Module` itself: a model need not subclass
        anything, `build_model` checks the protocol when the model is built.
        """

else:
    ProtocolModule = nn.Module


class OptionalHooks(Protocol):
    """The optional part of the protocol: a model may define any of these. meshrun reaches them only
    through the functions of the same name below, each of which falls back to the default it states."""

    tied_weight: str | None

    takes_documents: bool
    """The model trains on packed rows (models/documents.py): its forward takes the packed input
    (B, 2, T), passes the positions to its embedding and attention, and hands (hidden, positions)
    between pipeline stages. Default: False; packed data is then refused."""

    sequence_shards: int
    """Written by meshrun, not read: under sequence parallel the hidden states a forward receives
    hold 1/sequence_shards of each sample's positions (parallel/tensor.py sets it to tp). A model
    that derives positions from their length (rotary embeddings) multiplies by it."""

    def keep_stage(self, *, first: bool, last: bool) -> None: ...

    def standalone_blocks(self) -> list[nn.Module]: ...

    def check_weights(self) -> None: ...

    def pretrained_dir(self) -> Path | None: ...

    def fresh_weights(self) -> list[str]: ...

    def tp_plan(self) -> dict[str, str] | None: ...

    def tp_local(self, tp: int) -> None: ...


def keep_stage(model: ProtocolModule, *, first: bool, last: bool) -> None:
    """Drop the parts another pipeline stage owns (its blocks are already gone). Default: `embed`
    unless `first`, `norm` and `head` unless `last`; a tied model's last stage keeps its matrix."""
    hook = getattr(model, "keep_stage", None)
    if hook is not None:
        hook(first=first, last=last)
        return
    if not first:
        model.embed = None
    if not last:
        model.norm = model.head = None


def standalone_blocks(model: ProtocolModule) -> list[nn.Module]:
    """The blocks as modules a profiler can feed the previous one's output alone (`parallel.balance:
    time | size` runs embed, blocks, norm + head in sequence: a state the embedding hands on, as the
    encoder's (hidden, mask), passes through). Default: the blocks themselves."""
    hook = getattr(model, "standalone_blocks", None)
    return hook() if hook is not None else list(model.blocks.values())


def tied_weight(model: nn.Module) -> str | None:
    """The name of the embedding matrix the head shares, held by the first and the last pipeline
    stage alike (parallel/tied.py keeps the copies equal). Default: None, nothing tied."""
    return getattr(model, "tied_weight", None)


def takes_documents(model: nn.Module) -> bool:
    """Whether the model keeps the documents of a packed row apart (OptionalHooks.takes_documents). Default: False."""
    return bool(getattr(model, "takes_documents", False))


def check_weights(model: nn.Module) -> None:
    """Before any worker exists: the weights the model would load exist, shaped as its config says.
    Default: nothing to check."""
    hook = getattr(model, "check_weights", None)
    if hook is not None:
        hook()


def pretrained_dir(model: nn.Module) -> Path | None:
    """The folder the model's weights are loaded from (for the run's description). Default: None,
    the weights come from `init_weights(seed)`."""
    hook = getattr(model, "pretrained_dir", None)
    return hook() if hook is not None else None


def fresh_weights(model: nn.Module) -> list[str]:
    """The tensors a model that loads pretrained weights draws from the seed instead (a new head the
    folder lacks), by name. Default: none."""
    hook = getattr(model, "fresh_weights", None)
    return hook() if hook is not None else []


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """How tensor parallelism splits the model, or None if it cannot be split.

    The plan maps module-path patterns (`*` for a block index) to style names. The model names
    the split; parallel/tensor.py applies it. Each style is one record in parallel/tp_styles.py,
    which says what it splits and what the module hands on. In short:

    - colwise, rowwise: a Linear split by output columns, or by input rows (Megatron's pair).
    - vocab_embedding, vocab_head: the embedding and the output Linear split by vocabulary; the
      head's logits stay sharded for the vocabulary-parallel loss. tied_vocab_head: a head that
      reads the embedding's matrix.
    - colwise_gathered: a colwise Linear whose output every rank gathers whole, for a module that
      needs the whole width. That module takes sliced_output: it runs whole and hands on this
      rank's columns.
    - per_head: a module left whole that runs on this rank's heads (a per-head norm); its weight's
      gradient sums every rank's heads.

    The other styles act only under `parallel.sequence_parallel`. They say where activations are
    split by position:

    - scatter: the module whose output starts the split (the embedding).
      vocab_embedding_scatter: a vocab_embedding whose output is that stream itself.
    - norm: a module with weights that acts on each position alone.
    - gather: a module that needs the whole sequence (attention, the MLP); its input is
      all-gathered. gather_hidden_states: the same for an input passed as `hidden_states=`.
    - scatter_state, gather_pair, norm_state: the same for a state tuple (encdec's encoder hidden,
      decoder hidden, source mask); gather_pair gathers two inputs (cross-attention's).

    Default: None; parallel.tp > 1 is then refused."""
    hook = getattr(model, "tp_plan", None)
    return hook() if hook is not None else None


def tp_local(model: nn.Module, tp: int) -> None:
    """Before its plan splits it: the model (a stage) runs as one of `tp` ranks, so a module that
    holds a size as a number where its forward needs this rank's share takes that share (Phi-3's
    attention slices its fused q, k, v output by head counts). Default: nothing, for forwards that
    reshape with -1 heads."""
    hook = getattr(model, "tp_local", None)
    if hook is not None:
        hook(tp)


class StagedModel(ProtocolModule):
    """Base for models meshrun can split: subclasses set `embed`, `blocks`, `norm` and `head`
    (and implement `init_weights` and `flops_per_token`); any part may be pruned to None."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        """Token ids (B, T) -> logits (B, T, V); a pruned stage maps what it receives to what the next expects.

        A packed batch (B, 2, T) of a model that `takes_documents`: its positions go to the embedding
        and every block, and a stage before the last hands on (hidden, positions)."""
        x, positions = unpack(x, positions)
        extra = {} if positions is None else {"positions": positions}
        if self.embed is not None:
            x = self.embed(x, **extra)
        for block in self.blocks.values():
            x = block(x, **extra)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is None:
            return handed_on(x, positions)
        return self.head(x)
