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
  a grouped matmul, `jax.lax.ragged_dot` (or megablox's Pallas `gmm` on TPU). Nothing is dropped.
  A capacity model runs dropless at inference (after `model.eval()`: evaluation, generation,
  HF export parity), so its eval loss does not depend on the batch and matches transformers'
  (Switch, too, evaluates with more capacity than it trains with).
  On CPU XLA expands ragged_dot to a dense masked product (about E× one expert's FLOPs;
  benchmarks/moe.py measures it).

Balancing: the Switch loss and the router z-loss (the layer returns its routing statistics; the
training step adds the losses with their coefficients, over the global batch), router noise in
training (the lecture's mixture, or Shazeer's noisy top-k; drawn from the 'dropout' RNG stream, so
a resumed run draws the same noise), and DeepSeek-V3's aux-loss-free bias (an `ExpertBias`
variable that shifts the choice only; `update_expert_bias` is applied after each step).

`model.ffn.kind='moe'` with the `model.moe.*` keys puts this layer in place of the FFN
(`MoE.from_config`); experts and the model's dense layers are FFNs of `moe.expert_kind`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers.ffn import FFNS, hidden_dim
from mllm.layers.init import weight_std
from mllm.ops import mesh as on_mesh

ROUTERS = ('softmax', 'sigmoid')
DISPATCHES = ('capacity', 'dropless')
GROUPED_MATMULS = ('ragged_dot', 'megablox', 'tiled')  # the dropless path's kernel
NOISES = ('none', 'mixture', 'noisy_topk')
BALANCE_CONVENTIONS = ('switch', 'hf')


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


