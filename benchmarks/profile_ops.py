"""Where a profiled step's time goes, read offline from the trace's .xplane.pb with
`jax.profiler.ProfileData` (no TensorBoard or xprof): device time per HLO op, its kind (matmul,
attention, ...) and the device's busy time against the wall step. benchmarks/train_step.py
--profile_dir prints it.

What XLA's profiler writes (jax 0.10-0.12; openxla/xla sources):
- GPU: one plane per device, '/device:GPU:<ordinal>' (kGpuPlanePrefix,
  xla/tsl/profiler/utils/xplane_schema.cc). Its lines are CUDA streams named
  'Stream #<id>(<event types>)', e.g. 'Stream #13(Compute,MemcpyD2D)', beside 'CUPTI overhead' and
  the '_counters_' line (GetDeviceXLineName in xla/backends/profiler/gpu/cupti_collector.cc;
  'Compute' is a kernel, GetTraceEventTypeName in cupti_tracer.cc). An event is one kernel or
  copy: named by the demangled CUDA kernel (or 'MemcpyD2D' ...), with the key=values of the XLA
  annotation it was launched under as stats (CreateXEvent, cupti_collector.cc: ParseAnnotationStack
  of 'XlaModule:#hlo_module=jit_step,...#::Thunk:#name=...,hlo_op=fusion.12,...#' from
  MakeInstructionTitle, xla/backends/gpu/runtime/annotation.cc): 'hlo_op', 'hlo_module', 'tf_op'.
- 'XLA Ops' / 'XLA Modules' lines of a GPU plane are derived by xprof when it converts a trace
  (GenerateDerivedTimeLines, xprof/utils/derived_timeline.cc); the .xplane.pb has none
  (PostProcessSingleHostXSpace, xla/tsl/profiler/convert/post_process_single_host_xplane.cc, only
  merges and sorts). TPUs write an 'XLA Ops' line themselves. Stream lines are read where there are
  any, else 'XLA Ops' lines, never both, so no time counts twice.
- CPU: no device plane; XLA's CPU ops are events on the host threads of '/host:CPU'.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from typing import NamedTuple

CATEGORIES = ('matmul', 'attention', 'elementwise/reduction', 'copy/transpose', 'other')


class Event(NamedTuple):
  plane: str
  line: str
  name: str  # the kernel (GPU), the op ('XLA Ops', host threads)
  start_ns: float
  duration_ns: float
  stats: dict


@dataclasses.dataclass
class Op:
  name: str  # the HLO op ('fusion.12'), else the kernel's name
  kernel: str  # the kernel that took most of its time
  category: str
  ns: float
  count: int


@dataclasses.dataclass
class Table:
  source: str  # 'GPU streams', "device 'XLA Ops'" or 'host XLA threads'
  ops: list[Op]  # most time first
  busy_ns: float  # time any selected line of a plane is busy, summed over planes
  planes: int
  lines: int
  note: str = ''  # why a GPU trace fell back to the host threads


def category(op: str, kernel: str = '') -> str:
  """The kind of an op from its HLO name and kernel name: cuDNN / Pallas (Triton, Mosaic GPU)
  attention kernels, cuBLAS (its Hopper kernels are 'nvjet_sm90_...') / CUTLASS / Triton GEMMs,
  copies and concatenations, XLA's loop, reduction and Triton
  fusions. A custom call that is no GEMM counts as attention: a training step's other custom calls
  are its attention kernels."""
  text = f'{op} {kernel}'.lower()
  if any(k in text for k in ('fmha', 'sdpa', 'flash', 'attention', 'attn', 'cudnn', 'mosaic')):
    return 'attention'
  if any(k in text for k in ('gemm', 'cublas', 'cutlass', 'xmma', 'nvjet', 'matmul', 'dot')):
    return 'matmul'
  if 'custom-call' in op or 'custom_call' in op:
    return 'attention'
  if any(k in text for k in ('copy', 'transpose', 'memcpy', 'memset', 'concatenate')):
    return 'copy/transpose'
  if any(k in text for k in ('fusion', 'reduce', 'loop_', 'input_', 'wrapped_', 'triton')):
    return 'elementwise/reduction'
  return 'other'


def select(data) -> tuple[str, list[Event], str]:
  """(source, events, note) of a `jax.profiler.ProfileData`: the GPU planes' stream lines, else
  the device planes' 'XLA Ops' lines, else the host's XLA threads (the python line and executor
  wrappers, names with '::', left out)."""
  device = [p for p in data.planes if p.name.startswith('/device:')]
  for source, keep in (('GPU streams', _is_stream), ("device 'XLA Ops'", _is_xla_ops)):
    events = _events(device, keep, stats=True)
    if events:
      return source, events, ''
  note = ''
  gpus = [p for p in device if p.name.startswith('/device:GPU:')]
  if gpus:  # a GPU trace without kernels: say what it held
    note = (
      'no kernel events on the GPU planes ('
      + '; '.join(f'{p.name}: lines {[line.name for line in p.lines]}' for p in gpus)
      + '); CUPTI missing or failed?'
    )
  host = [p for p in data.planes if p.name.startswith('/host:CPU')]
  events = _events(host, lambda plane, line: line.name != 'python', stats=False)
  return 'host XLA threads', [e for e in events if '::' not in e.name], note


def _is_stream(plane, line) -> bool:
  return plane.name.startswith('/device:GPU:') and line.name.startswith('Stream #')


def _is_xla_ops(plane, line) -> bool:
  return line.name == 'XLA Ops'


def _events(planes, keep, stats: bool) -> list[Event]:
  # jax's profile_data binds its stats iterator as a type without __module__, which Python 3.13
  # reports as a DeprecationWarning on every read: the binding's, nothing to act on here.
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', 'builtin type event_stats', DeprecationWarning)
    return [
      Event(
        plane.name, line.name, e.name, e.start_ns, e.duration_ns, dict(e.stats) if stats else {}
      )
      for plane in planes
      for line in plane.lines
      if keep(plane, line)
      for e in line.events
    ]


def tabulate(source: str, events: list[Event], note: str = '') -> Table:
  """Time per op over `events`: keyed by the 'hlo_op' stat (the kernel's name where there is
  none, or where the op is one of XLA's command buffers, a CUDA graph of many ops: seen on an
  H100, 2026-11-27, every kernel of the 125M step under 'command_buffer_N'), qualified by
  'hlo_module' where the events come from several modules."""
  modules = {e.stats.get('hlo_module') for e in events} - {None}
  per_op: dict[str, dict[str, list[float]]] = {}  # op -> kernel -> [ns, count]
  for e in events:
    op = str(e.stats.get('hlo_op') or e.name)
    if op.startswith('command_buffer'):  # a CUDA graph of many HLO ops: its kernels name them
      op = e.name
    if len(modules) > 1 and 'hlo_module' in e.stats:
      op = f"{e.stats['hlo_module']}/{op}"
    ns_count = per_op.setdefault(op, {}).setdefault(e.name, [0.0, 0])
    ns_count[0] += e.duration_ns
    ns_count[1] += 1
  ops = []
  for op, kernels in per_op.items():
    kernel = max(kernels, key=lambda k: kernels[k][0])
    ns, count = sum(v[0] for v in kernels.values()), sum(v[1] for v in kernels.values())
    ops.append(Op(op, kernel, category(op, kernel), ns, count))
  ops.sort(key=lambda o: -o.ns)
  by_plane: dict[str, list[tuple[float, float]]] = {}
  for e in events:
    by_plane.setdefault(e.plane, []).append((e.start_ns, e.start_ns + e.duration_ns))
  busy = sum(_union(spans) for spans in by_plane.values())
  lines = len({(e.plane, e.line) for e in events})
  return Table(source, ops, busy, len(by_plane), lines, note)


def _union(spans: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end) spans."""
  total, end = 0.0, float('-inf')
  for s, e in sorted(spans):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def report(table: Table, steps: int, wall_ms: float | None = None, top: int = 10) -> list[str]:
  """The lines to print: the busy time against the wall step, the `top` ops and the categories,
  per step."""
  ms = 1e-6 / steps
  total = sum(o.ns for o in table.ops) or 1.0
  out = [f'profile: {table.note}'] if table.note else []
  wall = f' of a {wall_ms:.2f} ms wall step ({table.busy_ns * ms / wall_ms:.0%})' if wall_ms else ''
  out.append(
    f'profile: {table.source} ({table.lines} lines, {table.planes} planes), {steps} steps: busy '
    f'{table.busy_ns * ms:.3f} ms/step{wall}; op time {total * ms:.3f} ms/step'
  )
  out.append(f'profile: top {top} ops (ms/step, % of op time, events/step, category, op [kernel]):')
  for o in table.ops[:top]:
    kernel = '' if o.kernel.replace('_', '.') == o.name.replace('_', '.') else f'  [{o.kernel}]'
    out.append(
      f'  {o.ns * ms:9.3f} {o.ns / total:6.1%} x{o.count / steps:<5g} {o.category:<21} '
      f'{(o.name + kernel)[:120]}'
    )
  out.append('profile: by category (ms/step, % of op time):')
  sums = {c: sum(o.ns for o in table.ops if o.category == c) for c in CATEGORIES}
  for c in sorted(CATEGORIES, key=lambda c: -sums[c]):
    out.append(f'  {sums[c] * ms:9.3f} {sums[c] / total:6.1%} {c}')
  return out


def read(directory: str) -> Table:
  """The op table of the newest .xplane.pb under `directory` (jax.profiler.trace's output)."""
  from jax.profiler import ProfileData

  paths = glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True)
  return tabulate(*select(ProfileData.from_file(max(paths, key=os.path.getmtime))))
