"""The fused kernels behind `attend`'s contract: mllm's Pallas flash attention ('pallas',
'pallas_tpu', 'pallas_mgpu'), JAX's splash kernel ('splash', mllm/ops/splash.py) and cuDNN's
('cudnn', through `jax.nn.dot_product_attention`). The terms each cannot compute are refused before
it runs, from its record (`AttentionImpl.lacks`, mllm/ops/attention.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mllm.ops import mesh as on_mesh
from mllm.ops import splash
from mllm.ops.masks import AttentionMask, RelativeValues, ScoreBias


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
  softcap: float | None = None,
  sinks=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  block_q: int | None = None,
  block_k: int | None = None,
  impl: str = 'pallas',
) -> jax.Array:
  """mllm's Pallas flash-attention kernel: pallas_kernels/flash_attention_triton.py (Triton; interpreted
  on CPU), flash_attention_tpu.py (Mosaic TPU; interpreted off a TPU) or flash_attention_mgpu.py
  (Mosaic GPU; interpreted off a GPU), by `pallas_kernel`."""
  del rel_values, dropout_rate, dropout_rng  # refused before the call (AttentionImpl.lacks)
  # Importing Pallas is deferred until a kernel runs.
  kernel = pallas_kernel(impl)
  # Interpreted off the kernel's hardware, judged by the devices the code is traced for.
  interpret = on_mesh.backend() != ('tpu' if kernel == 'tpu' else 'gpu')
  if kernel == 'tpu':
    from pallas_kernels.flash_attention_tpu import flash_attention
  elif kernel == 'mgpu':
    from pallas_kernels.flash_attention_mgpu import flash_attention
  else:
    from pallas_kernels.flash_attention_triton import flash_attention
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  alibi = bias is not None and bias.alibi_slopes is not None
  out = flash_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    scale=scale,
    softcap=softcap,
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
    return_lse=sinks is not None,
  )
  if sinks is None:
    return out
  return with_sinks(*out, sinks)


def with_sinks(out_BTNH, lse_BNT, sinks_N) -> jax.Array:
  """Attention with a sink logit s per head from attention without: a sink adds e^s to each row's
  normalizer Z = e^lse, so every probability, and the output, scales by Z / (Z + e^s) =
  σ(lse − s). A row that saw no key (output 0) stays 0. Differentiable through the kernel's lse."""
  keep_BNT = jax.nn.sigmoid(lse_BNT - sinks_N.astype(jnp.float32)[None, :, None])
  return (out_BTNH * keep_BNT.transpose(0, 2, 1)[..., None]).astype(out_BTNH.dtype)


def cudnn_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None,
  rel_values: RelativeValues | None,
  scale: float,
  softcap: float | None = None,
  sinks=None,
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
  del rel_values, sinks, dropout_rate, dropout_rng, softcap  # refused before the call (its record)
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  plain = cudnn_takes_mask(mask, T, S)
  dense_bias = _cudnn_bias(bias, q_BTNH.dtype, implementation)
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


def cudnn_takes_mask(mask: AttentionMask, q_len: int, kv_len: int) -> bool:
  """Whether cuDNN takes the mask as its own flags (no [B, 1, T, S] array): no mask, or a causal
  mask (with a causal window) whose queries and keys line up (cuDNN aligns them top-left)."""
  if mask.q_segment_ids is not None or mask.kv_positions is not None:
    return False
  if not mask.causal and mask.window is None:
    return True
  aligned = q_len == kv_len and mask.static_offset(q_len, kv_len, 'cudnn') == 0
  return aligned and mask.causal


def _cudnn_bias(bias: ScoreBias | None, dtype, implementation: str):
  """The dense [B|1, N|1, T, S] score bias dot_product_attention takes, or None."""
  if bias is None:
    return None
  dense = bias.materialize()
  # cuDNN reads the bias in the input dtype: bf16 rounds large ALiBi terms.
  return dense.astype(dtype) if implementation == 'cudnn' else dense


def splash_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
  """JAX's splash kernel (TPU; interpreted elsewhere) behind this contract: mllm/ops/splash.py."""
  return splash.splash_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs)


# --- What each kernel accepts: block sizes and backends (read through mllm/ops/attention.py's
# records by config validation, before anything is built). Each returns None, or why not.


def triton_tiles(key: str, value: int) -> str | None:
  if value < 16 or value & (value - 1):
    return (
      'the Pallas kernel (Triton) needs a power of two >= 16; allowed: 16, 32, 64, 128, 256, '
      'or None for its default'
    )
  return None


def tpu_tiles(key: str, value: int) -> str | None:
  multiple = {'block_q': 8, 'block_k': 128}[key]  # TPU sublanes (queries), lanes (keys)
  if value % multiple:
    return (
      f'the TPU kernel tiles {key[-1]} in multiples of {multiple}; allowed: {multiple}, '
      f'{2 * multiple}, ..., or None for its default'
    )
  return None


def mgpu_tiles(key: str, value: int) -> str | None:
  if value != 64 if key == 'block_q' else value % 64:
    return (
      'the Mosaic GPU kernel gives each warpgroup 64 query rows and streams keys in multiples '
      'of 64; allowed: block_q 64, block_k 64, 128, 192, ..., or None for their defaults'
    )
  return None


def triton_head_dim(head_dim: int) -> str | None:
  """Why the Triton kernel is not run at this head dim: it pads to a power of two, and its tiles
  (pallas_kernels/flash_attention_triton.py default_tiling) are sized up to 256."""
  if head_dim > 256:
    return f'the Triton kernel pads head_dim to a power of two up to 256, got {head_dim}'
  return None


# The largest head_dim the Mosaic GPU kernel was measured to fit in Hopper's 227 KiB of shared
# memory at its default tiles (block_k 64, 3 ring slots: run at D 128 on an H100,
# benchmarks/results/gpu-h100.md, where block_k 128 with 3 slots was already 112 bytes over).
# Larger heads go to the Triton kernel. Hp is head_dim rounded up to 64.
MGPU_MAX_HEAD_DIM = 128


def mgpu_head_dim(head_dim: int) -> str | None:
  if head_dim > MGPU_MAX_HEAD_DIM:
    return (
      f'the Mosaic GPU kernel at its default tiles fits shared memory up to head_dim '
      f'{MGPU_MAX_HEAD_DIM}, got {head_dim}'
    )
  return None


def splash_backends(backend: str) -> str | None:
  if backend == 'gpu':
    return (
      'splash is a TPU kernel (off a TPU it only interprets, for tests); allowed on gpu: '
      "'xla', 'blockwise', 'pallas', 'cudnn', 'auto'"
    )
  return None


def mgpu_backends(backend: str) -> str | None:
  if backend == 'tpu':
    return (
      'the Mosaic GPU kernel is for Hopper GPUs (off a GPU it only interprets, for tests); '
      "allowed on tpu: 'xla', 'blockwise', 'pallas', 'pallas_tpu', 'splash', 'auto'"
    )
  return None


def cudnn_backends(backend: str) -> str | None:
  if backend != 'gpu':
    return (
      f"cuDNN needs a GPU, this machine's JAX backend is {backend!r}; allowed here: 'xla', "
      "'blockwise', 'pallas', 'auto'"
    )
  return None
