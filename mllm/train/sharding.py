"""The device mesh and how parameters and batches are laid out on it.

Every parameter carries `logical_axes` metadata ('embed', 'heads', 'mlp', ...). `LOGICAL_RULES` maps
those names to mesh axes: FSDP shards the model dimension over 'fsdp' (ZeRO-3 style: gathered
for each matmul, gradients reduce-scattered), tensor parallelism splits heads, FFN hidden units and
the vocabulary over 'tensor' (Megatron-LM), expert parallelism puts each MoE expert's weights on
one slice of 'expert' (GShard). The batch is split over ('data', 'fsdp', 'expert'): outside the
experts, the expert axis is one more data-parallel axis. XLA's SPMD partitioner inserts the
collectives (the token exchange into and out of the experts included); there is no hand-written
communication.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mllm.checks import ConfigError
from mllm.ops.mesh import BATCH_AXES, HEADS_AXIS
from mllm.validation import MESH_AXES

LOGICAL_RULES: dict[str, str | None] = {
  'embed': 'fsdp',
  'vocab': 'tensor',
  'heads': HEADS_AXIS,
  'kv_heads': HEADS_AXIS,
  'mlp': 'tensor',
  'expert': 'expert',
  'head_dim': None,
  'latent': None,  # MLA's low-rank latents (mllm/layers/mla.py): small, replicated
  'norm': None,
  'positions': None,
  'relpos_buckets': None,
}


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
  """(data, fsdp, expert, tensor) with the -1 axis filled so the product is `n_devices`."""
  sizes = [mesh_cfg[a] for a in MESH_AXES]
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n_devices % fixed:
      raise ConfigError(
        'mesh', dict(mesh_cfg), f'the fixed axes ({fixed}) must divide the {n_devices} devices'
      )
    sizes[sizes.index(-1)] = n_devices // fixed
  if math.prod(sizes) != n_devices:
    raise ConfigError(
      'mesh',
      dict(mesh_cfg),
      f'the axis sizes multiply to {math.prod(sizes)}, '
      f'but there are {n_devices} devices; allowed: a product of {n_devices}, '
      'or -1 on one axis',
    )
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(mesh_cfg, len(devices))
  # Auto axes: shardings are annotations that XLA propagates (jax.make_mesh defaults to Explicit
  # axes, which put shardings in the type system).
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=devices
  )


def logical_to_spec(names, shape, mesh, rules=LOGICAL_RULES) -> P:
  """PartitionSpec for an array with logical axis `names` (a scanned layer axis is unnamed)."""
  names = (None,) * (len(shape) - len(names)) + tuple(names)
  used, spec = set(), []
  for dim, name in zip(shape, names):
    axis = rules.get(name) if name else None
    # A dimension that does not divide evenly stays replicated rather than padded.
    if axis is None or axis in used or mesh.shape[axis] == 1 or dim % mesh.shape[axis]:
      spec.append(None)
    else:
      spec.append(axis)
      used.add(axis)
  return P(*spec)


def param_shardings(abstract_params: nnx.State, mesh) -> nnx.State:
  """The parameter tree with each Variable's value replaced by its NamedSharding."""

  def sharding(var):
    names = var.get_metadata().get('logical_axes', ())
    return var.replace(NamedSharding(mesh, logical_to_spec(names, var.get_value().shape, mesh)))

  return jax.tree.map(sharding, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def opt_state_shardings(opt_state, params, shardings: nnx.State, mesh):
  """The optimizer state's shardings: a leaf whose path ends with a parameter's path and which has
  its shape (a moment: Adam's mu and nu, Muon's momentum) is sharded as that parameter; any other
  (counts, Muon's Newton-Schulz coefficients) is replicated. By path, not by re-initialising the
  transformation on placeholders (optax.tree_map_params), which a Muon whose matrices are chosen
  by the parameters' metadata cannot do."""
  by_path = {
    tuple(path): (leaf.shape, sharding)
    for (path, leaf), sharding in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings), strict=True
    )
  }
  longest = max(map(len, by_path), default=0)

  def sharding_of(path, leaf):
    for start in range(max(len(path) - longest, 0), len(path)):
      shape, sharding = by_path.get(tuple(path[start:]), (None, None))
      if sharding is not None and shape == leaf.shape:
        return sharding
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(sharding_of, opt_state)


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
  """This process's rows → one global array per key, split over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
