"""One record per tensor-parallel style: the names a model's `tp_plan` gives its modules.

A record says everything meshrun does with a module of that style, and three places read it:

- parallel/tensor.py applies its DTensor form (`plain`, or `sequence` under
  `parallel.sequence_parallel`) and sizes a rank's shards of the parameters it splits (`split`);
- planner/tp_shapes.py gives the planner's trace the shapes that form's collectives hand one rank
  (`takes`, `hands_on`: the trace runs without collectives);
- parallel/tp_rng.py reads where a rank holds its own part of the activations
  (`closes_rank_stream`), so dropout there draws from the rank's own stream.

A column- or row-parallel Linear that model.lora wrapped (peft's `lora.Linear`: the Linear under
`base_layer`, the adapter's `lora_A` (in -> r) and `lora_B` (r -> out) beside it) is split by its
style's `adapted` record instead (`AdaptedLinear`): the adapter is split the way the base is, so its
output adds to the base's shard with no collective of its own.

Adding a style is adding its record to `TP_STYLES` and a probe module to
tests/parallel/test_tp_styles.py, which checks on two gloo ranks that the planner's shapes are
the ones the applied DTensor form gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshrun.parallel.token_share import TokenShare


@dataclass(frozen=True)
class Resize:
    """What a collective at a module's edge does to one rank's tensors: all of `dim` gathered
    (`whole`: tp times the size) or cut to this rank's part (1/tp of it)."""

    dim: int  # 1: positions (B, T, C); -1: columns
    whole: bool
    count: int = 1  # of a tuple: the first `count` hidden states (a state's mask stays whole)
    keyword: str | None = None  # an input passed by this keyword, not by position


@dataclass(frozen=True)
class Form:
    """A style in one mode (without or with sequence parallel)."""

    make: Callable[[], ParallelStyle] | None = None  # the DTensor style applied; None: nothing
    takes: Resize | None = None  # the collective before the module: its input
    hands_on: Resize | None = None  # the collective after it: its output


LEFT_WHOLE = Form()  # the module runs as without tp


@dataclass(frozen=True)
class Adapted:
    """How a style splits a Linear that peft's LoRA wraps: the base as the style splits it, the
    adapter matrix on the split side alike, the other left whole. Inside the wrapper everything is
    a DTensor, so the base's and the adapter's outputs add in their common placement and the
    wrapper's output is redistributed once (`hands_on`): a row-parallel layer's two partial sums
    are all-reduced together, not one after the other."""

    takes: Placement  # the wrapper's input (this rank's local tensor), as a DTensor
    hands_on: Placement  # its output redistributed to this, then handed on as a local tensor
    base: Callable[[], ParallelStyle]
    lora_a: Callable[[], ParallelStyle] | None  # None: replicated (in -> r, on a whole input)
    lora_b: Callable[[], ParallelStyle] | None  # None: replicated (r -> out, to a partial output)
    split: Mapping[str, int]  # parameter name below the wrapper -> the dimension split over tp
    sequence_hands_on: Placement | None = None  # under sequence parallel; None: as without it

    def output(self, sequence_parallel: bool) -> Placement:
        return self.sequence_hands_on if sequence_parallel and self.sequence_hands_on is not None else self.hands_on


