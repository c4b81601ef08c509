"""One attention function, several implementations (`model.attention.impl`).

    attend(q, k, v, mask=..., bias=...) = softmax(q·kᵀ·scale + bias) v        (Vaswani et al. 2017, eq. 1)

Shapes: q [B, T, N, H], k/v [B, S, K, H] with N a multiple of K. Grouped-query attention (GQA, MQA when
K = 1) works by viewing the N query heads as K groups of N/K heads that share one K/V head; K and V
are never repeated in memory.

Implementations (`ATTENTION_IMPLS`): 'xla' materializes the scores (the reference); 'blockwise' is
FlashAttention's online softmax in plain JAX (mllm/ops/blockwise.py, O(N) memory, any backend);
'pallas' is mllm's flash-attention kernel for the backend (pallas_kernels/flash_attention.py,
Triton; flash_attention_tpu.py on a TPU), 'pallas_tpu' the TPU one on any backend (interpreted off
a TPU), 'pallas_mgpu' the Mosaic GPU (Hopper) one (flash_attention_mgpu.py; interpreted off a GPU);
'cudnn' is cuDNN's fused kernel (GPU); 'auto' picks one per call (`choose_impl`).

What an implementation needs to know about the mask and the positional terms comes in small
objects, so the tiled implementations skip whole blocks and compute ALiBi in-kernel instead of
reading an [N, T, S] tensor:
  - `AttentionMask`: causal, sliding window, segment ids (packed documents), query offset.
  - `ScoreBias`: ALiBi slopes with positions, and/or a dense learned bias (T5, Shaw's key term).
  - `RelativeValues`: Shaw's value term, Σ_j p_ij · a^V[index_ij], added to the output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from mllm.ops import mesh as on_mesh
from mllm.ops.blockwise import blockwise_attention
from pallas_kernels.block_ranges import MASK_VALUE, visible


@struct.dataclass
class AttentionMask:
  """Which (query, key) pairs may attend. Indices, not positions, define order.

  causal: key index j ≤ query index i. window: additionally i − j < window (the `window` most recent
  keys, the query itself included; Mistral's sliding window). Segment ids: only equal ids attend.
  q_offset: index of query 0 in the key sequence; None means S − T, i.e. the queries are the last T
  keys (bottom-right alignment, as in chunked prefill and decoding).
  q_positions / kv_positions (decoding with a KV cache): order by these per-sequence positions
  instead of by index, and a key at a negative position is an empty cache slot (never attended).
  'xla' and 'blockwise' read them, 'cudnn' as a dense mask; see `attend` for the others.
  """

  causal: bool = struct.field(pytree_node=False, default=True)
  window: int | None = struct.field(pytree_node=False, default=None)
  q_segment_ids: jax.Array | None = None  # [B, T]
  kv_segment_ids: jax.Array | None = None  # [B, S]
  q_offset: jax.Array | int | None = None  # scalar or [B]
  q_positions: jax.Array | None = None  # [B, T]
  kv_positions: jax.Array | None = None  # [B, S]

  def offset(self, q_len: int, kv_len: int):
    """Key index of query 0: q_offset, or kv_len − q_len (bottom-right) when it is None."""
    return kv_len - q_len if self.q_offset is None else self.q_offset

  def static_offset(self, q_len: int, kv_len: int, impl: str) -> int:
    """The offset as a Python int, for implementations that decide block skipping at trace time."""
    try:
      return int(self.offset(q_len, kv_len))
    except (TypeError, jax.errors.ConcretizationTypeError):
      raise ValueError(
        f"attention impl={impl!r} needs a static q_offset (a Python int or None); "
        "got a traced array: use impl='xla' for per-example offsets"
      ) from None

  def allowed(self, q_len: int, kv_len: int) -> jax.Array:
    """Boolean [B or 1, 1, T, S]: True where query i may attend key j."""
    if self.kv_positions is not None:
      distance = self.q_positions[:, :, None] - self.kv_positions[:, None, :]  # [B, T, S]
      ok = visible(distance, causal=self.causal, window=self.window)
      ok &= (self.kv_positions >= 0)[:, None, :]
      return ok[:, None]
    offset = self.offset(q_len, kv_len)
    q_idx = jnp.reshape(jnp.asarray(offset), (-1, 1)) + jnp.arange(q_len)  # [B|1, T]
    k_idx = jnp.arange(kv_len)
    distance = q_idx[:, :, None] - k_idx[None, None, :]  # [B|1, T, S], i − j
    ok = visible(distance, causal=self.causal, window=self.window)
    if self.q_segment_ids is not None:
      ok &= self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :]
    return ok[:, None]


@struct.dataclass
class ScoreBias:
  """Additive terms on the scaled attention logits, from a positional scheme.

  alibi_slopes [N] with q_positions [B, T] and kv_positions [B, S] add m_h·(pos_k − pos_q)
  (Press et al. 2022, sec. 3), which a kernel can compute on the fly. dense [B|1, N|1, T, S] is a
  learned bias (T5, Shaw's key term): autodiff gives its gradient through 'xla'.
  """

  alibi_slopes: jax.Array | None = None
  q_positions: jax.Array | None = None
  kv_positions: jax.Array | None = None
  dense: jax.Array | None = None

  def materialize(self) -> jax.Array:
    """The whole bias as one [B|1, N|1, T, S] float32 array."""
    total = 0.0
    if self.alibi_slopes is not None:
      rel_BTS = (self.kv_positions[:, None, :] - self.q_positions[:, :, None]).astype(jnp.float32)
      total = total + self.alibi_slopes.astype(jnp.float32)[None, :, None, None] * rel_BTS[:, None]
    if self.dense is not None:
      total = total + self.dense.astype(jnp.float32)
    return jnp.asarray(total)


@struct.dataclass
class RelativeValues:
  """Shaw et al. (2018) eq. 3: out_i += Σ_j p_ij · table[index_ij]. table [R, H], index [B|1, T, S]."""

  table: jax.Array
  index: jax.Array


def _split_heads_bias(bias_BNTS: jax.Array, n_kv: int) -> jax.Array:
  """[B|1, N|1, T, S] → [B|1, K|1, G|1, T, S] to line up with grouped logits."""
  b, n, t, s = bias_BNTS.shape
  if n == 1:
    return bias_BNTS[:, :, None]
  return bias_BNTS.reshape(b, n_kv, n // n_kv, t, s)


def xla_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None,
  rel_values: RelativeValues | None,
  scale: float,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """The reference: materializes the [B, N, T, S] scores and lets XLA fuse what it can.
  (`block_q`/`block_k` are for the tiled implementations; this one has no blocks.)

  Without bias, relative values or dropout (RoPE, NoPE, learned/sinusoidal positions) and with
  more than one query it takes `_plain_attention`, the same math with a hand-written backward.
  """
  del block_q, block_k
  # One query row (a decode step) takes the einsums below: _plain_attention's heads-first layout
  # would copy the whole KV cache into it at every step (2.2x slower at batch 8, 1,024 keys).
  if (
    bias is None
    and rel_values is None
    and not (dropout_rate > 0.0 and dropout_rng is not None)
    and q_BTNH.shape[1] > 1
  ):
    allowed_BTS = mask.allowed(q_BTNH.shape[1], k_BSKH.shape[1])[:, 0]
    return _plain_attention(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale)
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  logits_BKGTS = (
    jnp.einsum('btkgh,bskh->bkgts', q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
  )
  if bias is not None:
    logits_BKGTS = logits_BKGTS + _split_heads_bias(bias.materialize(), K)
  allowed = mask.allowed(T, S)[:, :, None]  # [B|1, 1, 1, T, S]
  logits_BKGTS = jnp.where(allowed, logits_BKGTS, MASK_VALUE)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
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
    n_rel = rel_values.table.shape[0]
    onehot_BTSR = jax.nn.one_hot(rel_values.index, n_rel, dtype=jnp.float32)
    weights_BKGTR = jnp.einsum('bkgts,btsr->bkgtr', probs_BKGTS, onehot_BTSR)
    out_BTKGH = out_BTKGH + jnp.einsum(
      'bkgtr,rh->btkgh', weights_BKGTR, rel_values.table.astype(jnp.float32)
    )
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


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


def _plain_probs(q_BKMH, k_BKSH, ok_BKMS, scale, lse_BKM=None):
  """Masked softmax probabilities [B, K, M, S] and their log-sum-exp [B, K, M] (float32)."""
  logits = (
    jnp.matmul(q_BKMH, jnp.swapaxes(k_BKSH, -1, -2), preferred_element_type=jnp.float32) * scale
  )
  logits = jnp.where(ok_BKMS, logits, MASK_VALUE)
  if lse_BKM is None:
    peak = jnp.max(logits, axis=-1)
    lse_BKM = peak + jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))
  probs = jnp.exp(logits - lse_BKM[..., None])
  # A query with no visible key (e.g. padding) gets a zero output, never an average of masked values.
  return jnp.where(jnp.any(ok_BKMS, axis=-1, keepdims=True), probs, 0.0), lse_BKM


def _plain_forward(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale):
  T, N, K = q_BTNH.shape[1], q_BTNH.shape[2], k_BSKH.shape[2]
  q, k, v = _heads_first(q_BTNH, K), _heads_first(k_BSKH, K), _heads_first(v_BSKH, K)
  probs, lse = _plain_probs(q, k, _rows_allowed(allowed_BTS, N // K), scale)
  out_BKMH = jnp.matmul(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return _heads_last(out_BKMH, T).astype(q_BTNH.dtype), (q, k, v, out_BKMH, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _plain_attention(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale):
  return _plain_forward(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale)[0]


def _plain_fwd(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale):
  out, (q, k, v, out_BKMH, lse) = _plain_forward(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale)
  return out, (q, k, v, allowed_BTS, out_BKMH, lse)


def _plain_bwd(scale, residuals, d_out_BTNH):
  q, k, v, allowed_BTS, out_BKMH, lse = residuals  # q [B, K, M, H], M = T·G; k, v [B, K, S, H]
  T, K = allowed_BTS.shape[1], k.shape[1]
  dtype = q.dtype  # matmul operands keep the compute dtype; accumulation is float32
  do = _heads_first(d_out_BTNH, K)
  delta = jnp.sum(do.astype(jnp.float32) * out_BKMH, axis=-1)  # rowsum(dO ⊙ O), [B, K, M]
  ok = _rows_allowed(allowed_BTS, q.shape[2] // T)
  # dQ = scale · dS·K with dS = P ⊙ (dO·Vᵀ − delta), all [B, K, M, S].
  probs, _ = _plain_probs(q, k, ok, scale, lse)
  dp = jnp.matmul(do, jnp.swapaxes(v, -1, -2), preferred_element_type=jnp.float32)
  ds = (probs * (dp - delta[..., None])).astype(dtype)
  dq = jnp.matmul(ds, k, preferred_element_type=jnp.float32) * scale
  # dK = scale · dSᵀ·Q and dV = Pᵀ·dO from the transposed scores, recomputed: [B, K, S, M].
  logits_t = jnp.matmul(k, jnp.swapaxes(q, -1, -2), preferred_element_type=jnp.float32) * scale
  ok_t = jnp.swapaxes(ok, -1, -2)
  probs_t = jnp.exp(jnp.where(ok_t, logits_t, MASK_VALUE) - lse[:, :, None, :])
  probs_t = jnp.where(jnp.any(ok_t, axis=-2, keepdims=True), probs_t, 0.0)
  dp_t = jnp.matmul(v, jnp.swapaxes(do, -1, -2), preferred_element_type=jnp.float32)
  ds_t = (probs_t * (dp_t - delta[:, :, None, :])).astype(dtype)
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


def refuse_biases(impl: str, bias, rel_values, dropout: bool, alibi: bool = False) -> None:
  """A kernel's refusal of what it cannot compute: learned biases, dropout (and ALiBi if asked)."""
  if rel_values is not None or (bias is not None and bias.dense is not None):
    raise ValueError(
      f"attention impl={impl!r} takes {'no' if alibi else 'only ALiBi as a'} score "
      "bias; learned biases (T5, Shaw) need impl='xla' or 'blockwise', where "
      'autodiff gives their gradients'
    )
  if alibi and bias is not None and bias.alibi_slopes is not None:
    raise ValueError(
      f"attention impl={impl!r} has no additive bias, so no ALiBi; use impl="
      "'pallas' (ALiBi in-kernel) or 'blockwise'"
    )
  if dropout:
    raise ValueError(
      f"attention impl={impl!r} has no attention dropout; use impl='xla' or "
      "'blockwise', or set model.attention.dropout=0"
    )


def pallas_kernel(impl: str, backend: str | None = None) -> str:
  """Which of mllm's Pallas kernels an impl runs: 'pallas' the one for this backend (Mosaic TPU
  on a TPU, else Triton, interpreted on CPU); 'pallas_tpu' the TPU one and 'pallas_mgpu' the
  Mosaic GPU one anywhere."""
  if impl in ('pallas_tpu', 'pallas_mgpu'):
    return impl[len('pallas_') :]
  return 'tpu' if (backend or on_mesh.backend()) == 'tpu' else 'triton'


def pallas_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None,
  rel_values: RelativeValues | None,
  scale: float,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  block_q: int | None = None,
  block_k: int | None = None,
  impl: str = 'pallas',
) -> jax.Array:
  """mllm's Pallas flash-attention kernel: pallas_kernels/flash_attention.py (Triton; interpreted
  on CPU), flash_attention_tpu.py (Mosaic TPU; interpreted off a TPU) or flash_attention_mgpu.py
  (Mosaic GPU; interpreted off a GPU), by `pallas_kernel`."""
  # Importing Pallas is deferred until a kernel runs.
  kernel = pallas_kernel(impl)
  # Interpreted off the kernel's hardware, judged by the devices the code is traced for.
  interpret = on_mesh.backend() != ('tpu' if kernel == 'tpu' else 'gpu')
  if kernel == 'tpu':
    from pallas_kernels.flash_attention_tpu import flash_attention
  elif kernel == 'mgpu':
    from pallas_kernels.flash_attention_mgpu import flash_attention
  else:
    from pallas_kernels.flash_attention import flash_attention
  refuse_biases(impl, bias, rel_values, dropout_rate > 0.0 and dropout_rng is not None)
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  alibi = bias is not None and bias.alibi_slopes is not None
  return flash_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    scale=scale,
    causal=mask.causal,
    window=mask.window,
    q_offset=mask.static_offset(T, S, impl),
    q_segment_ids=mask.q_segment_ids,
    kv_segment_ids=mask.kv_segment_ids,
    alibi_slopes=bias.alibi_slopes if alibi else None,
    q_positions=bias.q_positions if alibi else None,
    kv_positions=bias.kv_positions if alibi else None,
    block_q=block_q,
    block_k=block_k,
    interpret=interpret,
  )


