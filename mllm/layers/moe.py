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

Balancing: the Switch loss and the router z-loss (sown for the training step to add with their
coefficients), router noise in training (the lecture's mixture, or Shazeer's noisy top-k; drawn
from the 'dropout' RNG stream, so a resumed run draws the same noise), and DeepSeek-V3's
aux-loss-free bias (an `ExpertBias` variable that shifts the choice only; `update_expert_bias`
is applied after each step).

Status: the layer and everything above, tested against float64 NumPy. The config keys (`moe.*`),
the model and training-step wiring, accounting and expert parallelism come next (issue 10).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers.ffn import FFNS

ROUTERS = ('softmax', 'sigmoid')
DISPATCHES = ('capacity', 'dropless')
NOISES = ('none', 'mixture', 'noisy_topk')


class ExpertBias(nnx.Variable):
  """DeepSeek-V3's per-expert routing bias: not a Param, so no optimizer or gradient touches it;
  `update_expert_bias` moves it after each step. Saved with the model's state."""


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


def mixture_noise(probs_TE: jax.Array, alpha: float, key: jax.Array) -> jax.Array:
  """The lecture's noisy router: p = (1 − α)·p + α·ε, with ε uniform on the probability simplex
  (Dirichlet(1, ..., 1), drawn per token), so p stays a distribution."""
  exponential = jax.random.exponential(key, probs_TE.shape, jnp.float32)
  epsilon = exponential / jnp.sum(exponential, axis=-1, keepdims=True)
  return (1.0 - alpha) * probs_TE + alpha * epsilon


def noisy_topk_logits(logits_TE: jax.Array, noise_logits_TE: jax.Array,
                      key: jax.Array) -> jax.Array:
  """Noisy top-k gating (Shazeer et al. 2017, eq. 4): H = x·W_g + N(0, 1)·softplus(x·W_noise)."""
  normal = jax.random.normal(key, logits_TE.shape, jnp.float32)
  return logits_TE + normal * jax.nn.softplus(noise_logits_TE.astype(jnp.float32))


def update_expert_bias(bias_E: jax.Array, tokens_per_expert_E: jax.Array,
                       rate: float) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024): b_i ← b_i + γ·sign(mean load − load_i),
  raising under-loaded experts and lowering over-loaded ones. Use the global batch's counts."""
  load = tokens_per_expert_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(jnp.mean(load) - load)


def load_summary(tokens_per_expert_E: jax.Array) -> dict[str, jax.Array]:
  """How balanced one step's routing was: the coefficient of variation of the load (std/mean, 0
  when even), max/mean load (1 when even) and the fraction of experts that got no token."""
  load = tokens_per_expert_E.astype(jnp.float32)
  mean = jnp.maximum(jnp.mean(load), 1e-9)
  return {'load_cv': jnp.std(load) / mean, 'load_max_over_mean': jnp.max(load) / mean,
          'dead_experts': jnp.mean((load == 0).astype(jnp.float32))}


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
  z-loss, the tokens per expert, the mean router probability per expert, the router entropy and
  the drop rate; the training step collects them with `nnx.capture` (no global state).
  """

  def __init__(self, d_model: int, *, num_experts: int, top_k: int, expert_d_ff: int,
               ffn_kind: str = 'swiglu', num_shared_experts: int = 0, shared_d_ff: int | None = None,
               router: str = 'softmax', renormalize: bool = True, dispatch: str = 'capacity',
               capacity_factor: float = 1.25, balance_convention: str = 'switch',
               noise: str = 'none', noise_alpha: float = 0.1, expert_bias: bool = False,
               init_std: float = 0.02, out_std: float = 0.02, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f'top_k={top_k} must be in [1, num_experts={num_experts}]')
    if router not in ROUTERS or dispatch not in DISPATCHES or noise not in NOISES:
      raise ValueError(f'router {router!r} / dispatch {dispatch!r} / noise {noise!r}; allowed: '
                       f'{ROUTERS}, {DISPATCHES}, {NOISES}')
    self.num_experts, self.k, self.router_kind = num_experts, top_k, router
    self.renormalize, self.dispatch = renormalize, dispatch
    self.capacity_factor, self.balance_convention = capacity_factor, balance_convention
    self.noise, self.noise_alpha = noise, noise_alpha
    init = nnx.initializers.normal(init_std)
    self.router = nnx.Param(init(rngs.params(), (d_model, num_experts), param_dtype),
                            logical_axes=('embed', None))
    # Shazeer et al. initialise the noise matrix to zero: noise of std softplus(0) ≈ 0.69 at first.
    self.noise_router = (nnx.Param(jnp.zeros((d_model, num_experts), param_dtype),
                                   logical_axes=('embed', None))
                         if noise == 'noisy_topk' else None)
    self.bias = (ExpertBias(jnp.zeros((num_experts,), jnp.float32))
                 if expert_bias else None)
    # As nnx.Dropout: a 'dropout' stream (the train step reseeds it from (seed, step), so a
    # resumed run draws the same noise) and `deterministic`, which model.eval() sets.
    self.deterministic = False
    self.rngs = rngs['dropout'].fork() if noise != 'none' else None
    self.experts = Experts(num_experts, d_model, expert_d_ff, ffn_kind, init_std=init_std,
                           out_std=out_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.shared = (Experts(num_shared_experts, d_model, shared_d_ff or expert_d_ff, ffn_kind,
                           init_std=init_std, out_std=out_std, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
                   if num_shared_experts else None)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    batch, length, d_model = x_BTD.shape
    x_TD = x_BTD.reshape(batch * length, d_model)
    x32 = x_TD.astype(jnp.float32)
    logits_TE = x32 @ self.router[...].astype(jnp.float32)
    training_noise = self.noise != 'none' and not self.deterministic
    routing_logits = logits_TE
    if training_noise and self.noise == 'noisy_topk':
      routing_logits = noisy_topk_logits(logits_TE, x32 @ self.noise_router[...].astype(
          jnp.float32), self.rngs())
    probs_TE = router_probs(routing_logits, self.router_kind)
    if training_noise and self.noise == 'mixture':
      probs_TE = mixture_noise(probs_TE, self.noise_alpha, self.rngs())
    renormalize = self.renormalize or self.router_kind == 'sigmoid'
    bias = None if self.bias is None else jax.lax.stop_gradient(self.bias[...])
    gates_Tk, experts_Tk = top_k(probs_TE, self.k, renormalize=renormalize,
                                 selection_bias_E=bias)
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
        'router_entropy': jnp.mean(-jnp.sum(probs_TE * jnp.log(jnp.maximum(probs_TE, 1e-30)),
                                            axis=-1)),
        'drop_rate': drop_rate,
    })
    return y_TD.reshape(batch, length, d_model).astype(x_BTD.dtype)
