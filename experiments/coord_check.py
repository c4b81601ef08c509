"""µP's coordinate check (Yang et al. 2022, "Tensor Programs V", Fig. 5 and Appendix D.1): models
of widths 64 ... 1024 train a few Adam steps at one rate on one batch; after each step, the RMS of
each layer's output (the embedding, the residual stream after each block, the logits) and of its
change since the init. Under µP the blocks' change is flat in the width; under the standard
parametrization it grows with it (an update of the same rate moves a wider layer's output more),
which is why its best rate falls as the width grows.

    python -m experiments coord_check [--widths 64,128,256,512,1024] [--steps 8] [--lr 0.01]
                                      [--out experiments/results/coord_check]

writes results.json (every RMS), results.md (widest over narrowest, per layer) and
coord_check.png (one panel per parametrization and layer).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, 'experiments', 'results', 'coord_check')
BASE_D_MODEL = 64  # µP's base width: the narrowest model is the standard one
HEAD_DIM = 16  # at every width: the heads grow in number


def width_config(
  parametrization: str, d_model: int, *, lr: float, n_layers: int = 2, seq_len: int = 64
):
  """A small model of width `d_model` (head dim 16, so the heads grow with the width)."""
  import mllm

  return mllm.load_config(
    os.path.join(ROOT, 'configs', 'base.py'),
    {
      'model.parametrization.kind': parametrization,
      # One rate at every width: the standard parametrization's width rule off (µP's is its own).
      **(
        {
          'model.parametrization.mup.base_d_model': BASE_D_MODEL,
          # The heads multiply, each of 16 at every width: the scores keep 1/√16 (the default,
          # base_d_model / n_heads, is for heads that widen).
          'model.parametrization.mup.base_head_dim': HEAD_DIM,
        }
        if parametrization == 'mup'
        else {'model.parametrization.standard.lr_base_d_model': None}
      ),
      'model.d_model': d_model,
      'model.n_heads': d_model // HEAD_DIM,
      'model.n_kv_heads': d_model // HEAD_DIM,
      'model.n_layers': n_layers,
      'model.vocab_size': 256,
      'model.max_seq_len': seq_len,
      'data.seq_len': seq_len,
      'data.batch_size': 8,
      'train.learning_rate': lr,
      'train.warmup_steps': 0,
      'train.schedule': 'constant',
      'train.steps': 100,
    },
  )


def layer_outputs(model, tokens_BT) -> dict:
  """Each layer's output: 'embedding', 'block i' (the residual stream after block i), 'logits'.
  The stem and blocks are called as Transformer.__call__ calls them (an unscanned model without a
  cache); the logits are the model's own."""
  import jax.numpy as jnp

  from mllm.ops.attention import AttentionMask

  positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  x_BTD = model.position.embed(model.embed(tokens_BT), positions)
  out = {'embedding': x_BTD}
  context = model.position.context(positions, positions)
  mask = AttentionMask(causal=True, window=model.window)
  for i, block in enumerate(model.blocks):
    x_BTD, _, _ = block(x_BTD, context, mask)
    out[f'block {i}'] = x_BTD
  out['logits'] = model(tokens_BT)
  return out


