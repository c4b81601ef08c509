"""The training loop: resume or initialize, step, log, evaluate, checkpoint, stop cleanly.

    from mllm.train import train
    summary = train(config, 'runs/rope_swiglu')

One code path for one CPU, one GPU or a pod: the jitted step runs on a `Mesh` and each process
feeds its own rows of the batch (`jax.make_array_from_process_local_data`). The loop dispatches
steps; what happens around them (the divergence guard, the progress bar, the train log,
evaluation, checkpoints, and a caller's own) are hooks at named points (mllm/train/hooks.py),
which read a step's metrics once the next step runs unless they need its state.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mllm import compile_cache
from mllm.accounting import count_params, training_flops_per_token
from mllm.layers.moe import moe_layers
from mllm.paths import RunDir
from mllm.train import run_text
from mllm.train.cluster import StopRequest
from mllm.train.evaluation import run_eval
from mllm.train.hooks import Hook, StepInfo, needs_state, run_hooks
from mllm.train.metrics import (
  MetricsWriter,
  Progress,
  moe_records,
  peak_flops_per_device,
  plot_losses,
)
from mllm.train.opening import Run, open_run, starting_state
from mllm.train.sharding import global_batch
from mllm.train.step import make_eval_step, make_train_step


class TrainingDiverged(RuntimeError):
  """The loss became NaN or infinite; the run stopped without saving that state."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def train(
  config,
  workdir: str,
  *,
  stop_after: int | None = None,
  progress: bool = True,
  hooks: tuple[Hook, ...] = (),
) -> dict:
  """Train `config` in `workdir`, resuming from its latest checkpoint; returns a summary dict.

  stop_after: leave after this global step (saving a checkpoint), as a preemption would.
  hooks: more `Hook`s (mllm/train/hooks.py), run after the built-in ones at each step due.
  """
  started = time.perf_counter()  # the first step's start-up line counts from here
  with open_run(config, workdir) as run:
    opened = (
      f'open {time.perf_counter() - started:.1f} s with devices {run.devices_s:.1f} s and data '
      f'{run.data_s:.1f} s'
    )
    start, state, state_note = starting_state(run)
    state_note = f'{opened}, {state_note}'
    ready = time.perf_counter()  # the state is ready; building the steps and writers follows
    cached_before = compile_cache.counts()
    end = config.train.steps if stop_after is None else min(config.train.steps, stop_after)
    counts = count_params(run.setup.abstract_model())
    device = jax.devices()[0]
    speed = _Speed(
      tokens_per_step=config.data.batch_size * config.data.seq_len,
      flops_per_token=training_flops_per_token(config, counts, config.data.seq_len).total,
      peak=peak_flops_per_device(device.device_kind, config.model.dtype, config.train.peak_flops),
    )
    writer = metrics_writer(workdir, config.train, start)
    run.closing.callback(writer.close)
    loop = _Loop(
      run=run,
      train_step=make_train_step(run.setup),
      eval_step=make_eval_step(run.setup, run.data.tokenizer.token_bytes),
      writer=writer,
      speed=speed,
      bar=Progress(end, start, log_every=config.train.log_every, enabled=progress),
      start=start,
      end=end,
      state=state,
      # Resumed at its last step: report the losses it ended with, not NaN.
      loss=run_text.last_train_loss(writer.path, start) if start >= end else float('nan'),
      cached_before=cached_before,
      read_ahead=jax.default_backend() != 'cpu' or run.mesh.size == 1,
      hooks=tuple(hooks),
    )
    run_text.print_start(loop.bar, run, counts, device, start)
    loop.run_steps(started, state_note, ready)
    return loop.finish()