def cudnn_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None,
  rel_values: RelativeValues | None,
  scale: float,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  block_q: int | None = None,
  block_k: int | None = None,
  implementation: str = 'cudnn',
) -> jax.Array:
  """cuDNN's fused flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16).

  cuDNN's own causal mask is top-left aligned and its window is causal-only, so those go to cuDNN
  as flags only when the queries and keys line up (q_offset 0, T = S); every other mask (segment
  ids, bottom-right alignment, two-sided windows) and ALiBi reach it as dense [B, 1, T, S] arrays,
  which cost O(T·S) memory. `implementation='xla'` runs the same translation on any backend,
  which is how the tests check it on CPU.
  """
  del block_q, block_k
  refuse_biases('cudnn', bias, rel_values, dropout_rate > 0.0 and dropout_rng is not None)
  if implementation == 'cudnn' and q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(
      f'attention impl=cudnn needs bfloat16 or float16 inputs, got {q_BTNH.dtype}; '
      "set model.dtype='bfloat16' or use impl='blockwise'"
    )
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  aligned = mask.static_offset(T, S, 'cudnn') == 0 and T == S
  plain = aligned and mask.q_segment_ids is None and (mask.window is None or mask.causal)
  dense_bias = None
  if bias is not None:  # cuDNN reads the bias in the input dtype: bf16 rounds large ALiBi terms
    dense_bias = bias.materialize()
    dense_bias = dense_bias.astype(q_BTNH.dtype) if implementation == 'cudnn' else dense_bias
  if plain:
    window = None if mask.window is None else (mask.window - 1, 0)
    return jax.nn.dot_product_attention(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      bias=dense_bias,
      scale=scale,
      is_causal=mask.causal,
      local_window_size=window,
      implementation=implementation,
    )
  allowed = mask.allowed(T, S)  # [B|1, 1, T, S]
  out = jax.nn.dot_product_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    bias=dense_bias,
    mask=allowed,
    scale=scale,
    implementation=implementation,
  )
  # A query that sees no key gets zeros here too (dot_product_attention would average).
  return jnp.where(jnp.any(allowed, axis=-1)[:, 0, :, None, None], out, 0).astype(q_BTNH.dtype)


