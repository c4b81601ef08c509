"""The decoder-only transformer: embedding → N × Block → final norm → head.

Each sublayer f (attention, then the FFN) of a Block, by `model.norm.placement`:

    pre       x = x + f(Norm(x))                 Pre-LN (Xiong et al. 2020)
    post      x = Norm(x + f(x))                 Post-LN (Vaswani et al. 2017)
    sandwich  x = x + Norm_out(f(Norm(x)))       Gemma 2 (Team et al. 2024); Peri-LN (Kim et al.
                                                 2025, arXiv 2502.02732, eq. 3)
    output    x = x + Norm(f(x))                 OLMo 2 (Team OLMo 2025, arXiv 2501.00656, sec.
                                                 3.2.1: the norm moved onto the sublayer's output)

The FFN is a dense one or, in the layers `model.ffn.moe` picks, a mixture of experts, whose routing
statistics the model returns on request (`return_moe_stats=True`) for the training step's losses.

Multi-token prediction (`model.multi_token_prediction`; DeepSeek-V3, arXiv 2412.19437, sec. 2.2,
eqs. 21-23, one depth; Gloeckle et al. 2024): beside the next token, an `MTPModule` predicts the
one after it from the last block's hidden state h_i and the next token's embedding,
h'_i = W [Norm(h_i); Norm(Emb(t_{i+1}))], one more Block, its own final norm and the shared head.
Training adds its loss (mllm/train/step.py); inference ignores it.

Every variant is looked up by its config name in a registry (positions, FFNs, norms, attention
implementations); this file only wires them together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers import initializers
from mllm.layers.attention import ATTENTIONS, layer_period, layer_windows
from mllm.layers.ffn import FFNS
from mllm.layers.kv_cache import (
  KVCache,
  LayerCache,
  plan_writes,
  rolling_window,
  scatter,
  write_slots,
  writes_first,
)
from mllm.layers.moe import moe_layers
from mllm.layers.moe_routing import ExpertBias
from mllm.layers.norms import NORMS
from mllm.layers.parametrization import output_multiplier, weight_std
from mllm.layers.positions import POSITIONS, PositionContext, rotating_layers
from mllm.layers.remat import REMAT_POLICIES
from mllm.ops.attention import AttentionMask
from pallas_kernels.tile_math import softcapped

# The variables that are the model's weights: state['params'] of a run, its checkpoints, an HF
# export. The rest (RNG streams) is rebuilt, never saved.
CHECKPOINTED = (nnx.Param, ExpertBias)


class ValueMix(nnx.Module):
  """The value residual's weights (λ₁, λ₂) of layers 1..n−1, from (0.5, 0.5) (ResFormer:
  mllm/layers/attention.py)."""

  def __init__(self, n_layers: int, param_dtype=jnp.float32):
    self.weights = nnx.Param(
      jnp.full((n_layers - 1, 2), 0.5, param_dtype), logical_axes=('layers', 'value_mix')
    )


class MTPModule(nnx.Module):
  """One multi-token-prediction depth (module docstring): `mtp(h_BTD, next_BTD, context, mask)`
  -> the hidden state that the shared head turns into logits for t_{i+2}."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    norm = NORMS[cfg.norm.kind]
    d = cfg.d_model
    # Its block has the last layer's place in any per-layer pattern.
    self.block = Block(cfg, layer=cfg.n_layers - 1, rngs=rngs)
    self.hidden_norm = norm.from_config(cfg, d, rngs=rngs)
    self.embed_norm = norm.from_config(cfg, d, rngs=rngs)
    self.proj = nnx.Linear(
      2 * d,
      d,
      use_bias=False,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.dtype(cfg.param_dtype),
      kernel_init=initializers.normal(weight_std(cfg, 'in', fan_in=2 * d)),
      rngs=rngs,
      kernel_metadata={'logical_axes': ('mtp_in', 'embed')},
    )
    self.final_norm = norm.from_config(cfg, d, rngs=rngs)

  def __call__(self, h_BTD, next_BTD, context, mask):
    joined = jnp.concatenate([self.hidden_norm(h_BTD), self.embed_norm(next_BTD)], axis=-1)
    x_BTD, _, _ = self.block(self.proj(joined), context, mask)
    return self.final_norm(x_BTD)


