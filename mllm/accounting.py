"""Parameter counts and training FLOPs per token.

FLOPs per token for one training step (forward + backward = 3 × forward, Kaplan et al. 2020, sec. 2.1;
PaLM appendix B):
    6 · N_matmul  +  12 · n_layers · n_heads · head_dim · keys_per_query
N_matmul is every parameter a token's matrix multiplies use: the active non-embedding parameters
plus the output head (d_model · vocab, tied or not). In an MoE layer a token uses k of the E routed
experts, so their parameters count k/E (the active parameters; shared experts and the router count
whole); capacity padding and dropped tokens are not counted. Attention's QKᵀ and PV cost 2·2·head_dim FLOPs per head per
(query, key) pair forward; with a causal mask a query sees on average (T + 1)/2 keys (about half),
and with a sliding window W, mean_i min(i + 1, W). A gated FFN's third matrix is a parameter like any
other, so it is counted. Norms, softmax and positional terms are O(d) per token and left out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from mllm.layers.attention import ATTENTIONS
from mllm.layers.moe import MoE


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  total: int
  embedding: int  # token table, learned position table, untied output head
  non_embedding: int
  active: int  # used per token: total less the routed experts a token does not use (MoE)

  @property
  def active_non_embedding(self) -> int:
    return self.active - self.embedding


def abstract_model(config) -> nnx.Module:
  """The model with ShapeDtypeStructs instead of arrays: built without allocating or computing."""
  from mllm.model import build_model

  return nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))


def count_params(model_or_config) -> ParamCounts:
  """Count the parameters of a model, or of the model a config describes (without building it)."""
  model = model_or_config
  if not isinstance(model, nnx.Module):
    model = abstract_model(model_or_config)
  embedding = total = 0
  learned_positions = getattr(getattr(model, 'position', None), 'max_positions', None) is not None
  for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    size = int(np.prod(leaf.shape))
    total += size
    top = str(path[0])
    if top in ('embed', 'head') or (top == 'position' and learned_positions):
      embedding += size
  unused = 0
  for _, module in nnx.iter_modules(model):
    if isinstance(module, MoE):
      routed = sum(
        int(np.prod(leaf.shape))
        for _, leaf in nnx.to_flat_state(nnx.state(module.experts, nnx.Param))
      )
      unused += routed * (module.num_experts - module.k) // module.num_experts
  return ParamCounts(
    total=total, embedding=embedding, non_embedding=total - embedding, active=total - unused
  )


def keys_per_query(seq_len: int, window: int | None) -> float:
  """Mean number of keys a causal query attends to in a sequence of seq_len tokens."""
  i = np.arange(1, seq_len + 1)
  return float(np.mean(np.minimum(i, window) if window else i))


@dataclasses.dataclass(frozen=True)
class FlopCounts:
  dense: float  # 6 · N_matmul
  attention: float  # 6 · L · heads · (qk head dim + v head dim) · keys_per_query
  total: float


def training_flops_per_token(config, counts: ParamCounts, seq_len: int | None = None) -> FlopCounts:
  """Training FLOPs per token for the model `config` describes, whose parameters `counts` counted
  (`count_params(config)`), at sequence length `seq_len` (default: model.max_seq_len)."""
  m = config.model if 'model' in config else config
  seq_len = seq_len or m.max_seq_len
  head_matmul = m.d_model * m.vocab_size
  n_matmul = counts.active_non_embedding + head_matmul
  qk_dim, v_dim = ATTENTIONS[m.attention.kind].head_dims(m)
  dense = 6.0 * n_matmul
  # q·kᵀ and P·v: 2·(qk_dim + v_dim) per head and key forward, 3x that with the backward.
  attention = (
    6.0
    * m.n_layers
    * m.n_heads
    * (qk_dim + v_dim)
    * keys_per_query(seq_len, m.attention.sliding_window)
  )
  return FlopCounts(dense=dense, attention=attention, total=dense + attention)
