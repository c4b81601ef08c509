"""MoE routing (mllm/layers/moe.py puts it together): router probabilities (softmax, or sigmoid as
DeepSeek-V3), top-k choice, the Switch balancing loss and ST-MoE's router z-loss, router noise in
training, DeepSeek-V3's aux-loss-free expert bias, and load statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

NOISES = ('none', 'mixture', 'noisy_topk')
BALANCE_CONVENTIONS = ('switch', 'hf')


class ExpertBias(nnx.Variable):
  """DeepSeek-V3's per-expert routing bias: not a Param, so no optimizer or gradient touches it;
  `update_expert_bias` moves it after each step. Saved with the model's state."""


# ---------------------------------------------------------------------------------------------
# Routing.
# ---------------------------------------------------------------------------------------------


# name → per-expert scores from the router's logits (`model.ffn.moe.router`): softmax over experts
# (they sum to 1), or independent sigmoids (DeepSeek-V3, whose gates are then normalised over
# the chosen k).
ROUTERS = {
  'softmax': lambda logits_TE: jax.nn.softmax(logits_TE, axis=-1),
  'sigmoid': jax.nn.sigmoid,
}


def router_probs(logits_TE: jax.Array, kind: str = 'softmax') -> jax.Array:
  """The `kind` router's per-expert scores, in float32."""
  if kind not in ROUTERS:
    raise ValueError(f'unknown router {kind!r}; allowed: {", ".join(ROUTERS)}')
  return ROUTERS[kind](logits_TE.astype(jnp.float32))


def top_k(
  probs_TE: jax.Array,
  k: int,
  *,
  renormalize: bool,
  selection_bias_E: jax.Array | None = None,
  groups: int = 1,
  top_groups: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(gates [T, k], experts [T, k]): the k best experts per token, best first.

  selection_bias_E shifts the choice but not the gates (DeepSeek-V3's aux-loss-free balancing).
  Group-limited routing (DeepSeek-V3, sec. 2.1.2's node-limited routing, as its code and
  transformers compute it): the E experts in `groups` equal groups, each scored by the sum of its
  two best (biased) scores; a token chooses its k among the `top_groups` best groups only.
  """
  scores = probs_TE if selection_bias_E is None else probs_TE + selection_bias_E
  if top_groups is not None and top_groups < groups:
    T, E = scores.shape
    best_two_TG = jax.lax.top_k(scores.reshape(T, groups, E // groups), 2)[0].sum(-1)
    _, chosen_Tg = jax.lax.top_k(best_two_TG, top_groups)
    kept_TG = jnp.any(jax.nn.one_hot(chosen_Tg, groups, dtype=jnp.bool_), axis=1)
    scores = jnp.where(jnp.repeat(kept_TG, E // groups, axis=1), scores, -jnp.inf)
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
  """A noisy router that mixes in uniform noise: p = (1 − α)·p + α·ε, with ε uniform on the probability simplex
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
