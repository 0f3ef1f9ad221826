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

Optional hooks, declared in `meshrun.models.protocol.OptionalHooks` and reached only through the
functions of the same name there, which fall back to the default when a model lacks one:

- `keep_stage(first=, last=)`: drop the parts another pipeline stage owns (default: embed unless
  first, norm and head unless last).
- `tied_weight`: name of the embedding matrix the head shares, kept on the first and last stage
  (default: None, nothing tied).
- `standalone_blocks()`: the blocks as modules that take hidden states alone, for profiling
  (default: the blocks).
- `check_weights()`: before any worker exists, the weights it would load exist and fit (default: nothing).
- `pretrained_dir()`: the folder its weights load from, for the run's description (default: None).
- `fresh_weights()`: tensors drawn from the seed although weights load (a classifier's new head; default: none).
- `tp_plan()`: module-path patterns -> tensor-parallel style names (colwise, rowwise,
  vocab_embedding, vocab_head, ...; scatter, norm, gather for sequence parallel; one record each
  in `meshrun.parallel.tp_styles`) that `parallel.tp > 1` applies (default: None, tp > 1 refused).
- `tp_local(tp)`: before the plan splits it, sizes a forward reads as numbers become one tp rank's
  share (e.g. head counts used to slice a fused projection; default: nothing).
- `sequence_shards`: written by meshrun under sequence parallel (tp): the hidden states a forward
  receives hold 1/sequence_shards of the positions; a model deriving positions from their length
  (rotary embeddings) multiplies by it.

Subclassing `meshrun.models.protocol.StagedModel` provides that forward; `ModelProtocol` there
is the protocol as a type, and `meshrun.models.families.build_model` returns a `ProtocolModule` (nn.Module + protocol).
Each family is declared once in `meshrun.models.families.FAMILIES`: its config section (`model.name`
picks it: gpt, encdec, encoder, timeseries, or hf, which `model.hf` / `model.hf_config` imply; see `meshrun.config.model_sections`)
and its builder. `model.factory: "pkg.module:function"` builds your own: the function receives the
model section (the shared keys and `model.options`) and returns such a module (not beside `model.hf`:
a factory that wraps a Hugging Face model builds it itself). Build happens on the meta device, so constructors must not initialise values themselves.
"""
