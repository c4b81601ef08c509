"""Mixture of Experts: a router sends each token to k of E expert FFNs.

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
training (a mixture with uniform noise, or Shazeer's noisy top-k; drawn from the 'dropout' RNG stream, so
a resumed run draws the same noise), and DeepSeek-V3's aux-loss-free bias (an `ExpertBias`
variable that shifts the choice only; `update_expert_bias` is applied after each step).

`model.ffn.kind='moe'` is this layer, an FFN kind like the dense ones (registered in FFNS), with
its own section `model.ffn.moe` (moe_settings.py); experts and the model's dense layers are FFNs
of the kind `model.ffn.moe.expert.kind` chooses, with that FFN's own settings. Its Hugging Face
mapping (Mixtral, Qwen3-MoE) is moe_hf.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers import initializers
from mllm.layers.ffn import FFNS, hidden_dim
from mllm.layers.moe_experts import (
  DISPATCHES,
  Experts,
  capacity,
  capacity_dispatch,
  dropless_dispatch,
  resolve_dispatch,
)
from mllm.layers.moe_routing import (
  NOISES,
  ROUTERS,
  ExpertBias,
  load_balancing_loss,
  load_summary,
  mixture_noise,
  noisy_topk_logits,
  router_probs,
  top_k,
  update_expert_bias,
  z_loss,
)
from mllm.layers.moe_settings import MoESettings, check_moe_config, moe_layers
from mllm.layers.parametrization import weight_std
from mllm.ops import mesh as on_mesh
from mllm.variant_config import settings_of

# ---------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------


def _check_choices(num_experts: int, top_k: int, router: str, dispatch: str, noise: str) -> None:
  """ValueError for a layer built by hand with choices no config would pass (validation checks
  the config's)."""
  if not 1 <= top_k <= num_experts:
    raise ValueError(f'top_k={top_k} must be in [1, num_experts={num_experts}]')
  if router not in ROUTERS or dispatch not in DISPATCHES or noise not in NOISES:
    raise ValueError(
      f'router {router!r} / dispatch {dispatch!r} / noise {noise!r}; allowed: '
      f'{tuple(ROUTERS)}, {DISPATCHES}, {NOISES}'
    )


def _router_params(d_model: int, num_experts: int, init_std: float, noise: str, param_dtype, rngs):
  """The router's [d_model, E] matrix, and noisy top-k's noise matrix (else None)."""
  init = initializers.normal(init_std)
  router = nnx.Param(
    init(rngs.params(), (d_model, num_experts), param_dtype), logical_axes=('embed', None)
  )
  # Shazeer et al. initialise the noise matrix to zero: noise of std softplus(0) ≈ 0.69 at first.
  noise_router = (
    nnx.Param(jnp.zeros((d_model, num_experts), param_dtype), logical_axes=('embed', None))
    if noise == 'noisy_topk'
    else None
  )
  return router, noise_router


class MoE(nnx.Module):
  """Router + E routed experts (+ shared experts), in place of an FFN: [B, T, D] → [B, T, D].

  `__call__` returns (y, stats): the routing statistics of this call, which the training step
  turns into the balancing and z losses and the load metrics (an explicit output, not global
  state): tokens_per_expert [E] (assignments), mean_prob [E] (P_i, differentiable), z_loss,
  router_entropy, drop_rate.
  """

  Settings = MoESettings  # its section, model.ffn.moe
  holds_experts = True  # not an expert itself (ffn.DENSE_FFNS)
  hf_activations = ()

  def __init__(
    self,
    d_model: int,
    *,
    num_experts: int,
    top_k: int,
    expert_d_ff: int,
    ffn_kind: str = 'swiglu',
    ffn_settings=None,
    num_shared_experts: int = 0,
    shared_d_ff: int | None = None,
    router: str = 'softmax',
    renormalize: bool = True,
    routed_scale: float = 1.0,
    groups: int = 1,
    top_groups: int | None = None,
    dispatch: str = 'capacity',
    capacity_factor: float = 1.25,
    grouped_matmul: str = 'ragged_dot',
    noise: str = 'none',
    noise_alpha: float = 0.1,
    expert_bias: bool = False,
    router_bias: bool = False,
    use_bias: bool = False,
    force_uniform_routing: bool = False,
    init_std: float = 0.02,
    out_std: float = 0.02,
    shared_out_std: float | None = None,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    _check_choices(num_experts, top_k, router, dispatch, noise)
    self.num_experts, self.k, self.router_kind = num_experts, top_k, router
    self.renormalize, self.dispatch, self.capacity_factor = renormalize, dispatch, capacity_factor
    self.grouped_matmul = grouped_matmul
    self.routed_scale, self.groups, self.top_groups = routed_scale, groups, top_groups
    self.noise, self.noise_alpha = noise, noise_alpha
    self.force_uniform_routing = force_uniform_routing
    self.router, self.noise_router = _router_params(
      d_model, num_experts, init_std, noise, param_dtype, rngs
    )
    self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32)) if expert_bias else None
    # A learned bias on the router's logits (gpt-oss), unlike expert_bias part of the scores.
    self.router_bias = (
      nnx.Param(jnp.zeros((num_experts,), param_dtype), logical_axes=(None,))
      if router_bias
      else None
    )
    # As nnx.Dropout: a 'dropout' stream (the train step reseeds it from (seed, step), so a
    # resumed run draws the same noise) and `deterministic`, which model.eval() sets.
    self.deterministic = False
    self.rngs = rngs['dropout'].fork() if noise != 'none' else None
    experts = functools.partial(
      Experts,
      d_model=d_model,
      ffn_kind=ffn_kind,
      ffn_settings=ffn_settings,
      use_bias=use_bias,
      init_std=init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.experts = experts(num_experts, d_ff=expert_d_ff, out_std=out_std)
    # shared_out_std (None: out_std): the shared down projection's fan-in may differ (shared_d_ff).
    self.shared = (
      experts(
        num_shared_experts,
        d_ff=shared_d_ff or expert_d_ff,
        out_std=out_std if shared_out_std is None else shared_out_std,
      )
      if num_shared_experts
      else None
    )

  @classmethod
  def check(cls, m, p: str) -> None:
    check_moe_config(m, p)

  @classmethod
  def dense_kind(cls, m) -> str:
    """The FFN kind of the model's dense layers (a mixed stack): the experts'."""
    return m.ffn.moe.expert.kind

  @classmethod
  def dense_layer(cls, cfg, *, rngs: nnx.Rngs) -> nnx.Module:
    """A dense layer of a mixed stack: the experts' FFN, with its settings."""
    expert = cfg.ffn.moe.expert
    return FFNS[expert.kind].from_config(cfg, section=expert, rngs=rngs)

  @classmethod
  def from_config(cls, cfg, *, rngs: nnx.Rngs) -> MoE:
    """The layer `model.ffn.moe` describes (cfg: the model config), initialised as `model.init`
    says: the router and the experts' gate and up read d_model features, each down projection its
    expert's hidden size."""
    moe = settings_of(cls, cfg.ffn)
    expert_d_ff = expert_hidden_dim(cfg)
    return cls(
      cfg.d_model,
      num_experts=moe.num_experts,
      top_k=moe.top_k,
      expert_d_ff=expert_d_ff,
      ffn_kind=moe.expert.kind,
      ffn_settings=moe.expert.settings,
      num_shared_experts=moe.num_shared_experts,
      shared_d_ff=moe.shared_d_ff,
      router=moe.router,
      renormalize=moe.renormalize,
      routed_scale=moe.routed_scale,
      groups=moe.groups,
      top_groups=moe.top_groups,
      dispatch=resolve_dispatch(moe.dispatch),
      capacity_factor=moe.capacity_factor,
      grouped_matmul=moe.grouped_matmul,
      noise=moe.noise,
      noise_alpha=moe.noise_alpha,
      expert_bias=moe.expert_bias,
      router_bias=moe.router_bias,
      use_bias=cfg.ffn.use_bias,
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
    if self.router_bias is not None:
      logits_TE = logits_TE + self.router_bias[...].astype(jnp.float32)
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
      gates_Tk, experts_Tk = top_k(
        probs_TE,
        self.k,
        renormalize=renormalize,
        selection_bias_E=bias,
        groups=self.groups,
        top_groups=self.top_groups,
      )
    if self.routed_scale != 1.0:
      gates_Tk = gates_Tk * self.routed_scale
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
  moe = cfg.ffn.moe
  return moe.expert_d_ff or hidden_dim(cfg.ffn, cfg.d_model, kind=moe.expert.kind)


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
      'model.ffn.moe.top_k=1 with model.ffn.moe.renormalize=True makes every gate 1: the router gets '
      'no gradient from the loss, only from the balancing and z losses; Switch gates the '
      'top-1 expert by its probability (model.ffn.moe.renormalize=False)'
    )
  return None


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


# ---------------------------------------------------------------------------------------------
# What the training step asks of the model's MoE layers; the registration as an FFN kind.
# ---------------------------------------------------------------------------------------------


def draws_noise(m) -> bool:
  """Whether the model's MoE layers draw router noise in training (the step then seeds it)."""
  return bool(moe_layers(m)) and m.ffn.moe.noise != 'none'


FFNS['moe'] = MoE
