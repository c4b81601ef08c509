"""Hugging Face import and export at real sizes: time and peak host memory.

    python -m benchmarks.hf_interop                 # results/hf_interop-<backend>.md
    python -m benchmarks.hf_interop --sizes=125m    # one size

Protocol: a Llama-shaped model (random weights: no checkpoint is downloaded) is written once as a
bfloat16 transformers folder by `to_hf`; then, each in a fresh process, `from_hf` (float32
parameters) and `to_hf` (bfloat16) of it are timed, and the process's peak resident memory above
its level after importing mllm (`ru_maxrss`) is read. The import reads one tensor at a time, so
its peak should be the parameters plus about one tensor, not the file plus the parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

# name: (d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab) — GPT-2-small-like width with
# Llama's vocabulary, and TinyLlama-1.1B's shape.
SIZES = {'125m': (768, 12, 12, 12, 2048, 32000), '1.1b': (2048, 22, 32, 4, 5632, 32000)}


def overrides(size: str) -> dict:
  d, layers, heads, kv, d_ff, vocab = SIZES[size]
  return {
    'model.d_model': d,
    'model.n_layers': layers,
    'model.n_heads': heads,
    'model.n_kv_heads': kv,
    'model.ffn.d_ff': d_ff,
    'model.ffn.match_params': False,
    'model.vocab_size': vocab,
    'model.max_seq_len': 2048,
    'model.tie_embeddings': False,
    'data.seq_len': 2048,
  }


def _rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss_bytes() -> int:
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def one(step: str, size: str, path: str) -> dict:
  """In this process: write (`make`), import or export; seconds and peak memory above start."""
  import jax
  from flax import nnx

  import mllm
  from mllm.interop import hf

  start_rss = _current_rss_bytes()
  t0 = time.perf_counter()
  if step == 'make':
    config = mllm.load_config(hf.base_config_path(), overrides(size))
    model = mllm.build_model(config.model, rngs=nnx.Rngs(0))
    hf.to_hf(config, model, path, dtype='bfloat16')
  elif step == 'import':
    _, model = hf.from_hf(path)
    jax.block_until_ready(nnx.state(model, nnx.Param))
  else:  # export
    config, model = hf.from_hf(path)
    jax.block_until_ready(nnx.state(model, nnx.Param))
    start_rss, t0 = _current_rss_bytes(), time.perf_counter()  # the export alone
    hf.to_hf(config, model, path + '-exported', dtype='bfloat16')
  seconds = time.perf_counter() - t0
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return {'seconds': seconds, 'peak_above_start': _rss_bytes() - start_rss, 'params': params}


def _run(step: str, size: str, path: str) -> dict:
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'benchmarks.hf_interop',
      f'--one={step}',
      f'--sizes={size}',
      f'--path={path}',
    ],
    capture_output=True,
    text=True,
    check=False,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
  )
  if proc.returncode:
    raise RuntimeError(proc.stderr[-2000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


HEADER = [
  'model',
  'params',
  'file GiB (bf16)',
  'params GiB (f32)',
  'import s',
  'import peak GiB',
  'largest tensor GiB (f32)',
  'export s',
  'export peak GiB',
]
GIB = 2**30


def measure(size: str) -> list[str]:
  """The table row of one size: its folder written, then imported and exported, each step in a
  fresh process."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'hf')
    _run('make', size, path)
    file_bytes = sum(
      os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith('.safetensors')
    )
    imported, exported = _run('import', size, path), _run('export', size, path)
    largest = max(_tensor_sizes(path).values())
  params = imported['params']
  return [
    size,
    f'{params / 1e6:,.0f}M',
    f'{file_bytes / GIB:.2f}',
    f'{4 * params / GIB:.2f}',
    f"{imported['seconds']:.1f}",
    f"{imported['peak_above_start'] / GIB:.2f}",
    f'{largest * 4 / GIB:.2f}',
    f"{exported['seconds']:.1f}",
    f"{exported['peak_above_start'] / GIB:.2f}",
  ]


def report(rows) -> None:
  """Print the table and write it to results/hf_interop-<backend>.md."""
  import jax
  from rich.console import Console
  from rich.table import Table

  from benchmarks.machine import describe

  table = Table(*HEADER, title='Hugging Face import / export')
  for row in rows:
    table.add_row(*row)
  Console().print(table)
  lines = [
    f'# Hugging Face import / export ({describe()})',
    '',
    'python -m benchmarks.hf_interop. A Llama-shaped random model written as a bfloat16 '
    'transformers folder; from_hf to float32 parameters, to_hf back to bfloat16; each in '
    'a fresh process; peak = ru_maxrss above the process\'s memory before the call.',
    '',
    '| ' + ' | '.join(HEADER) + ' |',
    '|' + '---|' * len(HEADER),
  ]
  lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
  os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
  out = os.path.join(os.path.dirname(__file__), 'results', f'hf_interop-{jax.default_backend()}.md')
  with open(out, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print(f'wrote {out}')


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--sizes', default=','.join(SIZES))
  parser.add_argument('--one', choices=('make', 'import', 'export'))
  parser.add_argument('--path')
  args = parser.parse_args()
  if args.one:  # a child process of _run
    print(json.dumps(one(args.one, args.sizes, args.path)))
    return
  report([measure(size) for size in args.sizes.split(',')])


def _tensor_sizes(path: str) -> dict[str, int]:
  """Each tensor's number of elements."""
  from safetensors import safe_open

  out = {}
  for f in os.listdir(path):
    if f.endswith('.safetensors'):
      with safe_open(os.path.join(path, f), 'np') as h:
        for name in h:
          shape = h.get_slice(name).get_shape()
          n = 1
          for s in shape:
            n *= s
          out[name] = n
  return out


if __name__ == '__main__':
  main()