def save_initial_state(config, workdir: str) -> None:
  """Save the state a run of `config` starts from (train.init_from's parameters) as step 0 of a
  new run in `workdir`, with its config, tokenizer and data position (launch.py --mode=import):
  the start of `train` without its loop."""
  with open_run(config, workdir) as run:
    start, state, _ = starting_state(run)
    assert start == 0, start  # launch.py refuses a workdir that holds checkpoints
    run.ckpt.save(0, state, run.iterator, run.saved_config)
    run.ckpt.wait()


@dataclasses.dataclass(frozen=True)
class _Speed:
  """What turns a step's seconds into tokens/s and MFU."""

  tokens_per_step: int
  flops_per_token: float
  peak: float | None  # FLOP/s of one device; None where unknown (no MFU)


def metrics_writer(workdir, t, start: int) -> MetricsWriter:
  """The run's MetricsWriter, resuming at step `start` (t: config.train)."""

  # Records after the resumed step are replayed; so is the final eval of a finished run.
  def keep(record) -> bool:
    final_eval = record['split'] == 'eval' and start == t.steps
    return record['step'] < start or (record['step'] == start and not final_eval)

  return MetricsWriter(workdir, tensorboard=t.tensorboard, resume_step=start, keep=keep)


@dataclasses.dataclass(frozen=True)
class _Dispatched:
  """A step on its way: its metrics (device arrays, not yet read) and when it started."""

  step: int
  metrics: dict
  started: float  # time.perf_counter() before its batch was read