def bigram_batch(config, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """A batch of the configured shape whose sequences follow token → next[token], a random map:
  a language a model learns within a few steps."""
  from mllm.train.step import synthetic_batch

  batch = synthetic_batch(config, rng)
  following = rng.permutation(config.model.vocab_size)
  tokens = np.empty((batch['inputs'].shape[0], batch['inputs'].shape[1] + 1), np.int32)
  tokens[:, 0] = rng.integers(0, config.model.vocab_size, tokens.shape[0])
  for t in range(1, tokens.shape[1]):
    tokens[:, t] = following[tokens[:, t - 1]]
  return {**batch, 'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}


def _rms(x) -> float:
  return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def measure(
  parametrization: str, d_model: int, *, steps: int, lr: float, seed: int = 0, **shape
) -> dict[str, list[dict]]:
  """{'rms': [each layer's output RMS after step 0 (the init), 1, ..., steps], 'delta': [the RMS
  of its change since the init, the same steps]} of one width."""
  import jax

  from mllm.train.sharding import global_batch, make_mesh
  from mllm.train.state import setup
  from mllm.train.step import make_train_step

  config = width_config(parametrization, d_model, lr=lr, **shape)
  mesh = make_mesh(config.mesh)
  train_setup, init = setup(config, mesh)
  step, state = make_train_step(train_setup), init()
  # One batch, trained on at every step and probed after it: an update's effect on the inputs it
  # was computed from is what µP keeps Θ(1). Its text follows a fixed random bigram map, so there
  # is something to learn and the updates are coherent (uniformly random targets give noise).
  batch = bigram_batch(config, np.random.default_rng(seed))
  probe = jax.numpy.asarray(batch['inputs'])
  outputs = jax.jit(lambda params: layer_outputs(train_setup.merge(params), probe))
  first = now = jax.device_get(outputs(state['params']))
  rms, delta = [], []
  for t in range(steps + 1):
    if t:
      state, _ = step(state, global_batch(batch, mesh))
      now = jax.device_get(outputs(state['params']))
    rms.append({k: _rms(v) for k, v in now.items()})
    delta.append({k: _rms(v - first[k]) for k, v in now.items()})
  return {'rms': rms, 'delta': delta}


def run(widths: list[int], *, steps: int, lr: float) -> dict:
  """{parametrization: {width: `measure`'s {'rms', 'delta'}}}."""
  from tqdm import tqdm

  results = {}
  jobs = [(p, w) for p in ('standard', 'mup') for w in widths]
  for p, w in tqdm(jobs, desc='coord check', unit='model'):
    results.setdefault(p, {})[str(w)] = measure(p, w, steps=steps, lr=lr)
  return results


def growth(results: dict, parametrization: str, layer: str, step: int = -1, what='delta') -> float:
  """The widest model's `what` ('delta': the change since the init; 'rms') of the layer's output
  over the narrowest one's, after `step`: ~1 when flat in the width."""
  by_width = results[parametrization]
  widths = sorted(by_width, key=int)
  return by_width[widths[-1]][what][step][layer] / by_width[widths[0]][what][step][layer]


def plot(results: dict, path: str) -> None:
  """One panel per parametrization (rows) and layer (columns): the RMS of the layer's output change
  since the init against the width, one line per step."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  parametrizations = list(results)
  first = next(iter(results[parametrizations[0]].values()))
  layers, n_steps = list(first['delta'][0]), len(first['delta'])
  fig, axes = plt.subplots(
    len(parametrizations),
    len(layers),
    figsize=(3 * len(layers), 2.8 * len(parametrizations)),
    squeeze=False,
    sharey='col',
  )
  for row, p in enumerate(parametrizations):
    widths = sorted(results[p], key=int)
    for col, layer in enumerate(layers):
      ax = axes[row][col]
      for t in range(1, n_steps):
        ax.plot(
          [int(w) for w in widths],
          [results[p][w]['delta'][t][layer] for w in widths],
          marker='o',
          color=plt.cm.viridis((t - 1) / max(n_steps - 2, 1)),
          label=f'step {t}',
        )
      ax.set_xscale('log', base=2)
      ax.set_yscale('log')
      ax.set_title(f'{p}: {layer}', fontsize=9)
      ax.set_xlabel('d_model')
    axes[row][0].set_ylabel('RMS of the change since init')
  axes[0][-1].legend(fontsize=7)
  fig.suptitle(
    'Coordinate check: flat in the width under µP (Tensor Programs V, Fig. 5)', fontsize=10
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def logits_limit(results: dict, widths: list[int]) -> tuple[float, float]:
  """(C, I) of Δ² = C² + I²/m fitted (least squares) to µP's logits change after the last step:
  the width-independent part and the part that vanishes as 1/√m."""
  m = np.asarray(widths, np.float64) / BASE_D_MODEL
  delta = np.asarray([results['mup'][str(w)]['delta'][-1]['logits'] for w in widths])
  (c2, i2), *_ = np.linalg.lstsq(np.stack([np.ones_like(m), 1 / m], 1), delta**2, rcond=None)
  return float(np.sqrt(max(c2, 0.0))), float(np.sqrt(max(i2, 0.0)))


def report(results: dict, widths: list[int], steps: int, lr: float) -> str:
  """results.md: each layer's change since the init, widest over narrowest, per parametrization."""
  import datetime

  import jax

  layers = list(results['mup'][str(widths[0])]['delta'][0])
  rows = [
    f'| {p} | ' + ' | '.join(f'{growth(results, p, layer):.2f}x' for layer in layers) + ' |'
    for p in results
  ]
  device = jax.devices()[0]
  limit, vanishing = logits_limit(results, widths)
  return '\n'.join(
    [
      '# Coordinate check',
      '',
      f'`python -m experiments coord_check --widths {",".join(map(str, widths))} --steps {steps} '
      f'--lr {lr:g}` ({device.platform}, {datetime.date.today()}): widths {widths[0]} to '
      f'{widths[-1]} (head dim 16, 2 layers, µP base width {BASE_D_MODEL}), {steps} Adam steps '
      'at one rate on one batch of a random bigram language; the RMS of each layer\'s output '
      'change since the init, at the widest model over the narrowest (1.00x: flat in the width).',
      '',
      '| parametrization | ' + ' | '.join(layers) + ' |',
      '|---|' + '---:|' * len(layers),
      *rows,
      '',
      'Under µP every block moves by the same amount at every width; under the standard '
      'parametrization the blocks move far more in the wider models (which become unstable at '
      'this rate), the reason its best rate falls with the width. The logits\' change under µP '
      'does not grow but falls toward a width-independent limit: its part from the initial '
      'readout (Δh · W₀ / m, incoherent) vanishes as 1/√m, as the initial logits do (Tensor '
      'Programs V, Table 3: the readout\'s init variance 1/fan_in²), leaving the learned part '
      f'(h · ΔW / m), which is Θ(1): fitting Δ² = C² + I²/m over the widths (m = d_model / '
      f'{BASE_D_MODEL}) gives C = {limit:.2f} (learned) and I = {vanishing:.2f} (vanishing).',
      '',
      '![coord_check.png](coord_check.png)',
      '',
    ]
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m experiments coord_check', description=__doc__.split('\n')[0]
  )
  parser.add_argument('--widths', default='64,128,256,512,1024', help='comma list of d_model')
  parser.add_argument('--steps', type=int, default=8, help='Adam steps after the init')
  parser.add_argument('--lr', type=float, default=1e-2, help='one rate for every width')
  parser.add_argument('--out', default=DEFAULT_OUT, help='folder for results.json and the plot')
  args = parser.parse_args(argv)
  try:
    widths = [int(w) for w in args.widths.split(',')]
  except ValueError:
    parser.error(f'--widths={args.widths!r}: allowed: a comma list of integers such as 64,128,256')
  if any(w % 16 or w < 16 for w in widths):
    parser.error(f'--widths={args.widths!r}: allowed: multiples of 16 (the head dim)')
  results = run(widths, steps=args.steps, lr=args.lr)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(
      {
        'widths': widths,
        'steps': args.steps,
        'lr': args.lr,
        'base_d_model': BASE_D_MODEL,
        'rms': results,
      },
      f,
      indent=1,
    )
  plot(results, os.path.join(args.out, 'coord_check.png'))
  with open(os.path.join(args.out, 'results.md'), 'w') as f:
    f.write(report(results, widths, args.steps, args.lr))
  for p in results:
    layers = results[p][str(widths[0])]['delta'][0]
    line = ', '.join(f'{layer} {growth(results, p, layer):.2f}x' for layer in layers)
    print(f'{p}: change since init, widest / narrowest, after step {args.steps}: {line}')
  return 0
