"""Tied embeddings when one rank runs both the first and the last stage (summed locally), in
one process: the gradient sum, the norm counting the matrix once, and the identity check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrun.config.schema import validate
from meshrun.errors import RunError
from meshrun.parallel.layout import Layout
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.parallel.tied import TiedEmbeddings

GPT2 = {
    "model_type": "gpt2",
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 2,
    "vocab_size": 256,
    "n_positions": 32,
    "embd_pdrop": 0.0,
    "resid_pdrop": 0.0,
    "attn_pdrop": 0.0,
}


@pytest.fixture
def mesh():
    mesh = init_mesh(Layout())
    yield mesh
    shutdown()


def test_first_and_last_stage_on_one_rank(mesh) -> None:
    cfg = validate({"model": {"hf_config": GPT2, "seq_len": 8}})
    whole = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    first, last = (materialise_part(cfg, torch.device("cpu"), layers=[i], first=i == 0, last=i == 1) for i in (0, 1))
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in (whole, last):
        torch.nn.functional.cross_entropy(
            model(first(tokens) if model is last else tokens).flatten(0, 1), tokens.flatten()
        ).backward()
    tied = TiedEmbeddings([first, last], [0, 1], num_stages=2, mesh=mesh)
    assert tied.group is None and dist.get_world_size() == 1  # no process group: a local sum
    tied.sync_gradients()
    copies = [first.embed.wte.weight, last.embed.wte.weight]
    assert torch.equal(copies[0].grad, copies[1].grad)
    assert torch.allclose(
        copies[0].grad, whole.embed.wte.weight.grad, atol=1e-6
    )  # embedding + head, as one tied matrix
    params = [*first.parameters(), *last.parameters()]
    assert len(tied.counted_once(params)) == len(params) - 1 and any(p is copies[0] for p in tied.counted_once(params))
    tied.check_identical()
    with torch.no_grad():
        copies[1][0, 0] += 1e-7
    with pytest.raises(RunError, match="copies on the first and last pipeline stage differ"):
        tied.check_identical()
