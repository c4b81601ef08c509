"""The training loop: resume or initialize, step, log, evaluate, checkpoint, stop cleanly.

    from mllm.train import train
    summary = train(config, 'runs/rope_swiglu')

One code path for one CPU, one GPU or a pod: the jitted step runs on a `Mesh` and each process
feeds its own rows of the batch (`jax.make_array_from_process_local_data`).
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time

import jax
import numpy as np
from flax import nnx

from mllm.accounting import count_params, training_flops_per_token
from mllm.model import build_model
from mllm.train.checkpoint import Checkpointer, check_resumable, write_config
from mllm.train.metrics import MetricsWriter, Progress, peak_flops_per_device, plot_losses
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import setup
from mllm.train.step import eval_summary, make_eval_step, make_train_step


class TrainingDiverged(RuntimeError):
  """The loss became NaN or infinite; the run stopped without saving that state."""


def maybe_initialize_distributed() -> None:
  """`jax.distributed.initialize()` when the launcher started several processes.

  JAX reads the coordinator, process count and id itself from SLURM, Open MPI, Kubernetes
  JobSets and Cloud TPU pods; JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES, JAX_PROCESS_ID)
  covers anything else.
  """
  env = os.environ
  many = (env.get('JAX_COORDINATOR_ADDRESS') or int(env.get('SLURM_NTASKS', '1')) > 1
          or int(env.get('OMPI_COMM_WORLD_SIZE', '1')) > 1
          or ',' in env.get('TPU_WORKER_HOSTNAMES', ''))
  if many and not jax.distributed.is_initialized():
    jax.distributed.initialize()


def param_shapes(model_config) -> dict[str, tuple[int, ...]]:
  abstract = nnx.eval_shape(lambda: build_model(model_config, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  return {jax.tree_util.keystr(p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


class _StopRequest:
  """SIGTERM / SIGINT set a flag; the loop saves a checkpoint after the current step and returns.
  A second signal stops at once."""

  def __init__(self):
    self.signal = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.signal is not None:
      raise KeyboardInterrupt
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def run_eval(eval_step, params, data, mesh, max_batches: int) -> dict | None:
  """Validation metrics, or None when the validation split is empty."""
  batches = data.eval_batches(max_batches)
  if not len(batches):
    return None
  totals = {'loss_sum': 0.0, 'tokens': 0.0, 'bytes': 0.0}
  for batch in batches:
    out = jax.device_get(eval_step(params, global_batch(batch, mesh)))
    for k in totals:
      totals[k] += float(out[k])  # summed in float64 on the host
  return eval_summary(totals)


def _fmt_eval(e: dict) -> str:
  return (f"val loss {e['loss']:.4f}  ppl {e['perplexity']:.2f}  "
          f"bits/byte {e['bits_per_byte']:.4f}")


def train(config, workdir: str, *, stop_after: int | None = None, progress: bool = True) -> dict:
  """Train `config` in `workdir`, resuming from its latest checkpoint; returns a summary dict.

  stop_after: leave after this global step (saving a checkpoint), as a preemption would.
  """
  from mllm.data import build_data
  maybe_initialize_distributed()
  t = config.train
  check_resumable(workdir, config, param_shapes)
  mesh = make_mesh(config.mesh)
  data = build_data(config, workdir, process_index=jax.process_index(),
                    process_count=jax.process_count())
  write_config(workdir, config)
  model, init = setup(config, mesh)
  train_step = make_train_step(model)
  eval_step = make_eval_step(model, data.tokenizer.token_bytes)
  iterator = data.train_iterator()
  ckpt = Checkpointer(workdir, max_to_keep=t.max_to_keep, async_save=t.async_checkpoint)
  writer = MetricsWriter(workdir, tensorboard=t.tensorboard)

  start, state = ckpt.restore_latest(model.abstract_state, iterator)
  if start is None:
    start, state = 0, init()
  end = t.steps if stop_after is None else min(t.steps, stop_after)

  counts = count_params(config)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  flops_per_token = training_flops_per_token(config, config.data.seq_len, counts).total
  device = jax.devices()[0]
  peak = peak_flops_per_device(device.device_kind, config.model.dtype, t.peak_flops)
  bar = Progress(end, start, log_every=t.log_every, enabled=progress)
  if not data.stats['val']['tokens']:
    bar.print(f'note: the validation split is empty (data.val_fraction={config.data.val_fraction} '
              'of too few documents); no eval metrics')
  bar.print(f"{'resuming from step ' + str(start) if start else 'starting'} in {workdir}: "
            f'{counts.total:,} parameters, {jax.device_count()} × {device.device_kind}, mesh '
            + ' × '.join(f'{k}={v}' for k, v in mesh.shape.items()))

  step, last_saved, loss, compile_s, last_eval = start, start, float('nan'), 0.0, None
  times = []
  with _StopRequest() as stop:
    try:
      while step < end:
        batch = global_batch(next(iterator), mesh)
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        # Reading the loss blocks on the step: it also avoids the multi-device CPU rendezvous
        # deadlock between consecutive steps (JAX_NOTES.md).
        loss = float(metrics['loss'])
        dt = time.perf_counter() - t0
        step += 1
        if not math.isfinite(loss) or not bool(metrics['params_finite']):
          what = f'loss is {loss}' if not math.isfinite(loss) else 'the update overflowed'
          raise TrainingDiverged(
              f'{what} at step {step}; stopped without saving that state. The latest '
              f'checkpoint is step {ckpt.latest_step()}; lower train.learning_rate or raise '
              'train.warmup_steps')
        if step == start + 1:
          compile_s = dt  # the first call compiles
        else:
          times.append(dt)
        tok_s = tokens_per_step / dt
        mfu = (flops_per_token * tok_s / (peak * jax.device_count())) if peak else None
        bar.update(step, f'loss {loss:.4f}  {tok_s:,.0f} tok/s  {dt * 1e3:.0f} ms/step'
                   + (f'  MFU {mfu:.1%}' if mfu is not None else ''))
        if step % t.log_every == 0 or step == end:
          writer.write(step, 'train', {
              'loss': loss, 'grad_norm': metrics['grad_norm'],
              'learning_rate': metrics['learning_rate'], 'tokens_per_s': tok_s,
              'step_time_s': dt, 'mfu': mfu, 'tokens_seen': step * tokens_per_step})
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:
          last_eval = run_eval(eval_step, state['params'], data, mesh, t.eval_batches)
          if last_eval:
            writer.write(step, 'eval', last_eval)
            bar.print(f'step {step}: {_fmt_eval(last_eval)}')
        if step % t.checkpoint_every == 0 or step == end:
          ckpt.save(step, state, iterator)
          last_saved = step
        if stop.signal:
          if last_saved != step:
            ckpt.save(step, state, iterator)
            last_saved = step
          bar.print(f'{stop.signal}: saved step {step} in {ckpt.directory}; run again to resume')
          break
    finally:
      bar.close()
      ckpt.close()
  if step == t.steps and not stop.signal:
    last_eval = run_eval(eval_step, state['params'], data, mesh, t.eval_batches)
    if last_eval:
      writer.write(step, 'eval', last_eval)
  writer.close()
  plot = None
  if jax.process_index() == 0 and os.path.exists(writer.path):
    plot = plot_losses(writer.path, os.path.join(workdir, 'loss.png'))
  median = float(np.median(times)) if times else float('nan')
  summary = {'step': step, 'train_loss': loss, 'eval': last_eval, 'compile_s': compile_s,
             'median_step_s': median, 'tokens_per_s': tokens_per_step / median if times else None,
             'interrupted': stop.signal, 'workdir': workdir, 'plot': plot}
  bar.print(_summary_line(summary))
  return summary


def _summary_line(s: dict) -> str:
  parts = [f"{'stopped' if s['interrupted'] else 'done'} at step {s['step']}",
           f"train loss {s['train_loss']:.4f}"]
  if s['eval']:
    parts.append(_fmt_eval(s['eval']))
  if s['tokens_per_s']:
    parts.append(f"{s['tokens_per_s']:,.0f} tok/s (median step {s['median_step_s'] * 1e3:.0f} ms, "
                 f"compile {s['compile_s']:.1f} s)")
  parts.append(f"workdir {s['workdir']}")
  return '; '.join(parts)


def evaluate(config, workdir: str) -> dict:
  """Validation loss, perplexity and bits per byte of `workdir`'s latest checkpoint."""
  from mllm.config import ConfigError
  from mllm.data import build_data
  maybe_initialize_distributed()
  check_resumable(workdir, config, param_shapes)
  mesh = make_mesh(config.mesh)
  ckpt = Checkpointer(workdir, max_to_keep=config.train.max_to_keep, async_save=False)
  model, _ = setup(config, mesh)
  step, state = ckpt.restore_latest(model.abstract_state)
  ckpt.close()
  if step is None:
    raise ConfigError('--workdir', workdir, 'has no checkpoint to evaluate; allowed: the workdir '
                      'of a training run')
  data = build_data(config, workdir, process_index=jax.process_index(),
                    process_count=jax.process_count())
  result = run_eval(make_eval_step(model, data.tokenizer.token_bytes), state['params'], data,
                    mesh, config.train.eval_batches)
  if result is None:
    raise ConfigError('data.val_fraction', config.data.val_fraction,
                      'the validation split is empty; allowed: a larger fraction or more documents')
  result['step'] = step
  return result
