"""Models and the small protocol every model follows so meshrun can split it into pipeline stages.

A model is an `nn.Module` with:

- `embed`: module or None. Maps the model input (token ids) to hidden states.
- `blocks`: `nn.ModuleDict` keyed "0", "1", ... in execution order. Keys are global layer
  indices, so parameter names (and checkpoints) survive pruning to a stage.
- `norm`, `head`: modules or None. Final norm and output projection (hidden -> logits).
- `forward(x)`: runs whatever of embed -> blocks -> norm -> head is present, skipping the
  parts a stage does not own (None, or removed from `blocks`).
- `init_weights(seed)`: initialises the parts present; each parameter's values depend only on
  the seed and its name, never on which other parts exist.
- `flops_per_token(length=None)`: training FLOPs per token of the whole model on samples of
  `length` tokens (None: model.seq_len), for TFLOP/s and MFU. A model that takes no `length`
  is priced at model.seq_len on every batch (see `flops_at`).

Optionally `keep_stage(first=, last=)` drops the parts another pipeline stage owns (default:
embed unless first, norm and head unless last).

Subclassing `meshrun.models.protocol.StagedModel` provides that forward; `ModelProtocol` there
is the protocol as a type, and `meshrun.models.families.build_model` returns a `ProtocolModule` (nn.Module + protocol).
Built-in models are listed in `BUILTIN`; `model.hf` / `model.hf_config` build a Hugging Face model (models/hf.py);
`model.factory: "pkg.module:function"` builds your own: the function receives the `ModelConfig` and returns such a module. Build happens on the
meta device, so constructors must not initialise values themselves.
"""