def make_ffn(cfg, sparse: bool, *, rngs: nnx.Rngs) -> nnx.Module:
  """The layer's FFN: the one `ffn.kind` names in its sparse layers (an MoE's, `moe_layers`),
  its dense layer elsewhere (an MoE model's: its experts' FFN)."""
  ffn = FFNS[cfg.ffn.kind]
  return ffn.from_config(cfg, rngs=rngs) if sparse else ffn.dense_layer(cfg, rngs=rngs)


def dense_ffn_kind(cfg) -> str:
  """The FFN kind of the dense layers: `ffn.kind`, or an MoE model's experts' kind."""
  return FFNS[cfg.ffn.kind].dense_kind(cfg)


class Block(nnx.Module):
  """One transformer layer: `block(x, context, mask, cache=None) -> (x, stats or None, the
  layer's updated (k, v) or None)`; stats: an MoE layer's routing statistics and, with
  `probe=True`, its largest attention logit ('max_attention_logit'). A sublayer's one norm is
  `attention_norm` / `ffn_norm` under every placement; 'sandwich' adds `attention_out_norm` /
  `ffn_out_norm` on the sublayer's output."""

  def __init__(self, cfg, *, moe: bool = False, layer: int = 0, rngs: nnx.Rngs):
    # Its place in a per-layer pattern: whether it rotates q and k (not a NoPE layer) and its
    # window (None: a global layer); scanned layers get theirs per call (_scan_blocks).
    self.rotates = rotating_layers(cfg)[layer]
    self.window = layer_windows(cfg)[layer]
    norm = NORMS[cfg.norm.kind]
    sandwich = cfg.norm.placement == 'sandwich'
    self.attention_norm = norm.from_config(cfg, cfg.d_model, rngs=rngs)
    self.attention_out_norm = norm.from_config(cfg, cfg.d_model, rngs=rngs) if sandwich else None
    self.attention = ATTENTIONS[cfg.attention.kind](cfg, rngs=rngs)
    self.ffn_norm = norm.from_config(cfg, cfg.d_model, rngs=rngs)
    self.ffn_out_norm = norm.from_config(cfg, cfg.d_model, rngs=rngs) if sandwich else None
    self.ffn = make_ffn(cfg, moe, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
    self.placement = cfg.norm.placement
    self.moe = moe

  def _input(self, x_BTD, norm):
    """A sublayer's input: normed under 'pre' and 'sandwich', x itself otherwise."""
    return norm(x_BTD) if self.placement in ('pre', 'sandwich') else x_BTD

  def _residual(self, x_BTD, sublayer, norm, out_norm):
    """(x after the sublayer `sublayer(input) -> (y, extra)` and its residual add, under the
    block's placement (module docstring); extra)."""
    y_BTD, extra = sublayer(self._input(x_BTD, norm))
    if self.placement == 'sandwich':
      y_BTD = out_norm(y_BTD)
    elif self.placement == 'output':
      y_BTD = norm(y_BTD)
    x_BTD = x_BTD + self.dropout(y_BTD)
    return (norm(x_BTD) if self.placement == 'post' else x_BTD), extra

  def _ffn(self, x_BTD):
    return self.ffn(x_BTD) if self.moe else (self.ffn(x_BTD), None)

  def first_values(self, x_BTD):
    """This layer's attention values of x [B, T, K, H]: the first layer's are every later layer's
    value residual (mllm/layers/attention.py)."""
    return self.attention.value(self._input(x_BTD, self.attention_norm))

  def __call__(
    self,
    x_BTD,
    context: PositionContext,
    mask: AttentionMask,
    cache: LayerCache | None = None,
    probe: bool = False,
    value_residual: tuple[jax.Array, jax.Array | None] | None = None,
  ):
    if mask.window != self.window:  # a global layer among windowed ones
      mask = mask.replace(window=self.window)
    if not self.rotates:  # a NoPE layer among rotating ones
      context = context.without_rotation()

    def attention(in_BTD):  # (output, the cache's update or the probe's peak logit)
      if cache is None and not probe:
        return self.attention(in_BTD, context, mask, value_residual=value_residual), None
      return self.attention(
        in_BTD, context, mask, cache, value_residual=value_residual, probe=probe
      )

    x_BTD, extra = self._residual(x_BTD, attention, self.attention_norm, self.attention_out_norm)
    x_BTD, stats = self._residual(x_BTD, self._ffn, self.ffn_norm, self.ffn_out_norm)
    if probe:
      return x_BTD, {**(stats or {}), 'max_attention_logit': extra}, None
    return x_BTD, stats, extra


class Transformer(nnx.Module):
  """`model(tokens[B, T], positions=None, segment_ids=None) -> logits[B, T, vocab]` (float32;
  with `float32_logits=False` in the compute dtype, for a loss that upcasts inside its own passes:
  mllm/ops/cross_entropy.py).

  positions default to 0..T−1; pass per-document positions for packed sequences (with segment_ids,
  so no token attends across documents) or offset positions when continuing a sequence.
  With `return_moe_stats=True`: (logits, stats), stats the MoE layers' routing statistics stacked
  in layer order (`self.moe_layers`): tokens_per_expert [L, E], mean_prob [L, E], z_loss [L], ...
  ({} for a dense model); with `probe_attention=True` also each layer's largest attention logit,
  max_attention_logit [L] (mllm/ops/xla_attention.max_logit: the evaluation step's).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    # Built in the order the parts draw from `rngs`; a fast init builds them one program at a
    # time in the same order (mllm/train/state.py), so both give the same parameters.
    for name, part in make_stem(cfg, rngs=rngs).items():
      setattr(self, name, part)
    self.window = cfg.attention.sliding_window
    self.cache_window = rolling_window(cfg)  # the KV cache's rolling buffer, if any
    # What the cache keeps per token and layer: (heads, dims) of its k and of its v.
    self.cache_dims = ATTENTIONS[cfg.attention.kind].cache_dims(cfg)
    self.scan_layers = cfg.scan_layers
    self.scan_unroll = cfg.scan_unroll
    self.layer_period = layer_period(cfg)  # what one scanned iteration's layers attend with
    self.output_multiplier = output_multiplier(cfg)  # µP: 1/m (parametrization.py); else 1
    self.final_logit_softcap = cfg.final_logit_softcap
    self.moe_layers = tuple(moe_layers(cfg))
    if cfg.scan_layers:
      # One Block whose parameters carry a leading 'layers' axis; __call__ scans over it, so XLA
      # compiles one layer instead of n_layers copies. (Validation: all MoE or all dense.)
      @nnx.split_rngs(splits=cfg.n_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_blocks(rngs):
        return Block(cfg, moe=bool(self.moe_layers), rngs=rngs)

      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List(
        [Block(cfg, moe=i in self.moe_layers, layer=i, rngs=rngs) for i in range(cfg.n_layers)]
      )
    for name, part in make_tail(cfg, rngs=rngs).items():
      setattr(self, name, part)
    self.embed_scale = cfg.embed_scale
    self.remat = cfg.remat

  def __call__(
    self,
    tokens_BT: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    return_moe_stats: bool = False,
    cache: KVCache | None = None,
    float32_logits: bool = True,
    probe_attention: bool = False,
    next_tokens: jax.Array | None = None,
  ):
    if positions is None:
      positions = self._default_positions(tokens_BT, cache)
    x_BTD = self.embed(tokens_BT)
    if self.embed_scale != 1.0:  # e.g. √d: token vectors on the scale of added sinusoids
      x_BTD = x_BTD * jnp.asarray(self.embed_scale, x_BTD.dtype)
    # Padding in a cached pass has position −1: embedded at 0 (finite), never attended or cached.
    x_BTD = self.embed_dropout(self.position.embed(x_BTD, jnp.maximum(positions, 0)))
    if cache is None:
      context = self.position.context(positions, positions)
      mask = AttentionMask(
        causal=True, window=self.window, q_segment_ids=segment_ids, kv_segment_ids=segment_ids
      )
      writes = None
    else:
      context, mask, writes, new_positions = self._cached_context(positions, cache)
    h_BTD, stats, kv = self._blocks(x_BTD, context, mask, cache, writes, probe_attention)
    x_BTD = h_BTD if self.final_norm is None else self.final_norm(h_BTD)
    logits_BTV = self._logits(x_BTD, float32_logits)
    if next_tokens is not None and self.mtp is not None:  # training's second-next-token logits
      next_BTD = self.embed(next_tokens)
      if self.embed_scale != 1.0:
        next_BTD = next_BTD * jnp.asarray(self.embed_scale, next_BTD.dtype)
      mtp_BTD = self.mtp(h_BTD, next_BTD, context, mask)
      stats = {**(stats or {}), 'mtp_logits': self._logits(mtp_BTD, float32_logits)}
    if cache is not None:
      new_cache = KVCache(k=kv[0], v=kv[1], positions=new_positions)
      return logits_BTV, new_cache
    return (logits_BTV, stats or {}) if return_moe_stats else logits_BTV

  def _logits(self, x_BTD, float32_logits: bool):
    """The head's logits of final hidden states x: tied or untied, µP's multiplier, the soft cap."""
    logits_BTV = self.embed.attend(x_BTD) if self.head is None else self.head(x_BTD)
    if self.output_multiplier != 1.0:
      logits_BTV = logits_BTV * jnp.asarray(self.output_multiplier, logits_BTV.dtype)
    if self.final_logit_softcap is not None:  # Gemma 2 (Team et al. 2024): cap · tanh(z / cap)
      capped = softcapped(logits_BTV.astype(jnp.float32), self.final_logit_softcap)
      logits_BTV = capped.astype(logits_BTV.dtype)
    return logits_BTV.astype(jnp.float32) if float32_logits else logits_BTV

  def _default_positions(self, tokens_BT, cache: KVCache | None):
    """0..T−1, or with a cache each sequence's next positions after the latest it holds."""
    B, T = tokens_BT.shape
    if cache is not None:  # each sequence continues after the latest position in its cache
      start_B = jnp.max(cache.positions, axis=1) + 1
      return start_B[:, None] + jnp.arange(T, dtype=jnp.int32)
    table = self.position.max_positions
    if table is not None and table < T:
      raise ValueError(
        f'sequence length {T} exceeds model.max_seq_len={table}, the '
        'size of the learned position table'
      )
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  def _cached_context(self, positions, cache: KVCache):
    """(position context, mask, (the cache writes, whether they come first), the cache's new
    positions) of a pass that reads and extends `cache`."""
    slots = write_slots(positions, cache.size)
    writes = plan_writes(slots, cache.size)
    first = writes_first(positions.shape[1], self.cache_window)
    new_positions = scatter(cache.positions, positions, writes)
    kv_positions = new_positions if first else jnp.concatenate([cache.positions, positions], axis=1)
    context = self.position.context(positions, kv_positions)
    mask = AttentionMask(
      causal=True, window=self.window, q_positions=positions, kv_positions=kv_positions
    )
    return context, mask, (writes, first), new_positions

  def _blocks(self, x_BTD, context, mask, cache: KVCache | None, writes, probe: bool = False):
    """(x after every block, the blocks' statistics stacked in layer order, the cache's (k, v))."""
    if self.scan_layers:
      return _scan_blocks(
        x_BTD,
        self.blocks,
        context,
        mask,
        self.remat,
        None if cache is None else (cache, *writes),
        unroll=self.scan_unroll,
        probe=probe,
        period=self.layer_period,
        value_mix=None if self.value_mix is None else self.value_mix.weights[...],
      )
    per_layer, peaks = [], []  # MoE layers' stats (in some layers only); every layer's peak logit
    kv = None if cache is None else (cache.k, cache.v)
    # The first layer's values of these tokens, for the later layers' value residual.
    first_BTKH = None if self.value_mix is None else self.blocks[0].first_values(x_BTD)
    for i, block in enumerate(self.blocks):
      layer_cache = None if cache is None else LayerCache(*kv, i, *writes)
      residual = None  # layer 0 attends with the values just projected, the rest mix them in
      if first_BTKH is not None:
        residual = (first_BTKH, self.value_mix.weights[i - 1] if i else None)
      x_BTD, layer_stats, layer_kv = _call_block(
        block, x_BTD, context, mask, self.remat, layer_cache, probe, residual
      )
      layer_stats = dict(layer_stats or {})
      if probe:
        peaks.append(layer_stats.pop('max_attention_logit'))
      if layer_stats:
        per_layer.append(layer_stats)
      kv = layer_kv
    stats = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer) if per_layer else {}
    if peaks:
      stats['max_attention_logit'] = jnp.stack(peaks)
    return x_BTD, stats, kv