@dataclass(frozen=True)
class TPStyle:
    """A tensor-parallel style: how it splits a module and what the module hands on."""

    name: str
    plain: Form
    sequence: Form | None = None  # under sequence parallel; None: as without it
    split: Mapping[str, int] = field(default_factory=dict)  # parameter name -> the dimension split over tp
    starts_sequence_split: bool = False  # its output is where the residual stream's split by position starts
    # its parent, from its entry to this module, holds this rank's heads or columns: dropout there
    # draws from the rank's own stream (without sequence parallel, which gives each block one)
    closes_rank_stream: bool = False
    # its output is a sum over the tp ranks inside a block (an all-reduce; a reduce-scatter under
    # sequence parallel), a new tensor that selective recompute keeps (parallel/recompute.py)
    kept_by_selective: bool = False
    adapted: Adapted | None = None  # its split of a LoRA-wrapped Linear; None: model.lora under tp refuses it
    # its parameters (and its submodules') stay plain tensors, the same on every tp rank, and it computes
    # on plain tensors: tensor.py makes none of them DTensors (a MoE block: routing and all-to-alls)
    keeps_plain: bool = False
    # where parallel.ep spans the tp ranks (Layout.experts_over_tp): its forms without and with sequence
    # parallel (a MoE block on this rank's share of the tokens); None: as without it
    over_tp: tuple[Form, Form] | None = None

    def form(self, sequence_parallel: bool, *, experts_over_tp: bool = False) -> Form:
        if experts_over_tp and self.over_tp is not None:
            return self.over_tp[sequence_parallel]
        return self.sequence if sequence_parallel and self.sequence is not None else self.plain


