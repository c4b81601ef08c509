"""The weights' initializer: a normal draw of a given std, one compiled program per shape.

`jax.nn.initializers.normal` called outside a trace (a model built eagerly: tests, tools, a
notebook) runs as single operations, each its own XLA program per shape (a uniform draw, erf⁻¹,
two products); here the same operations are one jitted program, cached by (shape, dtype, std).
Inside a trace (the training state's jitted init) the nested jit is inlined: the same
computation, the same values bit for bit (tests/test_init.py).
"""

from __future__ import annotations

import functools

import jax


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, std):
  return jax.nn.initializers.normal(std)(key, shape, dtype)


def normal(std: float):
  """An initializer (key, shape, dtype) -> array of N(0, std²) draws, as jax.nn's normal(std)."""

  def init(key, shape, dtype=jax.numpy.float32):
    return _normal(key, tuple(shape), dtype, float(std))

  return init