# 'auto': from this many keys on, 'blockwise' replaces 'xla' (benchmarks/results/attention-cpu.md:
# on CPU, causal forward+backward, blockwise takes 0.73x xla's time at 512 keys and 0.53x at 8192,
# and its memory stays O(N)); below it the dense scores are small and 'xla' is as fast.
BLOCKWISE_FROM = 512


def choose_impl(
  q_BTNH,
  k_BSKH,
  *,
  bias: ScoreBias | None,
  rel_values: RelativeValues | None,
  dropout: bool,
  backend: str | None = None,
) -> str:
  """What 'auto' runs: the fastest implementation that supports the call on this backend.

  GPU, bf16/fp16, no learned terms and no ALiBi: cuDNN (the fastest fused kernel on H100 in the
  FA3 paper; it would round an ALiBi bias to bf16). TPU, no learned terms: JAX's splash kernel,
  or mllm's TPU kernel ('pallas') with ALiBi, which splash cannot add. Otherwise 'xla' below
  BLOCKWISE_FROM keys and 'blockwise' from there. mllm's GPU kernels are not picked until they
  have been measured on a GPU.
  """
  backend = backend or on_mesh.backend()
  learned = rel_values is not None or dropout or (bias is not None and bias.dense is not None)
  alibi = bias is not None and bias.alibi_slopes is not None
  if backend == 'gpu' and not learned and not alibi and q_BTNH.dtype in (jnp.bfloat16, jnp.float16):
    return 'cudnn'
  if backend == 'tpu' and not learned:
    return 'pallas' if alibi else 'splash'
  return 'xla' if k_BSKH.shape[1] < BLOCKWISE_FROM else 'blockwise'


