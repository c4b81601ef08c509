"""SwiGLU vs ReLU replicated outside mllm: the same initial weights and batches trained by a plain
PyTorch Llama (benchmarks/torch_llama.py), its own loss, AdamW, clipping and schedule values.

At 4 M tokens (`ffn_tokens`) mllm's default SwiGLU ends 0.158 nats behind ReLU. If an independent
implementation, started from mllm's initial weights and fed mllm's batches, ends with the same gap,
the gap belongs to the model, data and settings, not to a fault of mllm's code.

    # mllm's venv: the run's config (its hash checked against the committed run), initial
    # weights, every train batch, the eval windows, the per-step learning rates, mllm's init loss
    python -m benchmarks.ffn_replication export --variant relu --seed 0 --out /tmp/ffn_repl
    # a venv with torch and numpy only (mllm is not imported): trains, logs, evaluates
    python -m benchmarks.ffn_replication train /tmp/ffn_repl/relu-s0 [--weight_decay 0]
    # mllm's venv: the table against the committed ffn_tokens runs
    python -m benchmarks.ffn_replication report /tmp/ffn_repl > benchmarks/results/ffn_replication-cpu.md

The train half logs the loss at every step, and every `eval_every` steps the eval loss on the
exported windows, each FFN matrix's Frobenius norm (mean over layers) and the RMS of the FFN's
hidden activation (the input of `down`) on the first eval batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

SUITE = 'ffn_tokens'  # the committed runs this replicates (4 M tokens, rates tuned there)
BATCH_KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')


def _torch_params(state) -> dict[str, np.ndarray]:
  """mllm's parameters under torch_llama's names and layouts ([out, in] linear weights)."""
  import jax

  out = {}
  for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = [str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))) for k in path]
    if keys[-1] == 'value' and keys[-2] in ('kernel', 'scale', 'embedding'):
      keys = keys[:-1]  # nnx.Variable's own attribute, not the attention's `value` module
    array = np.asarray(value, np.float32)
    *where, leaf = keys
    name = '.'.join(where)
    if leaf == 'embedding':
      out[f'{name}.weight'] = array
    elif leaf == 'scale':
      out[f'{name}.scale'] = array
    elif leaf == 'kernel':
      if where[-1] in ('query', 'key', 'value'):
        array = array.reshape(array.shape[0], -1)  # [d, heads, head_dim] -> [d, heads·head_dim]
      elif where[-1] == 'out':
        array = array.reshape(-1, array.shape[-1])  # [heads, head_dim, d]
      out[f'{name}.weight'] = np.ascontiguousarray(array.T)
    else:
      raise ValueError(f'parameter {".".join(keys)}: no torch_llama counterpart')
  return out


def export(variant: str, seed: int, out: str, results: str = 'experiments/results') -> str:
  """Write <out>/<variant>-s<seed>/: meta.json, params.npz, train.npz, eval.npz."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from experiments.run import config_hash, resolve
  from experiments.suite import load_suite
  from mllm.data import build_data
  from mllm.layers.ffn import hidden_dim
  from mllm.train.optimizer import learning_rate_schedule
  from mllm.train.state import initial_model

  suite = load_suite(SUITE)
  with open(os.path.join(results, SUITE, 'results.json')) as f:
    record = next(r for r in json.load(f)['runs'] if r['variant'] == variant and r['seed'] == seed)
  config = resolve(
    suite,
    next(v for v in suite.variants if v.name == variant),
    'cpu',
    seed,
    {'train.learning_rate': record['learning_rate']},
  )
  if config_hash(config) != record['hash']:
    raise ValueError(
      f'{variant} seed {seed}: the resolved config hashes to {config_hash(config)}, the '
      f"committed run to {record['hash']}; allowed: the config the run trained"
    )
  folder = os.path.join(out, f'{variant}-s{seed}')
  os.makedirs(folder, exist_ok=True)
  t = config.train
  data = build_data(config, folder, verbose=False)
  iterator = data.train_iterator()
  batches = [next(iterator) for _ in range(t.steps)]
  train = {k: np.stack([b[k] for b in batches]) for k in BATCH_KEYS}
  np.savez(
    os.path.join(folder, 'train.npz'),
    **{k: v.astype(np.int16 if k != 'loss_mask' else np.uint8) for k, v in train.items()},
  )
  evals = list(data.eval_batches(t.eval_batches))
  np.savez(
    os.path.join(folder, 'eval.npz'), **{k: np.stack([b[k] for b in evals]) for k in BATCH_KEYS}
  )
  model = initial_model(config)
  np.savez(os.path.join(folder, 'params.npz'), **_torch_params(nnx.state(model, nnx.Param)))
  first = batches[0]
  logits = model(
    jnp.asarray(first['inputs']),
    positions=jnp.asarray(first['positions']),
    segment_ids=jnp.asarray(first['segment_ids']),
  )
  import optax

  losses = optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), jnp.asarray(first['targets'])
  )
  mask = jnp.asarray(first['loss_mask'], jnp.float32)
  schedule = learning_rate_schedule(t)
  meta = {
    'suite': SUITE,
    'variant': variant,
    'seed': seed,
    'hash': record['hash'],
    'model': config.model.to_dict(),
    'd_ff': hidden_dim(config.model.ffn, config.model.d_model),
    'train': {
      k: t[k] for k in ('steps', 'weight_decay', 'b1', 'b2', 'eps', 'grad_clip', 'eval_every')
    },
    'learning_rates': [float(schedule(k)) for k in range(t.steps)],
    'decay_embeddings': t.decay_embeddings,
    'decay_norms_and_biases': t.decay_norms_and_biases,
    'mllm': {
      'init_loss': float((losses * mask).sum() / mask.sum()),
      'curve': record.get('curve'),
      'eval_curve': record.get('eval_curve'),
      'eval_loss': record['eval_loss'],
      'provenance': record.get('provenance'),
    },
    'jax': jax.__version__,
  }
  with open(os.path.join(folder, 'meta.json'), 'w') as f:
    json.dump(meta, f)
  return folder