class _Loop:
  """The steps of one `train` call and the hooks around them (mllm/train/hooks.py): the
  divergence guard, the progress bar, the train log, evaluation and checkpoints, in that order.
  What it carries from step to step is its own; the summary is `finish()`'s."""

  def __init__(
    self,
    *,
    run: Run,
    train_step: Callable,
    eval_step: Callable,
    writer: MetricsWriter,
    speed: _Speed,
    bar: Progress,
    start: int,
    end: int,
    state: dict,
    loss: float = float('nan'),
    cached_before: tuple[int, int] = (0, 0),
    read_ahead: bool = False,
    hooks: tuple[Hook, ...] = (),
  ):
    self.run, self.bar = run, bar
    self._train_step, self._eval_step, self._writer, self._speed = (
      train_step,
      eval_step,
      writer,
      speed,
    )
    self._start, self._end, self._state, self._loss = start, end, state, loss
    self._cached_before = cached_before  # compile_cache.counts() before the first step
    self._read_ahead = read_ahead  # read a step's metrics once the next one runs
    self._step = self._last_saved = start  # steps dispatched; the last step saved
    self._compile_s = 0.0
    self._last_eval: dict | None = None
    self._interrupted: str | None = None  # the signal that stopped the job (in any process)
    self._times: list[float] = []  # step times after the first
    self._last_read = 0.0  # when the previous step's metrics were read
    # The next step's batch, already on the devices, and the data position before it was read.
    self._prefetched: tuple[dict, Any] | None = None
    t = run.config.train
    self._hooks = [
      Hook('divergence guard', self._guard),
      Hook('progress', self._show),
      Hook('train log', self._log, every=t.log_every),
      Hook(
        'evaluation', self._evaluate_during, every=t.eval_every, at_last=False, needs_state=True
      ),
      Hook('checkpoint', self._checkpoint, every=t.checkpoint_every, needs_state=True),
      *hooks,
    ]

  def run_steps(self, started: float, state_note: str, ready: float) -> None:
    """Step until `end`, or until a stop request (SIGTERM, SIGINT), which saves the step reached.
    started: time.perf_counter() at the start of `train`; state_note: how long the state took to
    initialize or restore, ready: when it was ready (all three for the first step's start-up
    line)."""
    self._startup = (started, state_note, ready)
    self._last_read = ready
    pending: _Dispatched | None = None
    with StopRequest() as stop:
      try:
        while self._step < self._end:
          step = self._dispatch()
          if pending is not None:  # read now that the next step runs
            self._finish(pending)
            pending = None
          last = step.step == self._end
          if self._read_ahead and not needs_state(self._hooks, step.step, last):
            pending = step
          else:
            self._finish(step)
          self._interrupted = stop.agreed()
          if self._interrupted:
            if pending is not None:
              self._finish(pending)
              pending = None
            self._save_for_resume()
            break
      finally:
        self.bar.close()

  def _dispatch(self) -> _Dispatched:
    """Start the next training step on the devices (and read the batch after it meanwhile)."""
    t0 = time.perf_counter()
    batch = self._next_batch()
    self._state, metrics = self._train_step(self._state, batch)
    self._step += 1
    self._prefetch()  # while the devices run this step
    return _Dispatched(self._step, metrics, t0)

  def _finish(self, step: _Dispatched) -> None:
    """Read a step's loss (waiting for it), time it, and run the hooks due at it."""
    loss = float(step.metrics['loss'])
    now = time.perf_counter()
    dt = now - max(step.started, self._last_read)
    self._last_read = now
    if step.step == self._start + 1:
      self._compile_s = dt  # the first call compiles
      started, state_note, ready = self._startup
      self.bar.print(
        f'first step after {now - started:.1f} s from the start of train() '
        f'({state_note}, then {step.started - ready:.1f} s to the first step, compile + step '
        f'{dt:.1f} s{self._cache_note()})'
      )
    else:
      self._times.append(dt)
    self._loss = loss
    last = step.step == self._end
    info = StepInfo(
      step=step.step,
      loss=loss,
      metrics=step.metrics,
      seconds=dt,
      last=last,
      state=self._state if needs_state(self._hooks, step.step, last) else None,
    )
    run_hooks(self._hooks, info)

  # The built-in hooks, in the order they run.

  def _guard(self, info: StepInfo) -> None:
    """Raise TrainingDiverged, before the step's state can be saved, when the loss or the new
    parameters are not finite."""
    loss = info.loss
    if not math.isfinite(loss) or not bool(info.metrics['params_finite']):
      what = f'loss is {loss}' if not math.isfinite(loss) else 'the update overflowed'
      raise TrainingDiverged(
        f'{what} at step {info.step}; stopped without saving that state. The latest '
        f'checkpoint is step {self.run.ckpt.latest_step()}; lower train.learning_rate or raise '
        'train.warmup_steps',
        info.step,
      )

  def _show(self, info: StepInfo) -> None:
    """The step on the progress bar."""
    tok_s, mfu = self._rates(info.seconds)
    moe = jax.device_get(info.metrics['moe']) if 'moe' in info.metrics else None
    self.bar.update(info.step, run_text.step_info(info.loss, tok_s, info.seconds, mfu, moe))

  def _log(self, info: StepInfo) -> None:
    """The train record, every log_every steps and at the last."""
    tok_s, mfu = self._rates(info.seconds)
    moe = jax.device_get(info.metrics['moe']) if 'moe' in info.metrics else None
    self._writer.write(
      info.step,
      'train',
      {
        'loss': info.loss,
        'grad_norm': info.metrics['grad_norm'],
        'learning_rate': info.metrics['learning_rate'],
        'log_z': info.metrics['log_z'],
        'tokens_per_s': tok_s,
        'step_time_s': info.seconds,
        'mfu': mfu,
        'tokens_seen': info.step * self._speed.tokens_per_step,
        # Multi-token prediction's second-next-token loss, where the model has it.
        **({'mtp_loss': info.metrics['mtp_loss']} if 'mtp_loss' in info.metrics else {}),
        **(moe_records(moe, moe_layers(self.run.config.model)) if moe else {}),
      },
    )

  def _rates(self, seconds: float) -> tuple[float, float | None]:
    """(tokens/s, MFU or None where the chip's peak is unknown) of a step of `seconds`."""
    speed = self._speed
    tok_s = speed.tokens_per_step / seconds
    mfu = (
      (speed.flops_per_token * tok_s / (speed.peak * jax.device_count())) if speed.peak else None
    )
    return tok_s, mfu

  def _evaluate_during(self, info: StepInfo) -> None:
    """Evaluate every eval_every steps (the last step's eval comes after the loop)."""
    if info.step < self.run.config.train.steps:
      self._evaluate()
      if self._last_eval:
        self.bar.print(f'step {info.step}: {run_text.fmt_eval(self._last_eval)}')

  def _checkpoint(self, info: StepInfo) -> None:
    """Save every checkpoint_every steps and at the last."""
    self._save()

  def _cache_note(self) -> str:
    """', N programs from the compilation cache, M compiled' where the cache is on."""
    if not jax.config.jax_compilation_cache_dir:
      return ''
    hits, written = (now - then for now, then in zip(compile_cache.counts(), self._cached_before))
    return f'; compilation cache: {hits} read, {written} compiled and written'

  def _next_batch(self) -> dict:
    if self._prefetched is None:
      return global_batch(next(self.run.iterator), self.run.mesh)
    batch, self._prefetched = self._prefetched[0], None
    return batch

  def _prefetch(self) -> None:
    """Read and place the next step's batch while this step runs (else the host's reading and
    copying would add to every step a loop that waits for it: 79 against 72 ms on an H100 at
    125M, 2026-11-27). Not before a save: a checkpoint holds the data position after the last
    batch trained on. A stop request puts a prefetched batch back (`_unread`)."""
    step = self._step  # the step now running
    if step >= self._end or step % self.run.config.train.checkpoint_every == 0:
      return
    position = self.run.iterator.get_state()
    self._prefetched = (global_batch(next(self.run.iterator), self.run.mesh), position)

  def _unread(self) -> None:
    """Return the data position to before a prefetched batch, so that a save records it."""
    if self._prefetched is not None:
      self.run.iterator.set_state(self._prefetched[1])
      self._prefetched = None

  def _evaluate(self) -> None:
    """Evaluate the current parameters and write the eval record (none if the split is empty)."""
    self._last_eval = run_eval(
      self._eval_step,
      self._state['params'],
      self.run.data,
      self.run.mesh,
      self.run.config.train.eval_batches,
    )
    if self._last_eval:
      self._writer.write(self._step, 'eval', self._last_eval)

  def _save(self) -> None:
    """Save the step reached (train state and data position)."""
    self._unread()
    self.run.ckpt.save(self._step, self._state, self.run.iterator, self.run.saved_config)
    self._last_saved = self._step

  def _save_for_resume(self) -> None:
    """On a stop request: save the step reached (unless just saved) and say how to resume."""
    if self._last_saved != self._step:
      self._save()
    self.bar.print(
      f'{self._interrupted}: saved step {self._step} in {self.run.ckpt.directory}; '
      'run again to resume'
    )

  def finish(self) -> dict:
    """After the loop: wait for the last save, evaluate a finished run, close the metrics, plot
    the losses; print and return the summary."""
    t, step = self.run.config.train, self._step
    self.run.ckpt.wait()  # the last save is committed before the run reports itself done
    if step == t.steps and not self._interrupted:
      self._evaluate()
    self._writer.close()
    plot = None
    if jax.process_index() == 0 and os.path.exists(self._writer.path):
      plot = plot_losses(self._writer.path, RunDir(self.run.workdir).loss_plot)
    times = self._times
    median = float(np.median(times)) if times else float('nan')
    summary = {
      'step': step,
      'train_loss': self._loss,
      'eval': self._last_eval,
      'compile_s': self._compile_s,
      'median_step_s': median,
      'tokens_per_s': self._speed.tokens_per_step / median if times else None,
      'interrupted': self._interrupted,
      'workdir': self.run.workdir,
      'plot': plot,
      'nothing_left': self._start >= self._end,
    }
    self.bar.print(run_text.summary_line(summary))
    return summary
