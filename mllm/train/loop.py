"""The training loop: resume or initialize, step, log, evaluate, checkpoint, stop cleanly.

    from mllm.train import train
    summary = train(config, 'runs/rope_swiglu')

One code path for one CPU, one GPU or a pod: the jitted step runs on a `Mesh` and each process
feeds its own rows of the batch (`jax.make_array_from_process_local_data`).
"""

from __future__ import annotations

import contextlib
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
from mllm.paths import RunDir, writable_dir
from mllm.train import peers, run_text
from mllm.train.checkpoint import Checkpointer, config_as_dict, write_config
from mllm.train.checkpoint_folder import note
from mllm.train.cluster import StopRequest, maybe_initialize_distributed
from mllm.train.evaluation import run_eval
from mllm.train.logs import route_library_output
from mllm.train.metrics import (
  MetricsWriter,
  Progress,
  moe_records,
  peak_flops_per_device,
  plot_losses,
)
from mllm.train.resume import adopt_tokenizer, check_resumable, init_params, mismatch_error
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import setup
from mllm.train.state_signature import StateMismatch
from mllm.train.step import make_eval_step, make_train_step


class TrainingDiverged(RuntimeError):
  """The loss became NaN or infinite; the run stopped without saving that state."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def train(config, workdir: str, *, stop_after: int | None = None, progress: bool = True) -> dict:
  """Train `config` in `workdir`, resuming from its latest checkpoint; returns a summary dict.

  stop_after: leave after this global step (saving a checkpoint), as a preemption would.
  """
  started = time.perf_counter()  # the first step's start-up line counts from here
  with _open_run(config, workdir) as run:
    opened = (
      f'open {time.perf_counter() - started:.1f} s with devices {run.devices_s:.1f} s and data '
      f'{run.data_s:.1f} s'
    )
    start, state, state_note = _starting_state(run)
    state_note = f'{opened}, {state_note}'
    ready = time.perf_counter()  # the state is ready; building the steps and writers follows
    cached_before = compile_cache.counts()
    end = config.train.steps if stop_after is None else min(config.train.steps, stop_after)
    writer = _metrics_writer(workdir, config.train, start)
    run.closing.callback(writer.close)
    counts = count_params(config)
    device = jax.devices()[0]
    loop = _Loop(
      run=run,
      train_step=make_train_step(run.setup),
      eval_step=make_eval_step(run.setup, run.data.tokenizer.token_bytes),
      writer=writer,
      speed=_Speed(
        tokens_per_step=config.data.batch_size * config.data.seq_len,
        flops_per_token=training_flops_per_token(config, config.data.seq_len, counts).total,
        peak=peak_flops_per_device(device.device_kind, config.model.dtype, config.train.peak_flops),
      ),
      bar=Progress(end, start, log_every=config.train.log_every, enabled=progress),
      start=start,
      end=end,
      state=state,
    )
    run_text.print_start(loop.bar, run, counts, device, start)
    if start >= end:  # resumed at its last step: report the losses it ended with, not NaN
      loop.loss = run_text.last_train_loss(writer.path, start)
    loop.cached_before = cached_before
    loop.run_steps(started, state_note, ready)
    return loop.finish()


def save_initial_state(config, workdir: str) -> None:
  """Save the state a run of `config` starts from (train.init_from's parameters) as step 0 of a
  new run in `workdir`, with its config, tokenizer and data position (launch.py --mode=import):
  the start of `train` without its loop."""
  with _open_run(config, workdir) as run:
    start, state, _ = _starting_state(run)
    assert start == 0, start  # launch.py refuses a workdir that holds checkpoints
    run.ckpt.save(0, state, run.iterator, run.saved_config)
    run.ckpt.wait()


@dataclasses.dataclass
class _Run:
  """What a run opens before its first step: the mesh, the state's structure and initializer,
  the checkpointer, the data and its iterator; `closing` closes them on every exit."""

  config: Any
  workdir: str
  mesh: jax.sharding.Mesh
  setup: Any  # mllm.train.state.TrainSetup
  init: Callable[[], dict]  # the fresh train state (jitted, sharded)
  ckpt: Checkpointer
  data: Any  # mllm.data.Data
  iterator: Any  # the training batches; saved with each checkpoint
  saved_config: dict  # the config as saved with each checkpoint
  closing: contextlib.ExitStack
  data_s: float = 0.0  # seconds to build the data (corpus, tokenizer, token files; cached: ~0)
  devices_s: float = 0.0  # seconds to the mesh: the backend's start (~0 on a CPU)


@contextlib.contextmanager
def _open_run(config, workdir: str):
  """Open what a run needs, in order: the processes, the workdir, the mesh and the state's
  structure, the checkpointer, the tokenizer (a run from a Hugging Face folder adopts its
  own), the data, and the config written beside the checkpoints."""
  from mllm.data import build_data
  from mllm.data.sources import check_path

  maybe_initialize_distributed()
  writable_dir('--workdir', workdir)
  check_path(config.data)
  t0 = time.perf_counter()
  mesh = make_mesh(config.mesh)  # the first device query starts the backend (seconds on a GPU)
  devices_s = time.perf_counter() - t0
  train_setup, init = setup(config, mesh)
  # Closing the checkpoint manager and the metrics writer on every exit, errors included, keeps
  # their background threads from dying noisily at interpreter shutdown.
  with contextlib.ExitStack() as closing:
    os.makedirs(workdir, exist_ok=True)
    closing.callback(route_library_output(workdir))  # undone last: after the closes below
    peers.watch(workdir)
    ckpt = Checkpointer(
      workdir, max_to_keep=config.train.max_to_keep, async_save=config.train.async_checkpoint
    )
    closing.callback(ckpt.close)
    resumes = check_resumable(workdir, config, ckpt, train_setup.abstract_state) is not None
    if not resumes and config.train.init_from:
      adopt_tokenizer(config, workdir)
    t0 = time.perf_counter()
    data = build_data(
      config, workdir, process_index=jax.process_index(), process_count=jax.process_count()
    )
    data_s = time.perf_counter() - t0
    write_config(workdir, config)
    yield _Run(
      config=config,
      workdir=workdir,
      mesh=mesh,
      setup=train_setup,
      init=init,
      ckpt=ckpt,
      data=data,
      iterator=data.train_iterator(),
      saved_config=config_as_dict(config),
      closing=closing,
      data_s=data_s,
      devices_s=devices_s,
    )


def _starting_state(run: _Run) -> tuple[int, dict, str]:
  """(start step, state, how long it took): the latest checkpoint, else a fresh state
  (train.init_from's parameters)."""
  config = run.config
  t0 = time.perf_counter()
  try:
    start, state = run.ckpt.restore_latest(run.setup.abstract_state, run.iterator)
  except StateMismatch as err:  # check_resumable ran first; this is the safety net
    raise mismatch_error(run.workdir, config, run.ckpt, err.step, err.diff) from None
  if start is not None:
    if config.train.init_from:
      note(f'note: resuming this run at step {start}; train.init_from applies only to its start')
  else:
    start, state = 0, run.init()
    if config.train.init_from:
      state['params'] = init_params(config, run.setup.abstract_state['params'])
  state = jax.block_until_ready(state)
  return start, state, f"{'restore' if start else 'init'} {time.perf_counter() - t0:.1f} s"


@dataclasses.dataclass(frozen=True)
class _Speed:
  """What turns a step's seconds into tokens/s and MFU."""

  tokens_per_step: int
  flops_per_token: float
  peak: float | None  # FLOP/s of one device; None where unknown (no MFU)


def _metrics_writer(workdir, t, start: int) -> MetricsWriter:
  """The run's MetricsWriter, resuming at step `start` (t: config.train)."""

  # Records after the resumed step are replayed; so is the final eval of a finished run.
  def keep(record) -> bool:
    final_eval = record['split'] == 'eval' and start == t.steps
    return record['step'] < start or (record['step'] == start and not final_eval)

  return MetricsWriter(workdir, tensorboard=t.tensorboard, resume_step=start, keep=keep)


@dataclasses.dataclass
class _Loop:
  """The steps of one `train` call: what they use, and what they carry from one step to the next
  and into the summary."""

  run: _Run
  train_step: Callable
  eval_step: Callable
  writer: MetricsWriter
  speed: _Speed
  bar: Progress
  start: int
  end: int
  state: dict  # the train state: step, params, opt_state, rng
  step: int = dataclasses.field(init=False)
  last_saved: int = dataclasses.field(init=False)
  loss: float = float('nan')
  compile_s: float = 0.0
  last_eval: dict | None = None
  interrupted: str | None = None  # the signal that stopped the job (in any of its processes)
  times: list[float] = dataclasses.field(default_factory=list)  # step times after the first
  # The next step's batch, already on the devices, and the data position before it was read.
  prefetched: tuple[dict, Any] | None = None
  cached_before: tuple[int, int] = (0, 0)  # compile_cache.counts() before the first step

  def __post_init__(self):
    self.step = self.last_saved = self.start

  def run_steps(self, started: float, state_note: str, ready: float) -> None:
    """Step until `end`, or until a stop request (SIGTERM, SIGINT), which saves the step reached.
    started: time.perf_counter() at the start of `train`; state_note: how long the state took to
    initialize or restore, ready: when it was ready (all three for the first step's start-up
    line)."""
    with StopRequest() as stop:
      try:
        while self.step < self.end:
          metrics, dt = self._take_step(started, state_note, ready)
          self._report(metrics, dt)
          self._evaluate_and_save()
          self.interrupted = stop.agreed()
          if self.interrupted:
            self._save_for_resume()
            break
      finally:
        self.bar.close()

  def _take_step(self, started: float, state_note: str, ready: float) -> tuple[dict, float]:
    """Run one training step: (its metrics, its seconds). Raises TrainingDiverged, before the new
    state can be saved, when the loss or the new parameters are not finite."""
    t0 = time.perf_counter()
    batch = self._next_batch()
    self.state, metrics = self.train_step(self.state, batch)
    self._prefetch()  # while the devices run this step
    # Reading the loss blocks on the step: it also avoids the multi-device CPU rendezvous
    # deadlock between consecutive steps that XLA:CPU can otherwise hit.
    self.loss = loss = float(metrics['loss'])
    dt = time.perf_counter() - t0
    self.step += 1
    if not math.isfinite(loss) or not bool(metrics['params_finite']):
      what = f'loss is {loss}' if not math.isfinite(loss) else 'the update overflowed'
      raise TrainingDiverged(
        f'{what} at step {self.step}; stopped without saving that state. The latest '
        f'checkpoint is step {self.run.ckpt.latest_step()}; lower train.learning_rate or raise '
        'train.warmup_steps',
        self.step,
      )
    if self.step == self.start + 1:
      self.compile_s = dt  # the first call compiles
      self.bar.print(
        f'first step after {time.perf_counter() - started:.1f} s from the start of train() '
        f'({state_note}, then {t0 - ready:.1f} s to the first step, compile + step {dt:.1f} s'
        f'{self._cache_note()})'
      )
    else:
      self.times.append(dt)
    return metrics, dt

  def _cache_note(self) -> str:
    """', N programs from the compilation cache, M compiled' where the cache is on."""
    if not jax.config.jax_compilation_cache_dir:
      return ''
    hits, written = (now - then for now, then in zip(compile_cache.counts(), self.cached_before))
    return f'; compilation cache: {hits} read, {written} compiled and written'

  def _next_batch(self) -> dict:
    if self.prefetched is None:
      return global_batch(next(self.run.iterator), self.run.mesh)
    batch, self.prefetched = self.prefetched[0], None
    return batch

  def _prefetch(self) -> None:
    """Read and place the next step's batch while this step runs (the loop blocks on each step,
    so else the host's reading and copying would add to every step: 79 against 72 ms on an H100
    at 125M, 2026-11-27). Not before a save: a checkpoint holds the data position after the
    last batch trained on. A stop request puts a prefetched batch back (`_unread`)."""
    step = self.step + 1  # the step now running
    if step >= self.end or step % self.run.config.train.checkpoint_every == 0:
      return
    position = self.run.iterator.get_state()
    self.prefetched = (global_batch(next(self.run.iterator), self.run.mesh), position)

  def _unread(self) -> None:
    """Return the data position to before a prefetched batch, so that a save records it."""
    if self.prefetched is not None:
      self.run.iterator.set_state(self.prefetched[1])
      self.prefetched = None

  def _report(self, metrics: dict, dt: float) -> None:
    """Show the step on the progress bar; write its train record every log_every steps and at
    the end."""
    step, loss = self.step, self.loss
    speed = self.speed
    tok_s = speed.tokens_per_step / dt
    mfu = (
      (speed.flops_per_token * tok_s / (speed.peak * jax.device_count())) if speed.peak else None
    )
    moe = jax.device_get(metrics['moe']) if 'moe' in metrics else None
    self.bar.update(step, run_text.step_info(loss, tok_s, dt, mfu, moe))
    if step % self.run.config.train.log_every == 0 or step == self.end:
      self.writer.write(
        step,
        'train',
        {
          'loss': loss,
          'grad_norm': metrics['grad_norm'],
          'learning_rate': metrics['learning_rate'],
          'tokens_per_s': tok_s,
          'step_time_s': dt,
          'mfu': mfu,
          'tokens_seen': step * speed.tokens_per_step,
          **(moe_records(moe, moe_layers(self.run.config.model)) if moe else {}),
        },
      )

  def _evaluate_and_save(self) -> None:
    """Evaluate every eval_every steps (the last step's eval comes after the loop); save every
    checkpoint_every steps and at the end."""
    t, step = self.run.config.train, self.step
    if t.eval_every and step % t.eval_every == 0 and step < t.steps:
      self._evaluate()
      if self.last_eval:
        self.bar.print(f'step {step}: {run_text.fmt_eval(self.last_eval)}')
    if step % t.checkpoint_every == 0 or step == self.end:
      self._save()

  def _evaluate(self) -> None:
    """Evaluate the current parameters and write the eval record (none if the split is empty)."""
    self.last_eval = run_eval(
      self.eval_step,
      self.state['params'],
      self.run.data,
      self.run.mesh,
      self.run.config.train.eval_batches,
    )
    if self.last_eval:
      self.writer.write(self.step, 'eval', self.last_eval)

  def _save(self) -> None:
    """Save the step reached (train state and data position)."""
    self._unread()
    self.run.ckpt.save(self.step, self.state, self.run.iterator, self.run.saved_config)
    self.last_saved = self.step

  def _save_for_resume(self) -> None:
    """On a stop request: save the step reached (unless just saved) and say how to resume."""
    if self.last_saved != self.step:
      self._save()
    self.bar.print(
      f'{self.interrupted}: saved step {self.step} in {self.run.ckpt.directory}; run again to resume'
    )

  def finish(self) -> dict:
    """After the loop: wait for the last save, evaluate a finished run, close the metrics, plot
    the losses; print and return the summary."""
    t, step = self.run.config.train, self.step
    self.run.ckpt.wait()  # the last save is committed before the run reports itself done
    if step == t.steps and not self.interrupted:
      self._evaluate()
    self.writer.close()
    plot = None
    if jax.process_index() == 0 and os.path.exists(self.writer.path):
      plot = plot_losses(self.writer.path, RunDir(self.run.workdir).loss_plot)
    times = self.times
    median = float(np.median(times)) if times else float('nan')
    summary = {
      'step': step,
      'train_loss': self.loss,
      'eval': self.last_eval,
      'compile_s': self.compile_s,
      'median_step_s': median,
      'tokens_per_s': self.speed.tokens_per_step / median if times else None,
      'interrupted': self.interrupted,
      'workdir': self.run.workdir,
      'plot': plot,
      'nothing_left': self.start >= self.end,
    }
    self.bar.print(run_text.summary_line(summary))
    return summary