class _Namespace:
  """Attribute access over the exported config dict (what TorchLlama reads)."""

  def __init__(self, d: dict):
    for k, v in d.items():
      setattr(self, k, _Namespace(v) if isinstance(v, dict) else v)


def _ffn_stats(model, batch) -> dict:
  """Mean over layers of each FFN matrix's Frobenius norm, and the RMS of the FFN's hidden
  activation (the input of `down`) on `batch`."""
  import torch
  import torch.nn.functional as F

  norms, hidden = {}, []

  def record(module, inputs, output):
    hidden.append(float(inputs[0].pow(2).mean().sqrt()))

  hooks = [block.ffn.down.register_forward_hook(record) for block in model.blocks]
  with torch.no_grad():
    model(*batch)
  for hook in hooks:
    hook.remove()
  for name in ('gate', 'up', 'down'):
    mats = [getattr(b.ffn, name).weight for b in model.blocks if hasattr(b.ffn, name)]
    if mats:
      norms[f'{name}_norm'] = float(np.mean([float(torch.linalg.norm(m)) for m in mats]))
  del F
  return {**norms, 'hidden_rms': float(np.mean(hidden))}


def train(folder: str, weight_decay: float | None = None, threads: int = 0) -> dict:
  """Train the exported run in PyTorch; write <folder>/torch[-wdX].json and return it."""
  import torch
  import torch.nn.functional as F

  from benchmarks.torch_llama import TorchLlama

  if threads:
    torch.set_num_threads(threads)
  with open(os.path.join(folder, 'meta.json')) as f:
    meta = json.load(f)
  t = meta['train']
  wd = t['weight_decay'] if weight_decay is None else weight_decay
  cfg = _Namespace(meta['model'])
  model = TorchLlama(cfg, d_ff=meta['d_ff'])
  params = dict(np.load(os.path.join(folder, 'params.npz')))
  state = model.state_dict()
  if set(params) != set(state):
    raise ValueError(f'exported {sorted(set(params) ^ set(state))} do not match the model')
  model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
  decay, no_decay = [], []
  for name, p in model.named_parameters():
    embedding = name.startswith('embed')
    norm = 'norm' in name
    skip = (embedding and not meta['decay_embeddings']) or (
      norm and not meta['decay_norms_and_biases']
    )
    (no_decay if skip else decay).append(p)
  optimizer = torch.optim.AdamW(
    [{'params': decay, 'weight_decay': wd}, {'params': no_decay, 'weight_decay': 0.0}],
    lr=meta['learning_rates'][0],
    betas=(t['b1'], t['b2']),
    eps=t['eps'],
  )
  arrays = np.load(os.path.join(folder, 'train.npz'))
  train_batches = {k: torch.from_numpy(arrays[k].astype(np.int64)) for k in BATCH_KEYS}
  train_batches['loss_mask'] = train_batches['loss_mask'].float()
  arrays = np.load(os.path.join(folder, 'eval.npz'))
  eval_batches = {k: torch.from_numpy(arrays[k].astype(np.int64)) for k in BATCH_KEYS}
  eval_batches['loss_mask'] = eval_batches['loss_mask'].float()

  def loss_of(batch, i):
    logits = model(batch['inputs'][i], batch['positions'][i], batch['segment_ids'][i])
    ce = F.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), batch['targets'][i].reshape(-1), reduction='none'
    )
    mask = batch['loss_mask'][i].reshape(-1)
    return (ce * mask).sum(), mask.sum()

  def evaluate() -> float:
    total, tokens = 0.0, 0.0
    with torch.no_grad():
      for i in range(eval_batches['inputs'].shape[0]):
        loss_sum, n = loss_of(eval_batches, i)
        total, tokens = total + float(loss_sum), tokens + float(n)
    return total / max(tokens, 1.0)

  def stats_now(step):
    first = tuple(eval_batches[k][0] for k in ('inputs', 'positions', 'segment_ids'))
    return {'step': step, 'eval_loss': evaluate(), **_ffn_stats(model, first)}

  losses, evals = [], [stats_now(0)]
  start = time.time()
  for i in range(t['steps']):
    loss_sum, n = loss_of(train_batches, i)
    loss = loss_sum / torch.clamp(n, min=1.0)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # optax.clip_by_global_norm: g · min(1, clip / ‖g‖) (torch's clip_grad_norm_ adds 1e-6).
    grads = [p.grad for p in model.parameters()]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    if t['grad_clip'] and norm > t['grad_clip']:
      for g in grads:
        g.mul_(float(t['grad_clip'] / norm))
    for group in optimizer.param_groups:
      group['lr'] = meta['learning_rates'][i]
    optimizer.step()
    losses.append(float(loss))
    step = i + 1
    if t['eval_every'] and (step % t['eval_every'] == 0 or step == t['steps']):
      evals.append(stats_now(step))
      print(
        f"{meta['variant']} s{meta['seed']} step {step}: train {losses[-1]:.4f} eval "
        f"{evals[-1]['eval_loss']:.4f} ({time.time() - start:.0f} s)",
        flush=True,
      )
  result = {
    'variant': meta['variant'],
    'seed': meta['seed'],
    'weight_decay': wd,
    'losses': losses,
    'evals': evals,
    'eval_loss': evals[-1]['eval_loss'],
    'wall_s': time.time() - start,
    'torch': torch.__version__,
    'threads': torch.get_num_threads(),
  }
  name = 'torch.json' if weight_decay is None else f'torch-wd{wd:g}.json'
  with open(os.path.join(folder, name), 'w') as f:
    json.dump(result, f)
  return result


