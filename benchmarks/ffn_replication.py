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
  import optax
  from flax import nnx

  from experiments.run import config_hash, older_hashes, resolve
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
  if record['hash'] not in {config_hash(config), *older_hashes(config).values()}:
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
  first = {k: jnp.asarray(v) for k, v in batches[0].items()}
  mask = first['loss_mask'].astype(jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def init_loss(params):
    """The masked mean cross-entropy of the first batch: the loss mllm's first step takes."""
    logits = nnx.merge(graphdef, params, rest)(
      first['inputs'], positions=first['positions'], segment_ids=first['segment_ids']
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), first['targets']
    )
    return (ce * mask).sum() / mask.sum()

  loss, grads = jax.value_and_grad(init_loss)(params)
  np.savez(os.path.join(folder, 'grads_init.npz'), **_torch_params(grads))
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
    'tokens_per_step': config.data.batch_size * config.data.seq_len,
    'decay_embeddings': t.decay_embeddings,
    'decay_norms_and_biases': t.decay_norms_and_biases,
    'mllm': {
      'init_loss': float(loss),
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


def _model(folder: str, own_init: bool = False):
  """(meta, the exported run's TorchLlama): mllm's initial weights, or with own_init
  torch_llama's own initialisation drawn after torch.manual_seed(seed)."""
  import torch

  from benchmarks.torch_llama import TorchLlama

  with open(os.path.join(folder, 'meta.json')) as f:
    meta = json.load(f)
  torch.manual_seed(meta['seed'])
  model = TorchLlama(_Namespace(meta['model']), d_ff=meta['d_ff'])
  params = dict(np.load(os.path.join(folder, 'params.npz')))
  state = model.state_dict()
  if set(params) != set(state):
    raise ValueError(f'exported {sorted(set(params) ^ set(state))} do not match the model')
  if not own_init:
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
  return meta, model


def _batches(folder: str, split: str) -> dict:
  """The exported batches of `split` ('train' or 'eval') as tensors [batches, B, T]."""
  import torch

  arrays = np.load(os.path.join(folder, f'{split}.npz'))
  batches = {k: torch.from_numpy(arrays[k].astype(np.int64)) for k in BATCH_KEYS}
  batches['loss_mask'] = batches['loss_mask'].float()
  return batches


def _loss_sum(model, batches: dict, i: int):
  """(Σ cross-entropy · loss_mask, Σ loss_mask) of batch i, as mllm's step sums them."""
  import torch.nn.functional as F

  logits = model(batches['inputs'][i], batches['positions'][i], batches['segment_ids'][i])
  ce = F.cross_entropy(
    logits.reshape(-1, logits.shape[-1]), batches['targets'][i].reshape(-1), reduction='none'
  )
  mask = batches['loss_mask'][i].reshape(-1)
  return (ce * mask).sum(), mask.sum()


def gradcheck(folder: str) -> dict[str, float]:
  """{parameter: max |torch − mllm| / max |mllm|} of the loss's gradient at the initial weights
  on the first batch: mllm's (jax.grad through its layers, the FFN's hand-written backward
  included) against PyTorch's autograd."""
  _, model = _model(folder)
  loss_sum, n = _loss_sum(model, _batches(folder, 'train'), 0)
  (loss_sum / n).backward()
  reference = dict(np.load(os.path.join(folder, 'grads_init.npz')))
  return {
    name: float(np.abs(p.grad.numpy() - reference[name]).max() / np.abs(reference[name]).max())
    for name, p in model.named_parameters()
  }


def _ffn_stats(model, batch) -> dict:
  """Mean over layers of each FFN matrix's Frobenius norm, and the RMS of the FFN's hidden
  activation (the input of `down`) on `batch`."""
  import torch

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
  return {**norms, 'hidden_rms': float(np.mean(hidden))}


def train(
  folder: str, weight_decay: float | None = None, threads: int = 0, own_init: bool = False
) -> dict:
  """Train the exported run in PyTorch; write <folder>/torch[-wdX][-own_init].json and return it.
  own_init: torch_llama's own initialisation (N(0, init_std), the output projections scaled by
  depth; torch.manual_seed(seed)) instead of mllm's initial weights."""
  import torch

  if threads:
    torch.set_num_threads(threads)
  meta, model = _model(folder, own_init)
  t = meta['train']
  wd = t['weight_decay'] if weight_decay is None else weight_decay
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
  train_batches, eval_batches = _batches(folder, 'train'), _batches(folder, 'eval')

  def evaluate() -> float:
    total, tokens = 0.0, 0.0
    with torch.no_grad():
      for i in range(eval_batches['inputs'].shape[0]):
        loss_sum, n = _loss_sum(model, eval_batches, i)
        total, tokens = total + float(loss_sum), tokens + float(n)
    return total / max(tokens, 1.0)

  def stats_now(step):
    first = tuple(eval_batches[k][0] for k in ('inputs', 'positions', 'segment_ids'))
    return {'step': step, 'eval_loss': evaluate(), **_ffn_stats(model, first)}

  losses, evals = [], [stats_now(0)]
  start = time.time()
  for i in range(t['steps']):
    loss_sum, n = _loss_sum(model, train_batches, i)
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
    'init': 'torch' if own_init else 'mllm',
    'losses': losses,
    'evals': evals,
    'eval_loss': evals[-1]['eval_loss'],
    'wall_s': time.time() - start,
    'torch': torch.__version__,
    'threads': torch.get_num_threads(),
  }
  name = (
    'torch' + ('' if weight_decay is None else f'-wd{wd:g}') + ('-own_init' if own_init else '')
  )
  name += '.json'
  with open(os.path.join(folder, name), 'w') as f:
    json.dump(result, f)
  return result


