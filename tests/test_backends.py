"""What the suite assumes of its backend, checked on whichever one it runs (CPU or GPU).

tests/conftest.py sets float32 matmuls to full precision (a GPU would use TF32) and enforces the
`cpu_only` / `gpu_only` marks by the backend this process really has; the twins below assert what
each backend does where the library's behaviour differs by backend (docs/testing.md lists them).
"""

from __future__ import annotations

import os

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_float32_matmuls_run_in_full_precision():
  """The float64-reference tolerances assume it: TF32 (a GPU's default) rounds inputs to a 10-bit
  mantissa, ~1e-3 relative error on this product; full float32 gives ~1e-7."""
  assert jax.config.jax_default_matmul_precision == os.environ['JAX_DEFAULT_MATMUL_PRECISION']
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(2, 256, 256))
  got = np.asarray(jax.jit(jnp.matmul)(jnp.float32(a), jnp.float32(b)), np.float64)
  want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


class _Item:
  """What pytest_runtest_setup reads of a test item."""

  def __init__(self, name, **kwargs):
    self.nodeid = f'tests/x.py::{name}'
    self._mark = getattr(pytest.mark, name)(**kwargs).mark

  def get_closest_marker(self, name):
    return self._mark if name == self._mark.name else None


def test_backend_marks_run_only_on_their_backend():
  backend = jax.default_backend()
  for name, needed in conftest.BACKEND_MARKS.items():
    item = _Item(name, reason='why')
    if needed == backend:
      conftest.pytest_runtest_setup(item)  # runs
    else:
      with pytest.raises(pytest.skip.Exception, match=rf'{name} \(this run: {backend}\): why'):
        conftest.pytest_runtest_setup(item)
  with pytest.raises(pytest.UsageError, match='needs reason='):
    conftest.pytest_runtest_setup(_Item('cpu_only'))


# --- Twins: one backend's behaviour each. ------------------------------------------------------


@pytest.mark.cpu_only(reason="'auto' MoE dispatch is capacity on a CPU, where ragged_dot expands")
def test_auto_moe_dispatch_is_capacity_on_a_cpu():
  from mllm.layers.moe_experts import resolve_dispatch

  assert resolve_dispatch('auto') == 'capacity'


@pytest.mark.gpu_only(reason="'auto' MoE dispatch is dropless (ragged_dot) on an accelerator")
def test_auto_moe_dispatch_is_dropless_on_a_gpu():
  from mllm.layers.moe_experts import resolve_dispatch

  assert resolve_dispatch('auto') == 'dropless'


def _pallas_attention_hlo() -> str:
  from mllm.ops.attention import AttentionMask, attend

  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)
  fn = jax.jit(lambda q, k, v: attend(q, k, v, mask=AttentionMask(causal=True), impl='pallas'))
  return fn.lower(q, q, q).as_text()


@pytest.mark.cpu_only(reason="the Triton kernel ('pallas') runs in Pallas interpret mode on a CPU")
def test_the_triton_kernel_is_interpreted_on_a_cpu():
  text = _pallas_attention_hlo()
  assert 'triton' not in text and 'while' in text  # the grid as XLA loops, no kernel call


@pytest.mark.gpu_only(reason="the Triton kernel ('pallas') compiles for real on a GPU")
def test_the_triton_kernel_is_a_kernel_call_on_a_gpu():
  text = _pallas_attention_hlo()
  assert text.count('__gpu$xla.gpu.triton') + text.count('triton_kernel_call') == 1
