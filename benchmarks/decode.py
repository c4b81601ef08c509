"""Decoding costs: the KV cache against recomputation, cache bytes per attention variant, and the
jitted decode loop's tokens/s.

    python -m benchmarks.decode            # results/decode-<backend>.md
    python -m benchmarks.decode --repeats=9

Protocol: configs/rope_swiglu.py weights (random init, float32), greedy, EOS ignored, compile and
warm-up excluded, median of `--repeats` runs, prefill reported apart from decode.
(1) One new token's latency at a growing context: a cached step (q_len 1 against the cache)
    against recomputing the whole forward pass, batch 1 and 8; and the cache's bytes with a full
    cache against a sliding-window rolling buffer (W = 64), which stays flat.
(2) KV-cache bytes for MHA, GQA and MQA at the same d_model against 2·layers·n_kv·d_head·len·
    batch·bytes (the positions, 4 bytes a slot, are counted apart).
(3) End to end: `generate_tokens` (chunked prefill, then one jitted while_loop) tokens/s.
(4) Against Hugging Face transformers' `generate()` (`pip install torch transformers`; skipped
    with a note if absent): the same Llama-shaped model with the same weights
    (benchmarks/hf_llama.py), float32, greedy, EOS ignored, both sides on all cores, at 4.9 M and
    32 M parameters, batch 1 and 8, in one run; checks that both produce the same tokens.
(5) `--only_125m` (a GPU measurement): `generate_tokens` tokens/s at batch 1 and 32 for the
    125M model of benchmarks/train_step.py (d 768, 12 layers, MHA), bf16 compute and cache.
    transformers' decode time is generate(N) − generate(1) over N − 1 tokens (its prefill and
    first token taken out); mllm's is the while_loop's N steps (N forward passes, one more than
    needed: the comparison is conservative).
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

import mllm
from benchmarks.machine import describe
from mllm.generation import generate_tokens
from mllm.layers.kv_cache import init_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(**overrides):
  spec = os.path.join(ROOT, 'configs', 'rope_swiglu.py')
  config = mllm.load_config(spec, {'model.max_seq_len': 2048, **overrides})
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  model.eval()
  return config, model


def _median_s(fn, repeats: int) -> float:
  fn()  # warm-up (compiles)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def per_token_latency(config, model, batch: int, contexts, repeats: int):
  """Rows: context, cached step ms, recompute ms."""
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c), donate_argnums=2)
  full = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  rows = []
  for context in contexts:
    tokens = jax.random.randint(jax.random.key(0), (batch, context), 0, config.model.vocab_size)
    cache = init_cache(config.model, batch, context + repeats + 2)
    _, cache = step(state, tokens, cache)  # prefill the context
    box = [cache]
    token = tokens[:, -1:]

    def cached():
      logits, box[0] = step(state, token, box[0])  # noqa: B023 (runs within this iteration)
      jax.block_until_ready(logits)

    cached_s = _median_s(cached, repeats)
    whole = jnp.concatenate([tokens, token], axis=1)
    recompute_s = _median_s(lambda: jax.block_until_ready(full(state, whole)), repeats)  # noqa: B023 (runs within this iteration)
    rows.append((context, cached_s * 1e3, recompute_s * 1e3))
  return rows


def kv_bytes_table(lengths, batch: int):
  """Rows: variant, n_kv, length, measured bytes of k and v, formula bytes."""
  rows = []
  for name, n_kv in (('MHA', 8), ('GQA 8:2', 2), ('MQA', 1)):
    config, _ = load(**{'model.n_kv_heads': n_kv})
    m = config.model
    head_dim = m.d_model // m.n_heads
    for length in lengths:
      cache = init_cache(m, batch, length)
      formula = 2 * m.n_layers * n_kv * head_dim * length * batch * 4
      rows.append((name, n_kv, length, cache.k.nbytes + cache.v.nbytes, formula))
  return rows


def timed_generate(model, prompts, new_tokens: int, repeats: int):
  """(the greedy tokens, median prefill s, median decode s) of `generate_tokens`, after a
  warm-up call that compiles; its timings exclude compilation."""
  tokens = generate_tokens(model, prompts, max_new_tokens=new_tokens)  # compiles, warms up
  timings, prefill, decode = {}, [], []
  for _ in range(repeats):
    generate_tokens(model, prompts, max_new_tokens=new_tokens, timings=timings)
    prefill.append(timings['prefill_s'])
    decode.append(timings['decode_s'])
  return tokens, statistics.median(prefill), statistics.median(decode)


def end_to_end(config, model, batch: int, prompt_len: int, new_tokens: int, repeats: int):
  prompts = [list(range(1, prompt_len + 1))] * batch
  return timed_generate(model, prompts, new_tokens, repeats)[1:]


# The comparison's models: configs/rope_swiglu.py with these overrides. init_std 0.1 makes greedy
# decoding of random weights produce varied tokens (at 0.02 it repeats one token, which would
# make the same-tokens check nearly vacuous); it does not change the cost.
HF_MODELS = {
  '4.9M': {'model.vocab_size': 8192, 'model.init': 'fixed', 'model.init_std': 0.1},
  '32M': {
    'model.vocab_size': 8192,
    'model.init': 'fixed',
    'model.init_std': 0.1,
    'model.d_model': 512,
    'model.n_layers': 10,
  },
}


def against_transformers(repeats: int, prompt_len: int = 16, new_tokens: int = 128):
  """Rows: model, params, batch, HF prefill ms, HF tok/s, mllm prefill ms, mllm tok/s, same."""
  import numpy as np
  import torch

  from benchmarks.hf_llama import to_hf_llama

  torch.set_num_threads(os.cpu_count())
  rows = []
  for name, overrides in HF_MODELS.items():
    config, model = load(**overrides)
    hf = to_hf_llama(model, config.model)
    n_params = mllm.count_params(model).total
    for batch in (1, 8):
      prompts = np.random.default_rng(batch).integers(
        0, config.model.vocab_size, (batch, prompt_len)
      )

      def hf_generate(n):
        with torch.no_grad():
          return hf.generate(  # noqa: B023 (runs within this iteration)
            torch.from_numpy(prompts),  # noqa: B023 (runs within this iteration)
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
          )

      theirs = hf_generate(new_tokens)[:, prompt_len:].tolist()  # warm-up
      hf_first, hf_decode = [], []
      for _ in range(repeats):
        start = time.perf_counter()
        hf_generate(1)
        first = time.perf_counter()
        hf_generate(new_tokens)
        hf_first.append(first - start)
        hf_decode.append(time.perf_counter() - first - (first - start))
      ours, prefill_s, decode_s = timed_generate(model, prompts.tolist(), new_tokens, repeats)
      hf_rate = batch * (new_tokens - 1) / statistics.median(hf_decode)
      our_rate = batch * new_tokens / decode_s
      same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
      rows.append(
        (
          name,
          n_params,
          batch,
          statistics.median(hf_first) * 1e3,
          hf_rate,
          prefill_s * 1e3,
          our_rate,
          f'{same}/{batch * new_tokens}',
        )
      )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--out', default=None)
  parser.add_argument('--only_hf', action='store_true', help='run only (4)')
  parser.add_argument('--only_125m', action='store_true', help='run only (5)')
  args = parser.parse_args()
  console = Console()
  backend = jax.default_backend()
  machine = describe()
  config, model = load()
  n_params = mllm.count_params(model).total
  lines = [f'# Decoding ({backend})', '', f'Machine: {machine}.', '']
  if not args.only_125m:
    lines += [
      f'Model: configs/rope_swiglu.py ({n_params:,} parameters, d_model '
      f'{config.model.d_model}, {config.model.n_layers} layers, 8 query / 2 KV heads), '
      f'float32, greedy, median of {args.repeats} after a warm-up. '
      '`python -m benchmarks.decode` regenerates this file.',
      '',
    ]

  if args.only_125m:
    lines += _section_5(console, args.repeats)
  else:
    if not args.only_hf:
      lines += _section_1(console, config, model, args.repeats)
      lines += _section_2()
      lines += _section_3(console, config, model, args.repeats)
    lines += _section_4(console, args.repeats)
  out = args.out or os.path.join(ROOT, 'benchmarks', 'results', f'decode-{backend}.md')
  with open(out, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  console.print(f'wrote {out}')


def _section_4(console, repeats: int) -> list[str]:
  lines = [
    '',
    "## (4) Against Hugging Face transformers' generate() (prompt 16, 128 new tokens)",
    '',
  ]
  try:
    import torch
    import transformers
  except ImportError:
    return lines + [
      'Not run: torch and transformers are not installed (`pip install torch transformers`).'
    ]
  lines += [
    f'transformers {transformers.__version__}, torch {torch.__version__} '
    f'({os.cpu_count()} threads), same weights, float32, greedy, EOS ignored. Models: '
    'configs/rope_swiglu.py with vocab 8192 (4.9M: d 256, 4 layers; 32M: d 512, 10 '
    'layers; 8 query / 2 KV heads). HF first token = generate(1): prefill and one '
    'token.',
    '',
    '| model | params | batch | HF first token ms | HF decode tok/s | mllm prefill ms | '
    'mllm decode tok/s | mllm / HF | same greedy tokens |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for name, n, batch, hf_ms, hf_rate, our_ms, our_rate, same in against_transformers(repeats):
    lines.append(
      f'| {name} | {n:,} | {batch} | {hf_ms:.1f} | {hf_rate:,.0f} | {our_ms:.1f} | '
      f'{our_rate:,.0f} | {our_rate / hf_rate:.2f}x | {same} |'
    )
  console.print('\n'.join(lines))
  return lines


def _section_5(console, repeats: int, prompt_len: int = 128, new_tokens: int = 256) -> list[str]:
  from benchmarks.train_step import MODELS

  overrides = {k: v for k, v in MODELS['125m'][0].items() if k.startswith('model.')}
  config, model = load(**overrides)
  n_params = mllm.count_params(model).total
  lines = [
    '',
    f'## (5) The 125M model: generate_tokens (prompt {prompt_len}, {new_tokens} new, EOS ignored)',
    '',
    f'{n_params:,} parameters ({MODELS["125m"][1]}); weights float32, compute and KV cache '
    f'{config.model.dtype}.',
    '',
    '| batch | prefill ms | decode s | decode tokens/s | ms per step |',
    '|---:|---:|---:|---:|---:|',
  ]
  for batch in (1, 32):
    prefill_s, decode_s = end_to_end(config, model, batch, prompt_len, new_tokens, repeats)
    lines.append(
      f'| {batch} | {prefill_s * 1e3:.1f} | {decode_s:.3f} | '
      f'{batch * new_tokens / decode_s:,.0f} | {decode_s / new_tokens * 1e3:.2f} |'
    )
    console.print(lines[-1])
  return lines


def _section_1(console, config, model, repeats: int) -> list[str]:
  """Per-token latency, cached against recomputed, then the full cache's bytes against a window's."""
  lines = [
    '## (1) One new token at a growing context: cached step vs recomputing the forward',
    '',
    '| batch | context | cached ms | recompute ms | recompute / cached |',
    '|---:|---:|---:|---:|---:|',
  ]
  table = Table(title='(1) per-token latency')
  for col in ('batch', 'context', 'cached ms', 'recompute ms', 'ratio'):
    table.add_column(col, justify='right')
  for batch in (1, 8):
    for context, cached_ms, recompute_ms in per_token_latency(
      config, model, batch, (32, 128, 512, 1024), repeats
    ):
      cells = [
        str(batch),
        str(context),
        f'{cached_ms:.2f}',
        f'{recompute_ms:.2f}',
        f'{recompute_ms / cached_ms:.1f}',
      ]
      table.add_row(*cells)
      lines.append('| ' + ' | '.join(cells) + ' |')
  console.print(table)
  windowed, _ = load(**{'model.attention.sliding_window': 64})
  lines += [
    '',
    'Cache bytes (k, v and positions), batch 1: a full cache grows with the context; '
    'the sliding-window (W = 64) rolling buffer stays at 64 slots.',
    '',
    '| context | full cache bytes | window-64 buffer bytes |',
    '|---:|---:|---:|',
  ]
  for context in (64, 256, 1024, 2048):
    lines.append(
      f'| {context} | {init_cache(config.model, 1, context).nbytes:,} | '
      f'{init_cache(windowed.model, 1, context).nbytes:,} |'
    )
  return lines


def _section_2() -> list[str]:
  lines = [
    '',
    '## (2) KV-cache bytes per attention variant (batch 8, float32)',
    '',
    '| variant | n_kv_heads | length | k + v bytes | 2·L·n_kv·d_head·len·B·4 |',
    '|---|---:|---:|---:|---:|',
  ]
  for name, n_kv, length, measured, formula in kv_bytes_table((256, 2048), 8):
    lines.append(f'| {name} | {n_kv} | {length} | {measured:,} | {formula:,} |')
  return lines


def _section_3(console, config, model, repeats: int) -> list[str]:
  lines = [
    '',
    '## (3) generate_tokens end to end (prompt 16 tokens, 128 new, EOS ignored)',
    '',
    '| batch | prefill ms | decode s | decode tokens/s |',
    '|---:|---:|---:|---:|',
  ]
  for batch in (1, 8):
    prefill_s, decode_s = end_to_end(config, model, batch, 16, 128, repeats)
    lines.append(
      f'| {batch} | {prefill_s * 1e3:.1f} | {decode_s:.3f} | {batch * 128 / decode_s:,.0f} |'
    )
  console.print('\n'.join(lines[-4:]))
  return lines


if __name__ == '__main__':
  main()
