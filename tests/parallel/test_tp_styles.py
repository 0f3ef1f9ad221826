"""Each tensor-parallel style's record (parallel/tp_styles.py) agrees across the three places that
read it, on 2 gloo ranks: the shapes the planner's trace gives one rank (planner/tp_shapes.py)
are the local shapes the applied DTensor form gives (parallel/tensor.py), with and without
sequence parallel, and the rank streams (parallel/tp_rng.py) end exactly where a module takes
its rank's own values and hands on values equal on every rank. A style made up here is taken up
by all three without editing them."""

from __future__ import annotations

import copy
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.config.model_sections import EncDecSection, GPTSection, MoESection
from meshrun.models.families import build_model
from meshrun.models.gpt import GPT
from meshrun.models.protocol import tp_plan
from meshrun.parallel.tensor import apply_tensor_parallel, check_plan
from meshrun.parallel.tp_rng import rank_stream_regions
from meshrun.parallel.tp_styles import TP_STYLES, Form, Resize, TPStyle
from meshrun.planner.fake_cpu import fake_cpu
from meshrun.planner.tp_shapes import emulate_tp_shapes, shrink_to_tp_shard

TP, BATCH, LEN = 2, 2, 8
TINY = {"num_layers": 1, "dim": 16, "num_heads": 2, "seq_len": LEN, "vocab_size": 32}

# made up here: a row-parallel Linear by another name, every field written out
MADE_UP = TPStyle(
    "made_up_rowwise",
    Form(RowwiseParallel),
    Form(lambda: RowwiseParallel(output_layouts=Shard(1)), hands_on=Resize(dim=1, whole=False)),
    split={"weight": 1},
    closes_rank_stream=True,
)


class KeywordAttention(nn.Module):
    """transformers' attention as the planner sees it: called with `hidden_states=`, OLMo 2's
    whole-width q norm (q gathered, the norm's output sliced) and Qwen3's per-head k norm."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = nn.LayerNorm(dim), nn.LayerNorm(self.head_dim)

    def forward(self, *, hidden_states: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.q(hidden_states))  # (B, T, C/tp): this rank's heads
        k = self.k_norm(self.k(hidden_states).unflatten(-1, (-1, self.head_dim)))  # (B, T, H/tp, D)
        return self.o(q * k.flatten(-2))


class KeywordBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(dim), KeywordAttention(dim, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(hidden_states=self.ln(x))


class KeywordModel(nn.Module):
    """The styles Hugging Face layouts use (hf.py) that gpt and encdec do not."""

    def __init__(self) -> None:
        super().__init__()
        dim, vocab = TINY["dim"], TINY["vocab_size"]
        self.embed, self.norm, self.head = nn.Embedding(vocab, dim), nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleDict({"0": KeywordBlock(dim, TINY["num_heads"])})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks["0"](self.embed(ids))))

    def tp_plan(self) -> dict[str, str]:
        return {
            "embed": "vocab_embedding_scatter",
            "blocks.*.ln": "norm",
            "norm": "norm",
            "blocks.*.attn": "gather_hidden_states",
            "blocks.*.attn.q": "colwise_gathered",
            "blocks.*.attn.q_norm": "sliced_output",
            "blocks.*.attn.k": "colwise",
            "blocks.*.attn.k_norm": "per_head",
            "blocks.*.attn.o": "rowwise",
            "head": "vocab_head",
        }


class MadeUpGPT(GPT):
    """gpt with its MLP's output projection in the style made up here."""

    def tp_plan(self) -> dict[str, str]:
        return {**super().tp_plan(), "blocks.*.mlp.proj": MADE_UP.name}


def probes() -> dict[str, nn.Module]:
    """Tiny models whose plans use every style, on the meta device; `keyword-lora`: peft's adapters
    on a colwise_gathered, a colwise and a rowwise Linear (each style's `adapted` split)."""
    from peft import LoraConfig, inject_adapter_in_model

    with torch.device("meta"):
        made_up = MadeUpGPT(GPTSection(**TINY))
        keyword, adapted = KeywordModel(), KeywordModel()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q", "k", "o"]), adapted)
    return {
        "gpt": build_model(GPTSection(**TINY)),
        "encdec-tied": build_model(EncDecSection(**{**TINY, "num_layers": 2}, tie_embeddings=True)),
        "keyword": keyword,
        "keyword-lora": adapted,
        "made-up": made_up,
        "moe-gpt": build_model(GPTSection(**TINY, moe=MoESection(num_experts=2, top_k=1))),  # moe_block
    }


def test_every_style_has_a_probe() -> None:
    """A style added without a probe here fails: its record is then checked by nothing."""
    used = {style for model in probes().values() for style in (tp_plan(model) or {}).values()}
    assert used == {*TP_STYLES, MADE_UP.name}


def _local_shapes(value: object) -> list[tuple[int, ...]]:
    """The shapes of the tensors in `value` (a tuple's, a dict's) as this rank holds them."""
    if isinstance(value, tuple | list):
        return [shape for x in value for shape in _local_shapes(x)]
    if isinstance(value, dict):
        return [shape for x in value.values() for shape in _local_shapes(x)]
    if isinstance(value, torch.Tensor):
        return [tuple((value.to_local() if isinstance(value, DTensor) else value).shape)]
    return []


def _local(value: object) -> list[torch.Tensor]:
    """The floating tensors in `value`, this rank's values."""
    if isinstance(value, tuple | list | dict):
        return [x for v in (value.values() if isinstance(value, dict) else value) for x in _local(v)]
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return [(value.to_local() if isinstance(value, DTensor) else value).detach().clone()]
    return []


