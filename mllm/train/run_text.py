"""What a run prints: its start line and notes, the progress bar's text for a step, the eval
and summary lines, and the last train loss a resumed run had recorded."""

from __future__ import annotations

import os

import jax
import numpy as np

from mllm.layers.moe import moe_layers, training_note
from mllm.train.metrics import read_metrics


def fmt_eval(e: dict) -> str:
  return f"val loss {e['loss']:.4f}  ppl {e['perplexity']:.2f}  bits/byte {e['bits_per_byte']:.4f}"


def print_start(bar, run, counts, device, start: int) -> None:
  """The notes for the run (MoE training, an empty validation split) and the line it starts with."""
  config, data, mesh = run.config, run.data, run.mesh
  moe_note = training_note(config.model.ffn.moe) if moe_layers(config.model) else None
  if moe_note:
    bar.print(f'note: {moe_note}')
  if not data.stats['val']['tokens']:
    bar.print(
      f'note: the validation split is empty (data.val_fraction={config.data.val_fraction} '
      'of too few documents); no eval metrics'
    )
  bar.print(
    f"{'resuming from step ' + str(start) if start else 'starting'} in {run.workdir}: "
    f'{counts.total:,} parameters, {jax.device_count()} × {device.device_kind}, mesh '
    + ' × '.join(f'{k}={v}' for k, v in mesh.shape.items())
  )


def step_info(loss: float, tok_s: float, dt: float, mfu: float | None, moe: dict | None) -> str:
  """The progress bar's text for a step: loss, speed, MFU where known, MoE drop rate and load."""
  return (
    f'loss {loss:.4f}  {tok_s:,.0f} tok/s  {dt * 1e3:.0f} ms/step'
    + (f'  MFU {mfu:.1%}' if mfu is not None else '')
    + (
      f"  drop {np.mean(moe['drop_rate']):.1%}  max/mean load "
      f"{np.mean(moe['load_max_over_mean']):.2f}"
      if moe
      else ''
    )
  )


def last_train_loss(metrics_path: str, step: int) -> float:
  """The train loss recorded at `step` (or the last before it), NaN if none was."""
  if not os.path.exists(metrics_path):
    return float('nan')
  losses = [
    r['loss']
    for r in read_metrics(metrics_path)
    if r['split'] == 'train' and r['step'] <= step and 'loss' in r
  ]
  return float(losses[-1]) if losses else float('nan')


def summary_line(s: dict) -> str:
  if s.get('nothing_left'):
    parts = [
      f"nothing left to train: the run is at step {s['step']} already "
      f"(train.steps or --stop_after); its last train loss {s['train_loss']:.4f}"
    ]
  else:
    parts = [
      f"{'stopped' if s['interrupted'] else 'done'} at step {s['step']}",
      f"train loss {s['train_loss']:.4f}",
    ]
  if s['eval']:
    parts.append(fmt_eval(s['eval']))
  if s['tokens_per_s']:
    parts.append(
      f"{s['tokens_per_s']:,.0f} tok/s (median step {s['median_step_s'] * 1e3:.0f} ms, "
      f"compile {s['compile_s']:.1f} s)"
    )
  parts.append(f"workdir {s['workdir']}")
  return '; '.join(parts)
