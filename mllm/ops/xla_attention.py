"""impl='xla', the reference: softmax(softcap(q·kᵀ·scale) + bias)·v with the [B, N, T, S] scores
materialized (Vaswani et al. 2017, eq. 1; the soft cap cap · tanh(x / cap) is Gemma 2's, applied
when `softcap` is set; `sinks` add a valueless term per head to the normalizer, gpt-oss's), and
without bias a hand-written backward that XLA:CPU runs faster than autodiff's (the comment above
`_heads_first`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mllm.ops.masks import AttentionMask, RelativeValues, ScoreBias
from pallas_kernels.block_ranges import MASK_VALUE
from pallas_kernels.tile_math import softcap_slope, softcapped


def _split_heads_bias(bias_BNTS: jax.Array, n_kv: int) -> jax.Array:
  """[B|1, N|1, T, S] → [B|1, K|1, G|1, T, S] to line up with grouped logits."""
  b, n, t, s = bias_BNTS.shape
  if n == 1:
    return bias_BNTS[:, :, None]
  return bias_BNTS.reshape(b, n_kv, n // n_kv, t, s)


def grouped_logits(q_BTNH, k_BSKH, scale: float) -> jax.Array:
  """q·kᵀ·scale as [B, K, G, T, S] float32: the G = N/K query heads of each KV head side by side,
  K and V never repeated."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  logits = jnp.einsum('btkgh,bskh->bkgts', q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  return logits * scale


def max_logit(q_BTNH, k_BSKH, mask: AttentionMask, scale: float) -> jax.Array:
  """The largest q·kᵀ·scale over the pairs `mask` allows, before any soft cap or bias: the
  measure of attention-logit growth (Wortsman et al. 2023, Fig. 1-2). A float32 scalar; it
  materializes the [B, N, T, S] logits, so the evaluation step alone computes it."""
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  allowed = mask.allowed(T, S)[:, :, None]  # [B|1, 1, 1, T, S]
  return jnp.max(jnp.where(allowed, grouped_logits(q_BTNH, k_BSKH, scale), -jnp.inf))


def xla_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None,
  rel_values: RelativeValues | None,
  scale: float,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """The reference: materializes the [B, N, T, S] scores and lets XLA fuse what it can.
  (`block_q`/`block_k` are for the tiled implementations; this one has no blocks.) `sinks` [N]:
  each query head's sink logit, one more term of the softmax's normalizer.

  Without bias, relative values, sinks or dropout (RoPE, NoPE, learned/sinusoidal positions) and
  with more than one query it takes `_plain_attention`, the same math with a hand-written backward.
  """
  del block_q, block_k
  # One query row (a decode step) takes the einsums below: _plain_attention's heads-first layout
  # would copy the whole KV cache into it at every step (2.2x slower at batch 8, 1,024 keys).
  if (
    bias is None
    and rel_values is None
    and sinks is None
    and not (dropout_rate > 0.0 and dropout_rng is not None)
    and q_BTNH.shape[1] > 1
  ):
    allowed_BTS = mask.allowed(q_BTNH.shape[1], k_BSKH.shape[1])[:, 0]
    return _plain_attention(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap)
  B, T, N, _ = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  logits_BKGTS = softcapped(grouped_logits(q_BTNH, k_BSKH, scale), softcap)
  if bias is not None:
    logits_BKGTS = logits_BKGTS + _split_heads_bias(bias.materialize(), K)
  allowed = mask.allowed(T, S)[:, :, None]  # [B|1, 1, 1, T, S]
  logits_BKGTS = jnp.where(allowed, logits_BKGTS, MASK_VALUE)
  if sinks is None:
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
  else:  # the sink: one more column of the softmax, its probability dropped (it has no value)
    sink_BKGTS = jnp.broadcast_to(
      sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), logits_BKGTS.shape[:-1] + (1,)
    )
    with_sink = jnp.concatenate([logits_BKGTS, sink_BKGTS], axis=-1)
    probs_BKGTS = jax.nn.softmax(with_sink, axis=-1)[..., :S]
  # A query with no visible key (e.g. padding) gets a zero output, never an average of masked values.
  probs_BKGTS = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), probs_BKGTS, 0.0)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BKGTS.shape)
    probs_BKGTS = jnp.where(keep, probs_BKGTS / (1.0 - dropout_rate), 0.0)
  out_BTKGH = jnp.einsum(
    'bkgts,bskh->btkgh',
    probs_BKGTS.astype(v_BSKH.dtype),
    v_BSKH,
    preferred_element_type=jnp.float32,
  )
  if rel_values is not None:
    out_BTKGH = out_BTKGH + _relative_values(probs_BKGTS, rel_values)
  return out_BTKGH.reshape(B, T, N, v_BSKH.shape[-1]).astype(q_BTNH.dtype)


