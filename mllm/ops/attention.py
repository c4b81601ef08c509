"""One attention function, several implementations (`model.attention.impl`).

    attend(q, k, v, mask=..., bias=...) = softmax(q·kᵀ·scale + bias) v        (Vaswani et al. 2017, eq. 1)

With `softcap` the scaled logits are soft-capped first, cap · tanh(q·kᵀ·scale / cap) (Gemma 2,
Team et al. 2024), before the bias and the mask. With `sinks` (a logit s_n per query head: gpt-oss,
OpenAI 2025; StreamingLLM's sink, Xiao et al. 2024, learned) the softmax's normalizer gains a term
exp(s_n) that carries no value: P_ij = exp(S_ij) / (exp(s_n) + Σ_j' exp(S_ij')).

Shapes: q [B, T, N, H], k/v [B, S, K, H] with N a multiple of K. Grouped-query attention (GQA, MQA when
K = 1) works by viewing the N query heads as K groups of N/K heads that share one K/V head; K and V
are never repeated in memory.

Implementations (`ATTENTION_IMPLS`): 'xla' materializes the scores (the reference); 'blockwise' is
FlashAttention's online softmax in plain JAX (mllm/ops/blockwise.py, O(N) memory, any backend);
'pallas' is mllm's flash-attention kernel for the backend (pallas_kernels/flash_attention_triton.py,
Triton; flash_attention_tpu.py on a TPU), 'pallas_tpu' the TPU one on any backend (interpreted off
a TPU), 'pallas_mgpu' the Mosaic GPU (Hopper) one (flash_attention_mgpu.py; interpreted off a GPU);
'cudnn' is cuDNN's fused kernel (GPU); 'auto' picks one per call (`choose_impl`).

The mask and bias objects are in mllm/ops/masks.py (re-exported here: they are `attend`'s
arguments), the reference in xla_attention.py, the kernels in kernels.py; this file holds the
registry, 'auto' and `attend`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mllm.ops import kernels, splash
from mllm.ops import mesh as on_mesh
from mllm.ops.blockwise import blockwise_attention
from mllm.ops.cudnn_rules import GpuFacts, cudnn_refusal, is_half, runtime_gpu_facts
from mllm.ops.kernels import cudnn_attention, pallas_attention, pallas_kernel, splash_attention
from mllm.ops.masks import AttentionMask, RelativeValues, ScoreBias
from mllm.ops.xla_attention import xla_attention

__all__ = [
  'ATTENTION_IMPLS',
  'AttentionImpl',
  'AttentionMask',
  'RelativeValues',
  'ScoreBias',
  'attend',
  'cached_impl',
  'choose_impl',
  'choosing_for',
  'pallas_kernel',
]


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
  mask: AttentionMask | None = None,
  gpu: GpuFacts | None = None,
  training: bool = True,
  softcap: bool = False,
  sinks: bool = False,
) -> str:
  """What 'auto' runs: the fastest implementation that supports the call on this backend.

  Learned terms or dropout (their gradients come from autodiff): 'xla' below BLOCKWISE_FROM keys,
  'blockwise' from there, on every backend. TPU: JAX's splash kernel, or mllm's TPU kernel
  ('pallas') with ALiBi, which splash cannot add. CPU: 'xla' / 'blockwise' by the same length.
  GPU (`choose_on_gpu`): cuDNN when it can run the call and takes its mask as flags, else
  mllm's kernels, which take every index mask natively. `mask` defaults to plain causal; `gpu`
  (compute capability, cuDNN version) to the runtime's; `training`: the call is differentiated
  (cuDNN refuses more then; 'auto' cannot tell inside a trace, so it assumes so); `softcap`: the
  logits are soft-capped (cuDNN cannot); `sinks`: learned sink logits (neither cuDNN nor splash).
  """
  backend = backend or on_mesh.backend()
  learned = rel_values is not None or dropout or _dense(bias)
  alibi = bias is not None and bias.alibi_slopes is not None
  by_length = 'xla' if k_BSKH.shape[1] < BLOCKWISE_FROM else 'blockwise'
  if learned:
    return by_length
  if backend == 'tpu':  # splash first; mllm's TPU kernel for what splash's record lacks (ALiBi)
    return next(
      n for n in ('splash', 'pallas') if ATTENTION_IMPLS[n].lacks(alibi=alibi, sinks=sinks) is None
    )
  if backend == 'gpu':
    gpu = runtime_gpu_facts() if gpu is None else gpu
    # cuDNN has neither a soft cap nor sinks.
    no_cudnn = softcap or sinks
    return choose_on_gpu(q_BTNH, k_BSKH, mask or AttentionMask(), alibi, gpu, training, no_cudnn)
  return by_length


def choose_on_gpu(
  q_BTNH, k_BSKH, mask: AttentionMask, alibi: bool, gpu: GpuFacts, training, softcap=False
):
  """'auto' on a GPU, for a call without learned terms. In order:
  1. 'cudnn' (fastest in every cell measured, docs/kernels.md) when cuDNN takes the mask as
     flags (none, or causal / causal window aligned top-left), there is no ALiBi (it would be a
     dense bias, rounded to bf16) nor soft cap and `cudnn_refusal` finds nothing (dtype, head dim, odd
     lengths in training, GPU generation).
  2. 'pallas_mgpu' (Mosaic GPU) on Hopper (9.x) for bf16/fp16 with head_dim <= 128: packed
     documents, bottom-right alignment, two-sided windows and ALiBi in-kernel, O(N) memory.
  3. 'pallas' (Triton) for head_dim <= 256: the same masks, any float dtype, any GPU.
  4. 'blockwise' (O(N) memory), or 'xla' for a mask only it reads: a traced q_offset, or
     positions (a KV cache's prefill chunk) below BLOCKWISE_FROM keys.
  """
  T, S, H = q_BTNH.shape[1], k_BSKH.shape[1], q_BTNH.shape[3]
  by_length = 'xla' if S < BLOCKWISE_FROM else 'blockwise'
  if mask.kv_positions is not None:  # the kernels mask by index only
    return by_length
  try:
    mask.static_offset(T, S, 'auto')
  except ValueError:  # per-example offsets: only 'xla' reads them
    return 'xla'
  dtype = q_BTNH.dtype
  if not alibi and not softcap and kernels.cudnn_takes_mask(mask, T, S):
    why = cudnn_refusal(
      dtype=dtype,
      q_len=T,
      kv_len=S,
      head_dim=H,
      head_dim_v=k_BSKH.shape[3],
      causal=mask.causal,
      window=mask.window,
      training=training,
      gpu=gpu,
    )
    if why is None:
      return 'cudnn'
  if gpu.hopper and is_half(dtype) and kernels.mgpu_head_dim(H) is None:
    return 'pallas_mgpu'
  if kernels.triton_head_dim(H) is None:
    return 'pallas'
  return 'blockwise'


# What 'auto' chooses for, when set: (backend, GpuFacts), instead of the mesh's backend and the
# runtime's GPU. Tests trace on CPU what a GPU run would trace (the kernels then interpret).
_CHOOSE_FOR: list[tuple[str, GpuFacts | None]] = []


@contextlib.contextmanager
def choosing_for(backend: str, gpu: GpuFacts | None = None):
  """'auto' picks as on `backend` (with these GPU facts) while the calls inside are traced."""
  _CHOOSE_FOR.append((backend, gpu))
  try:
    yield
  finally:
    _CHOOSE_FOR.pop()


def auto_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
  terms = call_terms(q_BTNH, **kwargs)
  backend, gpu = _CHOOSE_FOR[-1] if _CHOOSE_FOR else (None, None)
  impl = choose_impl(
    q_BTNH,
    k_BSKH,
    bias=kwargs.get('bias'),
    rel_values=kwargs.get('rel_values'),
    dropout=terms['dropout'],
    backend=backend,
    mask=kwargs.get('mask'),
    gpu=gpu,
    softcap=terms['softcap'],
    sinks=terms['sinks'],
  )
  for key in ('block_q', 'block_k'):  # tiles set for another kernel: the picked one's defaults
    if kwargs.get(key) is not None and ATTENTION_IMPLS[impl].refuses_tile(key, kwargs[key]):
      kwargs[key] = None
  return run_impl(impl, q_BTNH, k_BSKH, v_BSKH, **kwargs)


def run_impl(impl: str, q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
  """ATTENTION_IMPLS[impl](...), a kernel impl run on each device's shard of the batch and heads
  when the mesh in context has several devices (mllm/ops/mesh.py: XLA cannot split a kernel).
  A term the implementation's record says it cannot compute is refused in one line."""
  if not ATTENTION_IMPLS[impl].per_shard:
    return ATTENTION_IMPLS[impl](q_BTNH, k_BSKH, v_BSKH, **kwargs)
  mask, bias, sinks = kwargs.pop('mask'), kwargs.pop('bias'), kwargs.pop('sinks', None)
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

  def kernel(q, k, v, mask, bias, sinks):
    if static_offset is not None:
      mask = mask.replace(q_offset=static_offset)
    return ATTENTION_IMPLS[impl](q, k, v, mask=mask, bias=bias, sinks=sinks, **kwargs)

  return on_mesh.per_shard(
    kernel,
    (q_BTNH, k_BSKH, v_BSKH, mask, bias, sinks),
    (heads, heads, heads, mask_specs, bias_specs, None if sinks is None else on_mesh.P(h)),
    heads,
  )


# The terms of a call an implementation may be unable to compute, as `AttentionImpl.lacks` names
# them, and how a refusal says each.
TERMS = {
  'learned_bias': 'a learned score bias (T5, Shaw), whose gradient only autodiff gives',
  'dropout': 'attention dropout',
  'alibi': "ALiBi (it adds no bias to the scores)",
  'float32': 'float32 inputs (it runs in bfloat16/float16 only)',
  'softcap': 'attention-logit soft-capping (model.attention.logit_softcap)',
  'sinks': 'learned attention sinks (model.attention.sinks)',
}


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
  """One implementation of `attend` and what it can run: the one record of its capabilities.
  Config validation, 'auto', `run_impl`, `cached_impl` and the benchmarks read these fields;
  adding an implementation is adding a record. Calling the record runs it."""

  run: Callable[..., jax.Array]
  learned_terms: bool = False  # T5/Shaw learned biases and attention dropout (autodiff's gradients)
  alibi: bool = True  # adds ALiBi's bias to the scores
  softcap: bool = True  # soft-caps the scaled logits, cap · tanh(x / cap)
  sinks: bool = False  # a learned sink logit per head in the softmax's normalizer
  per_shard: bool = False  # an opaque custom call: run per shard of a mesh (mllm/ops/mesh.py)
  index_masks: bool = False  # masks by index only: a KV cache's prefill chunk goes 'blockwise'
  pallas: bool = False  # one of mllm's Pallas kernels (pallas_kernels/)
  half_precision: str | None = None  # runs only in bfloat16/float16: what its error calls it
  tiles: Callable[[str, int], str | None] | None = None  # why a block_q/block_k is refused
  backends: Callable[[str], str | None] | None = None  # why a JAX backend is refused

  def __call__(self, q_BTNH, k_BSKH, v_BSKH, **kwargs) -> jax.Array:
    """Run it, after refusing in one line a term of the call that it cannot compute."""
    term = self.lacks(**call_terms(q_BTNH, **kwargs))
    if term:
      name = next((n for n, impl in ATTENTION_IMPLS.items() if impl is self), repr(self.run))
      raise ValueError(
        f'attention impl={name!r} cannot compute {TERMS[term]}; allowed with it: '
        + ', '.join(impls_with(term))
      )
    return self.run(q_BTNH, k_BSKH, v_BSKH, **kwargs)

  def lacks(
    self,
    *,
    learned_bias: bool = False,
    dropout: bool = False,
    alibi: bool = False,
    float32: bool = False,
    softcap: bool = False,
    sinks: bool = False,
  ) -> str | None:
    """The first term (a TERMS key) of a call with these terms that this implementation cannot
    compute, or None. `float32`: the inputs are float32 (not bfloat16/float16)."""
    needs = {
      'learned_bias': learned_bias and not self.learned_terms,
      'dropout': dropout and not self.learned_terms,
      'alibi': alibi and not self.alibi,
      'float32': float32 and self.half_precision is not None,
      'softcap': softcap and not self.softcap,
      'sinks': sinks and not self.sinks,
    }
    return next((term for term, missing in needs.items() if missing), None)

  def refuses_tile(self, key: str, value: int) -> str | None:
    """Why `model.attention.<key>=value` is refused, or None."""
    return self.tiles(key, value) if self.tiles else None

  def refuses_backend(self, backend: str) -> str | None:
    """Why this JAX backend cannot run it, or None."""
    return self.backends(backend) if self.backends else None


def _dense(bias: ScoreBias | None) -> bool:
  return bias is not None and bias.dense is not None


def call_terms(
  q_BTNH,
  *,
  bias=None,
  rel_values=None,
  dropout_rate=0.0,
  dropout_rng=None,
  softcap=None,
  sinks=None,
  **_,
) -> dict[str, bool]:
  """Which TERMS a call of `attend`'s contract asks for (`AttentionImpl.lacks`'s arguments)."""
  return {
    'learned_bias': rel_values is not None or _dense(bias),
    'dropout': dropout_rate > 0.0 and dropout_rng is not None,
    'alibi': bias is not None and bias.alibi_slopes is not None,
    'float32': not is_half(q_BTNH.dtype),
    'softcap': softcap is not None,
    'sinks': sinks is not None,
  }


def impls_with(term: str) -> tuple[str, ...]:
  """The implementations that compute a call with `term` (a TERMS key), in registry order."""
  return tuple(name for name, impl in ATTENTION_IMPLS.items() if impl.lacks(**{term: True}) is None)


_KERNEL = dict(per_shard=True, index_masks=True)

# name → implementation (`model.attention.impl`).
ATTENTION_IMPLS: dict[str, AttentionImpl] = {
  'xla': AttentionImpl(xla_attention, learned_terms=True, sinks=True),
  'blockwise': AttentionImpl(blockwise_attention, learned_terms=True, sinks=True),
  'pallas': AttentionImpl(
    pallas_attention, pallas=True, sinks=True, tiles=kernels.triton_tiles, **_KERNEL
  ),
  'pallas_tpu': AttentionImpl(
    functools.partial(pallas_attention, impl='pallas_tpu'),
    pallas=True,
    sinks=True,
    tiles=kernels.tpu_tiles,
    **_KERNEL,
  ),
  'pallas_mgpu': AttentionImpl(
    functools.partial(pallas_attention, impl='pallas_mgpu'),
    pallas=True,
    sinks=True,
    half_precision='the Mosaic GPU kernel (wgmma)',
    tiles=kernels.mgpu_tiles,
    backends=kernels.mgpu_backends,
    **_KERNEL,
  ),
  'splash': AttentionImpl(
    splash_attention,
    alibi=False,
    tiles=splash.tile_problem,
    backends=kernels.splash_backends,
    **_KERNEL,
  ),
  'cudnn': AttentionImpl(
    cudnn_attention,
    softcap=False,  # jax.nn.dot_product_attention has no soft cap
    half_precision='cuDNN flash attention',
    backends=kernels.cudnn_backends,
  ),
  'auto': AttentionImpl(auto_attention, learned_terms=True, sinks=True),
}
PALLAS_IMPLS = tuple(name for name, impl in ATTENTION_IMPLS.items() if impl.pallas)


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
  return 'blockwise' if ATTENTION_IMPLS[impl].index_masks else impl


def attend(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask: AttentionMask,
  bias: ScoreBias | None = None,
  rel_values: RelativeValues | None = None,
  scale: float | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  impl: str = 'xla',
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """softmax(softcap(q·kᵀ·scale) + bias)·v (+ Shaw's value term), by the implementation named
  `impl`; `softcap` None: no cap; `sinks` [N]: each query head's sink logit (None: none)."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention impl={impl!r}; allowed: {', '.join(sorted(ATTENTION_IMPLS))}")
  n_heads, n_kv = q_BTNH.shape[2], k_BSKH.shape[2]
  if n_heads % n_kv:
    raise ValueError(f'query heads ({n_heads}) must be a multiple of key/value heads ({n_kv})')
  if scale is None:
    scale = q_BTNH.shape[-1] ** -0.5
  if mask.kv_positions is not None:
    impl = cached_impl(impl, q_BTNH.shape[1])
  qk_dim, v_dim = q_BTNH.shape[-1], v_BSKH.shape[-1]
  widened = qk_dim != v_dim and impl != 'xla'
  if widened:
    # The tiled implementations take one head size: zero dims in the smaller side change no
    # score (q·k) and no output column (P·v) but add ones sliced away (MLA: d_v < d_h + d_R).
    width = max(qk_dim, v_dim)
    q_BTNH, k_BSKH, v_BSKH = (
      jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])]) for x in (q_BTNH, k_BSKH, v_BSKH)
    )
  out_BTNH = run_impl(
    impl,
    q_BTNH,
    k_BSKH,
    v_BSKH,
    mask=mask,
    bias=bias,
    rel_values=rel_values,
    scale=scale,
    softcap=softcap,
    sinks=sinks,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
    block_q=block_q,
    block_k=block_k,
  )
  return out_BTNH[..., :v_dim] if widened else out_BTNH