# Where the replication's runs are written as evidence a diagnosis can recompute from
# (experiments/diagnosis.py reads <results>/<name>/results.json): one folder per condition.
CONDITIONS = {
  ('mllm', 0.1): 'ffn_replication',
  ('mllm', 0.0): 'ffn_replication_wd0',
  ('torch', 0.1): 'ffn_replication_own_init',
}


def _load(out: str) -> list[tuple[dict, dict]]:
  """(meta, torch run) of every exported folder's finished runs."""
  found = []
  for name in sorted(os.listdir(out)):
    folder = os.path.join(out, name)
    if not os.path.exists(os.path.join(folder, 'meta.json')):
      continue
    with open(os.path.join(folder, 'meta.json')) as f:
      meta = json.load(f)
    for file in sorted(os.listdir(folder)):
      if file.startswith('torch') and file.endswith('.json'):
        with open(os.path.join(folder, file)) as f:
          run = json.load(f)
        run.setdefault('init', 'mllm')
        found.append((meta, run))
  return found


def write_evidence(out: str, results: str = 'experiments/results') -> dict[str, int]:
  """Each condition's runs as <results>/<CONDITIONS name>/results.json ({'runs': [...]}: variant,
  seed, eval_loss, eval_curve), which diagnoses read as they read a suite's; {name: runs}."""
  by_name = {}
  for meta, run in _load(out):
    name = CONDITIONS.get((run['init'], round(run['weight_decay'], 6)))
    if name is None:
      continue
    by_name.setdefault(name, []).append(
      {
        'variant': meta['variant'],
        'seed': meta['seed'],
        'eval_loss': run['eval_loss'],
        'eval_curve': {
          'step': [e['step'] for e in run['evals'][1:]],
          'loss': [e['eval_loss'] for e in run['evals'][1:]],
        },
        'ffn_stats': run['evals'],
        'tokens': int(meta.get('tokens_per_step', 2048) * len(run['losses'])),
        'steps': len(run['losses']),
        'weight_decay': run['weight_decay'],
        'init': run['init'],
        'replicates': f"{meta['suite']} {meta['variant']} seed {meta['seed']} ({meta['hash']})",
        'provenance': {'torch': run['torch'], 'threads': run['threads']},
        'wall_s': run['wall_s'],
      }
    )
  for name, runs in by_name.items():
    os.makedirs(os.path.join(results, name), exist_ok=True)
    with open(os.path.join(results, name, 'results.json'), 'w') as f:
      json.dump({'suite': name, 'runs': runs}, f, indent=1)
  return {name: len(runs) for name, runs in by_name.items()}