def _record(model: nn.Module, *, values: bool) -> dict[str, dict]:
    """Hooks (after the styles' own) recording what each module the plan names takes and hands on."""
    plan = tp_plan(model) or {}
    seen: dict[str, dict] = {}
    for name, module in model.named_modules():
        if any(fnmatch(name, pattern) for pattern in plan):

            def before(_m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                seen[name] = {"takes": _local_shapes((args, kwargs))}
                if values:
                    seen[name]["takes_values"] = _local((args, kwargs))

            def after(_m: nn.Module, _i: tuple, out: object, name: str = name) -> None:
                seen[name]["hands_on"] = _local_shapes(out)
                if values:
                    seen[name]["hands_on_values"] = _local(out)

            module.register_forward_pre_hook(before, with_kwargs=True)
            module.register_forward_hook(after)
    return seen


def _planned(
    meta_model: nn.Module, *, sequence_parallel: bool, experts_over_tp: bool = False
) -> tuple[dict[str, dict], dict[str, tuple]]:
    """The planner's trace of one tp rank: what each planned module takes and hands on, and the parameters' shapes."""
    model = copy.deepcopy(meta_model)
    shrink_to_tp_shard(model, TP)
    fake = fake_cpu()
    with fake.mode:
        fake.to_empty(model)
        emulate_tp_shapes(model, TP, sequence_parallel=sequence_parallel, experts_over_tp=experts_over_tp)
        seen = _record(model, values=False)
        model(torch.zeros(BATCH, LEN, dtype=torch.long))
    return seen, {name: tuple(p.shape) for name, p in model.named_parameters()}


def _applied(
    meta_model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool, experts_over_tp: bool = False
) -> tuple[dict, dict, int]:
    """The same on this rank of the model split by its DTensor forms, with values, and the
    collectives its forward runs."""
    model = copy.deepcopy(meta_model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # the same values on every rank
    for param in model.parameters():  # where no reset_parameters sets them (a MoE block's router and experts)
        torch.nn.init.normal_(param.detach(), std=0.02)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel, experts_over_tp=experts_over_tp)
    seen = _record(model, values=True)
    ids = torch.arange(BATCH * LEN).reshape(BATCH, LEN) % TINY["vocab_size"]
    with torch.no_grad(), Collectives() as comms:
        model(ids)
    params = {
        name: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape) for name, p in model.named_parameters()
    }
    return seen, params, comms.count


class Collectives(TorchDispatchMode):
    """Counts the collectives DTensor issues (its functional c10d ops, their waits left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "_c10d_functional" and "wait" not in func.__name__
        return func(*args, **(kwargs or {}))


def _equal_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    gathered: list[list[torch.Tensor] | None] = [None] * TP
    dist.all_gather_object(gathered, tensors)
    return all(
        len(other) == len(tensors) and all(torch.equal(a, b) for a, b in zip(tensors, other))
        for other in gathered
        if other is not None
    )


def _check_rank(rank: int, store: str) -> None:
    TP_STYLES[MADE_UP.name] = MADE_UP  # registered here only; the modules that read styles are untouched
    dist.init_process_group("gloo", store=dist.FileStore(store, TP), rank=rank, world_size=TP)
    collectives: dict[tuple[str, bool], int] = {}
    try:
        mesh = init_device_mesh("cpu", (TP,))
        for probe, meta_model in probes().items():
            check_plan(meta_model, TP, probe, sequence_parallel=True)
            for sp in (False, True):
                planned, planned_params = _planned(meta_model, sequence_parallel=sp)
                applied, applied_params, collectives[probe, sp] = _applied(meta_model, mesh, sequence_parallel=sp)
                assert planned_params == applied_params, (probe, sp)
                assert planned.keys() == applied.keys() and applied, (probe, sp)
                for name, seen in applied.items():
                    shapes = {k: v for k, v in seen.items() if not k.endswith("_values")}
                    assert planned[name] == shapes, (probe, sp, name)
                if not sp:
                    _check_rank_streams(probe, meta_model, applied)
        for sp in (False, True):  # parallel.ep spanning tp: the MoE block on each rank's own positions (TokenShare)
            meta_model = probes()["moe-gpt"]
            planned, _ = _planned(meta_model, sequence_parallel=sp, experts_over_tp=True)
            applied, _, _ = _applied(meta_model, mesh, sequence_parallel=sp, experts_over_tp=True)
            for name, seen in applied.items():
                assert planned[name] == {k: v for k, v in seen.items() if not k.endswith("_values")}, (sp, name)
        for sp in (False, True):  # an adapter's output joins its layer's: no collective of its own
            assert collectives["keyword-lora", sp] == collectives["keyword", sp], (sp, collectives)
    finally:
        dist.destroy_process_group()


def _check_rank_streams(probe: str, meta_model: nn.Module, applied: dict[str, dict]) -> None:
    """Without sequence parallel (`applied`: what each planned module took and handed on) a
    rank's own stream ends at exactly the modules that take this rank's own values and hand on
    values equal on every rank."""
    plan = tp_plan(meta_model) or {}
    names = {module: name for name, module in meta_model.named_modules()}
    ends = {names[end] for _, end in rank_stream_regions(meta_model, plan, sequence_parallel=False) if end is not None}
    for name, seen in applied.items():
        own_in = not _equal_on_every_rank(seen["takes_values"])
        equal_out = _equal_on_every_rank(seen["hands_on_values"])
        assert (name in ends) == (own_in and equal_out), (probe, name, own_in, equal_out)


@pytest.mark.timeout(240)
def test_planner_shapes_equal_the_applied_styles_and_rank_streams_end_where_values_agree(tmp_path: Path) -> None:
    """Every probe, with and without sequence parallel, on each of 2 gloo ranks."""
    torch.multiprocessing.spawn(_check_rank, args=(str(tmp_path / "store"),), nprocs=TP)
