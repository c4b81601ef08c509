"""Mixture of Experts: a router sends each token to k of E expert FFNs (the lecture's last FFN).

    p(x) = softmax(x·W_r)  (or sigmoid, DeepSeek-V3),  in float32 whatever the compute dtype
    y(x) = Σ_{i ∈ top-k(p)} g_i(x) · E_i(x)  [+ Σ_j S_j(x), always-on shared experts]
    g_i = p_i, or p_i / Σ_{top-k} p  with renormalisation (Mixtral; Shazeer et al. 2017, eq. 3-5)

Two ways to run the experts, equal when no token overflows (tested):
- `capacity` (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): each expert takes at most
  C = ceil(T/E · k · capacity_factor) assignments, filled in priority order (every token's first
  choice before any second choice, then token order); an assignment past C is dropped, so that
  token gets less (or nothing) from the layer and keeps its residual. Tokens are gathered into an
  [E, C, D] buffer: about the active FLOPs, and memory O(E·C·D), not a [T, E, C] mask.
- `dropless` (MegaBlocks, Gale et al. 2023): the T·k assignments sorted by expert and run through
  a grouped matmul, `jax.lax.ragged_dot`. Nothing is dropped. On CPU XLA expands ragged_dot to a
  dense masked product (about E× one expert's FLOPs; ../benchmarks/moe.py measures it).

Status: the layer, routing, both dispatches and the two losses, tested against float64 NumPy.
The config keys (`moe.*`), the model wiring, router noise, aux-loss-free balancing, metrics and
expert parallelism come next (issue 10).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers.ffn import FFNS

ROUTERS = ('softmax', 'sigmoid')
DISPATCHES = ('capacity', 'dropless')


# ---------------------------------------------------------------------------------------------
# Routing.
# ---------------------------------------------------------------------------------------------

def router_probs(logits_TE: jax.Array, kind: str = 'softmax') -> jax.Array:
  """Per-expert scores in float32: softmax over experts (they sum to 1), or independent sigmoids
  (DeepSeek-V3, whose gates are then normalised over the chosen k)."""
  logits_TE = logits_TE.astype(jnp.float32)
  if kind == 'softmax':
    return jax.nn.softmax(logits_TE, axis=-1)
  if kind == 'sigmoid':
    return jax.nn.sigmoid(logits_TE)
  raise ValueError(f'unknown router {kind!r}; allowed: {", ".join(ROUTERS)}')


def top_k(probs_TE: jax.Array, k: int, *, renormalize: bool,
          selection_bias_E: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(gates [T, k], experts [T, k]): the k best experts per token, best first.

  selection_bias_E shifts the choice but not the gates (DeepSeek-V3's aux-loss-free balancing).
  """
  scores = probs_TE if selection_bias_E is None else probs_TE + selection_bias_E
  _, experts_Tk = jax.lax.top_k(scores, k)
  gates_Tk = jnp.take_along_axis(probs_TE, experts_Tk, axis=-1)
  if renormalize:
    gates_Tk = gates_Tk / jnp.sum(gates_Tk, axis=-1, keepdims=True)
  return gates_Tk, experts_Tk


def load_balancing_loss(probs_TE: jax.Array, experts_Tk: jax.Array,
                        convention: str = 'switch') -> jax.Array:
  """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), E · Σ_i f_i · P_i, without α.

  P_i is the mean router probability of expert i over the T tokens. f_i is the fraction of
  assignments routed to i:
  - 'switch' (mllm's): over all k·T assignments, so Σ f = 1 and the loss is exactly 1 at uniform
    routing for every k (and α after the coefficient), larger when routing is skewed;
  - 'hf': transformers' `load_balancing_loss_func`, which normalises per choice slot over T only,
    so Σ f = k and uniform routing gives k.
  """
  num_experts = probs_TE.shape[-1]
  counts_E = jnp.sum(jax.nn.one_hot(experts_Tk, num_experts, dtype=jnp.float32), axis=(0, 1))
  n_tokens, k = experts_Tk.shape
  f_E = counts_E / (n_tokens * k if convention == 'switch' else n_tokens)
  if convention not in ('switch', 'hf'):
    raise ValueError(f"unknown balancing convention {convention!r}; allowed: 'switch', 'hf'")
  p_E = jnp.mean(probs_TE.astype(jnp.float32), axis=0)
  return num_experts * jnp.sum(f_E * p_E)


def z_loss(logits_TE: jax.Array) -> jax.Array:
  """Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)²."""
  return jnp.mean(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2)


