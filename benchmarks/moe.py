"""MoE dispatch costs: capacity vs dropless (ragged_dot, tiled) vs a dense FFN of the same ACTIVE size.

    python -m benchmarks.moe                   # results/moe-{layer,step}-<backend>.md
    python -m benchmarks.moe --part=step --repeats=10

Two parts, each against a dense baseline whose SwiGLU hidden size is top_k × expert_d_ff (the
FLOPs a token actually gets from its k experts):
- layer: forward+backward of one layer (loss = mean(y²) + the balancing and z losses) on
  [tokens, d_model] inputs;
- step: mllm's whole training step (`mllm.train.step.benchmark_step`: forward, backward, AdamW)
  of configs/base.py with ffn=moe in every layer, against the same model with the dense FFN.
Each row: the median time, tokens/s, the FLOPs XLA compiled (cost_analysis) and its scratch memory
(memory_analysis().temp_size_in_bytes). On CPU XLA expands `jax.lax.ragged_dot` to a dense masked
product (measured here): every one of the T·k sorted rows is multiplied by all E experts' weights, so
dropless compiles to E× the active FLOPs there, which `moe.dispatch=auto` avoids on CPU; the tiled
grouped matmul (`moe.grouped_matmul=tiled`, MegaBlocks' padding to whole tiles) computes at most
E·128 extra rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx
from rich.console import Console
from rich.table import Table

from benchmarks.machine import describe
from mllm.layers.ffn import FFNS
from mllm.layers.moe import MoE
from mllm.layers.moe_routing import load_balancing_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (experts, top_k, expert_d_ff): coarse experts, then fine-grained ones (DeepSeekMoE-style).
CASES = [(4, 2, 512), (8, 2, 512), (16, 2, 512), (64, 8, 128)]


def _costs(timed: dict, tokens: int) -> dict:
  cost = timed['compiled'].cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  temp = timed['compiled'].memory_analysis().temp_size_in_bytes
  return dict(
    ms=timed['median_s'] * 1e3,
    tok_s=tokens / timed['median_s'],
    gflops=cost.get('flops', float('nan')) / 1e9,
    temp_mb=temp / 2**20,
    compile_s=timed['compile_s'],
  )


def _setup_layer(module, x) -> dict:
  """Forward+backward of one layer, compiled; `run()` times one call."""
  graphdef, params = nnx.split(module)

  def loss(params, x):
    net = nnx.merge(graphdef, params)
    if isinstance(net, MoE):
      y, stats = net(x)
      balance = load_balancing_loss(stats['tokens_per_expert'], stats['mean_prob'], net.k)
      return jnp.mean(y**2) + 0.01 * balance + 1e-3 * stats['z_loss']
    return jnp.mean(net(x) ** 2)

  start = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
  compile_s = time.perf_counter() - start

  def run() -> float:
    begin = time.perf_counter()
    jax.block_until_ready(compiled(params, x))
    return time.perf_counter() - begin

  run()  # warm-up
  return dict(run=run, compiled=compiled, compile_s=compile_s, tokens=x.shape[0] * x.shape[1])


def _interleaved(case: str, setups: dict, repeats: int, base: dict | None = None) -> list[dict]:
  """One call of each variant in turn, `repeats` times, so that load from elsewhere on the
  machine hits all alike; rows with the median time, relative to `base` (default: the first
  row, the dense variant)."""
  times = {name: [] for name in setups}
  for _ in range(repeats):
    for name, setup in setups.items():
      times[name].append(setup['run']())
  rows = []
  for name, setup in setups.items():
    timed = dict(
      compiled=setup['compiled'],
      compile_s=setup['compile_s'],
      median_s=statistics.median(times[name]),
    )
    rows.append(dict(case=case, layer=name, **_costs(timed, setup['tokens'])))
  base = base or rows[0]
  for row in rows:
    row.update(vs_dense_time=row['ms'] / base['ms'], vs_dense_flops=row['gflops'] / base['gflops'])
  return rows


def run_case(experts: int, k: int, d_ff: int, d_model: int, tokens: int, repeats: int):
  """One layer: dense (d_ff = k·expert_d_ff) vs MoE capacity vs dropless."""
  x = jax.random.normal(jax.random.key(0), (1, tokens, d_model), jnp.float32)
  dense = FFNS['swiglu'](
    d_model, k * d_ff, use_bias=False, init_std=0.02, out_std=0.02, rngs=nnx.Rngs(0)
  )
  moe = {
    name: MoE(
      d_model,
      num_experts=experts,
      top_k=k,
      expert_d_ff=d_ff,
      dispatch=dispatch,
      grouped_matmul=matmul,
      capacity_factor=1.25,
      rngs=nnx.Rngs(0),
    )
    for name, dispatch, matmul in (
      ('capacity', 'capacity', 'ragged_dot'),
      ('dropless', 'dropless', 'ragged_dot'),
      ('tiled', 'dropless', 'tiled'),
    )
  }
  case = f'E={experts} top-{k} d_ff={d_ff}'
  rows = _interleaved(
    case,
    {
      f'dense swiglu d_ff={k * d_ff}': _setup_layer(dense, x),
      'moe capacity': _setup_layer(moe['capacity'], x),
    },
    repeats,
  )
  # Dropless alone: its scratch (up to GBs on CPU) would slow the rows it alternated with.
  return rows + _interleaved(
    case,
    {
      'moe dropless': _setup_layer(moe['dropless'], x),
      'moe dropless, tiled': _setup_layer(moe['tiled'], x),
    },
    max(3, repeats // 3),
    base=rows[0],
  )


def _step_config(overrides: dict):
  import mllm

  base = {'data.document_mask': False, 'train.warmup_steps': 0, 'model.ffn.match_params': False}
  return mllm.load_config(os.path.join(ROOT, 'configs', 'base.py'), {**base, **overrides})


def _setup_step(config) -> dict:
  """The library's jitted training step, compiled; `run()` times one step (the state, donated,
  is threaded through)."""
  from mllm.train.step import benchmark_step

  step_fn, state, batch = benchmark_step(config)
  start = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  box = [state]

  def run() -> float:
    begin = time.perf_counter()
    box[0], metrics = compiled(box[0], batch)
    jax.block_until_ready(metrics['loss'])
    return time.perf_counter() - begin

  run()  # warm-up
  return dict(
    run=run,
    compiled=compiled,
    compile_s=compile_s,
    tokens=config.data.batch_size * config.data.seq_len,
  )


def step_cases(experts: int, k: int, d_ff: int, repeats: int, dropless: bool):
  """Whole training steps: dense (d_ff = k·expert_d_ff) vs MoE capacity (vs dropless)."""
  variants = {f'dense swiglu d_ff={k * d_ff}': _step_config({'model.ffn.d_ff': k * d_ff})}
  for dispatch in ('capacity', 'dropless') if dropless else ('capacity',):
    variants[f'moe {dispatch}'] = _step_config(
      {
        'model.ffn.kind': 'moe',
        'model.ffn.moe.num_experts': experts,
        'model.ffn.moe.top_k': k,
        'model.ffn.moe.expert_d_ff': d_ff,
        'model.ffn.moe.dispatch': dispatch,
        'model.ffn.moe.capacity_factor': 1.25,
      }
    )
  setups = {name: _setup_step(config) for name, config in variants.items()}
  return _interleaved(f'E={experts} top-{k} d_ff={d_ff}', setups, repeats)


def _section(title: str, rows, console, lines) -> None:
  table = Table(title=title)
  for col in (
    'case',
    'layer',
    'ms',
    'tokens/s',
    '× dense time',
    'GFLOP',
    '× dense FLOPs',
    'scratch MB',
    'compile s',
  ):
    table.add_column(col, justify='left' if col in ('case', 'layer') else 'right')
  lines += [
    '| case | variant | ms | tokens/s | × dense time | GFLOP | × dense FLOPs | '
    'scratch MB | compile s |',
    '|---|---|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for row in rows:
    cells = [
      row['case'],
      row['layer'],
      f"{row['ms']:.1f}",
      f"{row['tok_s']:,.0f}",
      f"{row['vs_dense_time']:.2f}",
      f"{row['gflops']:.2f}",
      f"{row['vs_dense_flops']:.2f}",
      f"{row['temp_mb']:.1f}",
      f"{row['compile_s']:.1f}",
    ]
    table.add_row(*cells)
    lines.append('| ' + ' | '.join(cells) + ' |')
  console.print(table)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--part', choices=('layer', 'step', 'all'), default='all')
  parser.add_argument('--tokens', type=int, default=2048)
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--out_dir', default=os.path.join(ROOT, 'benchmarks', 'results'))
  args = parser.parse_args()
  console = Console()
  backend = jax.default_backend()
  machine = describe()
  header = [
    f'Machine: {machine}.',
    '',
    f'Median of {args.repeats} after a warm-up; capacity factor 1.25; FLOPs and scratch '
    'memory as XLA compiled them. `python -m benchmarks.moe --part=PART` regenerates '
    'this file.',
    '',
  ]
  if args.part in ('layer', 'all'):
    title = f'One MoE layer, forward+backward, {args.tokens} tokens × d_model {args.d_model}'
    lines = [f'# {title} ({backend})', ''] + header
    rows = [
      row
      for experts, k, d_ff in CASES
      for row in run_case(experts, k, d_ff, args.d_model, args.tokens, args.repeats)
    ]
    _section(title, rows, console, lines)
    _write(os.path.join(args.out_dir, f'moe-layer-{backend}.md'), lines, console)
  if args.part in ('step', 'all'):
    config = _step_config({})
    title = (
      f'Whole training step (configs/base.py: d_model {config.model.d_model}, '
      f'{config.model.n_layers} layers, batch {config.data.batch_size} × '
      f'{config.data.seq_len} tokens), MoE in every layer'
    )
    lines = [f'# {title} ({backend})', ''] + header
    # Dropless whole steps only where they finish in seconds on a CPU (E× the FLOPs there).
    rows = [
      row
      for experts, k, d_ff in CASES
      for row in step_cases(
        experts, k, d_ff, args.repeats, dropless=backend != 'cpu' or experts <= 8
      )
    ]
    _section(title, rows, console, lines)
    _write(os.path.join(args.out_dir, f'moe-step-{backend}.md'), lines, console)


def _write(path: str, lines: list[str], console) -> None:
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  console.print(f'wrote {path}')


if __name__ == '__main__':
  main()