def auto_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
  dropout = kwargs.get('dropout_rate', 0.0) > 0.0 and kwargs.get('dropout_rng') is not None
  impl = choose_impl(
    q_BTNH, k_BSKH, bias=kwargs.get('bias'), rel_values=kwargs.get('rel_values'), dropout=dropout
  )
  return run_impl(impl, q_BTNH, k_BSKH, v_BSKH, **kwargs)


def run_impl(impl: str, q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
  """ATTENTION_IMPLS[impl](...), a kernel impl run on each device's shard of the batch and heads
  when the mesh in context has several devices (mllm/ops/mesh.py: XLA cannot split a kernel)."""
  if impl not in KERNEL_IMPLS:
    return ATTENTION_IMPLS[impl](q_BTNH, k_BSKH, v_BSKH, **kwargs)
  mask, bias = kwargs.pop('mask'), kwargs.pop('bias')
  B = q_BTNH.shape[0]
  b, h = on_mesh.split_axes(B, (q_BTNH.shape[2], k_BSKH.shape[2]))

  def rows(x):  # [B, ...] split by row, or shared
    return on_mesh.P(b if x.ndim and x.shape[0] == B else None)

  # A Python-int offset stays static (the kernels skip blocks with it); arrays are split by row.
  static_offset = None if isinstance(mask.q_offset, jax.Array) else mask.q_offset
  mask = mask.replace(q_offset=None) if static_offset is not None else mask
  mask_specs = jax.tree.map(rows, mask)
  bias_specs = (
    None
    if bias is None
    else jax.tree.map(rows, bias).replace(
      alibi_slopes=None if bias.alibi_slopes is None else on_mesh.P(h)
    )
  )
  heads = on_mesh.P(b, None, h, None)

  def kernel(q, k, v, mask, bias):
    if static_offset is not None:
      mask = mask.replace(q_offset=static_offset)
    return ATTENTION_IMPLS[impl](q, k, v, mask=mask, bias=bias, **kwargs)

  return on_mesh.per_shard(
    kernel,
    (q_BTNH, k_BSKH, v_BSKH, mask, bias),
    (heads, heads, heads, mask_specs, bias_specs),
    heads,
  )


def splash_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
  """JAX's splash kernel (TPU; interpreted elsewhere) behind this contract: mllm/ops/splash.py."""
  from mllm.ops.splash import splash_attention as run  # deferred: imports Pallas

  return run(q_BTNH, k_BSKH, v_BSKH, **kwargs)


PALLAS_IMPLS = ('pallas', 'pallas_tpu', 'pallas_mgpu')  # mllm's own: index-ordered masks, ALiBi
INDEX_ORDERED_IMPLS = (*PALLAS_IMPLS, 'splash')  # masks by index: a KV cache's chunk goes blockwise
KERNEL_IMPLS = (*PALLAS_IMPLS, 'splash')  # opaque custom calls: run per shard on a mesh

# name → implementation.
ATTENTION_IMPLS: dict[str, Callable[..., jax.Array]] = {
  'xla': xla_attention,
  'blockwise': blockwise_attention,
  'pallas': pallas_attention,
  'pallas_tpu': functools.partial(pallas_attention, impl='pallas_tpu'),
  'pallas_mgpu': functools.partial(pallas_attention, impl='pallas_mgpu'),
  'splash': splash_attention,
  'cudnn': cudnn_attention,
  'auto': auto_attention,
}


def cached_impl(impl: str, q_len: int) -> str:
  """The implementation that runs a pass with a KV cache (a mask ordered by positions).

  A decode step (one query) always runs 'xla': its scores are one [B, N, 1, S] row, O(S) memory
  like any kernel's, and a tiled kernel would only add loop overhead. A prefill chunk runs the
  configured implementation: 'xla' and 'blockwise' read the positions (blockwise tiles the chunk,
  so a long chunk never holds T x S scores), 'cudnn' gets them as a dense [B, 1, T, S] mask, and
  'pallas', 'pallas_tpu' and 'splash', whose kernels mask by index only, hand the chunk to
  'blockwise', the same algorithm.
  """
  if q_len == 1:
    return 'xla'
  return 'blockwise' if impl in INDEX_ORDERED_IMPLS else impl


def attend(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None = None,
  rel_values: RelativeValues | None = None,
  scale: float | None = None,
  impl: str = 'xla',
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """softmax(q·kᵀ·scale + bias)·v (+ Shaw's value term), by the implementation named `impl`."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention impl={impl!r}; allowed: {', '.join(sorted(ATTENTION_IMPLS))}")
  n_heads, n_kv = q_BTNH.shape[2], k_BSKH.shape[2]
  if n_heads % n_kv:
    raise ValueError(f'query heads ({n_heads}) must be a multiple of key/value heads ({n_kv})')
  if scale is None:
    scale = q_BTNH.shape[-1] ** -0.5
  if mask.kv_positions is not None:
    impl = cached_impl(impl, q_BTNH.shape[1])
  return run_impl(
    impl,
    q_BTNH,
    k_BSKH,
    v_BSKH,
    mask=mask,
    bias=bias,
    rel_values=rel_values,
    scale=scale,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
    block_q=block_q,
    block_k=block_k,
  )
