"""The declared model-family spec (issue 27 item 3): one config section per family chosen by
`model.name`, a key of another family refused in one line, every family declared with its
builder, and the protocol's optional hooks reached through one helper each, with its default."""

from __future__ import annotations

import pytest
from torch import nn

from meshrun.config.model_sections import SECTIONS, EncDecSection, FactorySection, GPTSection, HFSection
from meshrun.config.schema import Config, load_config
from meshrun.errors import ConfigError
from meshrun.models import protocol
from meshrun.models.families import FAMILIES, build_model
from meshrun.models.hf_config import LAYOUT_OF

# a model section as a flat config.json of an older run wrote it: every family's keys, at their defaults
FLAT_DEFAULTS = {
    "name": "gpt",
    "factory": None,
    "options": {},
    "hf": None,
    "hf_config": None,
    "init": "auto",
    "encoder_layers": None,
    "source_len": None,
    "positions": "learned",
    "tie_embeddings": False,
}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.encoder_layers=2"], "model.encoder_layers is a key of model.name encdec, not of model.name gpt"),
        (["model.init=random"], "model.init is a key of model.name hf, not of model.name gpt"),
        (["model.name=encdec", "model.hf=/m"], "model.hf is a key of model.name hf, not of model.name encdec"),
        (["model.hf=/m", "model.positions=sinusoidal"], "model.positions is a key of model.name encdec"),
        (["model.factory=m:build", "model.tie_embeddings=true"], "a model.factory model gets the shared keys"),
    ],
)
def test_a_key_of_another_family_is_one_line_naming_its_family(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert expected in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_an_older_flat_section_still_loads_as_its_family() -> None:
    """Keys of other families at their defaults are dropped (config.json of older runs wrote all)."""
    gpt = Config.model_validate({"model": {**FLAT_DEFAULTS, "dim": 64}}).model
    hf = Config.model_validate({"model": {**FLAT_DEFAULTS, "hf": "/m"}}).model  # name gpt beside hf meant hf
    encdec = Config.model_validate({"model": {**FLAT_DEFAULTS, "name": "encdec", "source_len": 8}}).model
    user = Config.model_validate({"model": {**FLAT_DEFAULTS, "factory": "m:build"}}).model
    assert isinstance(gpt, GPTSection) and gpt.dim == 64
    assert isinstance(hf, HFSection) and hf.hf == "/m" and hf.name == "hf"
    assert isinstance(encdec, EncDecSection) and encdec.source_len == 8
    assert isinstance(user, FactorySection) and user.factory == "m:build"


def test_a_section_round_trips_through_its_dump() -> None:
    cfg = load_config(None, ["model.name=encdec", "model.tie_embeddings=true"])
    again = Config.model_validate(cfg.model_dump(mode="json"))
    assert again.model == cfg.model and isinstance(again.model, EncDecSection)
    assert "hf" not in cfg.model_dump()["model"]  # the section holds its own family's keys only


def test_a_misspelt_key_is_matched_against_its_familys_keys() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown config key model\.tie_embedding: did you mean model\.tie_embeddings\?"
    ):
        load_config(None, ["model.name=encdec", "model.tie_embedding=true"])


def test_every_family_section_has_a_declared_builder() -> None:
    declared = {family.section for family in FAMILIES}
    assert declared | {FactorySection} == set(SECTIONS.values())
    assert isinstance(build_model(EncDecSection(num_layers=2)).blocks, nn.ModuleDict)


def test_every_supported_model_type_has_one_layout_record() -> None:
    llama, gpt2 = LAYOUT_OF["qwen2"], LAYOUT_OF["gpt2"]
    assert llama is LAYOUT_OF["llama"] and llama.rotary and not gpt2.rotary
    assert llama.hf_names("embed.weight", tied=True) == [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "embed_tokens.weight",
    ]
    assert gpt2.hf_names("blocks.0.attn.c_attn.weight", tied=False)[-1] == "h.0.attn.c_attn.weight"


class Bare(protocol.StagedModel):
    """A protocol model with no optional hook: the helpers apply their defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(4, 2), nn.LayerNorm(2), nn.Linear(2, 4)
        self.blocks = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})

    def init_weights(self, seed: int) -> None: ...

    def flops_per_token(self, length: int | None = None) -> float:
        return 0.0


def test_hook_defaults_for_a_model_without_hooks() -> None:
    first, middle = Bare(), Bare()
    protocol.keep_stage(first, first=True, last=False)
    protocol.keep_stage(middle, first=False, last=False)
    assert first.embed is not None and first.norm is None and first.head is None
    assert middle.embed is None and middle.norm is None and middle.head is None
    model = Bare()
    assert protocol.standalone_blocks(model) == list(model.blocks.values())
    assert protocol.tied_weight(model) is None
    assert protocol.pretrained_dir(model) is None
    protocol.check_weights(model)  # nothing to check


def test_a_models_own_hook_wins_over_the_default() -> None:
    tied = build_model(EncDecSection(num_layers=2, tie_embeddings=True))
    assert protocol.tied_weight(tied) == "embed.tok.weight"
    protocol.keep_stage(tied, first=False, last=True)  # a tied last stage keeps the token matrix
    assert tied.embed is not None and tied.head is not None