def _table_init(cfg):
  """The initializer of the embedding and the head."""
  return initializers.normal(weight_std(cfg, 'table'))


def make_stem(cfg, *, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
  """The Transformer's modules before its blocks, by attribute name, built in that order."""
  return {
    'embed': nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.dtype(cfg.param_dtype),
      embedding_init=_table_init(cfg),
      rngs=rngs,
      embedding_metadata={'logical_axes': ('vocab', 'embed')},
    ),
    'position': POSITIONS[cfg.position.kind].from_config(cfg, rngs=rngs),
    'embed_dropout': nnx.Dropout(cfg.embed_dropout, rngs=rngs),
  }


def make_tail(cfg, *, rngs: nnx.Rngs) -> dict[str, nnx.Module | None]:
  """The Transformer's modules after its blocks, by attribute name, built in that order."""
  param_dtype = jnp.dtype(cfg.param_dtype)
  final_norm = (
    NORMS[cfg.norm.kind].from_config(cfg, cfg.d_model, rngs=rngs) if cfg.norm.final_norm else None
  )
  head = (
    None
    if cfg.tie_embeddings
    else nnx.Linear(
      cfg.d_model,
      cfg.vocab_size,
      use_bias=False,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=param_dtype,
      kernel_init=_table_init(cfg),
      rngs=rngs,
      kernel_metadata={'logical_axes': ('embed', 'vocab')},
    )
  )
  value_mix = (
    ValueMix(cfg.n_layers, param_dtype)
    if cfg.attention.value_residual and cfg.n_layers > 1
    else None
  )
  mtp = MTPModule(cfg, rngs=rngs) if cfg.multi_token_prediction else None
  return {'final_norm': final_norm, 'head': head, 'value_mix': value_mix, 'mtp': mtp}


