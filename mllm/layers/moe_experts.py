"""The experts of an MoE layer and the two ways to run them (mllm/layers/moe.py's docstring
compares them): E FFNs with stacked weights, the grouped matmul of the dropless path (ragged_dot,
megablox's gmm, or tiles), and the capacity and dropless dispatches."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers import initializers
from mllm.layers.ffn import FFNS
from mllm.ops import mesh as on_mesh

DISPATCHES = ('capacity', 'dropless')
GROUPED_MATMULS = ('ragged_dot', 'megablox', 'tiled')  # the dropless path's kernel


# ---------------------------------------------------------------------------------------------
# Experts: E FFNs of one kind, weights stacked along a leading expert axis.
# ---------------------------------------------------------------------------------------------


class Experts(nnx.Module):
  """E FFNs of the kind `ffn_kind` names (its activation, with its settings `ffn_settings`, and
  gating): gate/up [E, D, F], down [E, F, D]; with `use_bias` (gpt-oss) gate_bias/up_bias [E, F]
  and down_bias [E, D]."""

  def __init__(
    self,
    num_experts: int,
    d_model: int,
    d_ff: int,
    ffn_kind: str = 'swiglu',
    *,
    ffn_settings=None,
    use_bias: bool = False,
    init_std: float,
    out_std: float,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    ffn = FFNS[ffn_kind]
    self.ffn, self.ffn_settings, self.gated = ffn, ffn_settings, ffn.gated
    self.dtype = dtype

    def weight(shape, std, axes):
      init = initializers.normal(std)
      return nnx.Param(init(rngs.params(), shape, param_dtype), logical_axes=axes)

    e, d, f = num_experts, d_model, d_ff
    self.gate = weight((e, d, f), init_std, ('expert', 'embed', 'mlp')) if self.gated else None
    self.up = weight((e, d, f), init_std, ('expert', 'embed', 'mlp'))
    self.down = weight((e, f, d), out_std, ('expert', 'mlp', 'embed'))

    def zeros(shape, axes):
      return nnx.Param(jnp.zeros(shape, param_dtype), logical_axes=axes) if use_bias else None

    self.gate_bias = zeros((e, f), ('expert', 'mlp')) if self.gated else None
    self.up_bias = zeros((e, f), ('expert', 'mlp'))
    self.down_bias = zeros((e, d), ('expert', 'embed'))

  def hidden(self):
    return self.ffn.hidden_with(self.ffn_settings)

  def _weights(self, dtype):
    cast = lambda w: None if w is None else w[...].astype(dtype)  # noqa: E731
    return tuple(
      cast(w) for w in (self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias)
    )

  def grouped(self, x_ECD: jax.Array) -> jax.Array:
    """Expert e applied to its own rows x_ECD[e] (the capacity buffer)."""
    gate, up, down, gate_b, up_b, down_b = self._weights(self.dtype or x_ECD.dtype)
    x_ECD = x_ECD.astype(up.dtype)

    def matmul(x, w, b):
      y = jnp.einsum('ecd,edf->ecf', x, w)
      return y if b is None else y + b[:, None, :]

    pre_gate = None if gate is None else matmul(x_ECD, gate, gate_b)
    return matmul(self.hidden()(pre_gate, matmul(x_ECD, up, up_b)), down, down_b)

  def ragged(
    self, x_SD: jax.Array, group_sizes_E: jax.Array, impl: str = 'ragged_dot'
  ) -> jax.Array:
    """Rows sorted by expert, group_sizes_E[e] of them for expert e (the dropless path)."""
    gate, up, down, gate_b, up_b, down_b = self._weights(self.dtype or x_SD.dtype)
    x_SD = x_SD.astype(up.dtype)
    # Each row's expert, for the biases (gpt-oss's experts; none otherwise).
    expert_S = (
      None
      if self.up_bias is None
      else jnp.repeat(
        jnp.arange(group_sizes_E.shape[0]), group_sizes_E, total_repeat_length=x_SD.shape[0]
      )
    )

    def matmul(x, w, b):
      y = grouped_matmul(x, w, group_sizes_E, impl)
      return y if b is None else y + b[expert_S]

    pre_gate = None if gate is None else matmul(x_SD, gate, gate_b)
    return matmul(self.hidden()(pre_gate, matmul(x_SD, up, up_b)), down, down_b)


def grouped_matmul(
  x_SD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, impl: str = 'ragged_dot'
) -> jax.Array:
  """Rows of group e times w_EDF[e]: `jax.lax.ragged_dot`, or megablox's `gmm` (Pallas TPU kernel,
  run in Pallas interpret mode off TPU: for tests, slowly). gmm's row tiles are 128 (the whole
  matrix when smaller); extra zero rows pad the last group to a whole tile and are cut off."""
  if impl == 'ragged_dot':
    return jax.lax.ragged_dot(x_SD, w_EDF, group_sizes_E)
  if impl == 'tiled':
    return tiled_grouped_matmul(x_SD, w_EDF, group_sizes_E)
  if impl != 'megablox':
    raise ValueError(f'unknown grouped matmul {impl!r}; allowed: {", ".join(GROUPED_MATMULS)}')
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # deferred: TPU kernel

  mesh = on_mesh.current_mesh()
  if mesh is not None and mesh.size > 1:
    # gmm is an opaque kernel XLA cannot split, and the rows are sorted by expert over the whole
    # batch: splitting needs the whole dispatch under shard_map (not written yet).
    raise ValueError(
      f"model.ffn.moe.grouped_matmul='megablox' runs on one device, but the mesh has "
      f"{mesh.size}; use 'ragged_dot' on a mesh"
    )
  rows, d_in = x_SD.shape
  tile_m = min(128, rows)
  pad = -rows % tile_m
  x_padded = jnp.pad(x_SD, ((0, pad), (0, 0)))
  sizes = group_sizes_E.astype(jnp.int32).at[-1].add(pad)
  tiling = (tile_m, min(128, d_in), min(128, w_EDF.shape[-1]))
  out = gmm(
    x_padded, w_EDF, sizes, x_SD.dtype, tiling, None, None, False, on_mesh.backend() != 'tpu'
  )
  return out[:rows]


def tiled_grouped_matmul(
  x_SD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, tile: int = 128
) -> jax.Array:
  """Rows of group e times w_EDF[e], as MegaBlocks tiles them (Gale et al. 2023, sec. 5): each
  group is padded with zero rows to whole tiles of `tile` rows, so that every tile belongs to one
  group, and each tile multiplies its group's weight. At most E·(tile − 1) padding rows: for S
  sorted rows, (S + E·tile)·D·F multiply-adds where XLA:CPU's ragged_dot does E·S·D·F. The
  weights are gathered per tile ([tiles, D, F] in memory): a path for CPUs and small models."""
  rows, d_in = x_SD.shape
  num_experts = w_EDF.shape[0]
  tile = max(1, min(tile, rows))
  n_tiles = (rows + num_experts * (tile - 1)) // tile  # >= sum_e ceil(size_e / tile)
  sizes = group_sizes_E.astype(jnp.int32)
  padded = (sizes + tile - 1) // tile * tile
  start, padded_start = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
  group = jnp.repeat(jnp.arange(num_experts), sizes, total_repeat_length=rows)
  slot = padded_start[group] + jnp.arange(rows) - start[group]  # each row's place among the tiles
  x_tiles = jnp.zeros((n_tiles * tile, d_in), x_SD.dtype).at[slot].set(x_SD)
  # Tile t holds group e when padded_start[e] <= t·tile < padded_start[e] + padded[e]; tiles past
  # the last group hold zero rows only (their weight is any group's).
  owner = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_tiles) * tile, side='right')
  w_tiles = w_EDF[jnp.minimum(owner, num_experts - 1)]
  y_tiles = jnp.einsum('tcd,tdf->tcf', x_tiles.reshape(n_tiles, tile, d_in), w_tiles)
  return y_tiles.reshape(n_tiles * tile, -1)[slot]


# ---------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------


def capacity(n_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
  """Assignments one expert takes: ceil(T/E · k · capacity_factor)."""
  return max(1, math.ceil(n_tokens / num_experts * k * capacity_factor))


def capacity_dispatch(
  experts: Experts, x_TD, gates_Tk, experts_Tk, num_experts: int, cap: int
) -> tuple[jax.Array, jax.Array]:
  """(y [T, D], kept [T, k]) running each expert on at most `cap` assignments.

  Priority: slot-major (all first choices, then all second choices, ...), token order within a
  slot, as GShard and Switch fill their buffers; an assignment at position >= cap is dropped.
  """
  n_tokens, k = experts_Tk.shape
  d_model = x_TD.shape[-1]
  by_priority = experts_Tk.T.reshape(-1)  # [k·T], slot-major
  onehot = jax.nn.one_hot(by_priority, num_experts, dtype=jnp.int32)
  position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # rank within its expert
  kept_flat = position < cap
  slot_flat = jnp.where(kept_flat, by_priority * cap + position, num_experts * cap)  # overflow: bin
  token_flat = jnp.tile(jnp.arange(n_tokens), k)
  # Which token fills each of the E·C buffer rows (T: none, a zero row).
  rows = jnp.full((num_experts * cap + 1,), n_tokens, jnp.int32).at[slot_flat].set(token_flat)
  x_padded = jnp.concatenate([x_TD, jnp.zeros((1, d_model), x_TD.dtype)], axis=0)
  x_ECD = x_padded[rows[:-1]].reshape(num_experts, cap, d_model)
  y_rows = experts.grouped(x_ECD).reshape(num_experts * cap, d_model)
  y_rows = jnp.concatenate([y_rows, jnp.zeros((1, d_model), y_rows.dtype)], axis=0)
  y_kTD = y_rows[slot_flat].reshape(k, n_tokens, d_model)
  kept_Tk = kept_flat.reshape(k, n_tokens).T
  weights_kT = jnp.where(kept_Tk, gates_Tk, 0.0).T.astype(y_kTD.dtype)
  return jnp.einsum('ktd,kt->td', y_kTD, weights_kT), kept_Tk


def dropless_dispatch(
  experts: Experts, x_TD, gates_Tk, experts_Tk, num_experts: int, impl: str = 'ragged_dot'
) -> jax.Array:
  """y [T, D] with every assignment computed: sort by expert, grouped matmul, unsort."""
  n_tokens, k = experts_Tk.shape
  flat = experts_Tk.reshape(-1)  # token-major: assignment a is token a // k
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  y_sorted = experts.ragged(x_TD[order // k], group_sizes, impl)
  y_TkD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n_tokens, k, -1)
  return jnp.einsum('tkd,tk->td', y_TkD, gates_Tk.astype(y_TkD.dtype))


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
  """`auto` → capacity on CPU (ragged_dot costs E× the FLOPs there: benchmarks/results/moe-layer-*),
  dropless on accelerators."""
  if dispatch != 'auto':
    return dispatch
  return 'capacity' if (backend or on_mesh.backend()) == 'cpu' else 'dropless'
