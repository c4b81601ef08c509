"""What a run reports: a live progress bar, metrics.jsonl, TensorBoard events, MFU and a loss plot.

MFU (PaLM, Chowdhery et al. 2022, App. B) = achieved model FLOPs/s ÷ the devices' peak FLOPs/s,
with model FLOPs/token from `mllm.training_flops_per_token` (6N plus attention).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

from mllm.paths import RunDir

# Dense peak FLOP/s per chip: bf16, and float32 as XLA runs it on that chip (TF32 tensor cores on
# NVIDIA Ampere and newer, bf16 passes on TPU). Sources: vendor datasheets (SXM parts).
PEAK_FLOPS = {  # device_kind substring: (bfloat16, float32)
  'H200': (989e12, 495e12),
  'H100': (989e12, 495e12),
  'GH200': (989e12, 495e12),
  'B200': (2250e12, 1100e12),
  'A100': (312e12, 156e12),
  'L4': (121e12, 60e12),
  'A10G': (70e12, 35e12),
  'TPU v6': (918e12, 918e12),
  'TPU v5p': (459e12, 459e12),
  'TPU v5': (197e12, 197e12),  # v5e / 'TPU v5 lite'
  'TPU v4': (275e12, 275e12),
}


def peak_flops_per_device(
  device_kind: str, dtype: str, override: float | None = None
) -> float | None:
  """Peak FLOP/s of one device, or None when the chip is not in the table (CPUs)."""
  if override:
    return float(override)
  for name, (bf16, fp32) in PEAK_FLOPS.items():
    if name.lower() in device_kind.lower():
      return bf16 if dtype == 'bfloat16' else fp32
  return None


def summary_writer():
  """tensorboardX's SummaryWriter class, imported without torch where torch is not loaded yet.

  tensorboardX imports torch whenever it is installed (writer.py: to accept torch tensors): the
  likely cause of the 3.8-4.1 s between the state and the first step on a GPU image with torch
  2.11 (H100, 2026-11-27; not yet re-measured there). mllm logs Python floats. A None entry in
  sys.modules makes that `import torch` fail, as if torch were absent."""
  if 'tensorboardX' in sys.modules or 'torch' in sys.modules:
    from tensorboardX import SummaryWriter

    return SummaryWriter
  sys.modules['torch'] = None
  try:
    from tensorboardX import SummaryWriter
  finally:
    sys.modules.pop('torch', None)
  return SummaryWriter


class MetricsWriter:
  """Appends one JSON object per record to metrics.jsonl and mirrors scalars to TensorBoard.

  resume_step: the step a resumed run restarts from. The steps after it will be run and logged
  again, so records for which `keep(record)` is false (default: step > resume_step), and a line
  cut short by a kill, are dropped first; TensorBoard hides its later events (purge_step).
  """

  def __init__(
    self, workdir: str, *, tensorboard: bool = True, resume_step: int | None = None, keep=None
  ):
    self.enabled = jax.process_index() == 0
    self.path = RunDir(workdir).metrics
    self._tb = self._file = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      if resume_step is not None:
        truncate_metrics(self.path, keep or (lambda r: r['step'] <= resume_step))
      self._file = open(self.path, 'a', encoding='utf-8')  # noqa: SIM115 (open for the run)
      if tensorboard:
        self._tb = summary_writer()(
          RunDir(workdir).tensorboard, purge_step=resume_step + 1 if resume_step else None
        )

  def write(self, step: int, split: str, values: dict) -> None:
    if not self.enabled:
      return
    record = {'step': int(step), 'split': split, 'time': round(time.time(), 3)}
    record.update({k: _plain(v) for k, v in values.items()})
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k not in ('step', 'split', 'time') and isinstance(v, (int, float)):
          self._tb.add_scalar(f'{split}/{k}', v, step)

  def close(self) -> None:
    """Idempotent: the loop closes it before plotting, and again on any exit."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def moe_records(moe: dict, layers) -> dict:
  """The MoE metrics of one step as records: 'moe/<name>' averaged over the MoE layers, and
  'moe/layer<i>/<name>' per layer (tokens_per_expert and mean_prob as lists, in metrics.jsonl
  only; TensorBoard takes the scalars)."""
  out = {}
  for name, value in moe.items():
    value = np.asarray(value)
    if value.ndim == 1:
      out[f'moe/{name}'] = float(value.mean())
    for row, layer in zip(value, layers):
      out[f'moe/layer{layer}/{name}'] = row.tolist() if row.ndim else float(row)
  return out


def truncate_metrics(path: str, keep) -> None:
  """Rewrite metrics.jsonl (atomically) with the complete records for which keep(record) holds."""
  if os.path.exists(path + '.tmp'):
    os.remove(path + '.tmp')  # a rewrite killed before its rename
  if not os.path.exists(path):
    return
  with open(path, 'rb') as f:
    lines = f.read().split(b'\n')
  kept = []
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:  # empty, or cut short by a kill
      continue
    if isinstance(record, dict) and isinstance(record.get('step'), int) and keep(record):
      kept.append(line)
  if len(kept) == sum(1 for line in lines if line.strip()):
    return
  with open(path + '.tmp', 'wb') as f:
    f.write(b''.join(line + b'\n' for line in kept))
  os.replace(path + '.tmp', path)


def _plain(v):
  if hasattr(v, 'item'):
    v = v.item()
  if isinstance(v, float):
    return float(f'{v:.6g}')
  return v


def read_metrics(path: str) -> list[dict]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


class Progress:
  """A rich progress bar (loss, tokens/s, step time, ETA) on a terminal; plain lines otherwise."""

  def __init__(self, total: int, start: int, *, log_every: int, enabled: bool = True):
    self.total, self.log_every = total, log_every
    self.enabled = enabled and jax.process_index() == 0
    self.live = self.enabled and sys.stdout.isatty()
    self._bar = None
    if self.live:
      from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
      from rich.progress import Progress as RichProgress

      self._bar = RichProgress(
        TextColumn('[bold]train'),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn('{task.fields[info]}'),
        TimeRemainingColumn(),
      )
      self._task = self._bar.add_task('train', total=total, completed=start, info='compiling…')
      self._bar.start()

  def update(self, step: int, info: str) -> None:
    if self.live:
      self._bar.update(self._task, completed=step, info=info)
    elif self.enabled and (step % self.log_every == 0 or step == self.total):
      print(f'step {step}/{self.total}  {info}', flush=True)

  def print(self, text: str) -> None:
    if not self.enabled:
      return
    if self.live:
      self._bar.console.print(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


def plot_losses(metrics_path: str, out_path: str) -> str | None:
  """Train (and eval) loss against step → a PNG; None if there is nothing to plot."""
  records = read_metrics(metrics_path)
  train = [(r['step'], r['loss']) for r in records if r['split'] == 'train' and 'loss' in r]
  evals = [(r['step'], r['loss']) for r in records if r['split'] == 'eval' and 'loss' in r]
  if not train:
    return None
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(*zip(*train), label='train', linewidth=1)
  if evals:
    ax.plot(*zip(*evals), 'o-', label='validation')
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats / token)')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  return out_path