class StateNorm(ParallelStyle):
    """SequenceParallel for a norm called with the model's state tuple (torch's takes one tensor):
    its weights replicated, the state's hidden states marked split by position, so the weights'
    gradients sum over the positions' ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch annotates the hooks as returning None but uses what they return (as nn.Module hooks do)
        return distribute_module(
            module,
            device_mesh,
            input_fn=_sequence_inputs,  # pyright: ignore[reportArgumentType]
            output_fn=local_outputs,  # pyright: ignore[reportArgumentType]
        )


def _sequence_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """The hidden states among a module's inputs (a tuple's too) as split by position; integer
    tensors (a mask) stay as they are."""
    return tuple(
        _sequence_inputs(module, x, mesh)
        if isinstance(x, tuple)
        else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def local_outputs(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """It hands the next module a plain tensor, as without tp."""
    return output.to_local() if isinstance(output, DTensor) else output


class AdaptedLinear(ParallelStyle):
    """A Linear wrapped by peft's LoRA, split as `adapted` says: the wrapper's input becomes a
    DTensor, its base and adapter run on DTensors, its output (their sum) is redistributed once."""

    def __init__(self, adapted: Adapted, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.adapted, self.output = adapted, adapted.output(sequence_parallel)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        adapted, takes, output = self.adapted, self.adapted.takes, self.output
        adapters = module.get_submodule("lora_A")
        assert isinstance(adapters, nn.ModuleDict)  # peft's, one entry per adapter name
        styles = {"base_layer": adapted.base}
        for name in adapters:
            styles |= {f"lora_A.{name}": adapted.lora_a, f"lora_B.{name}": adapted.lora_b}
        parallelize_module(module, device_mesh, {key: make() for key, make in styles.items() if make is not None})

        def as_dtensor(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            """A DTensor already under sequence parallel (attention's and the MLP's gathered input)."""
            return tuple(
                x.redistribute(mesh, [takes])
                if isinstance(x, DTensor)
                else DTensor.from_local(x, mesh, [takes], run_check=False)
                for x in inputs
            )

        def handed_on(_module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.redistribute(mesh, [output]).to_local()

        # what is left whole (the other adapter matrix) replicated; input and output converted here
        # (torch annotates the hooks as returning None but uses what they return)
        distribute_module(module, device_mesh, input_fn=as_dtensor, output_fn=handed_on)  # pyright: ignore[reportArgumentType]
        for param in module.parameters():
            if param.requires_grad and isinstance(param, DTensor):
                param.register_hook(partial(_placed_like_param, placements=param.placements))
        return module


def _placed_like_param(grad: torch.Tensor, *, placements: tuple[Placement, ...]) -> torch.Tensor:
    """An adapter matrix left whole gets a partial gradient (its input or its output's gradient is
    a partial sum): summed over tp here, once per backward, so clipping and AdamW see the whole."""
    if isinstance(grad, DTensor) and grad.placements != placements:
        return grad.redistribute(grad.device_mesh, placements)
    return grad


# a column-parallel Linear's adapter: A (r x in) whole on the whole input, B (out x r) split by rows
# (output features) like the base's weight; base and adapter hand on this rank's columns
_COLUMNS_ADAPTED = Adapted(
    takes=Replicate(),
    hands_on=Shard(-1),
    base=lambda: ColwiseParallel(use_local_output=False),
    lora_a=None,
    lora_b=lambda: ColwiseParallel(use_local_output=False),
    split={"base_layer.weight": 0, "base_layer.bias": 0, "lora_B.*.weight": 0},
)
COLUMNS = {"weight": 0, "bias": 0}  # a Linear split by output features (an Embedding by vocabulary: its rows)
POSITIONS_CUT, POSITIONS_GATHERED = Resize(dim=1, whole=False), Resize(dim=1, whole=True)
# under sequence parallel, activations between the scatter and the head are split on dim 1 (B, T/tp, C);
# inside a gather module the whole sequence is back: the styles used there keep their form
_RECORDS = (
    # Megatron's column split (q, k, v, the MLP's first matrix): whole heads per rank
    TPStyle("colwise", Form(ColwiseParallel), split=COLUMNS, adapted=_COLUMNS_ADAPTED),
    # the output projections: each rank's partial sums all-reduced; under sequence parallel
    # reduce-scattered to the positions instead
    TPStyle(
        "rowwise",
        Form(RowwiseParallel),
        Form(lambda: RowwiseParallel(output_layouts=Shard(1)), hands_on=POSITIONS_CUT),
        split={"weight": 1},
        closes_rank_stream=True,
        kept_by_selective=True,
        # its adapter: A (r x in) split by columns like the base's weight, on this rank's input
        # columns; B (out x r) whole. A's output and so B's are partial sums, added to the base's
        # partial sums and all-reduced (reduce-scattered) with them: one collective, as without LoRA
        adapted=Adapted(
            takes=Shard(-1),
            hands_on=Replicate(),
            sequence_hands_on=Shard(1),
            base=lambda: RowwiseParallel(output_layouts=Partial(), use_local_output=False),
            lora_a=lambda: RowwiseParallel(output_layouts=Partial(), use_local_output=False),
            lora_b=None,
            split={"base_layer.weight": 1, "lora_A.*.weight": 1},
        ),
    ),
    # an Embedding split by vocabulary, its output whole (the embedding adds positions, then scatters)
    TPStyle("vocab_embedding", Form(lambda: RowwiseParallel(input_layouts=Replicate())), split={"weight": 0}),
    # a vocab_embedding whose output is the residual stream itself: under sequence parallel its
    # partial sums are reduce-scattered to the positions (torchtitan's Llama embedding)
    TPStyle(
        "vocab_embedding_scatter",
        Form(lambda: RowwiseParallel(input_layouts=Replicate())),
        Form(lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), hands_on=POSITIONS_CUT),
        split={"weight": 0},
        starts_sequence_split=True,
    ),
    # the output Linear split by vocabulary, its logits left sharded for the vocabulary-parallel loss
    TPStyle(
        "vocab_head",
        Form(lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)),
        Form(
            lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            takes=POSITIONS_GATHERED,
        ),
        split=COLUMNS,
    ),
    # a head that reads a vocab_embedding's matrix (tied): whole hidden states in, logits left sharded
    TPStyle(
        "tied_vocab_head",
        Form(
            lambda: PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False
            )
        ),
        Form(
            lambda: PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=False
            ),
            takes=POSITIONS_GATHERED,
        ),
    ),
    # a column split whose output every rank gathers whole, for a module that needs the whole
    # width (OLMo 2's q and k, for their whole-width norms)
    TPStyle(
        "colwise_gathered",
        Form(lambda: ColwiseParallel(output_layouts=Replicate()), hands_on=Resize(dim=-1, whole=True)),
        split=COLUMNS,
        adapted=replace(_COLUMNS_ADAPTED, hands_on=Replicate()),
    ),
    # that module (computed whole, as every unsplit one) hands on only this rank's columns
    TPStyle(
        "sliced_output",
        Form(
            lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(-1)),
            hands_on=Resize(dim=-1, whole=False),
        ),
    ),
    # a module left whole that runs on this rank's heads (B, T, H, D), e.g. a per-head norm: its
    # input marked sharded by heads, so its weight's gradient sums every rank's heads, not only its own
    TPStyle("per_head", Form(lambda: PrepareModuleInput(input_layouts=Shard(-2), desired_input_layouts=Shard(-2)))),
    # sequence parallel's styles, nothing without it. The module whose output starts the split
    # residual stream (the embedding):
    TPStyle(
        "scatter",
        LEFT_WHOLE,
        Form(
            lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            hands_on=POSITIONS_CUT,
        ),
        starts_sequence_split=True,
    ),
    # a module with weights that acts on each position alone: its weights' gradients summed over
    # the positions' ranks
    TPStyle("norm", LEFT_WHOLE, Form(lambda: SequenceParallel(use_local_output=True))),
    # a module that needs the whole sequence (attention, the MLP): its input all-gathered, a
    # DTensor, so its q, k, v (fc) gradients sum as partials, reduce-scattered once
    TPStyle(
        "gather",
        LEFT_WHOLE,
        Form(
            lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            takes=POSITIONS_GATHERED,
        ),
    ),
    # a gather for a module called with its input by keyword (transformers' attention)
    TPStyle(
        "gather_hidden_states",
        LEFT_WHOLE,
        Form(
            lambda: PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            takes=Resize(dim=1, whole=True, keyword="hidden_states"),
        ),
    ),
    # a scatter for a state (encoder hidden, decoder hidden, source mask): both hidden states
    # split, the mask whole
    TPStyle(
        "scatter_state",
        LEFT_WHOLE,
        Form(
            lambda: PrepareModuleOutput(
                output_layouts=(Replicate(), Replicate(), None), desired_output_layouts=(Shard(1), Shard(1), None)
            ),
            hands_on=Resize(dim=1, whole=False, count=2),
        ),
        starts_sequence_split=True,
    ),
    # a gather of two hidden-state inputs (cross-attention's queries and memory)
    TPStyle(
        "gather_pair",
        LEFT_WHOLE,
        Form(
            lambda: PrepareModuleInput(
                input_layouts=(Shard(1), Shard(1)), desired_input_layouts=(Replicate(), Replicate())
            ),
            takes=Resize(dim=1, whole=True, count=2),
        ),
    ),
    # a norm taking the state tuple
    TPStyle("norm_state", LEFT_WHOLE, Form(StateNorm)),
    # a Mixture-of-Experts block (router, experts, a shared expert) whole on every tp rank, on plain
    # tensors: every tp rank routes the same tokens, so its gradients are equal on the tp ranks and
    # need no reduction over tp (parallel/experts.py). Under sequence parallel its input is gathered
    # to the whole sequence (the per-sequence balance loss needs whole sequences) and its output cut to
    # this rank's positions, whose backward all-gathers the gradient: every tp rank still computes the same.
    # Where parallel.ep spans tp (`over_tp`) each tp rank computes on its own positions instead.
    TPStyle(
        "moe_block",
        LEFT_WHOLE,
        Form(
            lambda: PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            ),
            takes=POSITIONS_GATHERED,
            hands_on=POSITIONS_CUT,
        ),
        keeps_plain=True,
        # ep spanning tp: each tp rank routes its own positions (under sequence parallel those it holds),
        # its router's gradients summed over tp by parallel/experts.py's ExpertGradients
        over_tp=(Form(TokenShare, takes=POSITIONS_CUT, hands_on=POSITIONS_GATHERED), LEFT_WHOLE),
    ),
)
TP_STYLES: dict[str, TPStyle] = {style.name: style for style in _RECORDS}
