"""MoE dispatch costs: capacity vs dropless (ragged_dot) vs a dense FFN of the same ACTIVE size.

    python -m benchmarks.moe                   # results/moe-<backend>.md
    python -m benchmarks.moe --tokens=2048 --repeats=10

Forward+backward of one layer (loss = mean(y²) + the balancing and z losses) on [tokens, d_model]
inputs: the median time, the FLOPs XLA compiled (cost_analysis) and its scratch memory
(memory_analysis().temp_size_in_bytes). The dense baseline is a SwiGLU whose hidden size is
top_k × expert_d_ff, i.e. the FLOPs a token actually gets from its k experts. On CPU XLA expands
`jax.lax.ragged_dot` to a dense masked product (JAX_NOTES): every one of the T·k sorted rows is
multiplied by all E experts' weights, so dropless compiles to E× the active FLOPs there, which is
what `moe.dispatch=auto` must avoid on CPU. (The training-step
comparison of whole models comes with the model wiring of issue 10.)
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import jax
import jax.numpy as jnp
from flax import nnx
from rich.console import Console
from rich.table import Table

from benchmarks.machine import cpu_model
from benchmarks.timing import compile_and_time
from mllm.layers.ffn import FFNS
from mllm.layers.moe import MoE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (experts, top_k, expert_d_ff): coarse experts, then fine-grained ones (DeepSeekMoE-style).
CASES = [(4, 2, 512), (8, 2, 512), (16, 2, 512), (64, 8, 128)]


def _measure(module, x, repeats: int) -> dict:
  graphdef, params = nnx.split(module)

  def loss(params, x):
    net = nnx.merge(graphdef, params)
    if isinstance(net, MoE):
      y, inter = nnx.capture(net, nnx.Intermediate)(x)
      stats = inter['moe'].get_value()[-1]
      return jnp.mean(y ** 2) + 0.01 * stats['balance_loss'] + 1e-3 * stats['z_loss']
    return jnp.mean(net(x) ** 2)

  step = jax.jit(jax.value_and_grad(loss))
  timed = compile_and_time(step, params, x, repeats=repeats)
  cost = timed['compiled'].cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  temp = timed['compiled'].memory_analysis().temp_size_in_bytes
  return dict(ms=timed['median_s'] * 1e3, gflops=cost.get('flops', float('nan')) / 1e9,
              temp_mb=temp / 2**20, compile_s=timed['compile_s'])


def run_case(experts: int, k: int, d_ff: int, d_model: int, tokens: int, repeats: int):
  x = jax.random.normal(jax.random.key(0), (1, tokens, d_model), jnp.float32)
  dense = FFNS['swiglu'](d_model, k * d_ff, use_bias=False, init_std=0.02, out_std=0.02,
                         rngs=nnx.Rngs(0))
  rows = [dict(layer=f'dense swiglu d_ff={k * d_ff}', **_measure(dense, x, repeats))]
  for dispatch in ('capacity', 'dropless'):
    moe = MoE(d_model, num_experts=experts, top_k=k, expert_d_ff=d_ff, dispatch=dispatch,
              capacity_factor=1.25, rngs=nnx.Rngs(0))
    rows.append(dict(layer=f'moe {dispatch}', **_measure(moe, x, repeats)))
  base = rows[0]
  for row in rows:
    row.update(case=f'E={experts} top-{k} d_ff={d_ff}', vs_dense_time=row['ms'] / base['ms'],
               vs_dense_flops=row['gflops'] / base['gflops'])
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tokens', type=int, default=2048)
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--out', default=None, help='markdown file (default results/moe-<backend>.md)')
  args = parser.parse_args()
  console = Console()
  device = jax.devices()[0]
  machine = (f'{device.device_kind} ({jax.default_backend()}; {cpu_model()}, {os.cpu_count()} '
             f'cores), jax {jax.__version__}, Python {platform.python_version()}, '
             f'{datetime.date.today().isoformat()}')
  table = Table(title=f'MoE layer forward+backward, {args.tokens} tokens × d_model {args.d_model}')
  for col in ('case', 'layer', 'ms', '× dense time', 'GFLOP', '× dense FLOPs', 'scratch MB',
              'compile s'):
    table.add_column(col, justify='left' if col in ('case', 'layer') else 'right')
  lines = [f'# MoE dispatch costs ({jax.default_backend()})', '', f'Machine: {machine}.', '',
           f'Forward+backward of one layer on {args.tokens} tokens × d_model {args.d_model}, '
           f'median of {args.repeats} after a warm-up; capacity factor 1.25. FLOPs and scratch '
           "memory as XLA compiled them. `python -m benchmarks.moe` regenerates this file.", '',
           '| case | layer | ms | × dense time | GFLOP | × dense FLOPs | scratch MB | compile s |',
           '|---|---|---:|---:|---:|---:|---:|---:|']
  for experts, k, d_ff in CASES:
    for row in run_case(experts, k, d_ff, args.d_model, args.tokens, args.repeats):
      cells = [row['case'], row['layer'], f"{row['ms']:.1f}", f"{row['vs_dense_time']:.2f}",
               f"{row['gflops']:.2f}", f"{row['vs_dense_flops']:.2f}", f"{row['temp_mb']:.1f}",
               f"{row['compile_s']:.1f}"]
      table.add_row(*cells)
      lines.append('| ' + ' | '.join(cells) + ' |')
  console.print(table)
  out = args.out or os.path.join(ROOT, 'benchmarks', 'results', f'moe-{jax.default_backend()}.md')
  with open(out, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  console.print(f'wrote {out}')


if __name__ == '__main__':
  main()
