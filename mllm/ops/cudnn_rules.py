"""Why cuDNN's fused attention cannot run a call, from static facts: the checks JAX makes before it
hands a call to cuDNN, mirrored so that 'auto' falls back and config validation refuses instead of
a trace-time NotImplementedError.

Read from jax 0.10.2, 0.11.2 and 0.12.0.1 (the range pyproject.toml allows; the bf16/fp16 rules
are the same in all three): jax/_src/cudnn/fused_attention_stablehlo.py (`check_layout`,
`check_is_flash_attention`) and jax/_src/nn/functions.py (`dot_product_attention`, its 'cudnn'
case). What they refuse, and what mllm sends:
  1. q/k/v dtype other than float16/bfloat16 (fp8 has its own entry point, unused here).
  2. compute capability 10.3 with cuDNN < 9.11.
  3. q/k head dim not a multiple of 8, or above 256 on compute capability >= 9.0 (Hopper), above
     128 before.
  4. training (the custom VJP's forward rule) with a bias when T or S is odd. JAX always passes a
     bias operand to that check (an empty placeholder when there is no bias or mask), so every
     training call with an odd length is refused, plain causal without a mask included: this is
     the `Unsupported sequence length Q 37, KV 37` error. A forward-only call is not checked.
  5. a v head dim other than the q/k one (MLA) needs cuDNN >= 9.10 and Hopper; mllm's heads share
     one head_dim.
  6. a packed layout (q_offsets) needs Hopper; mllm never sends offsets.
  7. a window that is not causal (a right window) with no causal flag; mllm sends a window flag
     only with causal attention, two-sided windows go as a dense mask.
No limit on GQA (any N multiple of K) or on the lengths beyond (4). Not a JAX check but cuDNN's:
its flash attention needs compute capability >= 8.0 (Ampere).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

HALF = (jnp.bfloat16, jnp.float16)


def is_half(dtype) -> bool:
  """bfloat16 or float16: what cuDNN's and the Mosaic GPU kernel's tensor-core paths take."""
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in HALF]


@dataclasses.dataclass(frozen=True)
class GpuFacts:
  """What the rules need to know about the GPU; None: unknown, judged conservatively (as on a
  pre-Hopper GPU with an old cuDNN)."""

  compute_capability: tuple[int, int] | None = None  # (9, 0) on an H100
  cudnn_version: int | None = None  # major * 10000 + minor * 100 + patch, e.g. 91000 for 9.10.0

  @property
  def hopper_or_later(self) -> bool:
    return self.compute_capability is not None and self.compute_capability >= (9, 0)

  @property
  def hopper(self) -> bool:
    """Compute capability 9.x: wgmma, which the Mosaic GPU kernel is written for."""
    return self.compute_capability is not None and self.compute_capability[0] == 9


@functools.cache
def runtime_gpu_facts() -> GpuFacts:
  """The first local GPU's compute capability and the cuDNN version JAX loaded; GpuFacts() (all
  unknown) on a machine without a GPU."""
  import jax

  try:
    device = jax.devices('gpu')[0]
  except RuntimeError:
    return GpuFacts()
  capability = getattr(device, 'compute_capability', None)
  cc = tuple(int(x) for x in capability.split('.'))[:2] if isinstance(capability, str) else None
  try:  # how jax's fused_attention_stablehlo.check_cudnn_version reads it
    from jax._src.lib import cuda_versions

    version = None if cuda_versions is None else int(cuda_versions.cudnn_get_version())
  except Exception:  # a ROCm or unusual build: unknown, judged conservatively
    version = None
  return GpuFacts(cc, version)


def cudnn_refusal(
  *,
  dtype,
  q_len: int | None,
  kv_len: int | None,
  head_dim: int,
  head_dim_v: int | None = None,
  causal: bool = True,
  window: int | None = None,
  training: bool = True,
  packed: bool = False,
  gpu: GpuFacts = GpuFacts(),
) -> str | None:
  """Why `jax.nn.dot_product_attention(implementation='cudnn')` refuses this call, or None.

  causal / window: the flags sent to cuDNN (not a dense mask: a mask or bias sent as an array
  changes nothing here, see rule 4 above). training: the call is differentiated. packed: segments
  sent as q/kv offsets (mllm sends none). A length of None (unknown) is not judged.
  """
  cc, version = gpu.compute_capability, gpu.cudnn_version
  if not is_half(dtype):
    return f'cuDNN flash attention takes bfloat16/float16 inputs, not {jnp.dtype(dtype).name}'
  if cc is not None and cc < (8, 0):
    return f'cuDNN flash attention needs compute capability >= 8.0, this GPU has {cc[0]}.{cc[1]}'
  if cc == (10, 3) and (version is None or version < 91100):
    return 'compute capability 10.3 needs cuDNN >= 9.11'
  h_max = 256 if gpu.hopper_or_later else 128
  if head_dim > h_max or head_dim % 8:
    where = 'on Hopper and later' if gpu.hopper_or_later else 'before Hopper (or on an unknown GPU)'
    return f'cuDNN needs a head dim that is a multiple of 8 and <= {h_max} {where}, got {head_dim}'
  mla = head_dim_v is not None and head_dim_v != head_dim
  if mla and (version is None or version < 91000 or not gpu.hopper_or_later):
    return f'a v head dim ({head_dim_v}) other than q/k ({head_dim}) needs cuDNN >= 9.10 on Hopper'
  if training and any(n is not None and n % 2 for n in (q_len, kv_len)):
    return (
      f'cuDNN trains only on even sequence lengths, got {q_len} queries and {kv_len} keys '
      '(jax refuses odd lengths in the backward, causal or not)'
    )
  if packed and not gpu.hopper_or_later:
    return "cuDNN's packed layout (segment offsets) needs Hopper"
  if window is not None and not causal:
    return "cuDNN's sliding window is causal only"
  return None
