"""Forward+backward time of each architecture variant, one axis at a time, on the default config.

    python -m benchmarks.variants                       # every axis, results/variants-<backend>.md
    python -m benchmarks.variants --axis=norm --repeats=20

The RMSNorm paper reports RMSNorm 7-25% faster than LayerNorm in TensorFlow/PyTorch; under XLA the
normalizations fuse into neighbouring ops, so the gap may vanish. This measures it, and the cost of
every FFN and positional scheme, on whatever backend JAX finds. Timings are medians of `repeats`
steps after one warm-up step; compile time is reported separately.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

import jax
import optax
from flax import nnx
from rich.console import Console
from rich.table import Table

import mllm
from benchmarks.timing import compile_and_time
from mllm.accounting import count_params
from mllm.layers.ffn import FFNS
from mllm.layers.norms import NORMS
from mllm.layers.positions import POSITIONS

AXES = {
  'norm': ('norm', [k for k in NORMS if k != 'none'] + ['none']),
  'ffn': ('ffn', list(FFNS)),
  'pos': ('pos', list(POSITIONS)),
  'placement': ('placement', ['pre', 'post']),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_variant(choice: str, batch: int, seq_len: int, repeats: int) -> dict:
  config = mllm.load_config(
    os.path.join(ROOT, 'configs', 'base.py') + ':' + choice,
    {'data.seq_len': seq_len, 'data.batch_size': batch, 'model.max_seq_len': max(seq_len, 256)},
  )
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  step = jax.jit(jax.value_and_grad(loss_fn))
  tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, config.model.vocab_size)
  timed = compile_and_time(step, params, tokens, repeats=repeats)
  compile_s, step_s = timed['compile_s'], timed['median_s']
  return dict(
    choice=choice,
    params=count_params(model).total,
    compile_s=compile_s,
    step_ms=step_s * 1e3,
    tokens_per_s=batch * seq_len / step_s,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--axis', choices=list(AXES) + ['all'], default='all')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq_len', type=int, default=256)
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument(
    '--out', default=None, help='markdown file (default results/variants-<backend>.md)'
  )
  args = parser.parse_args()
  console = Console()
  axes = list(AXES) if args.axis == 'all' else [args.axis]
  device = jax.devices()[0]
  header = (
    f'{device.device_kind} ({jax.default_backend()}, {os.cpu_count()} CPU cores, '
    f'{platform.processor() or platform.machine()}), jax {jax.__version__}, '
    f'{datetime.date.today().isoformat()}'
  )
  lines = [
    f'# Variant step times: {header}',
    '',
    f'Default config (configs/base.py: d_model 256, 4 layers, 8 heads) with one choice '
    f'changed; forward+backward of next-token cross-entropy, batch {args.batch} × '
    f'{args.seq_len} tokens, float32, median of {args.repeats} steps after warm-up.',
    '',
  ]
  for axis in axes:
    key, values = AXES[axis]
    table = Table(title=f'{axis} ({header})')
    for column in ('variant', 'params', 'compile s', 'step ms', 'tokens/s', 'vs first'):
      table.add_column(column, justify='left' if column == 'variant' else 'right')
    lines += [
      f'## {axis}',
      '',
      '| variant | params | compile s | step ms | tokens/s | vs first |',
      '|---|---:|---:|---:|---:|---:|',
    ]
    first = None
    for value in values:
      r = time_variant(f'{key}={value}', args.batch, args.seq_len, args.repeats)
      first = first or r['step_ms']
      row = [
        value,
        f"{r['params']:,}",
        f"{r['compile_s']:.2f}",
        f"{r['step_ms']:.1f}",
        f"{r['tokens_per_s']:,.0f}",
        f"{r['step_ms'] / first:.2f}x",
      ]
      table.add_row(*row)
      lines.append('| ' + ' | '.join(row) + ' |')
    console.print(table)
    lines.append('')
  out = args.out or os.path.join(
    ROOT, 'benchmarks', 'results', f'variants-{jax.default_backend()}.md'
  )
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, 'w') as f:
    f.write('\n'.join(lines))
  console.print(f'wrote {out}')


if __name__ == '__main__':
  main()