def report(out: str) -> str:
  """The markdown tables of every exported run that trained: the first steps against mllm's, the
  final eval losses, the SwiGLU − ReLU gap per seed in both implementations and conditions, and
  the FFN's weight norms and hidden RMS over training."""
  from experiments import stats

  loaded = _load(out)
  lines = [
    '| variant | seed | init | weight decay | init loss: mllm / torch | train loss at step 10, '
    '20, 30: mllm / torch | largest train-loss difference, steps 10-100 / 10-2000 | eval loss: '
    'mllm / torch |',
    '|---|---:|---|---:|---:|---|---:|---:|',
  ]
  finals = {}
  for meta, run in sorted(
    loaded, key=lambda x: (x[1]['init'], -x[1]['weight_decay'], x[0]['variant'], x[0]['seed'])
  ):
    same = run['weight_decay'] == meta['train']['weight_decay'] and run['init'] == 'mllm'
    curve = meta['mllm']['curve'] or {'step': [], 'loss': []}
    early = (
      '; '.join(
        f'{loss:.4f} / {run["losses"][step - 1]:.4f}'
        for step, loss in zip(curve['step'], curve['loss'])
        if step in (10, 20, 30)
      )
      if same
      else ''
    )
    init_loss = f"{meta['mllm']['init_loss']:.5f} / {run['losses'][0]:.5f}" if same else ''
    apart = [
      (step, abs(loss - run['losses'][step - 1]))
      for step, loss in zip(curve['step'], curve['loss'])
    ]
    drift = (
      f"{max(d for st, d in apart if st <= 100):.1e} / {max(d for _, d in apart):.2f}"
      if same and apart
      else ''
    )
    mllm_eval = f"{meta['mllm']['eval_loss']:.4f}" if same else '-'
    lines.append(
      f"| {meta['variant']} | {meta['seed']} | {run['init']} | {run['weight_decay']:g} | "
      f"{init_loss} | {early} | {drift} | {mllm_eval} / {run['eval_loss']:.4f} |"
    )
    key = (run['init'], run['weight_decay'])
    finals.setdefault(key, {}).setdefault(meta['variant'], {})[meta['seed']] = (
      meta['mllm']['eval_loss'] if same else math.nan,
      run['eval_loss'],
    )
  checked = []
  for name in sorted(os.listdir(out)):
    path = os.path.join(out, name, 'gradcheck.json')
    if os.path.exists(path):
      with open(path) as f:
        errors = json.load(f)
      worst = max(errors, key=errors.get)
      checked.append(f'{name} {errors[worst]:.1e} ({worst})')
  if checked:
    lines += [
      '',
      'The loss gradient at the initial weights on the first batch (`gradcheck`), mllm (jax.grad '
      "through its layers, the FFN's hand-written backward included) against PyTorch autograd, "
      'largest difference relative to the parameter gradient\'s largest entry: '
      + '; '.join(checked)
      + '.',
    ]
  lines += [
    '',
    '| init | weight decay | implementation | SwiGLU − ReLU per seed | mean [95% CI] |',
    '|---|---:|---|---|---:|',
  ]
  for (init, wd), by_variant in sorted(finals.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
    if not {'relu', 'swiglu'} <= set(by_variant):
      continue
    seeds = sorted(set(by_variant['relu']) & set(by_variant['swiglu']))
    for k, label in ((0, 'mllm'), (1, 'PyTorch')):
      gaps = [by_variant['swiglu'][s][k] - by_variant['relu'][s][k] for s in seeds]
      if not gaps or not all(math.isfinite(g) for g in gaps):
        continue
      cell = '-'
      if len(gaps) >= 2:
        test = stats.paired_test(gaps, [0.0] * len(gaps))
        cell = f'{test.mean:+.4f} [{test.ci_low:+.4f}, {test.ci_high:+.4f}]'
      lines.append(
        f"| {init} | {wd:g} | {label} | {', '.join(f'{g:+.4f}' for g in gaps)} | {cell} |"
      )
  lines += [
    '',
    'FFN weight norms (Frobenius, mean over layers) and the hidden activation RMS (the input of '
    '`down`, first eval batch), mean over seeds, at 0, 1, 2 and 4 M tokens:',
    '',
    '| variant | init | weight decay | up norm | gate norm | down norm | hidden RMS |',
    '|---|---|---:|---|---|---|---|',
  ]
  grouped = {}
  for meta, run in loaded:
    grouped.setdefault((meta['variant'], run['init'], run['weight_decay']), []).append(run)
  for (variant, init, wd), runs in sorted(
    grouped.items(), key=lambda kv: (kv[0][1], -kv[0][2], kv[0][0])
  ):
    cells = []
    for key in ('up_norm', 'gate_norm', 'down_norm', 'hidden_rms'):
      at = []
      for step in (0, 500, 1000, 2000):
        values = [e[key] for r in runs for e in r['evals'] if e['step'] == step and key in e]
        at.append(f'{np.mean(values):.2f}' if values else '')
      cells.append(' → '.join(at) if any(at) else '')
    lines.append(f"| {variant} | {init} | {wd:g} | " + ' | '.join(cells) + ' |')
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
  tr.add_argument('--own_init', action='store_true', help="torch_llama's initialisation")
  gc = sub.add_parser('gradcheck')
  gc.add_argument('folder')
  rp = sub.add_parser('report')
  rp.add_argument('out')
  rp.add_argument('--evidence', default='', help='also write the runs under this results folder')
  args = parser.parse_args(argv)
  try:
    if args.command == 'export':
      print(export(args.variant, args.seed, args.out))
    elif args.command == 'gradcheck':
      errors = gradcheck(args.folder)
      worst = max(errors, key=errors.get)
      with open(os.path.join(args.folder, 'gradcheck.json'), 'w') as f:
        json.dump(errors, f)
      print(f'largest relative gradient difference: {errors[worst]:.2e} ({worst})')
    elif args.command == 'train':
      result = train(args.folder, args.weight_decay, args.threads, args.own_init)
      print(f"eval loss {result['eval_loss']:.4f} after {result['wall_s']:.0f} s")
    else:
      if args.evidence:
        write_evidence(args.out, args.evidence)
      print(report(args.out), end='')
  except (ValueError, FileNotFoundError, StopIteration) as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