def _call_block(
  block: Block, x_BTD, context, mask, remat: str, cache=None, probe=False, value_residual=None
):
  if remat == 'none' or cache is not None:  # decoding keeps no activations for a backward pass
    return block(x_BTD, context, mask, cache, probe, value_residual)
  return nnx.remat(
    lambda b, x: b(x, context, mask, probe=probe, value_residual=value_residual),
    policy=REMAT_POLICIES[remat],
  )(block, x_BTD)


def _scan_blocks(
  x_BTD,
  blocks: Block,
  context,
  mask,
  remat: str,
  cached=None,
  unroll: int = 1,
  probe=False,
  period: tuple = ((None, True),),
  value_mix=None,
):
  """(x, stats stacked over the layers, the updated cache's (k, v) or None). Each loop iteration
  runs one `period` of layers (attention.py's `layer_period`: the per-layer patterns repeat every
  len(period) layers), layer p of it with period[p]'s (window, whether it rotates), merged from
  the stacked parameters. With a cache, the (k, v) of all layers ride in the carry and each layer
  writes its slots in place. `value_mix`: the value residual's λ of layers 1..L−1 [L − 1, 2]
  (layer 0 mixes with (1, 0): it attends with its own values, V_1). `unroll` layers (1: one period; else a
  multiple of it) run in each iteration (jax.lax.scan's unroll): fewer loop-carried copies, and
  XLA fuses across them."""
  graphdef, state = nnx.split(blocks)
  size = len(period)
  n_layers = jax.tree.leaves(state)[0].shape[0]

  def grouped(x):  # [L, ...] -> [L / period, period, ...]
    return x.reshape(n_layers // size, size, *x.shape[1:])

  def layers(x):  # and back
    return x.reshape(n_layers, *x.shape[2:])

  cache, writes, first = (None, None, None) if cached is None else cached
  residual, mixes = None, None
  if value_mix is not None:
    first_layer = nnx.merge(graphdef, jax.tree.map(lambda x: x[0], state))
    own = jnp.asarray([[1, 0]], value_mix.dtype)
    residual = first_layer.first_values(x_BTD)
    mixes = grouped(jnp.concatenate([own, value_mix]))

  def body(carry, xs):
    x_BTD, kv = carry
    group, index, mix = xs
    states, stats = [], []
    for p, (window, rotates) in enumerate(period):
      block = nnx.merge(graphdef, jax.tree.map(lambda x, p=p: x[p], group))
      block.window, block.rotates = window, rotates
      layer_cache = None if cache is None else LayerCache(*kv, index[p], writes, first)
      value_residual = None if residual is None else (residual, mix[p])
      x_BTD, layer_stats, layer_kv = _call_block(
        block, x_BTD, context, mask, remat, layer_cache, probe, value_residual
      )
      kv = kv if cache is None else layer_kv
      states.append(nnx.state(block))
      stats.append(layer_stats)
    return (x_BTD, kv), (_stacked(states), None if stats[0] is None else _stacked(stats))

  kv = None if cache is None else (cache.k, cache.v)
  index = grouped(jnp.arange(n_layers))
  (x_BTD, kv), (new_state, stats) = jax.lax.scan(
    body, (x_BTD, kv), (jax.tree.map(grouped, state), index, mixes), unroll=max(1, unroll // size)
  )
  nnx.update(blocks, jax.tree.map(layers, new_state))
  return x_BTD, None if stats is None else jax.tree.map(layers, stats), kv


def _stacked(trees: list):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def build_model(config, *, rngs: nnx.Rngs) -> Transformer:
  """Build the transformer `config` (the full config or its `model` part) names; validate it
  first unless it is a RunConfig (load_config validated it), and check it runs on this backend."""
  from mllm.config import is_validated
  from mllm.validation import check_backend, validate_model

  model_cfg = config.model if 'model' in config else config
  if not is_validated(config):
    validate_model(model_cfg)
  check_backend(model_cfg, data=config.get('data') if 'model' in config else None)
  return Transformer(model_cfg, rngs=rngs)


def rng_stand_ins(abstract_model) -> nnx.State:
  """Concrete stand-ins for the model's RNG streams: the step reseeds them before every use."""
  key_data_shape = jax.random.key_data(jax.random.key(0)).shape

  def concrete(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.zeros(x.shape + key_data_shape, jnp.uint32))
    return jnp.zeros(x.shape, x.dtype)

  _, _, rest = nnx.split(abstract_model, CHECKPOINTED, ...)
  return jax.tree.map(concrete, rest)