def _relative_values(probs_BKGTS, rel_values: RelativeValues):
  """Shaw et al. 2018, Eq. 3's second term: sum_j p_ij a^V_ij, from the table of R embeddings.

  Each embedding's weight w_ir = sum_j p_ij [index_ij = r] is the adjoint of gathering column
  index_ij of a [.., R] array: a scatter-add, whose own gradient is that gather. As a product
  with a one-hot [B, T, S, R] (B·T matmuls of [N, S]·[S, R]) it took 6x as long on a CPU, the
  cpu preset's Shaw step 1.7x RoPE's (benchmarks/results/train_step-cpu.md)."""
  n_rel = rel_values.table.shape[0]
  index_B11TS = rel_values.index[:, None, None]
  zeros_BKGTR = jnp.zeros((*probs_BKGTS.shape[:-1], n_rel), jnp.float32)
  _, scatter_add = jax.vjp(
    lambda table_BKGTR: jnp.take_along_axis(table_BKGTR, index_B11TS, axis=-1), zeros_BKGTR
  )
  (weights_BKGTR,) = scatter_add(probs_BKGTS.astype(jnp.float32))
  return jnp.einsum('bkgtr,rh->btkgh', weights_BKGTR, rel_values.table.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# softmax(q·kᵀ·scale)·v with a hand-written backward: 'xla' without bias, relative values, dropout.
#
# XLA:CPU runs a dot as a row-major [M, K]·[K, N] (or [M, K]·[N, K]) matmul. Autodiff of the
# einsums in `xla_attention` needs dK = dSᵀ·Q and dV = Pᵀ·dO, and layout assignment then copies
# score-sized tensors ([B, N, T, S]: dS, P) into transposed layouts, or flips the output dots so
# that the forward's probabilities get transposed; those strided copies cost more than the matmuls
# around them. Here every score-sized tensor is produced in the layout its consumers read:
#   - heads are moved in front once, on the small tensors: q → [B, K, T·G, H], k/v → [B, K, S, H]
#     (G = N/K query heads per KV head, so GQA stays a plain batched matmul, K/V never repeated);
#   - the backward recomputes the scores from the saved log-sum-exp in both orientations
#     ([B, K, T·G, S] for dQ, [B, K, S, T·G] for dK and dV) instead of transposing them, as
#     FlashAttention's backward does (Dao et al. 2022, Alg. 4), without the tiling;
#   - the forward saves q, k, v, the output and the log-sum-exp, not the probabilities.
# ---------------------------------------------------------------------------------------------


def _heads_first(x_BTNH, n_kv):
  """[B, T, N, H] → [B, K, T·G, H]: the G query heads of a KV head next to each other per token."""
  B, T, N, H = x_BTNH.shape
  x = x_BTNH.reshape(B, T, n_kv, N // n_kv, H).transpose(0, 2, 1, 3, 4)
  return x.reshape(B, n_kv, T * (N // n_kv), H)


def _heads_last(x_BKMH, T):
  """Inverse of `_heads_first`: [B, K, T·G, H] → [B, T, N, H]."""
  B, K, M, H = x_BKMH.shape
  x = x_BKMH.reshape(B, K, T, M // T, H).transpose(0, 2, 1, 3, 4)
  return x.reshape(B, T, K * (M // T), H)


def _rows_allowed(allowed_BTS, group):
  """[B|1, T, S] → [B|1, 1, T·G, S], each query row repeated for its G heads."""
  b, t, s = allowed_BTS.shape
  return jnp.broadcast_to(allowed_BTS[:, :, None, :], (b, t, group, s)).reshape(b, 1, t * group, s)


def _plain_probs(q_BKMH, k_BKSH, ok_BKMS, scale, softcap, lse_BKM=None):
  """Masked softmax probabilities [B, K, M, S], their log-sum-exp [B, K, M] and the scaled logits
  q·kᵀ·scale before the soft cap (its backward's slope), all float32.

  A query with no visible key (e.g. padding) gets a zero output, never an average of masked
  values: its log-sum-exp is +inf, so exp(logits − lse) is exactly 0 in its row. Guarding the
  row-sized lse, not the score-sized probabilities, spares the backward a separate pass over the
  [B, K, M, S] scores in each orientation (XLA:CPU does not fuse a select after an exp that has two
  consumers); every other row is bitwise what a guard on the probabilities gives."""
  x = jnp.matmul(q_BKMH, jnp.swapaxes(k_BKSH, -1, -2), preferred_element_type=jnp.float32) * scale
  logits = jnp.where(ok_BKMS, softcapped(x, softcap), MASK_VALUE)
  if lse_BKM is None:
    peak = jnp.max(logits, axis=-1)
    lse_BKM = peak + jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))
    lse_BKM = jnp.where(jnp.any(ok_BKMS, axis=-1), lse_BKM, jnp.inf)
  return jnp.exp(logits - lse_BKM[..., None]), lse_BKM, x


def _plain_forward(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap):
  T, N, K = q_BTNH.shape[1], q_BTNH.shape[2], k_BSKH.shape[2]
  q, k, v = _heads_first(q_BTNH, K), _heads_first(k_BSKH, K), _heads_first(v_BSKH, K)
  probs, lse, _ = _plain_probs(q, k, _rows_allowed(allowed_BTS, N // K), scale, softcap)
  out_BKMH = jnp.matmul(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return _heads_last(out_BKMH, T).astype(q_BTNH.dtype), (q, k, v, out_BKMH, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _plain_attention(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap):
  return _plain_forward(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap)[0]


def _plain_fwd(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap):
  out, (q, k, v, out_BKMH, lse) = _plain_forward(
    q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap
  )
  return out, (q, k, v, allowed_BTS, out_BKMH, lse)


def _plain_bwd(scale, softcap, residuals, d_out_BTNH):
  q, k, v, allowed_BTS, out_BKMH, lse = residuals  # q [B, K, M, H], M = T·G; k, v [B, K, S, H]
  T, K = allowed_BTS.shape[1], k.shape[1]
  dtype = q.dtype  # matmul operands keep the compute dtype; accumulation is float32
  do = _heads_first(d_out_BTNH, K)
  delta = jnp.sum(do.astype(jnp.float32) * out_BKMH, axis=-1)  # rowsum(dO ⊙ O), [B, K, M]
  ok = _rows_allowed(allowed_BTS, q.shape[2] // T)
  # dQ = scale · dS·K with dS = P ⊙ (dO·Vᵀ − delta) (⊙ the soft cap's slope), all [B, K, M, S].
  probs, _, x = _plain_probs(q, k, ok, scale, softcap, lse)
  dp = jnp.matmul(do, jnp.swapaxes(v, -1, -2), preferred_element_type=jnp.float32)
  ds = probs * (dp - delta[..., None])
  if softcap is not None:
    ds = ds * softcap_slope(x, softcap)
  ds = ds.astype(dtype)
  dq = jnp.matmul(ds, k, preferred_element_type=jnp.float32) * scale
  # dK = scale · dSᵀ·Q and dV = Pᵀ·dO from the transposed scores, recomputed: [B, K, S, M].
  x_t = jnp.matmul(k, jnp.swapaxes(q, -1, -2), preferred_element_type=jnp.float32) * scale
  ok_t = jnp.swapaxes(ok, -1, -2)
  probs_t = jnp.exp(jnp.where(ok_t, softcapped(x_t, softcap), MASK_VALUE) - lse[:, :, None, :])
  dp_t = jnp.matmul(v, jnp.swapaxes(do, -1, -2), preferred_element_type=jnp.float32)
  ds_t = probs_t * (dp_t - delta[:, :, None, :])
  if softcap is not None:
    ds_t = ds_t * softcap_slope(x_t, softcap)
  ds_t = ds_t.astype(dtype)
  dk = jnp.matmul(ds_t, q, preferred_element_type=jnp.float32) * scale
  dv = jnp.matmul(probs_t.astype(dtype), do, preferred_element_type=jnp.float32)
  S = k.shape[2]
  return (
    _heads_last(dq, T).astype(dtype),
    _heads_last(dk, S).astype(k.dtype),
    _heads_last(dv, S).astype(v.dtype),
    None,
  )


_plain_attention.defvjp(_plain_fwd, _plain_bwd)
