"""train.optimizer: meshrun's AdamW, Adam, SGD and RMSprop step as torch.optim's own classes do,
skip a non-finite step on the device leaving everything bit-identical, are planned at the bytes
they hold, and train (and resume resharded) under a layout as one plain-torch process does."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import final_weights, grad_norms, max_weight_diff, tiny, train_job
from plain_reference import assert_grad_norms_match, plain_optimizer
from test_checkpoint import interrupted_copy

from meshrun.config.schema import Config, TrainConfig
from meshrun.hardware.precision import make_scaler
from meshrun.models.gpt import GPT
from meshrun.parallel.fsdp import measured_state_bytes
from meshrun.planner.stage_cost import state_bytes
from meshrun.training.optim import Optimizers

TINY_GPT = {"num_layers": 2, "dim": 16, "num_heads": 2, "vocab_size": 64, "seq_len": 8}
OPTIONS = {
    "adamw": {"optimizer": "adamw", "betas": (0.8, 0.9), "eps": 1e-6},
    "adam": {"optimizer": "adam", "weight_decay": 0.05},
    "sgd": {"optimizer": "sgd"},
    "sgd-nesterov": {"optimizer": "sgd", "momentum": 0.9, "nesterov": True},
    "rmsprop": {"optimizer": "rmsprop", "alpha": 0.9},
    "rmsprop-momentum": {"optimizer": "rmsprop", "momentum": 0.5, "eps": 1e-6},
}


def model_and_train(options: dict) -> tuple[GPT, TrainConfig]:
    cfg = Config.model_validate({"model": TINY_GPT, "train": {"lr": 1e-2, "steps": 10, "warmup_steps": 2, **options}})
    model = GPT(cfg.model)
    model.init_weights(cfg.train.seed)
    return model, cfg.train


def reference_of(model: GPT, train: TrainConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """A copy of `model` and torch.optim's own class over it, grouped as meshrun groups (matrices decayed)."""
    reference = GPT(model.cfg)
    reference.load_state_dict(model.state_dict())
    params = list(reference.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return reference, plain_optimizer(train, groups)


def set_gradients(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def snapshot(model: torch.nn.Module, optimizers: Optimizers) -> list[torch.Tensor]:
    state = [v for o in optimizers.optimizers for s in o.state.values() for v in s.values()]
    return [t.detach().clone() for t in [*model.parameters(), *state] if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", OPTIONS)
def test_ten_steps_equal_torch_optims_own_class(name: str) -> None:
    model, train = model_and_train(OPTIONS[name])
    reference, plain = reference_of(model, train)
    optimizers = Optimizers([model], train)
    for step in range(10):
        lr = optimizers.set_lr(step)
        for group in plain.param_groups:
            group["lr"] = lr
        set_gradients(model, step)
        set_gradients(reference, step)
        optimizers.step_unless(torch.zeros(()))
        plain.step()
    for (key, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{name} {key}: {m}")


@pytest.mark.parametrize("name", OPTIONS)
def test_a_skipped_step_leaves_weights_and_state_bit_identical(name: str) -> None:
    """Skipped on the device: after three steps, and as the very first step (state not yet made:
    what the optimizer holds afterwards must step on exactly as a fresh one)."""
    model, train = model_and_train(OPTIONS[name])
    optimizers = Optimizers([model], train)
    for step in range(3):
        set_gradients(model, step)
        optimizers.step_unless(torch.zeros(()))
    before = snapshot(model, optimizers)
    set_gradients(model, 3)
    next(model.parameters()).grad[0] = float("inf")  # pyright: ignore[reportOptionalSubscript]
    optimizers.step_unless(torch.ones(()))
    after = snapshot(model, optimizers)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))

    skipped_first, _ = model_and_train(OPTIONS[name])
    fresh, _ = model_and_train(OPTIONS[name])
    first, second = Optimizers([skipped_first], train), Optimizers([fresh], train)
    set_gradients(skipped_first, 99)
    first.step_unless(torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(skipped_first.parameters(), fresh.parameters()))
    for step in range(2):
        for model_, optimizers_ in ((skipped_first, first), (fresh, second)):
            set_gradients(model_, step)
            optimizers_.step_unless(torch.zeros(()))
    assert all(torch.equal(a, b) for a, b in zip(skipped_first.parameters(), fresh.parameters()))


@pytest.fixture
def one_process_group():
    """The scaler all-reduces found_inf over a process group: a one-rank gloo group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", OPTIONS)
def test_fp16_scaler_path_steps_as_torch_optim_and_skips_an_overflow(name: str, one_process_group) -> None:
    """The trainer's fp16 order (unscale_, the global norm, step_unless on it, update) on gradients
    multiplied by the loss scale: 4 steps equal torch.optim's class on the unscaled gradients, then
    an overflowing step leaves weights and state bit-identical and halves the scale."""
    model, train = model_and_train(OPTIONS[name])
    reference, plain = reference_of(model, train)
    cfg = Config.model_validate({"precision": "fp16", "model": TINY_GPT, "amp": {"init_scale": 1024.0}})
    scaler = make_scaler(cfg, torch.device("cpu"), None)
    assert scaler is not None
    optimizers = Optimizers([model], train)

    def scaled_step(step: int, *, inf: bool = False) -> None:
        set_gradients(model, step)
        for param in model.parameters():
            param.grad.mul_(scaler.get_scale())  # pyright: ignore[reportOptionalMemberAccess]
        if inf:
            next(model.parameters()).grad[0] = float("inf")  # pyright: ignore[reportOptionalSubscript]
        optimizers.unscale_(scaler)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizers.step_unless(torch.isfinite(norm).logical_not().float())
        scaler.update()

    for step in range(4):
        lr = optimizers.set_lr(step)
        for group in plain.param_groups:
            group["lr"] = lr
        scaled_step(step)
        set_gradients(reference, step)
        plain.step()
    for (key, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{name} {key}: {m}")
    before, scale = snapshot(model, optimizers), scaler.get_scale()
    scaled_step(4, inf=True)
    after = snapshot(model, optimizers)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert scaler.get_scale() == scale / 2


@pytest.mark.parametrize("name", OPTIONS)
def test_planned_optimizer_bytes_are_what_the_optimizer_holds(name: str) -> None:
    model, train = model_and_train(OPTIONS[name])
    optimizers = Optimizers([model], train)
    set_gradients(model, 0)
    optimizers.step_unless(torch.zeros(()))
    params, grads, optimizer = state_bytes(model, train)
    measured = measured_state_bytes(list(model.parameters()), optimizers.optimizers)
    assert measured == (params + grads + optimizer, params + grads + optimizer)  # all trainable


LAYOUT_RUN = {
    "train.optimizer": "rmsprop",
    "train.momentum": 0.5,
    "train.alpha": 0.9,
    "train.lr": 3e-3,
    "train.steps": 10,
    "checkpoint.interval": 5,
}
FSDP_DP2_PP2 = {"parallel.dp": 2, "parallel.pp": 2, "parallel.dp_mode": "fsdp"}  # RMSprop's skip on the shards


@pytest.fixture(scope="module")
def rmsprop_run(data_dir, tmp_path_factory: pytest.TempPathFactory):
    """RMSprop with momentum at FSDP dp2 x pp2, 10 clipped steps, a checkpoint every 5."""
    run = tmp_path_factory.mktemp("rmsprop") / "run"
    train_job(tiny(data_dir, run, **LAYOUT_RUN, **FSDP_DP2_PP2), tmp_path=run.parent)
    return run


def test_rmsprop_under_fsdp_trains_as_one_plain_torch_process(rmsprop_run, plain_reference) -> None:
    plain = plain_reference(**{k: v for k, v in LAYOUT_RUN.items() if not k.startswith("checkpoint.")})
    assert_grad_norms_match(grad_norms(rmsprop_run), plain.grad_norms)
    assert max_weight_diff(final_weights(rmsprop_run), plain.weights) < 1e-5


def test_sgd_nesterov_at_dp2_x_pp2_trains_and_resumes_as_one_plain_torch_process(
    data_dir, plain_reference, tmp_path
) -> None:
    """10 clipped steps; then SGD's momentum buffers (no step counter: state unlike Adam's and
    RMSprop's) written at dp2 x pp2 after step 5 and resumed at dp1 x pp1 end where the run did."""
    optimizer = {"train.optimizer": "sgd", "train.momentum": 0.9, "train.nesterov": True, "train.lr": 0.05}
    overrides = {"train.steps": 10, **optimizer}
    layout = {"parallel.dp": 2, "parallel.pp": 2, "checkpoint.interval": 5}
    train_job(tiny(data_dir, tmp_path / "run", **overrides, **layout), tmp_path=tmp_path)
    plain = plain_reference(**overrides)
    assert_grad_norms_match(grad_norms(tmp_path / "run"), plain.grad_norms)
    assert max_weight_diff(final_weights(tmp_path / "run"), plain.weights) < 1e-5

    resumed = interrupted_copy(tmp_path / "run", tmp_path / "resumed", at_step=5)
    result = train_job(tiny(data_dir, resumed, **overrides), tmp_path=tmp_path)
    assert "resumed from" in result.stderr
    assert max_weight_diff(final_weights(resumed), final_weights(tmp_path / "run")) < 1e-5


def test_optimizer_state_resumes_resharded(rmsprop_run, data_dir, tmp_path) -> None:
    """RMSprop's squared averages and momentum written at fsdp dp2 x pp2, resumed at dp1 x pp1: the
    run continues as the uninterrupted one."""
    run = interrupted_copy(rmsprop_run, tmp_path / "resumed", at_step=5)
    result = train_job(tiny(data_dir, run, **LAYOUT_RUN), tmp_path=tmp_path)
    assert "resumed from" in result.stderr
    assert max_weight_diff(final_weights(run), final_weights(rmsprop_run)) < 1e-5
    assert json.loads((run / "config.json").read_text())["train"]["optimizer"] == "rmsprop"