def report(out: str) -> str:
  """The markdown table of every exported run that trained: the first steps against mllm's, the
  final eval losses and the SwiGLU − ReLU gap per seed, in both implementations."""
  from experiments import stats

  runs = {}
  for name in sorted(os.listdir(out)):
    folder = os.path.join(out, name)
    meta_path = os.path.join(folder, 'meta.json')
    if not os.path.exists(meta_path):
      continue
    with open(meta_path) as f:
      meta = json.load(f)
    for file in sorted(os.listdir(folder)):
      if file.startswith('torch') and file.endswith('.json'):
        with open(os.path.join(folder, file)) as f:
          runs[(meta['variant'], meta['seed'], file)] = (meta, json.load(f))
  lines = [
    '| variant | seed | weight decay | init loss: mllm / torch | train loss at step 10, 20, 30: '
    'mllm / torch | eval loss: mllm / torch |',
    '|---|---:|---:|---:|---|---:|',
  ]
  finals = {}
  for (variant, seed, _file), (meta, run) in sorted(runs.items()):
    curve = meta['mllm']['curve'] or {'step': [], 'loss': []}
    early = [
      f'{loss:.4f} / {run["losses"][step - 1]:.4f}'
      for step, loss in zip(curve['step'], curve['loss'])
      if step in (10, 20, 30)
    ]
    same = run['weight_decay'] == meta['train']['weight_decay']
    mllm_eval = f"{meta['mllm']['eval_loss']:.4f}" if same else '-'
    lines.append(
      f"| {variant} | {seed} | {run['weight_decay']:g} | {meta['mllm']['init_loss']:.5f} / "
      f"{run['losses'][0]:.5f} | {'; '.join(early)} | {mllm_eval} / {run['eval_loss']:.4f} |"
    )
    finals.setdefault(run['weight_decay'], {}).setdefault(variant, {})[seed] = (
      meta['mllm']['eval_loss'] if same else math.nan,
      run['eval_loss'],
    )
  lines += ['', '| weight decay | implementation | SwiGLU − ReLU per seed | mean [95% CI] |']
  lines += ['|---:|---|---|---:|']
  for wd, by_variant in sorted(finals.items()):
    if not {'relu', 'swiglu'} <= set(by_variant):
      continue
    seeds = sorted(set(by_variant['relu']) & set(by_variant['swiglu']))
    for k, label in ((0, 'mllm'), (1, 'PyTorch')):
      gaps = [by_variant['swiglu'][s][k] - by_variant['relu'][s][k] for s in seeds]
      if not all(math.isfinite(g) for g in gaps):
        continue
      cell = '-'
      if len(gaps) >= 2:
        test = stats.paired_test(gaps, [0.0] * len(gaps))
        cell = f'{test.mean:+.4f} [{test.ci_low:+.4f}, {test.ci_high:+.4f}]'
      lines.append(f"| {wd:g} | {label} | {', '.join(f'{g:+.4f}' for g in gaps)} | {cell} |")
  return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.ffn_replication',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest='command', required=True)
  ex = sub.add_parser('export')
  ex.add_argument('--variant', required=True, choices=('relu', 'swiglu'))
  ex.add_argument('--seed', type=int, required=True)
  ex.add_argument('--out', required=True)
  tr = sub.add_parser('train')
  tr.add_argument('folder')
  tr.add_argument('--weight_decay', type=float, default=None)
  tr.add_argument('--threads', type=int, default=0)
  rp = sub.add_parser('report')
  rp.add_argument('out')
  args = parser.parse_args(argv)
  try:
    if args.command == 'export':
      print(export(args.variant, args.seed, args.out))
    elif args.command == 'train':
      result = train(args.folder, args.weight_decay, args.threads)
      print(f"eval loss {result['eval_loss']:.4f} after {result['wall_s']:.0f} s")
    else:
      print(report(args.out), end='')
  except (ValueError, FileNotFoundError, StopIteration) as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
