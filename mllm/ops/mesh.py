"""Where traced code will run: the mesh in context.

The train and eval steps trace the model under `traced_on(mesh)`. Two things follow from it:
  - `backend()` is the mesh's platform, so `auto` and the kernels choose for the devices the step
    is compiled for (a TPU pod compiled ahead of time from a CPU host included), not for the host.
  - `per_shard` runs a Pallas / Mosaic kernel under `jax.shard_map` on a mesh of several devices:
    a kernel is an opaque custom call that XLA's partitioner refuses to split ("Mosaic kernels
    cannot be automatically partitioned"), so each device runs it on its own rows and heads.
Outside a mesh context (a bare call, a single device) both fall back to JAX's defaults.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

# The logical rules of mllm/train/sharding.py for the axes a kernel sees: the batch is split over
# these mesh axes, heads over 'tensor'.
BATCH_AXES = ('data', 'fsdp', 'expert')
HEADS_AXIS = 'tensor'


def traced_on(mesh: jax.sharding.Mesh):
  """Context for tracing code that will run on `mesh` (usable inside jax.jit)."""
  if mesh is None:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def mesh_of(tree) -> jax.sharding.Mesh | None:
  """The mesh the arrays of `tree` are sharded over (the first NamedSharding found), else None."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return sharding.mesh
  return None


def current_mesh() -> jax.sharding.AbstractMesh | None:
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def backend() -> str:
  """The platform of the mesh in context ('cpu', 'gpu', 'tpu'), else JAX's default backend."""
  mesh = current_mesh()
  device = getattr(mesh, 'abstract_device', None) if mesh is not None else None
  platform = getattr(device, 'platform', None)
  if platform is None:
    return jax.default_backend()
  return 'gpu' if platform in ('cuda', 'rocm') else platform


def split_axes(batch: int, heads: tuple[int, ...]) -> tuple[tuple[str, ...] | None, str | None]:
  """(mesh axes the batch splits over, the axis heads split over) in the mesh in context: an
  axis that does not divide the dimension evenly is not used (that dimension is replicated)."""
  mesh = current_mesh()
  if mesh is None:
    return None, None
  b_axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  b = b_axes if b_axes and batch % math.prod(mesh.shape[a] for a in b_axes) == 0 else None
  t = mesh.shape.get(HEADS_AXIS, 1)
  h = HEADS_AXIS if t > 1 and all(n % t == 0 for n in heads) else None
  return b, h


def per_shard(fn: Callable, args: tuple, in_specs: tuple, out_specs) -> object:
  """fn(*args), run per device under shard_map on the mesh in context when it has several
  devices; plain fn(*args) otherwise. Specs name mesh axes (see `split_axes`)."""
  mesh = current_mesh()
  if mesh is None or mesh.size == 1:
    return fn(*args)
  # check_vma=False: a Pallas call has no rule for JAX's varying-manual-axes check.
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
    *args
  )


__all__ = [
  'BATCH_AXES',
  'HEADS_AXIS',
  'P',
  'backend',
  'current_mesh',
  'mesh_of',
  'per_shard',
  'split_axes',
  'traced_on',
]