# ---------------------------------------------------------------------------------------------
# Experts: E FFNs of one kind, weights stacked along a leading expert axis.
# ---------------------------------------------------------------------------------------------

class Experts(nnx.Module):
  """E bias-free FFNs of the kind `ffn_kind` names (its activation and gating): gate/up
  [E, D, F], down [E, F, D]."""

  def __init__(self, num_experts: int, d_model: int, d_ff: int, ffn_kind: str = 'swiglu', *,
               init_std: float, out_std: float, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    ffn = FFNS[ffn_kind]
    self.activation, self.gated = ffn.activation, ffn.gated
    self.dtype = dtype

    def weight(shape, std, axes):
      init = nnx.initializers.normal(std)
      return nnx.Param(init(rngs.params(), shape, param_dtype), logical_axes=axes)
    e, d, f = num_experts, d_model, d_ff
    self.gate = weight((e, d, f), init_std, ('expert', 'embed', 'mlp')) if self.gated else None
    self.up = weight((e, d, f), init_std, ('expert', 'embed', 'mlp'))
    self.down = weight((e, f, d), out_std, ('expert', 'mlp', 'embed'))

  def _weights(self, dtype):
    cast = lambda w: None if w is None else w[...].astype(dtype)  # noqa: E731
    return cast(self.gate), cast(self.up), cast(self.down)

  def _hidden(self, pre_gate, pre_up):
    return self.activation(pre_up) if pre_gate is None else self.activation(pre_gate) * pre_up

  def grouped(self, x_ECD: jax.Array) -> jax.Array:
    """Expert e applied to its own rows x_ECD[e] (the capacity buffer)."""
    gate, up, down = self._weights(self.dtype or x_ECD.dtype)
    x_ECD = x_ECD.astype(up.dtype)
    pre_gate = None if gate is None else jnp.einsum('ecd,edf->ecf', x_ECD, gate)
    hidden = self._hidden(pre_gate, jnp.einsum('ecd,edf->ecf', x_ECD, up))
    return jnp.einsum('ecf,efd->ecd', hidden, down)

  def ragged(self, x_SD: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """Rows sorted by expert, group_sizes_E[e] of them for expert e (the dropless path)."""
    gate, up, down = self._weights(self.dtype or x_SD.dtype)
    x_SD = x_SD.astype(up.dtype)
    pre_gate = None if gate is None else jax.lax.ragged_dot(x_SD, gate, group_sizes_E)
    hidden = self._hidden(pre_gate, jax.lax.ragged_dot(x_SD, up, group_sizes_E))
    return jax.lax.ragged_dot(hidden, down, group_sizes_E)


# ---------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------

def capacity(n_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
  """Assignments one expert takes: ceil(T/E · k · capacity_factor)."""
  return max(1, math.ceil(n_tokens / num_experts * k * capacity_factor))


def capacity_dispatch(experts: Experts, x_TD, gates_Tk, experts_Tk, num_experts: int,
                      cap: int) -> tuple[jax.Array, jax.Array]:
  """(y [T, D], kept [T, k]) running each expert on at most `cap` assignments.

  Priority: slot-major (all first choices, then all second choices, ...), token order within a
  slot, as GShard and Switch fill their buffers; an assignment at position >= cap is dropped.
  """
  n_tokens, k = experts_Tk.shape
  d_model = x_TD.shape[-1]
  by_priority = experts_Tk.T.reshape(-1)  # [k·T], slot-major
  onehot = jax.nn.one_hot(by_priority, num_experts, dtype=jnp.int32)
  position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # rank within its expert
  kept_flat = position < cap
  slot_flat = jnp.where(kept_flat, by_priority * cap + position, num_experts * cap)  # overflow: bin
  token_flat = jnp.tile(jnp.arange(n_tokens), k)
  # Which token fills each of the E·C buffer rows (T: none, a zero row).
  rows = jnp.full((num_experts * cap + 1,), n_tokens, jnp.int32).at[slot_flat].set(token_flat)
  x_padded = jnp.concatenate([x_TD, jnp.zeros((1, d_model), x_TD.dtype)], axis=0)
  x_ECD = x_padded[rows[:-1]].reshape(num_experts, cap, d_model)
  y_rows = experts.grouped(x_ECD).reshape(num_experts * cap, d_model)
  y_rows = jnp.concatenate([y_rows, jnp.zeros((1, d_model), y_rows.dtype)], axis=0)
  y_kTD = y_rows[slot_flat].reshape(k, n_tokens, d_model)
  kept_Tk = kept_flat.reshape(k, n_tokens).T
  weights_kT = jnp.where(kept_Tk, gates_Tk, 0.0).T.astype(y_kTD.dtype)
  return jnp.einsum('ktd,kt->td', y_kTD, weights_kT), kept_Tk


def dropless_dispatch(experts: Experts, x_TD, gates_Tk, experts_Tk,
                      num_experts: int) -> jax.Array:
  """y [T, D] with every assignment computed: sort by expert, grouped matmul, unsort."""
  n_tokens, k = experts_Tk.shape
  flat = experts_Tk.reshape(-1)  # token-major: assignment a is token a // k
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  y_sorted = experts.ragged(x_TD[order // k], group_sizes)
  y_TkD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n_tokens, k, -1)
  return jnp.einsum('tkd,tk->td', y_TkD, gates_Tk.astype(y_TkD.dtype))


# ---------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------

class MoE(nnx.Module):
  """Router + E routed experts (+ shared experts), a drop-in for an FFN: [B, T, D] → [B, T, D].

  Each call sows into `nnx.Intermediate` 'moe': the balancing loss (`balance_convention`), the
  z-loss, the tokens per expert, the mean router probability per expert and the drop rate; the
  training step pops them (no global state).
  """

  def __init__(self, d_model: int, *, num_experts: int, top_k: int, expert_d_ff: int,
               ffn_kind: str = 'swiglu', num_shared_experts: int = 0, shared_d_ff: int | None = None,
               router: str = 'softmax', renormalize: bool = True, dispatch: str = 'capacity',
               capacity_factor: float = 1.25, balance_convention: str = 'switch',
               init_std: float = 0.02, out_std: float = 0.02, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f'top_k={top_k} must be in [1, num_experts={num_experts}]')
    if router not in ROUTERS or dispatch not in DISPATCHES:
      raise ValueError(f'router {router!r} / dispatch {dispatch!r}; allowed: {ROUTERS}, '
                       f'{DISPATCHES}')
    self.num_experts, self.k, self.router_kind = num_experts, top_k, router
    self.renormalize, self.dispatch = renormalize, dispatch
    self.capacity_factor, self.balance_convention = capacity_factor, balance_convention
    init = nnx.initializers.normal(init_std)
    self.router = nnx.Param(init(rngs.params(), (d_model, num_experts), param_dtype),
                            logical_axes=('embed', None))
    self.experts = Experts(num_experts, d_model, expert_d_ff, ffn_kind, init_std=init_std,
                           out_std=out_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.shared = (Experts(num_shared_experts, d_model, shared_d_ff or expert_d_ff, ffn_kind,
                           init_std=init_std, out_std=out_std, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
                   if num_shared_experts else None)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    batch, length, d_model = x_BTD.shape
    x_TD = x_BTD.reshape(batch * length, d_model)
    logits_TE = x_TD.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
    probs_TE = router_probs(logits_TE, self.router_kind)
    renormalize = self.renormalize or self.router_kind == 'sigmoid'
    gates_Tk, experts_Tk = top_k(probs_TE, self.k, renormalize=renormalize)
    if self.dispatch == 'capacity':
      cap = capacity(x_TD.shape[0], self.num_experts, self.k, self.capacity_factor)
      y_TD, kept_Tk = capacity_dispatch(self.experts, x_TD, gates_Tk, experts_Tk,
                                        self.num_experts, cap)
      drop_rate = jnp.mean((~kept_Tk).astype(jnp.float32))
    else:
      y_TD = dropless_dispatch(self.experts, x_TD, gates_Tk, experts_Tk, self.num_experts)
      drop_rate = jnp.zeros((), jnp.float32)
    if self.shared is not None:  # every token through every shared expert, weight 1
      y_TD = y_TD + jnp.sum(self.shared.grouped(
          jnp.broadcast_to(x_TD, (self.shared.up.shape[0],) + x_TD.shape)), axis=0)
    counts_E = jnp.sum(jax.nn.one_hot(experts_Tk, self.num_experts, dtype=jnp.float32), (0, 1))
    self.sow(nnx.Intermediate, 'moe', {
        'balance_loss': load_balancing_loss(probs_TE, experts_Tk, self.balance_convention),
        'z_loss': z_loss(logits_TE),
        'tokens_per_expert': counts_E,
        'mean_prob': jnp.mean(probs_TE, axis=0),
        'drop_rate': drop_rate,
    })
    return y_TD.reshape(batch, length, d_model).astype(x_BTD.dtype)
