"""`launch.py --mode=summary`: what a config builds, how big it is, and one timed forward pass."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from mllm.accounting import count_params, training_flops_per_token
from mllm.config import config_diff
from mllm.layers.attention import ATTENTIONS, layer_windows
from mllm.layers.ffn import hidden_dim
from mllm.layers.moe import expert_hidden_dim, moe_layers
from mllm.layers.moe_experts import resolve_dispatch
from mllm.layers.positions import POSITIONS, rotating_layers
from mllm.model import build_model, dense_ffn_kind
from mllm.train.optimizer import describe_optimizer, peak_learning_rate, trained_params


def _attention_kind(m, layer: int | None = None) -> str:
  """The attention of the model config `m`, as `layer` has it (its window) when given."""
  family = ATTENTIONS[m.attention.kind]
  kind = family.describe(m)
  qk_dim, v_dim = family.head_dims(m)
  extras = [f'd_head {qk_dim}' if qk_dim == v_dim else f'd_head {qk_dim}, d_v {v_dim}']
  window = m.attention.sliding_window if layer is None else layer_windows(m)[layer]
  if window:
    extras.append(f'window {window}')
  elif layer is not None and m.attention.sliding_window:
    extras.append('global')
  if m.attention.qk_norm:
    extras.append('qk-norm')
  if m.attention.logit_softcap is not None:
    extras.append(f'logit soft cap {m.attention.logit_softcap:g}')
  if m.attention.output_gate is not None:
    extras.append(f'{m.attention.output_gate} output gate')
  if m.attention.value_residual:
    extras.append('value residual')
  if m.attention.sinks:
    extras.append('sinks')
  if m.attention.global_every and layer is None:
    extras.append(f'layers {m.attention.global_every}, {2 * m.attention.global_every}, ... global')
  return f"{kind} ({', '.join(extras)})"


def _training_choices(config) -> str:
  """The parametrization and the output's stabilisers (README's variant table names each)."""
  m = config.model
  if m.parametrization.kind == 'mup':
    kind = f'mup parametrization (base d_model {m.parametrization.mup.base_d_model})'
  else:
    kind = 'standard parametrization'
  base = m.parametrization.standard.lr_base_d_model
  if m.parametrization.kind == 'standard' and base is not None:
    rate = f'peak rate {config.train.learning_rate:g} × {base}/{m.d_model} = {peak_learning_rate(config):.3g}'
  else:
    rate = f'peak rate {peak_learning_rate(config):g}'
  parts = [kind, rate]
  if config.train.z_loss_coef:
    parts.append(f'output z-loss {config.train.z_loss_coef:g}')
  if m.final_logit_softcap is not None:
    parts.append(f'final-logit soft cap {m.final_logit_softcap:g}')
  if m.attention.logit_softcap is not None:
    parts.append(f'attention-logit soft cap {m.attention.logit_softcap:g}')
  if m.multi_token_prediction:
    t = config.train
    parts.append(
      f'multi-token prediction (weight {t.mtp_coef:g} → {t.mtp_coef_final:g} at '
      f'{t.mtp_switch_at:g} of the steps)'
    )
  return ', '.join(parts)


def _moe_kind(m) -> str:
  moe = m.ffn.moe
  d_ff = expert_hidden_dim(m)
  text = (
    f'moe {moe.num_experts}×{moe.expert.kind} top-{moe.top_k} d_ff={d_ff} '
    f'{resolve_dispatch(moe.dispatch)}'
  )
  if moe.num_shared_experts:
    text += f' +{moe.num_shared_experts} shared'
  return text


def _module_params(state) -> int:
  return sum(int(np.prod(leaf.shape)) for _, leaf in nnx.to_flat_state(state))


def layer_table(config, model) -> Table:
  """One row per module of the stack: embedding, each layer, final norm, head."""
  m = config.model
  params = nnx.state(model, nnx.Param)
  table = Table(title='Layers', show_lines=False)
  for column in ('module', 'attention', 'positions', 'ffn', 'norm', 'params'):
    table.add_column(column, justify='right' if column == 'params' else 'left')
  table.add_row('embed', '', '', '', '', f"{_module_params(params['embed']):,}")
  if 'position' in params:
    table.add_row(
      'position',
      '',
      POSITIONS[m.position.kind].describe(m),
      '',
      '',
      f"{_module_params(params['position']):,}",
    )
  dense_kind = dense_ffn_kind(m)
  dense_ffn = f'{dense_kind} d_ff={hidden_dim(m.ffn, m.d_model, dense_kind)}'
  moe_ffn = _moe_kind(m) if moe_layers(m) else ''
  sparse = set(moe_layers(m))
  norm = f'{m.norm.kind} {m.norm.placement}-LN'
  if m.scan_layers:
    per_layer = [_module_params(params['blocks']) // m.n_layers] * m.n_layers
  else:
    per_layer = [_module_params(params['blocks'][i]) for i in range(m.n_layers)]
  for i, count in enumerate(per_layer):
    ffn = moe_ffn if i in sparse else dense_ffn
    positions = POSITIONS[m.position.kind].describe(m)
    if not rotating_layers(m)[i]:
      positions = 'NoPE (no rotation in this layer)'
    table.add_row(
      f'layer {i}',
      _attention_kind(m, i),
      positions,
      ffn,
      norm,
      f'{count:,}',
    )
  if 'final_norm' in params:
    table.add_row(
      'final_norm', '', '', '', m.norm.kind, f"{_module_params(params['final_norm']):,}"
    )
  head = 'tied to embed' if m.tie_embeddings else f"{_module_params(params['head']):,}"
  table.add_row('head', '', '', '', '', head)
  return table


def time_forward(model, tokens, repeats: int = 5) -> dict:
  """Compile and run `model(tokens)` under jax.jit: compile time and median run time."""
  model.eval()
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  start = time.perf_counter()
  compiled = forward.lower(state, tokens).compile()
  compile_s = time.perf_counter() - start
  times, logits = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    logits = jax.block_until_ready(compiled(state, tokens))
    times.append(time.perf_counter() - start)
  return dict(compile_s=compile_s, run_s=statistics.median(times), logits=logits)


def summarize(
  config,
  base_config=None,
  *,
  spec: str = '',
  console: Console | None = None,
  run_forward: bool = True,
) -> dict:
  """Print the config diff, layer table, parameter counts, FLOPs/token and a timed forward pass."""
  console = console or Console(width=None if Console().is_terminal else 120)
  m = config.model
  console.rule(f'[bold]mllm summary[/] {spec}')
  if base_config is not None:
    diff = config_diff(config, base_config)
    table = Table(title='Config vs configs/base.py')
    for column in ('key', 'base', 'this config'):
      table.add_column(column)
    for key, (old, new) in sorted(diff.items()):
      table.add_row(key, repr(old), repr(new))
    if not diff:
      table.add_row('(no differences)', '', '')
    console.print(table)

  model = build_model(config, rngs=nnx.Rngs(config.seed))
  console.print(layer_table(config, model))
  counts = count_params(model)
  seq_len = config.data.seq_len
  flops = training_flops_per_token(config, counts, seq_len)
  console.print(
    f'parameters: {counts.total:,} total = {counts.embedding:,} embedding + '
    f'{counts.non_embedding:,} non-embedding'
    + (
      f'; {counts.active:,} active per token (top-{m.ffn.moe.top_k} of {m.ffn.moe.num_experts} experts)'
      if counts.active != counts.total
      else ''
    )
  )
  console.print(f'optimizer: {describe_optimizer(config.train, trained_params(model))}')
  console.print(f'training choices: {_training_choices(config)}')
  console.print(
    f'training FLOPs/token at seq_len {seq_len}: {flops.total:.4g} '
    f"(6·N{'_active' if counts.active != counts.total else ''} {flops.dense:.4g} + "
    f'attention {flops.attention:.4g})'
  )
  result = dict(params=counts, flops=flops)
  if run_forward:
    batch = config.data.batch_size
    tokens = jax.random.randint(
      jax.random.key(config.seed), (batch, seq_len), 0, m.vocab_size, dtype=jnp.int32
    )
    timing = time_forward(model, tokens)
    logits = timing['logits']
    finite = bool(jnp.all(jnp.isfinite(logits)))
    console.print(
      f'forward on random tokens [{batch}, {seq_len}] ({jax.default_backend()}): compile '
      f"{timing['compile_s']:.2f} s, run {timing['run_s'] * 1e3:.1f} ms (median of 5), "
      f"{batch * seq_len / timing['run_s']:,.0f} tokens/s; logits {list(logits.shape)} "
      f"{logits.dtype}, {'all finite' if finite else 'NOT FINITE'}"
    )
    result.update(timing, finite=finite)
  return result
