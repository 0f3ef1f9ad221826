"""Mixture-of-Experts models: the built-in experts' grouped matmul against a loop, the balance
losses' arithmetic, the built-in gpt's sigmoid gate (router and a training step) against plain
torch, and each Hugging Face MoE family in one process against transformers' own model (step-1
loss with transformers' auxiliary loss, pre-clip gradient norm)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import in_process_trainer

from meshrun.models import moe
from meshrun.models.moe_balance import microbatch_balance, sequence_balance, window_row

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
MOE_FAMILIES = {
    # layer 1 dense (mlp_only_layers): the sparse layers are whichever transformers made sparse
    "qwen3_moe": {**TINY, "num_experts": 4, "moe_intermediate_size": 16, "mlp_only_layers": [1], "head_dim": 8},
    # a shared expert with its sigmoid gate beside the routed ones; every second layer sparse
    "qwen2_moe": {
        **TINY,
        "num_experts": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "decoder_sparse_step": 2,
    },
    "mixtral": {**TINY, "num_local_experts": 4},  # files name the block block_sparse_moe, experts w1 w3 w2
    "olmoe": {**TINY, "num_experts": 4, "pad_token_id": 0},
}


def make_moe(family: str, out: Path) -> Path:
    """transformers' own model of the family, its random init seeded, saved with save_pretrained."""
    import transformers

    config = transformers.AutoConfig.for_model(family, **MOE_FAMILIES[family])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(out)
    return out


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_one_process_equals_transformers(family: str, data_dir: Path, tmp_path: Path) -> None:
    """One process, one microbatch, model.moe.aux_loss microbatch: meshrun's step-1 loss plus its
    auxiliary loss (x router_aux_loss_coef) is transformers' loss with output_router_logits, and
    the pre-clip gradient norms agree, to 1e-5 relative."""
    from hf_models import load_reference

    model_dir = make_moe(family, tmp_path / "model")
    settings = {
        "model.hf": model_dir,
        "model.seq_len": 16,
        "model.moe.aux_loss": "microbatch",
        "train.global_batch": 4,
        "train.micro_batch": 4,
        "train.steps": 1,
    }
    with in_process_trainer(data_dir, tmp_path / "run", **settings) as trainer:
        x, y = trainer.local_batch(trainer.train_data, 0)
        result = trainer.train_step(0)
        row = window_row(trainer.model.parts, trainer.moe_layers, trainer.device)
    reference = load_reference(model_dir).train()
    out = reference(input_ids=x, labels=y, shift_labels=y.contiguous(), output_router_logits=True)
    out.loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    ours = result.loss.item() + reference.config.router_aux_loss_coef * row["aux_loss"]
    assert ours == pytest.approx(out.loss.item(), rel=1e-5)
    assert row["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert result.grad_norm.item() == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_export_hf_loads_in_transformers_with_equal_logits(family: str, tmp_path: Path) -> None:
    """export --hf writes the experts as the files hold them (one tensor per expert; Mixtral's
    block_sparse_moe names), and transformers loads the folder into the same logits."""
    from hf_models import load_reference

    from meshrun.config.schema import validate
    from meshrun.models.hf_export import export_hf
    from meshrun.parallel.materialise import materialise_part

    cfg = validate({"model": {"hf_config": {"model_type": family, **MOE_FAMILIES[family]}, "seq_len": 16}})
    model = materialise_part(cfg, torch.device("cpu"), layers=[0, 1, 2], first=True, last=True).eval()
    out = export_hf(model, cfg.model, tmp_path / "export")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_reference(out)(input_ids=tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        ({"moe": {"num_experts": 4, "top_k": 5}}, {}, "model.moe.top_k (5) exceeds model.moe.num_experts (4)"),
        ({"moe": {"aux_loss": "microbatch"}}, {"pp": 2}, "model.moe.aux_loss microbatch pools every MoE layer"),
        ({"hf_config": {"model_type": "llama", **TINY}, "moe": {}}, {}, "has no MoE layers; remove model.moe"),
        (
            {"hf_config": {"model_type": "mixtral", **TINY, "num_local_experts": 2, "num_experts_per_tok": 3}},
            {},
            "num_experts_per_tok (3) exceeds its experts (2)",
        ),
    ],
)
def test_moe_settings_refused_in_one_line(model: dict, parallel: dict, message: str) -> None:
    """Before any worker: the config (or the model it builds) names what to change."""
    from meshrun.config.schema import validate
    from meshrun.errors import ConfigError
    from meshrun.models.families import build_model

    with pytest.raises(ConfigError, match=re.escape(message)):
        build_model(validate({"model": {"seq_len": 16, **model}, "parallel": parallel}).model)


