"""A suite's runs as one TensorBoard log: `tensorboard --logdir experiments/results/<suite>/tensorboard`.

One run directory per (variant, seed), `<variant>/s<seed>`, holding its train-loss curve and its
final metrics (at its last step), and a custom-scalars layout that puts every run of the suite on
the same charts. Written from results.json's records, so the suite's run folders are not needed.
"""

from __future__ import annotations

import math
import os
import shutil


def write(suite, results: dict, folder: str, final: tuple[str, ...]) -> str | None:
  """(Re)write <folder>/tensorboard, with the run metrics named in `final` as scalars at each
  run's last step; its path, or None when no run has finished."""
  from tensorboardX import SummaryWriter

  if not results['runs']:
    return None
  root = os.path.join(folder, 'tensorboard')
  shutil.rmtree(root, ignore_errors=True)
  finals = set()
  for run in results['runs']:
    writer = SummaryWriter(os.path.join(root, run['variant'], f"s{run['seed']}"))
    curve = run.get('curve') or {'step': [], 'loss': []}
    for step, loss in zip(curve['step'], curve['loss']):
      writer.add_scalar('train/loss', loss, step)
    last = curve['step'][-1] if curve['step'] else run.get('steps', 0)
    for key in final:
      value = run.get(key)
      if isinstance(value, (int, float)) and math.isfinite(value):
        writer.add_scalar(f'final/{key}', value, last)
        finals.add(key)
    writer.close()
  layout = {
    f'suite {suite.name}': {
      'train loss (every variant and seed)': ['Multiline', ['train/loss']],
      **{key: ['Multiline', [f'final/{key}$']] for key in final if key in finals},
    }
  }
  with SummaryWriter(root) as writer:
    writer.add_custom_scalars(layout)
  return root
