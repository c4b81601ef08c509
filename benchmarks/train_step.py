"""Training-step throughput: mllm's jitted JAX step against a plain PyTorch Llama, same CPU, one run.

    python -m benchmarks.train_step            # default and ~25M configs, prints the table
    python -m benchmarks.train_step --out table.md   # also write environment + table as markdown
    python -m benchmarks.train_step --quick    # smoke run: tiny model, 2 timed steps
    python -m benchmarks.train_step --models=125m --only=jax --batch_size=64   # GPU: MFU
    python -m benchmarks.train_step --models=125m --only=jax --scan_layers=both --profile_dir=/tmp/p

Both sides train the same model (configs/rope_swiglu.py: RoPE 'half', GQA, SwiGLU, RMSNorm pre-LN,
tied embeddings, float32, or bf16 compute for 125m; benchmarks/torch_llama.py for PyTorch) on the
same random tokens with next-token cross-entropy, global-norm clipping at 1.0 and AdamW; the
parameter counts are printed and must agree. Steps of the two alternate (one JAX step, one PyTorch
step, ...) so that load from other processes on a shared machine hits both alike. Step time is the
median over the timed steps after warm-up, each step blocked on (JAX: block_until_ready; PyTorch
runs eagerly); tokens/s is batch × seq_len over it. JAX compile time is printed separately.

The JAX step is `mllm.train.step.benchmark_step(config)` (the library's own training step) when it
exists, else an equivalent built here (split params, value_and_grad, optax chain, jit with donation;
`--jax_step=local` forces it). JAX MFU = the library's FLOPs per token
(`mllm.training_flops_per_token`: 6N + attention) × tokens/s ÷ the chip's peak
(`mllm.train.metrics.PEAK_FLOPS`), as the training loop reports it; '-' on a CPU. Warm-up of the
learning rate is off so that every timed step does the same work.

Document masking (`--document_mask`): 'on' is the config's default (`data.document_mask=True`):
the batch holds packed documents, rows cut from a stream `<eos> doc <eos> doc ...` by the data
pipeline's own `pack_window`, so segment ids and per-document positions are as training makes them;
document lengths are 1 + geometric with mean `--doc_len_mean` (256) from seed 0. 'off' is one
causal segment per row. The PyTorch side computes plain causal attention, so it runs in 'off' rows
only (the default is 'both' with `--only=jax`, else 'off'). Each row names the attention
implementation: the configured one, for 'auto' what `choose_impl` answers for the step's q/k, and
what the compiled step holds (a cuDNN, Triton or Mosaic GPU custom call, else XLA's own ops).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mllm
from benchmarks import profile_ops
from benchmarks.machine import cpu_model
from mllm import malloc
from mllm.train.metrics import peak_flops_per_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# For a GPU's MFU: GPT-2 small's shape, Llama-style (RoPE, SwiGLU, RMSNorm), MHA, vocab
# 50304 (GPT-2's 50257 rounded up to a multiple of 64), bf16 compute on fp32 master weights.
GPT2_SMALL = {
  'model.d_model': 768,
  'model.n_layers': 12,
  'model.n_heads': 12,
  'model.n_kv_heads': 12,
  'model.vocab_size': 50304,
  'model.max_seq_len': 1024,
  'data.seq_len': 1024,
  'data.batch_size': 32,
  'model.dtype': 'bfloat16',
}

# name -> (overrides of configs/rope_swiglu.py, description)
MODELS = {
  'default': ({}, 'configs/rope_swiglu.py as is: d 256, 4 layers, 8 heads / 2 KV, vocab 512'),
  '25m': (
    {'model.d_model': 512, 'model.n_layers': 8, 'model.vocab_size': 8192},
    'd 512, 8 layers, 8 heads / 2 KV, vocab 8192',
  ),
  '125m': (
    GPT2_SMALL,
    'd 768, 12 layers, 12 heads (MHA), vocab 50304, seq 1024, bf16 compute',
  ),
  # The same shape with a Mixtral-style MoE FFN in every layer (8 experts of the dense FFN's
  # size, top-2): the dispatch's cost in a whole step (--moe_dispatch).
  '125m_moe': (
    {
      **GPT2_SMALL,
      'model.ffn.kind': 'moe',
      'model.ffn.moe.num_experts': 8,
      'model.ffn.moe.top_k': 2,
    },
    'the 125m shape with 8 experts top-2 in every layer (MoE)',
  ),
  # The suites' cpu preset (experiments/suites/_presets.py) on rope_swiglu: what every CPU table
  # trains, 2,048 tokens a step.
  'cpu_preset': (
    {
      'model.d_model': 128,
      'model.max_seq_len': 128,
      'data.seq_len': 128,
      'data.batch_size': 16,
    },
    'the suites cpu preset: d 128, 4 layers, 8 heads / 2 KV, vocab 512, 16 x 128 tokens',
  ),
  'cpu_preset_bf16': (
    {
      'model.d_model': 128,
      'model.max_seq_len': 128,
      'data.seq_len': 128,
      'data.batch_size': 16,
      'model.dtype': 'bfloat16',
    },
    'the cpu preset with bfloat16 compute (float32 parameters and optimizer state)',
  ),
  'quick': (
    {
      'model.d_model': 64,
      'model.n_layers': 2,
      'model.n_heads': 4,
      'model.vocab_size': 256,
      'model.max_seq_len': 64,
      'data.seq_len': 64,
      'data.batch_size': 2,
    },
    'smoke test: d 64, 2 layers, seq 64, batch 2',
  ),
}


def is_moe(name: str) -> bool:
  return MODELS[name][0].get('model.ffn.kind') == 'moe'


def load(
  name: str,
  batch_size: int | None = None,
  document_mask: bool = False,
  scan_layers: bool | None = None,
  remat: str | None = None,
  impl: str | None = None,
  scan_unroll: int = 1,
  moe_dispatch: str | None = None,
):
  overrides = dict(MODELS[name][0])
  if batch_size:
    overrides['data.batch_size'] = batch_size
  overrides['data.document_mask'] = document_mask
  if scan_layers is not None:
    overrides['model.scan_layers'] = scan_layers
  if remat is not None:
    overrides['model.remat'] = remat
  if scan_unroll != 1:
    overrides['model.scan_unroll'] = scan_unroll
  if moe_dispatch and is_moe(name):
    overrides['model.ffn.moe.dispatch'] = moe_dispatch
  if impl is not None:
    overrides['model.attention.impl'] = impl
  overrides['train.warmup_steps'] = 0  # a constant learning rate: every timed step does the same
  return mllm.load_config(os.path.join(ROOT, 'configs', 'rope_swiglu.py'), overrides)


DOC_SEED = 0
EOS_ID = 0  # the documents' tokens are drawn from 1..vocab-1, so only BOS markers equal it


def packed_batch(config, mean_doc_len: float, seed: int = DOC_SEED) -> dict[str, np.ndarray]:
  """A batch of packed random documents, as mllm/data/pipeline.py makes it: the stream
  `<eos> doc1 <eos> doc2 ...` (mllm/data/corpus.py), cut into consecutive windows of seq_len + 1
  tokens, each packed by `pack_window` (segment ids from 1, positions restarting at each <eos>).
  Document lengths: 1 + geometric, mean `mean_doc_len`."""
  from mllm.data.pipeline import pack_window

  rng = np.random.default_rng(seed)
  B, T, V = config.data.batch_size, config.data.seq_len, config.model.vocab_size
  need = B * T + 1
  parts, total = [], 0
  while total < need:
    n = int(rng.geometric(1.0 / mean_doc_len))
    parts += [np.array([EOS_ID], np.int32), rng.integers(1, V, n, dtype=np.int32)]
    total += n + 1
  stream = np.concatenate(parts)
  rows = [pack_window(stream[i * T : i * T + T + 1], T, EOS_ID, EOS_ID, True) for i in range(B)]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


# ---------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------


def _local_benchmark_step(config):
  """(step_fn, state, batch): the training step written out here, for when mllm.train lacks one."""
  if config.model.scan_layers:  # nnx.split of a scanned model's RNG counts fails under this jit
    raise SystemExit(
      'error: --scan_layers=on: the local step does not scan; allowed: --jax_step=auto'
    )
  t = config.train
  model = mllm.build_model(config, rngs=nnx.Rngs(config.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def decays(path, _):
    names = [str(getattr(k, 'key', k)) for k in path]
    return not (names[0] == 'embed' or any('norm' in n for n in names))

  tx = optax.chain(
    optax.clip_by_global_norm(t.grad_clip),
    optax.adamw(
      t.learning_rate,
      t.b1,
      t.b2,
      t.eps,
      weight_decay=t.weight_decay,
      mask=lambda p: jax.tree_util.tree_map_with_path(decays, p),
    ),
  )

  packed = config.data.document_mask

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params, rest)(
      batch['inputs'],
      positions=batch['positions'] if packed else None,
      segment_ids=batch['segment_ids'] if packed else None,
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']).mean()

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state['params'], batch)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    return (
      {'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state},
      {'loss': loss, 'grad_norm': optax.global_norm(grads)},
    )

  B, T = config.data.batch_size, config.data.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (B, T + 1), np.int32)
  batch = {
    'inputs': jnp.asarray(tokens[:, :-1]),
    'targets': jnp.asarray(tokens[:, 1:]),
    'positions': jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
    'segment_ids': jnp.ones((B, T), jnp.int32),
  }
  state = {'params': params, 'opt_state': tx.init(params)}
  return jax.jit(step, donate_argnums=0), state, batch


def jax_benchmark_step(config, which: str):
  if which in ('auto', 'library'):
    try:
      from mllm.train.step import benchmark_step
    except ImportError:
      if which == 'library':
        raise
    else:
      step_fn, state, batch = benchmark_step(config)
      return step_fn, state, batch, 'mllm.train.step.benchmark_step'
  return (*_local_benchmark_step(config), 'benchmarks.train_step (local)')


def setup_jax(config, which: str, mean_doc_len: float = 256) -> dict:
  """Compiles the JAX step; `run()` does one step (blocked on) and returns its loss."""
  start = time.perf_counter()
  step_fn, state, batch, source = jax_benchmark_step(config, which)
  if config.data.document_mask:  # packed documents in place of the random tokens, same sharding
    packed = packed_batch(config, mean_doc_len)
    segments = packed['segment_ids'].max(axis=1)
    print(
      f'packed documents: {segments.sum()} segments in {len(segments)} rows '
      f'({packed["positions"].size / segments.sum():.0f} tokens each on average)',
      flush=True,
    )
    batch = {
      k: jax.device_put(packed[k], getattr(v, 'sharding', None)) if k in packed else v
      for k, v in batch.items()
    }
  n_params = sum(x.size for x in jax.tree.leaves(state['params']))
  print(f'built the model and optimizer state in {time.perf_counter() - start:.1f} s', flush=True)
  start = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  print(f'compiled the step in {compile_s:.1f} s', flush=True)
  hlo_text = compiled.as_text() or ''
  impl = attention_impl(config, hlo_text)
  box = [state]

  def run() -> float:
    box[0], metrics = compiled(box[0], batch)
    jax.block_until_ready((box[0], metrics))
    return metrics['loss']

  return dict(
    run=run, params=n_params, compile_s=compile_s, source=source, impl=impl, hlo_text=hlo_text
  )


# What a compiled step's HLO holds when a fused attention kernel ran (custom-call targets).
KERNEL_MARKERS = (
  ('cudnn', ('__cudnn$fmha',)),
  ('pallas/triton', ('__gpu$xla.gpu.triton', 'triton_kernel_call')),
  ('pallas/mosaic_gpu', ('mosaic_gpu',)),
  ('pallas/mosaic_tpu', ('tpu_custom_call',)),
)


def attention_impl(config, hlo_text: str) -> str:
  """The attention implementation of the step: the configured one; for 'auto' also what
  mllm.ops.attention.choose_impl answers for the step's q/k and mask (packed documents: segment
  ids; a failure is reported, not raised); then the fused kernels that the compiled HLO
  contains, which is what ran."""
  m = config.model
  impl = m.attention.impl
  if impl == 'auto':
    try:
      from mllm.layers import resolved_head_dim
      from mllm.ops.attention import AttentionMask, choose_impl

      B, T, H = config.data.batch_size, config.data.seq_len, resolved_head_dim(m)
      q = jax.ShapeDtypeStruct((B, T, m.n_heads, H), jnp.dtype(m.dtype))
      k = jax.ShapeDtypeStruct((B, T, m.n_kv_heads, H), jnp.dtype(m.dtype))
      segment_ids = jax.ShapeDtypeStruct((B, T), jnp.int32) if config.data.document_mask else None
      mask = AttentionMask(
        causal=True,
        window=m.attention.sliding_window,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
      )
      chosen = choose_impl(
        q, k, bias=None, rel_values=None, dropout=m.attention.dropout > 0, mask=mask
      )
    except Exception as e:  # a report, not a failure of the benchmark
      chosen = f'? (choose_impl: {type(e).__name__})'
    impl = f'auto->{chosen}'
  seen = [name for name, marks in KERNEL_MARKERS if any(x in hlo_text for x in marks)]
  return f"{impl}; HLO: {'+'.join(seen) if seen else 'no fused kernel (xla/blockwise)'}"


# ---------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------


def setup_torch(config) -> dict:
  import torch

  from benchmarks import torch_llama

  torch.manual_seed(config.seed)
  model = torch_llama.TorchLlama(config.model)
  t = config.train
  optimizer = torch_llama.make_optimizer(model, t.learning_rate, t.b1, t.b2, t.eps, t.weight_decay)
  step = torch_llama.make_train_step(model, optimizer, t.grad_clip)
  B, T = config.data.batch_size, config.data.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (B, T + 1), np.int64)
  inputs, targets = torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(tokens[:, 1:].copy())
  return dict(run=lambda: step(inputs, targets), params=torch_llama.count_params(model))


def time_interleaved(runners: dict, steps: int, warmup: int) -> dict:
  """Alternate one step of each runner per round, so that load from other processes on the
  machine hits all of them alike; returns the per-step times (after warm-up) and losses."""
  times = {name: [] for name in runners}
  losses = {name: [] for name in runners}
  for i in range(warmup + steps):
    for name, run in runners.items():
      start = time.perf_counter()
      loss = run()
      elapsed = time.perf_counter() - start
      if i >= warmup:
        times[name].append(elapsed)
      losses[name].append(float(loss))
  return dict(times=times, losses=losses)


# ---------------------------------------------------------------------------------------------


def environment(with_torch: bool = True, malloc_kept: bool = False) -> dict:
  import flax

  torch = None
  if with_torch:
    import torch
  env = {
    'machine': f'{cpu_model()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}',
    'device': f'{jax.devices()[0].device_kind} ({jax.default_backend()})',
    'date': datetime.date.today().isoformat(),
    'versions': (
      f'python {platform.python_version()}, jax {jax.__version__} '
      f'({jax.default_backend()}), flax {flax.__version__}, optax {optax.__version__}'
      + (f', torch {torch.__version__}' if torch else '')
    ),
    'threads': f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}; '
    f'OMP_NUM_THREADS={os.environ.get("OMP_NUM_THREADS", "unset")}',
    'malloc': 'freed memory kept (mllm.malloc)'
    if malloc_kept
    else f'the defaults ({malloc.users_own(os.environ) or "not glibc"})',
  }
  if torch:
    env['threads'] = (
      f'torch intra-op {torch.get_num_threads()} / inter-op '
      f'{torch.get_num_interop_threads()}; ' + env['threads']
    )
  return env


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='smoke run: tiny model, 2 steps')
  parser.add_argument('--models', default='default,25m', help=f'comma list of {list(MODELS)}')
  parser.add_argument('--steps', type=int, default=None, help='timed steps (default 10; 25m: 5)')
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--jax_step', choices=['auto', 'library', 'local'], default='auto')
  parser.add_argument('--only', choices=['both', 'jax', 'torch'], default='both')
  parser.add_argument('--batch_size', type=int, default=None, help="override the models' batch")
  parser.add_argument(
    '--document_mask',
    choices=['off', 'on', 'both'],
    default=None,
    help="data.document_mask: 'on' (the config default) feeds packed documents with segment ids "
    "and per-document positions (pipeline's pack_window), 'off' one causal segment a row; default "
    "'both' with --only=jax, else 'off' (the PyTorch side is plain causal and runs in 'off' rows only)",
  )
  parser.add_argument(
    '--doc_len_mean',
    type=float,
    default=256,
    help=f'mean document length with --document_mask on: 1 + geometric, seed {DOC_SEED}',
  )
  parser.add_argument(
    '--scan_layers',
    choices=['off', 'on', 'both'],
    default=None,
    help="model.scan_layers (nnx.scan over layers); default: the config's (off)",
  )
  parser.add_argument(
    '--moe_dispatch',
    choices=['auto', 'capacity', 'dropless', 'both'],
    default=None,
    help="model.ffn.moe.dispatch of the MoE models (125m_moe); 'both': capacity and dropless rows",
  )
  parser.add_argument(
    '--scan_unroll',
    type=int,
    default=1,
    help='model.scan_unroll: scanned layers per loop iteration (with --scan_layers=on)',
  )
  parser.add_argument(
    '--remat', choices=['none', 'full', 'dots'], default=None, help="model.remat; default: config's"
  )
  parser.add_argument(
    '--impl',
    default=None,
    help="model.attention.impl (e.g. cudnn: packed documents reach it as a dense mask); "
    "default: the config's ('auto')",
  )
  parser.add_argument(
    '--profile_dir',
    default=None,
    help='after timing, run --profile_steps more JAX steps inside jax.profiler.trace(DIR/<row>) '
    "and print where their time went, read offline from the trace's .xplane.pb with "
    'jax.profiler.ProfileData (benchmarks/profile_ops.py, no TensorBoard): on a GPU the kernels '
    "of its stream lines summed per HLO op (stat 'hlo_op'), the top 10, a summary by kind (matmul, "
    'attention, elementwise/reduction, copy/transpose, other) and busy vs wall time; on a CPU the '
    "XLA threads' events (host time); the trace opens in TensorBoard/XProf",
  )
  parser.add_argument('--profile_steps', type=int, default=3)
  parser.add_argument(
    '--hlo_dir',
    default=None,
    help="write each row's compiled step (the optimized HLO, `compiled.as_text()`) to "
    'DIR/<row>.hlo.txt, e.g. to compare the scanned and unrolled programs',
  )
  parser.add_argument(
    '--traceback_every_s',
    type=float,
    default=None,
    help="print every thread's stack this often (where a run hangs)",
  )
  parser.add_argument(
    '--out', default=None, help='markdown table (default: print only; e.g. benchmarks/results/x.md)'
  )
  return parser.parse_args(argv)


def variants(choice: str | None, default: str | None = None) -> list[bool | None]:
  """'off'/'on'/'both' (None: `default`, None meaning the config's value) as a list of settings."""
  choice = choice or default
  return {'off': [False], 'on': [True], 'both': [False, True], None: [None]}[choice]


def row_label(name: str, config, scan: bool | None, remat: str | None) -> str:
  label = f"{name}, doc mask {'on' if config.data.document_mask else 'off'}"
  if scan is not None:
    label += f", scan {'on' if scan else 'off'}"
  if scan and config.model.scan_unroll != 1:
    label += f' (unroll {config.model.scan_unroll})'
  if config.model.ffn.kind == 'moe':
    label += f', dispatch {config.model.ffn.moe.dispatch}'
  if remat is not None:
    label += f', remat {remat}'
  return label


def measure(
  name: str,
  args,
  document_mask: bool = False,
  scan: bool | None = None,
  moe_dispatch: str | None = None,
) -> dict:
  """The table row of one model: both sides set up, their steps timed interleaved and printed."""
  config = load(
    name,
    args.batch_size,
    document_mask,
    scan,
    args.remat,
    args.impl,
    scan_unroll=args.scan_unroll if scan else 1,
    moe_dispatch=moe_dispatch,
  )
  label = row_label(name, config, scan, args.remat)
  print(f'--- {label}', flush=True)
  steps = args.steps or (2 if args.quick else 5 if name == '25m' else 10)
  warmup = 1 if args.quick else args.warmup
  tokens = config.data.batch_size * config.data.seq_len
  row = dict(
    name=label,
    desc=MODELS[name][1],
    tokens=tokens,
    flops_per_token=mllm.training_flops_per_token(config, mllm.count_params(config)).total,
    peak=peak_flops_per_device(jax.devices()[0].device_kind, config.model.dtype),
  )
  runners = {}
  if args.only in ('both', 'jax'):
    j = setup_jax(config, args.jax_step, args.doc_len_mean)
    runners['jax'] = j['run']
    row.update(params=j['params'], jax_compile_s=j['compile_s'], jax_source=j['source'])
    row['name'] += f", attn {j['impl']}"
    print(f'[{label}] attention: {j["impl"]}', flush=True)
    if args.hlo_dir:  # the compiled program, to set two rows' programs side by side offline
      os.makedirs(args.hlo_dir, exist_ok=True)
      path = os.path.join(args.hlo_dir, slug(label) + '.hlo.txt')
      with open(path, 'w') as f:
        f.write(j['hlo_text'])
      print(f'[{label}] compiled HLO: {path} ({len(j["hlo_text"]):,} characters)', flush=True)
  if args.only in ('both', 'torch') and document_mask:
    print(f'[{label}] torch: not run (its attention is plain causal, no document mask)')
  elif args.only in ('both', 'torch'):
    t = setup_torch(config)
    runners['torch'] = t['run']
    row.update(torch_params=t['params'])
  r = time_interleaved(runners, steps, warmup)
  for side, times in r['times'].items():
    row[f'{side}_ms'] = 1e3 * statistics.median(times)
    row[f'{side}_min_ms'] = 1e3 * min(times)
    print(
      f"[{label}] {side}{' (' + row['jax_source'] + ')' if side == 'jax' else ''}: "
      f"params {row['params' if side == 'jax' else 'torch_params']:,}"
      f"{', compile {:.1f} s'.format(row['jax_compile_s']) if side == 'jax' else ''}, "
      f"step ms {[round(1e3 * x) for x in times]}, losses "
      f"{[round(x, 3) for x in r['losses'][side]]}",
      flush=True,
    )
  if args.profile_dir and 'jax' in runners:
    profile(
      runners['jax'],
      os.path.join(args.profile_dir, slug(label)),
      args.profile_steps,
      row['jax_ms'],
    )
  return row


def slug(label: str) -> str:
  return ''.join(c if c.isalnum() else '_' for c in label).strip('_')


def profile(run, directory: str, steps: int, step_ms: float | None = None) -> None:
  """`steps` steps inside jax.profiler.trace(directory), then where their time went
  (benchmarks/profile_ops.py: device time per HLO op and per kind, against the wall step)."""
  with jax.profiler.trace(directory):
    start = time.perf_counter()
    for _ in range(steps):
      run()
    wall_ms = 1e3 * (time.perf_counter() - start) / steps
  untraced = f', {step_ms:.2f} ms untraced' if step_ms else ''
  print(f'profile: trace of {steps} steps ({wall_ms:.2f} ms/step{untraced}) in {directory}')
  try:
    table = profile_ops.read(directory)
  except Exception as e:  # the trace is written; reading it is a convenience
    print(f'profile: could not read the trace offline ({type(e).__name__}: {e})')
    return
  if not table.ops:
    print(f'profile: no op events in the trace {table.note}')
    return
  print('\n'.join(profile_ops.report(table, steps, wall_ms)), flush=True)


def main() -> None:
  malloc_kept = malloc.keep_freed_memory()  # as launch.py does, before JAX's threads start
  args = parse_args()
  if args.traceback_every_s:
    faulthandler.dump_traceback_later(args.traceback_every_s, repeat=True)
  names = ['quick'] if args.quick else args.models.split(',')
  env = environment(with_torch=args.only != 'jax', malloc_kept=malloc_kept)
  for key, value in env.items():
    print(f'{key}: {value}')
  docs = variants(args.document_mask, 'both' if args.only == 'jax' else 'off')
  dispatches = ['capacity', 'dropless'] if args.moe_dispatch == 'both' else [args.moe_dispatch]
  rows = [
    measure(name, args, doc, scan, dispatch)
    for name in names
    for doc in docs
    for scan in variants(args.scan_layers)
    for dispatch in (dispatches if is_moe(name) else [None])
  ]
  print_table(rows, env, args.out)


def print_table(rows, env, out):
  """Tokens/s from the median step time; the fastest step is shown too (the machine is shared)."""
  header = [
    'model',
    'params (JAX = torch)',
    'tokens/step',
    'JAX compile s',
    'JAX step ms (median / min)',
    'torch step ms (median / min)',
    'JAX tokens/s',
    'torch tokens/s',
    'JAX / torch',
    'JAX MFU',
  ]
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' + '---:|' * (len(header) - 1)]
  for r in rows:
    tps = {
      side: r['tokens'] / r[f'{side}_ms'] * 1e3 for side in ('jax', 'torch') if f'{side}_ms' in r
    }
    params = f"{r.get('params', r.get('torch_params', 0)):,}"
    if 'params' in r and 'torch_params' in r and r['params'] != r['torch_params']:
      params += f" (torch {r['torch_params']:,}: MISMATCH)"
    step = {
      side: f"{r[f'{side}_ms']:,.0f} / {r[f'{side}_min_ms']:,.0f}" if side in tps else '-'
      for side in ('jax', 'torch')
    }
    cells = [
      r['name'],
      params,
      str(r['tokens']),
      f"{r['jax_compile_s']:.1f}" if 'jax_compile_s' in r else '-',
      step['jax'],
      step['torch'],
      f"{tps['jax']:,.0f}" if 'jax' in tps else '-',
      f"{tps['torch']:,.0f}" if 'torch' in tps else '-',
      f"{tps['jax'] / tps['torch']:.2f}x" if len(tps) == 2 else '-',
      f"{r['flops_per_token'] * tps['jax'] / r['peak']:.1%}" if r['peak'] and 'jax' in tps else '-',
    ]
    lines.append('| ' + ' | '.join(cells) + ' |')
  text = '\n'.join(lines)
  print(text)
  if out:
    with open(out, 'w') as f:
      f.write('\n'.join(f'- {k}: {v}' for k, v in env.items()) + '\n\n' + text + '\n')
    print(f'wrote {out}')


if __name__ == '__main__':
  main()
