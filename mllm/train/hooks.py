"""What the training loop does around its steps, as hooks called at named points (Levanter's
trainer hooks): each finished step (`StepInfo`: its loss read, its other metrics computed), every
`every` steps and at the last one. The loop runs the steps; logging, evaluation, checkpoints and
the divergence guard are hooks (mllm/train/loop.py builds them), and a caller may add its own.

A hook that reads the train state (`needs_state`: evaluation, checkpoints) makes the loop finish
that step before it dispatches the next, which takes the state over (the step donates it). Any
other step's metrics are read once the next step is running, so the host's work on them (the
progress bar, the metrics file) overlaps the device's (nanodo's loop), except on a multi-device
CPU, where consecutive steps must not overlap (XLA:CPU's rendezvous between two steps that
all-reduce can deadlock, in about half of the runs we tried).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """A finished step, as the hooks see it."""

  step: int  # global step count after it (1 after the first step)
  loss: float
  metrics: dict[str, Any]  # its metrics, computed (arrays: float() or jax.device_get reads them)
  seconds: float  # its wall time: from the previous step's end (or its own start) to its metrics
  last: bool  # the last step of this call (the run's end, or stop_after)
  state: dict | None = None  # the train state after it, for a hook that needs_state; else None


@dataclasses.dataclass(frozen=True)
class Hook:
  """`fn(info)` after every `every`-th step (and the last one, with `at_last`)."""

  name: str
  fn: Callable[[StepInfo], None]
  every: int = 1  # 0: only at the last step (with at_last)
  at_last: bool = True
  needs_state: bool = False

  def due(self, step: int, last: bool) -> bool:
    return bool(self.every and step % self.every == 0) or (self.at_last and last)


def run_hooks(hooks: list[Hook], info: StepInfo) -> None:
  """Each due hook, in order (the divergence guard first: nothing after it sees a bad step)."""
  for hook in hooks:
    if hook.due(info.step, info.last):
      hook.fn(info)


def needs_state(hooks: list[Hook], step: int, last: bool) -> bool:
  """Whether a hook due at `step` reads the state: the loop then finishes that step first."""
  return any(h.needs_state and h.due(step, last) for h in hooks)


def profiler(out_dir: str, first: int, last: int) -> Hook:
  """Trace steps `first`..`last` with `jax.profiler` into `out_dir` (TensorBoard's profile plugin
  or Perfetto read it: plugins/profile/<time>/*.xplane.pb, *.trace.json.gz). The trace starts
  once step first - 1 is done and stops once step `last` (or the run's last step) is; with the
  metrics read a step late it holds the step after too. first >= 2: the first step compiles."""
  if not 2 <= first <= last:
    raise ValueError(f'profile steps {first}:{last}; allowed: 2 <= first <= last')
  tracing = []

  def trace(info: StepInfo) -> None:
    import jax

    if not tracing and first - 1 <= info.step < last and not info.last:
      jax.profiler.start_trace(out_dir)
      tracing.append(info.step)
    elif tracing and (info.step >= last or info.last):
      jax.profiler.stop_trace()
      tracing.clear()

  return Hook('profiler', trace)