def top_k(
  probs_TE: jax.Array, k: int, *, renormalize: bool, selection_bias_E: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(gates [T, k], experts [T, k]): the k best experts per token, best first.

  selection_bias_E shifts the choice but not the gates (DeepSeek-V3's aux-loss-free balancing).
  """
  scores = probs_TE if selection_bias_E is None else probs_TE + selection_bias_E
  _, experts_Tk = jax.lax.top_k(scores, k)
  gates_Tk = jnp.take_along_axis(probs_TE, experts_Tk, axis=-1)
  if renormalize:
    gates_Tk = gates_Tk / jnp.sum(gates_Tk, axis=-1, keepdims=True)
  return gates_Tk, experts_Tk


def load_balancing_loss(
  tokens_per_expert_E: jax.Array, mean_prob_E: jax.Array, top_k: int, convention: str = 'switch'
) -> jax.Array:
  """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), E · Σ_i f_i · P_i, without α.

  P_i is the mean router probability of expert i over the T tokens; f_i the fraction of the
  assignments routed to it, from `tokens_per_expert` (T·k assignments in all):
  - 'switch' (mllm's): f_i = count_i / (k·T), so Σ f = 1 and the loss is exactly 1 at uniform
    routing for every k (and α after the coefficient), larger when routing is skewed;
  - 'hf': transformers' per-layer convention, f_i = count_i / T, so Σ f = k and uniform routing
    gives k.
  Both inputs may come from a larger batch than one forward pass (the training step passes the
  global batch's counts when accumulating gradients); f carries no gradient, P does.
  """
  if convention not in BALANCE_CONVENTIONS:
    raise ValueError(f"unknown balancing convention {convention!r}; allowed: 'switch', 'hf'")
  counts_E = jax.lax.stop_gradient(tokens_per_expert_E.astype(jnp.float32))
  n_tokens = jnp.sum(counts_E, axis=-1, keepdims=True) / top_k
  f_E = counts_E / (n_tokens * top_k if convention == 'switch' else n_tokens)
  return counts_E.shape[-1] * jnp.sum(f_E * mean_prob_E.astype(jnp.float32), axis=-1)


def balancing_objective(
  tokens_per_expert_LE: jax.Array, mean_prob_LE: jax.Array, top_k: int, convention: str = 'switch'
) -> jax.Array:
  """The balancing term of the training objective (before its coefficient), from the stacked
  statistics of the L MoE layers: 'switch', the mean over layers of each layer's loss; 'hf',
  transformers' `load_balancing_loss_func`, which pools the layers (counts summed, P averaged)
  into one loss."""
  if convention == 'hf':
    return load_balancing_loss(
      jnp.sum(tokens_per_expert_LE, 0), jnp.mean(mean_prob_LE, 0), top_k, 'hf'
    )
  return jnp.mean(load_balancing_loss(tokens_per_expert_LE, mean_prob_LE, top_k, convention))


def z_loss(logits_TE: jax.Array) -> jax.Array:
  """Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)²."""
  return jnp.mean(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2)


def mixture_noise(probs_TE: jax.Array, alpha: float, key: jax.Array) -> jax.Array:
  """The lecture's noisy router: p = (1 − α)·p + α·ε, with ε uniform on the probability simplex
  (Dirichlet(1, ..., 1), drawn per token), so p stays a distribution."""
  exponential = jax.random.exponential(key, probs_TE.shape, jnp.float32)
  epsilon = exponential / jnp.sum(exponential, axis=-1, keepdims=True)
  return (1.0 - alpha) * probs_TE + alpha * epsilon


def noisy_topk_logits(
  logits_TE: jax.Array, noise_logits_TE: jax.Array, key: jax.Array
) -> jax.Array:
  """Noisy top-k gating (Shazeer et al. 2017, eq. 4): H = x·W_g + N(0, 1)·softplus(x·W_noise)."""
  normal = jax.random.normal(key, logits_TE.shape, jnp.float32)
  return logits_TE + normal * jax.nn.softplus(noise_logits_TE.astype(jnp.float32))


def update_expert_bias(bias_E: jax.Array, tokens_per_expert_E: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek-V3; Wang et al. 2024):
  b_i ← b_i + γ·sign(mean load − load_i), raising under-loaded experts and lowering over-loaded
  ones (over the last axis, E). Use the global batch's counts."""
  load = tokens_per_expert_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def load_summary(tokens_per_expert_E: jax.Array) -> dict[str, jax.Array]:
  """How balanced one step's routing was (over the last axis, E): the coefficient of variation of
  the load (std/mean, 0 when even), max/mean load (1 when even) and the fraction of experts that
  got no token."""
  load = tokens_per_expert_E.astype(jnp.float32)
  mean = jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
  return {
    'load_cv': jnp.std(load, axis=-1) / mean,
    'load_max_over_mean': jnp.max(load, axis=-1) / mean,
    'dead_experts': jnp.mean((load == 0).astype(jnp.float32), axis=-1),
  }


# ---------------------------------------------------------------------------------------------
# Experts: E FFNs of one kind, weights stacked along a leading expert axis.
# ---------------------------------------------------------------------------------------------


class Experts(nnx.Module):
  """E bias-free FFNs of the kind `ffn_kind` names (its activation and gating): gate/up
  [E, D, F], down [E, F, D]."""

  def __init__(
    self,
    num_experts: int,
    d_model: int,
    d_ff: int,
    ffn_kind: str = 'swiglu',
    *,
    init_std: float,
    out_std: float,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
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

  def ragged(
    self, x_SD: jax.Array, group_sizes_E: jax.Array, impl: str = 'ragged_dot'
  ) -> jax.Array:
    """Rows sorted by expert, group_sizes_E[e] of them for expert e (the dropless path)."""
    gate, up, down = self._weights(self.dtype or x_SD.dtype)
    x_SD = x_SD.astype(up.dtype)
    matmul = lambda x, w: grouped_matmul(x, w, group_sizes_E, impl)  # noqa: E731
    pre_gate = None if gate is None else matmul(x_SD, gate)
    hidden = self._hidden(pre_gate, matmul(x_SD, up))
    return matmul(hidden, down)


def grouped_matmul(
  x_SD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, impl: str = 'ragged_dot'
) -> jax.Array:
  """Rows of group e times w_EDF[e]: `jax.lax.ragged_dot`, or megablox's `gmm` (Pallas TPU kernel,
  run in Pallas interpret mode off TPU: for tests, slowly). gmm's row tiles are 128 (the whole
  matrix when smaller); extra zero rows pad the last group to a whole tile and are cut off."""
  if impl == 'ragged_dot':
    return jax.lax.ragged_dot(x_SD, w_EDF, group_sizes_E)
  if impl == 'tiled':
    return tiled_grouped_matmul(x_SD, w_EDF, group_sizes_E)
  if impl != 'megablox':
    raise ValueError(f'unknown grouped matmul {impl!r}; allowed: {", ".join(GROUPED_MATMULS)}')
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # deferred: TPU kernel

  mesh = on_mesh.current_mesh()
  if mesh is not None and mesh.size > 1:
    # gmm is an opaque kernel XLA cannot split, and the rows are sorted by expert over the whole
    # batch: splitting needs the whole dispatch under shard_map (not written yet).
    raise ValueError(
      f"moe.grouped_matmul='megablox' runs on one device, but the mesh has "
      f"{mesh.size}; use 'ragged_dot' on a mesh"
    )
  rows, d_in = x_SD.shape
  tile_m = min(128, rows)
  pad = -rows % tile_m
  x_padded = jnp.pad(x_SD, ((0, pad), (0, 0)))
  sizes = group_sizes_E.astype(jnp.int32).at[-1].add(pad)
  tiling = (tile_m, min(128, d_in), min(128, w_EDF.shape[-1]))
  out = gmm(
    x_padded, w_EDF, sizes, x_SD.dtype, tiling, None, None, False, on_mesh.backend() != 'tpu'
  )
  return out[:rows]


def tiled_grouped_matmul(
  x_SD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, tile: int = 128
) -> jax.Array:
  """Rows of group e times w_EDF[e], as MegaBlocks tiles them (Gale et al. 2023, sec. 5): each
  group is padded with zero rows to whole tiles of `tile` rows, so that every tile belongs to one
  group, and each tile multiplies its group's weight. At most E·(tile − 1) padding rows: for S
  sorted rows, (S + E·tile)·D·F multiply-adds where XLA:CPU's ragged_dot does E·S·D·F. The
  weights are gathered per tile ([tiles, D, F] in memory): a path for CPUs and small models."""
  rows, d_in = x_SD.shape
  num_experts = w_EDF.shape[0]
  tile = max(1, min(tile, rows))
  n_tiles = (rows + num_experts * (tile - 1)) // tile  # >= sum_e ceil(size_e / tile)
  sizes = group_sizes_E.astype(jnp.int32)
  padded = (sizes + tile - 1) // tile * tile
  start, padded_start = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
  group = jnp.repeat(jnp.arange(num_experts), sizes, total_repeat_length=rows)
  slot = padded_start[group] + jnp.arange(rows) - start[group]  # each row's place among the tiles
  x_tiles = jnp.zeros((n_tiles * tile, d_in), x_SD.dtype).at[slot].set(x_SD)
  # Tile t holds group e when padded_start[e] <= t·tile < padded_start[e] + padded[e]; tiles past
  # the last group hold zero rows only (their weight is any group's).
  owner = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_tiles) * tile, side='right')
  w_tiles = w_EDF[jnp.minimum(owner, num_experts - 1)]
  y_tiles = jnp.einsum('tcd,tdf->tcf', x_tiles.reshape(n_tiles, tile, d_in), w_tiles)
  return y_tiles.reshape(n_tiles * tile, -1)[slot]


# ---------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------


def capacity(n_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
  """Assignments one expert takes: ceil(T/E · k · capacity_factor)."""
  return max(1, math.ceil(n_tokens / num_experts * k * capacity_factor))


def capacity_dispatch(
  experts: Experts, x_TD, gates_Tk, experts_Tk, num_experts: int, cap: int
) -> tuple[jax.Array, jax.Array]:
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


def dropless_dispatch(
  experts: Experts, x_TD, gates_Tk, experts_Tk, num_experts: int, impl: str = 'ragged_dot'
) -> jax.Array:
  """y [T, D] with every assignment computed: sort by expert, grouped matmul, unsort."""
  n_tokens, k = experts_Tk.shape
  flat = experts_Tk.reshape(-1)  # token-major: assignment a is token a // k
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  y_sorted = experts.ragged(x_TD[order // k], group_sizes, impl)
  y_TkD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n_tokens, k, -1)
  return jnp.einsum('tkd,tk->td', y_TkD, gates_Tk.astype(y_TkD.dtype))


# ---------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------


class MoE(nnx.Module):
  """Router + E routed experts (+ shared experts), in place of an FFN: [B, T, D] → [B, T, D].

  `__call__` returns (y, stats): the routing statistics of this call, which the training step
  turns into the balancing and z losses and the load metrics (an explicit output, not global
  state): tokens_per_expert [E] (assignments), mean_prob [E] (P_i, differentiable), z_loss,
  router_entropy, drop_rate.
  """

  def __init__(
    self,
    d_model: int,
    *,
    num_experts: int,
    top_k: int,
    expert_d_ff: int,
    ffn_kind: str = 'swiglu',
    num_shared_experts: int = 0,
    shared_d_ff: int | None = None,
    router: str = 'softmax',
    renormalize: bool = True,
    dispatch: str = 'capacity',
    capacity_factor: float = 1.25,
    grouped_matmul: str = 'ragged_dot',
    noise: str = 'none',
    noise_alpha: float = 0.1,
    expert_bias: bool = False,
    force_uniform_routing: bool = False,
    init_std: float = 0.02,
    out_std: float = 0.02,
    shared_out_std: float | None = None,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f'top_k={top_k} must be in [1, num_experts={num_experts}]')
    if router not in ROUTERS or dispatch not in DISPATCHES or noise not in NOISES:
      raise ValueError(
        f'router {router!r} / dispatch {dispatch!r} / noise {noise!r}; allowed: '
        f'{ROUTERS}, {DISPATCHES}, {NOISES}'
      )
    self.num_experts, self.k, self.router_kind = num_experts, top_k, router
    self.renormalize, self.dispatch, self.capacity_factor = renormalize, dispatch, capacity_factor
    self.grouped_matmul = grouped_matmul
    self.noise, self.noise_alpha = noise, noise_alpha
    self.force_uniform_routing = force_uniform_routing
    init = nnx.initializers.normal(init_std)
    self.router = nnx.Param(
      init(rngs.params(), (d_model, num_experts), param_dtype), logical_axes=('embed', None)
    )
    # Shazeer et al. initialise the noise matrix to zero: noise of std softplus(0) ≈ 0.69 at first.
    self.noise_router = (
      nnx.Param(jnp.zeros((d_model, num_experts), param_dtype), logical_axes=('embed', None))
      if noise == 'noisy_topk'
      else None
    )
    self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32)) if expert_bias else None
    # As nnx.Dropout: a 'dropout' stream (the train step reseeds it from (seed, step), so a
    # resumed run draws the same noise) and `deterministic`, which model.eval() sets.
    self.deterministic = False
    self.rngs = rngs['dropout'].fork() if noise != 'none' else None
    self.experts = Experts(
      num_experts,
      d_model,
      expert_d_ff,
      ffn_kind,
      init_std=init_std,
      out_std=out_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    # shared_out_std: the shared experts' down projection, whose fan-in (shared_d_ff) may differ
    # from the routed experts'; None: out_std.
    shared_out_std = out_std if shared_out_std is None else shared_out_std
    self.shared = (
      Experts(
        num_shared_experts,
        d_model,
        shared_d_ff or expert_d_ff,
        ffn_kind,
        init_std=init_std,
        out_std=shared_out_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
      )
      if num_shared_experts
      else None
    )

  @classmethod
  def from_config(cls, cfg, *, rngs: nnx.Rngs) -> MoE:
    """The layer `model.moe` describes (cfg: the model config), initialised as `model.init` says:
    the router and the experts' gate and up read d_model features, each down projection its
    expert's hidden size."""
    moe = cfg.moe
    expert_d_ff = expert_hidden_dim(cfg)
    return cls(
      cfg.d_model,
      num_experts=moe.num_experts,
      top_k=moe.top_k,
      expert_d_ff=expert_d_ff,
      ffn_kind=moe.expert_kind,
      num_shared_experts=moe.num_shared_experts,
      shared_d_ff=moe.shared_d_ff,
      router=moe.router,
      renormalize=moe.renormalize,
      dispatch=resolve_dispatch(moe.dispatch),
      capacity_factor=moe.capacity_factor,
      grouped_matmul=moe.grouped_matmul,
      noise=moe.noise,
      noise_alpha=moe.noise_alpha,
      expert_bias=moe.expert_bias,
      force_uniform_routing=moe.force_uniform_routing,
      init_std=weight_std(cfg, 'in', fan_in=cfg.d_model),
      out_std=weight_std(cfg, 'out', fan_in=expert_d_ff),
      shared_out_std=weight_std(cfg, 'out', fan_in=moe.shared_d_ff or expert_d_ff),
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.dtype(cfg.param_dtype),
      rngs=rngs,
    )

  def _route(self, x_TD):
    """(gates [T, k], experts [T, k], router logits [T, E], probabilities [T, E])."""
    x32 = x_TD.astype(jnp.float32)
    logits_TE = x32 @ self.router[...].astype(jnp.float32)
    training_noise = self.noise != 'none' and not self.deterministic
    routing_logits = logits_TE
    if training_noise and self.noise == 'noisy_topk':
      routing_logits = noisy_topk_logits(
        logits_TE, x32 @ self.noise_router[...].astype(jnp.float32), self.rngs()
      )
    probs_TE = router_probs(routing_logits, self.router_kind)
    if training_noise and self.noise == 'mixture':
      probs_TE = mixture_noise(probs_TE, self.noise_alpha, self.rngs())
    renormalize = self.renormalize or self.router_kind == 'sigmoid'
    if self.force_uniform_routing:
      experts_Tk = uniform_assignment(x_TD.shape[0], self.k, self.num_experts)
      gates_Tk = jnp.take_along_axis(probs_TE, experts_Tk, axis=-1)
      if renormalize:
        gates_Tk = gates_Tk / jnp.sum(gates_Tk, axis=-1, keepdims=True)
    else:
      bias = None if self.expert_bias is None else jax.lax.stop_gradient(self.expert_bias[...])
      gates_Tk, experts_Tk = top_k(probs_TE, self.k, renormalize=renormalize, selection_bias_E=bias)
    return gates_Tk, experts_Tk, logits_TE, probs_TE

  def _dropless_matmul(self) -> str:
    """The dropless path's kernel. A capacity layer takes that path only at inference, where
    megablox's gmm would run in Pallas interpret mode (off TPU: slow, for tests) or refuse the
    multi-device mesh that training ran on: ragged_dot there, the same result; and on a CPU,
    where ragged_dot costs E× the FLOPs, the tiled grouped matmul, the same result again."""
    if self.dispatch == 'dropless':
      return self.grouped_matmul
    if on_mesh.backend() == 'cpu':
      return 'tiled'
    if self.grouped_matmul != 'megablox':
      return self.grouped_matmul
    mesh = on_mesh.current_mesh()
    one_tpu = on_mesh.backend() == 'tpu' and (mesh is None or mesh.size == 1)
    return 'megablox' if one_tpu else 'ragged_dot'

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    batch, length, d_model = x_BTD.shape
    x_TD = x_BTD.reshape(batch * length, d_model)
    gates_Tk, experts_Tk, logits_TE, probs_TE = self._route(x_TD)
    # Capacity is a training device (fixed shapes, ~active FLOPs). At inference (model.eval())
    # nothing is dropped (Switch's Mesh TensorFlow code evaluates with a separate, larger capacity
    # factor; dropless is the limit): a token's output must not depend on which other tokens share
    # its batch, and must equal transformers' (which never drops).
    if self.dispatch == 'capacity' and not self.deterministic:
      cap = capacity(x_TD.shape[0], self.num_experts, self.k, self.capacity_factor)
      y_TD, kept_Tk = capacity_dispatch(
        self.experts, x_TD, gates_Tk, experts_Tk, self.num_experts, cap
      )
      drop_rate = jnp.mean((~kept_Tk).astype(jnp.float32))
    else:
      y_TD = dropless_dispatch(
        self.experts, x_TD, gates_Tk, experts_Tk, self.num_experts, self._dropless_matmul()
      )
      drop_rate = jnp.zeros((), jnp.float32)
    if self.shared is not None:  # every token through every shared expert, weight 1
      y_TD = y_TD + jnp.sum(
        self.shared.grouped(jnp.broadcast_to(x_TD, (self.shared.up.shape[0],) + x_TD.shape)), axis=0
      )
    stats = {
      'tokens_per_expert': jnp.sum(
        jax.nn.one_hot(experts_Tk, self.num_experts, dtype=jnp.float32), axis=(0, 1)
      ),
      'mean_prob': jnp.mean(probs_TE, axis=0),
      'z_loss': z_loss(logits_TE),
      'router_entropy': jnp.mean(
        -jnp.sum(probs_TE * jnp.log(jnp.maximum(probs_TE, 1e-30)), axis=-1)
      ),
      'drop_rate': drop_rate,
    }
    return y_TD.reshape(batch, length, d_model).astype(x_BTD.dtype), stats


def expert_hidden_dim(cfg) -> int:
  """Each routed expert's hidden size: `moe.expert_d_ff`, else the dense FFN's (`hidden_dim`)."""
  return cfg.moe.expert_d_ff or hidden_dim(cfg.ffn, cfg.d_model, kind=cfg.moe.expert_kind)


def uniform_assignment(n_tokens: int, k: int, num_experts: int) -> jax.Array:
  """`moe.force_uniform_routing`: experts [T, k] that give every expert T·k/E assignments (±1),
  k distinct ones per token, in an order shuffled by a fixed key. For timing and memory tests of
  the dispatch at perfect balance, whatever the router has learned."""
  order_T = jax.random.permutation(jax.random.key(0), n_tokens)
  return ((order_T[:, None] * k + jnp.arange(k)) % num_experts).astype(jnp.int32)


def training_note(moe_cfg) -> str | None:
  """A warning for a configuration that trains but defeats its router, else None.

  One softmax gate renormalised over k = 1 is p_i / p_i = 1 for every token: the output no longer
  depends on the router's probabilities, so the router learns only from the balancing and z losses.
  Switch Transformer (Fedus et al. 2022, eq. 2) gates the top-1 expert by p_i for exactly this
  reason. Allowed, not refused: a model imported with that setting computes it at inference."""
  if moe_cfg.top_k == 1 and moe_cfg.renormalize and moe_cfg.router == 'softmax':
    return (
      'model.moe.top_k=1 with model.moe.renormalize=True makes every gate 1: the router gets '
      'no gradient from the loss, only from the balancing and z losses; Switch gates the '
      'top-1 expert by its probability (model.moe.renormalize=False)'
    )
  return None


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
  """`auto` → capacity on CPU (ragged_dot costs E× the FLOPs there: benchmarks/results/moe-layer-*),
  dropless on accelerators."""
  if dispatch != 'auto':
    return dispatch
  return 'capacity' if (backend or on_mesh.backend()) == 'cpu' else 'dropless'


def moe_metrics(stats: dict[str, jax.Array], top_k: int, convention: str) -> dict[str, jax.Array]:
  """Per-layer metrics ([L] and [L, E]) from the stacked routing statistics of one step."""
  out = {name: jax.lax.stop_gradient(v) for name, v in stats.items()}
  out['balance_loss'] = load_balancing_loss(
    out['tokens_per_expert'], out['mean_prob'], top_k, convention
  )
  out.update(load_summary(out['tokens_per_expert']))
  return out


def update_expert_biases(
  variables: nnx.State, tokens_per_expert_LE: jax.Array, rate: float
) -> nnx.State:
  """`update_expert_bias` for every ExpertBias in `variables` (other leaves kept), row l of the
  counts going to the l-th MoE layer: the layers in order, or the one stacked [L, E] variable of
  scanned layers."""
  flat = sorted(nnx.to_flat_state(variables), key=lambda item: item[0])
  row, updated = 0, []
  for path, var in flat:
    if isinstance(var, ExpertBias):
      bias = var.get_value()
      n = bias.size // bias.shape[-1]
      counts = tokens_per_expert_LE[row : row + n].reshape(bias.shape)
      var = var.replace(update_expert_bias(bias, counts, rate))
      row += n
    updated.append((path, var))
  return nnx.from_flat_state(updated)