def test_grouped_matmul_equals_a_loop_over_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts' grouped matmul (torch.nn.functional.grouped_mm) and the loop over experts give
    the same outputs and gradients; torch 2.13 has the grouped matmul (an upgrade that drops or
    renames it fails here, not silently slower)."""
    assert hasattr(F, "grouped_mm")
    experts = moe.Experts(num_experts=4, dim=32, expert_dim=16)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, index = torch.randn(10, 32), torch.randint(0, 4, (10, 2))
    index[:, 1] = (index[:, 0] + 1) % 4  # two different experts, one of them unused maybe
    weights = torch.rand(10, 2)

    def run() -> tuple[torch.Tensor, ...]:
        experts.zero_grad()
        out = experts(x, index, weights)
        out.square().sum().backward()
        return out.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()

    assert moe.grouped_mm_fits(x, experts.gate_up_proj)
    grouped = run()
    monkeypatch.setattr(moe, "grouped_mm_fits", lambda x, w: False)
    looped = run()
    for a, b in zip(grouped, looped):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def hf_experts(family: str) -> torch.nn.Module:
    """The first MoE layer's experts of transformers' own model, built as meshrun builds it."""
    import transformers

    from meshrun.models.hf_moe import register_hf_experts

    config = transformers.AutoConfig.for_model(family, **MOE_FAMILIES[family])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=register_hf_experts())
    return next(m for m in model.modules() if hasattr(m, "gate_up_proj"))


@pytest.mark.parametrize("kind", ["built-in", "qwen3_moe"])
def test_experts_compute_in_autocast_dtype(kind: str) -> None:
    """Under bf16 autocast the experts' matmuls take bf16 operands, as a linear layer's would (the
    grouped matmul is on none of autocast's lists; on CUDA it refuses fp32): the output equals the
    same experts run on bf16 copies of the weights and tokens, and the fp32 weights get gradients."""
    experts = hf_experts(kind) if kind != "built-in" else moe.Experts(num_experts=4, dim=32, expert_dim=16)
    if kind == "built-in":
        torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
        torch.nn.init.normal_(experts.down_proj, std=0.2)
    x, index, weights = torch.randn(10, 32), torch.randint(0, 4, (10, 2)), torch.rand(10, 2)
    index[:, 1] = (index[:, 0] + 1) % 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, index, weights)
    out.float().sum().backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in experts.parameters())
    with torch.no_grad():
        expected = experts.to(torch.bfloat16)(x.to(torch.bfloat16), index, weights)
    torch.testing.assert_close(out.to(torch.bfloat16), expected, rtol=0, atol=0)


def test_plan_of_an_hf_moe_model_in_bf16_for_a_gpu(data_dir: Path, tmp_path: Path) -> None:
    """meshrun plan traces a GPU's stage under bf16 autocast: the experts' grouped matmul gets bf16
    operands there (CUDA's takes no other), where transformers' own would hand it the fp32 weights."""
    from conftest import meshrun_in_process, tiny

    model_dir = make_moe("qwen3_moe", tmp_path / "model")
    args = tiny(data_dir, tmp_path / "run", **{"model.hf": model_dir, "model.seq_len": 16, "precision": "bf16"})
    done = meshrun_in_process(["plan", *args, "--gpus", "2", "--gpu", "h100"], tmp_path=tmp_path)
    assert "memory per rank" in done.stdout, done.stdout + done.stderr


def test_experts_trace_on_fake_tensors_as_a_balanced_router() -> None:
    """meshrun plan traces on fake tensors (no counts to route by): the experts run as if each got
    N k / E rows; torch's private is_fake, which tells a trace apart, still answers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    experts = moe.Experts(num_experts=4, dim=32, expert_dim=16)
    assert not moe.planned(torch.zeros(1))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(torch.zeros(6, 32))
        assert moe.planned(fake)
        out = experts(fake, torch.zeros(6, 2, dtype=torch.long), torch.ones(6, 2))
    assert out.shape == (6, 32)


def test_microbatch_balance_pools_only_its_own_forward() -> None:
    """The microbatch form pools the layers of one forward: routing left over from a forward whose
    backward never ran (a recompute's, re-run inside the backward) does not join the next one."""
    from meshrun.config.model_sections import GPTSection
    from meshrun.models.moe_balance import meters_of

    cfg = GPTSection(
        num_layers=2, dim=32, num_heads=2, seq_len=8, vocab_size=64, moe={"num_experts": 4, "aux_loss": "microbatch"}
    )
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    recorded = []
    for leftover in (False, True):
        model = moe.MoEGPT(cfg)
        model.to_empty(device="cpu")
        model.init_weights(0)
        if leftover:
            model.blocks["1"].mlp(torch.randn(3, 8, 32))  # routed, never backwarded
        model(tokens).sum().backward()
        recorded.append(sum(float(m.aux_sum) for m in meters_of(model)))
    assert recorded[0] == pytest.approx(recorded[1], rel=1e-6)


def test_sequence_balance_does_not_depend_on_grouping() -> None:
    """The per-sequence loss summed over any split of a batch is the same; transformers' batch-level
    form over the same split is not (why `microbatch` depends on train.micro_batch)."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4 * 8, 4) * 3, dim=-1)  # 4 sequences of 8 tokens, 4 experts
    chosen = torch.topk(probs, 2, dim=-1).indices
    whole = sequence_balance(probs, chosen, batch=4).sum()
    halves = sum(sequence_balance(p, c, batch=2).sum() for p, c in zip(probs.chunk(2), chosen.chunk(2)))
    torch.testing.assert_close(whole, halves)
    pooled = microbatch_balance([probs], [chosen])
    split = sum(microbatch_balance([p], [c]) for p, c in zip(probs.chunk(2), chosen.chunk(2))) / 2
    assert abs(pooled.item() - split.item()) > 1e-3


SIGMOID_GPT = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.gate": "sigmoid",
    "model.moe.aux_loss_coef": 0.1,
}


def plain_sigmoid_route(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3's sigmoid routing from its definition, for tokens `x` (N, H) and a router `gate`
    (E, H): each expert's affinity 1 / (1 + exp(-x . g_e)); a token's k largest by a full
    descending sort; their weights the affinities over their sum; and, for the balance loss, the
    affinities over every expert's sum -> (probabilities (N, E), weights (N, k), experts (N, k))."""
    scores = 1 / (1 + torch.exp(-(x @ gate.T)))
    chosen = scores.sort(dim=-1, descending=True).indices[:, :top_k]
    top = scores.gather(-1, chosen)
    return scores / scores.sum(dim=-1, keepdim=True), top / top.sum(dim=-1, keepdim=True), chosen


def test_sigmoid_router_equals_plain_torch() -> None:
    """model.moe.gate sigmoid: the router's probabilities, chosen experts (best first) and top-k
    weights (summing to 1) are the plain computation's; softmax's renormalised weights differ."""
    from meshrun.config.model_sections import MoESection

    router = moe.Router(MoESection(num_experts=6, top_k=2, gate="sigmoid"), dim=16)
    generator = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(6, 16, generator=generator)
    x = torch.randn(20, 16, generator=generator)
    probs, weights, chosen = router(x)
    want_probs, want_weights, want_chosen = plain_sigmoid_route(x, router.weight.detach(), 2)
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(20))
    softmax = torch.softmax(x @ router.weight.detach().T, dim=-1).gather(-1, chosen)
    assert (softmax / softmax.sum(dim=-1, keepdim=True) - weights).abs().max() > 1e-2


def test_sigmoid_gate_training_step_equals_plain_torch(data_dir: Path, tmp_path: Path) -> None:
    """The built-in MoE gpt with the sigmoid gate, one process, 4 microbatches accumulated: step 1's
    language loss, balance loss (per-sequence, coef excluded), tokens per expert of every layer and
    pre-clip gradient norm equal a plain-torch forward and backward of the same weights over the
    whole global batch (plain_reference.plain_blocks with each MLP a loop over the experts, the
    routing plain_sigmoid_route's), 1e-5 relative."""
    from plain_reference import plain_blocks

    with in_process_trainer(data_dir, tmp_path / "run", **SIGMOID_GPT, **{"train.steps": 1}) as trainer:
        cfg = trainer.cfg.model
        w = {n: p.detach().clone().requires_grad_() for n, p in trainer.model.parts[0].named_parameters()}
        x, y = trainer.local_batch(trainer.train_data, 0)
        result = trainer.train_step(0)
        row = window_row(trainer.model.parts, trainer.moe_layers, trainer.device)
    (b, t), experts, balance, counts = x.shape, SIGMOID_GPT["model.moe.num_experts"], [], []

    def moe_mlp(layer: int, m: torch.Tensor) -> torch.Tensor:
        p, flat = f"blocks.{layer}.mlp.", m.reshape(b * t, -1)
        probs, weights, chosen = plain_sigmoid_route(flat, w[p + "gate.weight"], 2)
        out = torch.zeros_like(flat)
        for e in range(experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            gate, up = F.linear(flat[token], w[p + "experts.gate_up_proj"][e]).chunk(2, dim=-1)
            done = F.linear(F.silu(gate) * up, w[p + "experts.down_proj"][e])
            out = out.index_add(0, token, weights[token, slot, None] * done)
        picks = F.one_hot(chosen, experts).sum(dim=1).float().view(b, t, experts)
        balance.append(experts * (picks.mean(dim=1) * probs.view(b, t, experts).mean(dim=1)).sum(dim=-1))  # (B,)
        counts.append(picks.sum(dim=(0, 1)))
        return out.view(b, t, -1)

    h = w["embed.tok.weight"][x] + w["embed.pos.weight"][:t]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # True: may not attend
    h = plain_blocks(w, h, num_layers=cfg.num_layers, num_heads=cfg.num_heads, attn_mask=future, mlp=moe_mlp)
    logits = F.linear(h, w["head.weight"])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    aux = torch.stack(balance).mean()  # over the MoE layers and the global batch's sequences
    grads = torch.autograd.grad(loss + SIGMOID_GPT["model.moe.aux_loss_coef"] * aux, list(w.values()))
    norm = torch.stack([(g.double() ** 2).sum() for g in grads]).sum().sqrt().item()
    assert result.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    assert row["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    for layer, tokens in enumerate(counts):
        assert tokens.sum() == b * t * 2
        assert (row[f"moe/layer{layer}/tokens_min"], row[f"moe/layer{layer}/tokens_max"]) == (
            tokens.min(),
            tokens.max(),
        )
    assert result.grad_norm.item() == pytest.approx(norm, rel=1e-5)


HERE = Path(__file__).parent
GPT_MOE = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.aux_loss_coef": 0.1,
    "train.global_batch": 8,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
}
LAYOUTS = {
    "one": {},
    # recompute: a block's forward runs twice, its routing counts once
    "dp2-pp2-1f1b": {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "recompute": "full"},
    # the broken variant: each stage divides by its own MoE layers (tests/models/moe_per_stage.py)
    "broken-pp2": {
        "parallel.pp": 2,
        "parallel.schedule": "1f1b",
        "model.factory": "moe_per_stage:build",
        "train.steps": 1,
        **{f"model.options.{k}": v for k, v in (("num_experts", 4), ("top_k", 2), ("aux_loss_coef", 0.1))},
    },
}


@pytest.fixture(scope="module")
def gpt_runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The built-in MoE gpt with the per-sequence balance loss, trained at each layout (one launch each)."""
    from conftest import meshrun_env, run_meshrun, tiny

    runs = {}
    for name, layout in LAYOUTS.items():
        run = tmp_path_factory.mktemp(name) / "run"
        settings = {**GPT_MOE, **layout}
        if "model.factory" in settings:
            settings = {k: v for k, v in settings.items() if not k.startswith("model.moe.")}
        run_meshrun(
            ["train", *tiny(data_dir, run, **settings)],
            tmp_path=run.parent,
            env=meshrun_env(run.parent, PYTHONPATH=str(HERE)),
        )
        runs[name] = run
    return runs


def routing(run: Path) -> list[dict[str, float]]:
    """Each logged step's tokens per expert (min, max, cv per layer) and the balance loss."""
    from conftest import read_metrics

    return [
        {k: v for k, v in row.items() if k.startswith("moe/") or k == "aux_loss"}
        for row in read_metrics(run)
        if "loss" in row
    ]


def test_dp2_pp2_equals_one_process(gpt_runs: dict[str, Path]) -> None:
    """dp2 x pp2 (1F1B, full recompute) with the per-sequence balance loss: step-1 loss and gradient norm, the
    weights after 10 clipped AdamW steps (1e-5), and the routing of every step (tokens per expert
    of every layer, the balance loss) equal one process's."""
    from conftest import final_weights, grad_norms, losses, max_weight_diff

    one, split = gpt_runs["one"], gpt_runs["dp2-pp2-1f1b"]
    assert losses(split)[0] == pytest.approx(losses(one)[0], rel=1e-5)
    assert grad_norms(split)[0] == pytest.approx(grad_norms(one)[0], rel=1e-5)
    ours, theirs = routing(split), routing(one)
    assert ours[0]["aux_loss"] > 0 and ours[0].keys() == theirs[0].keys()
    for a, b in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert max_weight_diff(final_weights(split), final_weights(one)) < 1e-5


def test_a_balance_loss_normalised_per_stage_differs(gpt_runs: dict[str, Path]) -> None:
    """The check can fail: a stage that divides the balance loss by its own MoE layers (half the
    model's) gives another gradient at step 1, though the language loss and routing agree."""
    from conftest import grad_norms, losses

    one, broken = gpt_runs["one"], gpt_runs["broken-pp2"]
    assert losses(broken)[0] == pytest.approx(losses(one)[0], rel=1e-5)
    assert grad_norms(broken)[0] != pytest.approx(grad_norms(one)[0], rel=1e-5)


def test_hf_moe_pp2_equals_one_process(data_dir: Path, tmp_path: Path) -> None:
    """Qwen3-MoE (layers 0 and 2 sparse, 1 dense) split over two pipeline stages, each holding a
    MoE layer, with the per-sequence balance loss: step-1 loss, gradient norm and routing, and the
    weights after 4 steps, equal one process's (1e-5)."""
    from conftest import final_weights, grad_norms, losses, max_weight_diff, run_meshrun, tiny

    model_dir = make_moe("qwen3_moe", tmp_path / "model")
    settings = {"model.hf": model_dir, "model.seq_len": 16, "train.steps": 4, "train.lr": 3e-3, "train.grad_clip": 0.5}
    run_meshrun(["train", *tiny(data_dir, tmp_path / "pp2", **settings, **{"parallel.pp": 2})], tmp_path=tmp_path)
    with in_process_trainer(data_dir, tmp_path / "one", **settings) as trainer:
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model.parts[0].state_dict().items()}
    one, split = tmp_path / "one", tmp_path / "pp2"
    assert losses(split)[0] == pytest.approx(losses(one)[0], rel=1e-5)
    assert grad_norms(split)[0] == pytest.approx(grad_norms(one)[0], rel=1e-5)
    assert routing(split)[0] == pytest.approx(routing(one)[0], rel=1e-5)
    assert routing(split)[0]["aux_loss"] > 0
    assert max_weight_diff(final_weights(split), weights) < 1e-5


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_flops_count_only_the_experts_a_token_runs_through(lora: bool, data_dir: Path, tmp_path: Path) -> None:
    """The FLOPs per token behind MFU count each trained weight at 6 (LoRA on attention: each frozen
    weight at 4, each adapter at 6), the experts at top_k / E of their weights, + attention —
    counted here from the parameters (not from flops_per_token's arithmetic)."""
    from meshrun.models.families import flops_at

    model_dir = make_moe("qwen3_moe", tmp_path / "model")
    adapted = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.target_modules": ["q_proj", "v_proj"]}
    settings = {"model.hf": model_dir, "model.seq_len": 16, **(adapted if lora else {})}
    with in_process_trainer(data_dir, tmp_path / "run", **settings) as t:
        model = t.model.parts[0]
        config = model.hf_config
        share = config.num_experts_per_tok / config.num_experts
        frozen = trained = 0.0
        for name, p in model.named_parameters():
            if name.startswith("embed."):
                continue  # a lookup, no matmul
            weight = p.numel() * (share if ".experts." in name else 1.0)
            if p.requires_grad:
                trained += weight
            else:
                frozen += weight
        assert trained > 0 and any(".experts." in n for n, _ in model.named_parameters())
        assert (frozen > 0) == lora
        if model.tied:  # the head reads the embedding's matrix, trained unless LoRA froze it
            head = config.vocab_size * config.hidden_size
            frozen, trained = (frozen + head, trained) if lora else (frozen, trained + head)
        attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 16
        assert flops_at(model, 16) == pytest.approx(4 * frozen + 6 * trained + attention, rel=1e-9)


def test_dry_run_states_active_and_total_parameters() -> None:
    """--dry-run's MoE line: the sparse layers, and the parameters a token runs through (each expert
    weight at top_k / E) of the total, counted here from the parameters' names."""
    from meshrun.config.schema import validate
    from meshrun.models.families import build_model
    from meshrun.planner.dry_run import describe_job

    cfg = validate({"model": {"hf_config": {"model_type": "qwen3_moe", **MOE_FAMILIES["qwen3_moe"]}, "seq_len": 16}})
    model = build_model(cfg.model)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    active = sum(p.numel() * (2 / 4 if ".experts." in n else 1) for n, p in params.items())
    assert f"MoE: 2 layers (0, 2), 4 experts each, top 2: {active:,.0f} of the {total:,} parameters" in describe_job(
        cfg, model
    )
