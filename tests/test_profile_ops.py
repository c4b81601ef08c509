"""benchmarks/profile_ops.py on a synthetic GPU trace laid out as XLA's CUPTI collector writes one
(an XSpace text proto read by jax.profiler.ProfileData, as the .xplane.pb of a real run is): per-op
device time from the stream lines, nothing from the derived 'XLA Ops' line, 'CUPTI overhead' or the
host; busy time as the union over streams; the categories."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from benchmarks.profile_ops import CATEGORIES, category, read, report, select, tabulate

GEMM = 'sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1'
SDPA = 'cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0'
STREAM_A, STREAM_B = 'Stream #13(Compute,MemcpyD2D)', 'Stream #17(Compute)'
# One step: (line, event name, start ms, duration ms, hlo_op or None). Stream B's attention
# kernel runs beside stream A's GEMM, so the device is busy 4.75 ms of the 6.75 ms of op time.
STEP = [
  (STREAM_A, GEMM, 0.0, 2.0, 'custom-call.4'),
  (STREAM_A, 'cutlass_80_splitk_reduce', 2.0, 1.0, 'custom-call.4'),  # the same op's 2nd kernel
  (STREAM_A, 'loop_multiply_fusion_12', 3.0, 1.0, 'loop_multiply_fusion.12'),
  (STREAM_A, 'MemcpyD2D', 4.0, 0.5, 'copy.2'),
  (STREAM_B, SDPA, 1.0, 2.0, 'custom-call.7'),
  (STREAM_B, 'redzone_checker', 5.0, 0.25, None),  # no annotation: keyed by the kernel
  ('XLA Ops', 'custom-call.4', 0.0, 3.0, 'custom-call.4'),  # derived by xprof: not counted
  ('CUPTI overhead', 'Overhead', 0.0, 9.0, None),
]


def gpu_trace(steps: int = 2, step_ms: float = 10.0, step_events=STEP) -> str:
  """An XSpace text proto: '/device:GPU:0' holding `step_events` (STEP) `steps` times, and a busy
  host plane."""
  lines = {name: [] for name, *_ in step_events}
  names = sorted({name for _, name, *_ in step_events} | {'PjitFunction(jit(step))'})
  event_id = {name: i + 1 for i, name in enumerate(names)}
  ops = sorted({op for *_, op in step_events if op})
  stat_id = {key: i + 1 for i, key in enumerate(['hlo_op', 'hlo_module', *ops, 'jit_step'])}
  for step in range(steps):
    for line, name, start, ms, op in step_events:
      stats = (
        f'stats {{ metadata_id: {stat_id["hlo_op"]} ref_value: {stat_id[op]} }} '
        f'stats {{ metadata_id: {stat_id["hlo_module"]} ref_value: {stat_id["jit_step"]} }}'
        if op
        else ''
      )
      offset_ps = round((step * step_ms + start) * 1e9)
      lines[line].append(
        f'events {{ metadata_id: {event_id[name]} offset_ps: {offset_ps} '
        f'duration_ps: {round(ms * 1e9)} {stats} }}'
      )
  device = ' '.join(
    f'lines {{ id: {i} name: "{name}" timestamp_ns: 1000000 {" ".join(events)} }}'
    for i, (name, events) in enumerate(lines.items())
  )
  metadata = ' '.join(
    f'event_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}'
    for name, i in event_id.items()
  ) + ' '.join(
    f' stat_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}'
    for name, i in stat_id.items()
  )
  host = (
    'lines { id: 1 name: "tf_pjrt_thread" timestamp_ns: 0 events { metadata_id: '
    f'{event_id["PjitFunction(jit(step))"]} offset_ps: 0 duration_ps: 20000000000 }} }}'
  )
  return (
    f'planes {{ id: 1 name: "/device:GPU:0" {device} {metadata} }} '
    f'planes {{ id: 2 name: "/host:CPU" {host} {metadata} }}'
  )


def test_a_gpu_trace_sums_stream_kernels_per_hlo_op():
  table = tabulate(*select(ProfileData.from_text_proto(gpu_trace(steps=2))))
  assert (table.source, table.planes, table.lines, table.note) == ('GPU streams', 1, 2, '')
  per_step = {o.name: (o.ns / 2 / 1e6, o.count / 2, o.category, o.kernel) for o in table.ops}
  assert list(per_step) == [  # most time first
    'custom-call.4',
    'custom-call.7',
    'loop_multiply_fusion.12',
    'copy.2',
    'redzone_checker',
  ]
  assert per_step['custom-call.4'] == pytest.approx((3.0, 2, 'matmul', GEMM))
  assert per_step['custom-call.7'] == pytest.approx((2.0, 1, 'attention', SDPA))
  assert per_step['loop_multiply_fusion.12'][:3] == pytest.approx((1.0, 1, 'elementwise/reduction'))
  assert per_step['copy.2'] == pytest.approx((0.5, 1, 'copy/transpose', 'MemcpyD2D'))
  assert per_step['redzone_checker'][:3] == pytest.approx((0.25, 1, 'other'))
  assert table.busy_ns / 2 / 1e6 == pytest.approx(4.75)  # stream B's SDPA overlaps stream A


def test_kernels_of_a_command_buffer_are_keyed_by_their_own_names():
  """XLA runs a step's ops as CUDA graphs ('command_buffer_N' in the annotation): on an H100
  (2026-11-27) the whole 125M step was one such op, so the kernels must name the costs."""
  fusion = 'loop_multiply_fusion_24'
  graph = [
    (STREAM_A, GEMM, 0.0, 2.0, 'command_buffer_1'),
    (STREAM_A, fusion, 2.0, 1.0, 'command_buffer_1'),
    (STREAM_A, GEMM, 3.0, 0.5, 'command_buffer_1'),
    (STREAM_A, SDPA, 3.5, 1.5, 'custom-call.7'),
  ]
  table = tabulate(*select(ProfileData.from_text_proto(gpu_trace(1, step_events=graph))))
  got = {o.name: (o.ns / 1e6, o.count, o.category) for o in table.ops}
  assert got == {  # an op outside any graph keeps its HLO name
    GEMM: pytest.approx((2.5, 2, 'matmul')),
    'custom-call.7': pytest.approx((1.5, 1, 'attention')),
    fusion: pytest.approx((1.0, 1, 'elementwise/reduction')),
  }


def test_report_prints_busy_vs_wall_the_top_ops_and_five_categories():
  table = tabulate(*select(ProfileData.from_text_proto(gpu_trace(steps=2))))
  out = report(table, steps=2, wall_ms=9.5, top=3)
  assert out[0] == (
    'profile: GPU streams (2 lines, 1 planes), 2 steps: busy 4.750 ms/step of a 9.50 ms wall '
    'step (50%); op time 6.750 ms/step'
  )
  rows = out[2:5]
  assert rows[0].split()[:4] == ['3.000', '44.4%', 'x2', 'matmul']
  assert rows[0].endswith(f'custom-call.4  [{GEMM}]'[:120])
  assert rows[1].split()[:4] == ['2.000', '29.6%', 'x1', 'attention']
  assert rows[2].split() == [
    '1.000',
    '14.8%',
    'x1',
    'elementwise/reduction',
    'loop_multiply_fusion.12',
  ]
  assert out[5] == 'profile: by category (ms/step, % of op time):'
  assert [line.split()[2] for line in out[6:]] == [
    'matmul',
    'attention',
    'elementwise/reduction',
    'copy/transpose',
    'other',
  ]
  assert [line.split()[0] for line in out[6:]] == ['3.000', '2.000', '1.000', '0.500', '0.250']


def test_xla_ops_lines_count_where_there_are_no_streams():
  text = gpu_trace(steps=1).replace('Stream #', 'Unnamed #')
  source, events, _ = select(ProfileData.from_text_proto(text))
  assert source == "device 'XLA Ops'" and [e.name for e in events] == ['custom-call.4']


def test_a_gpu_trace_without_kernels_falls_back_to_the_host_and_says_so():
  text = gpu_trace(steps=1)
  text = text.replace('Stream #', 'Unnamed #').replace('"XLA Ops"', '"Steps"')
  table = tabulate(*select(ProfileData.from_text_proto(text)))
  assert table.source == 'host XLA threads'
  assert [o.name for o in table.ops] == ['PjitFunction(jit(step))']
  assert table.note.startswith('no kernel events on the GPU planes (/device:GPU:0: lines [')
  assert "'Unnamed #17(Compute)'" in table.note


def test_a_real_trace_of_this_backend_is_read(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((256, 256))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    f(x).block_until_ready()
  table = read(str(tmp_path))
  gpu = jax.default_backend() == 'gpu'
  assert table.source == ('GPU streams' if gpu else 'host XLA threads')
  assert table.ops and table.busy_ns > 0
  if gpu:  # a cuBLAS / Triton GEMM kernel; XLA:CPU may fuse the dot away ('ynn_fusion')
    assert 'matmul' in {o.category for o in table.ops}


@pytest.mark.parametrize(
  'op, kernel, kind',
  [
    ('cublas-gemm.3', 'sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n', 'matmul'),
    ('fusion.40', 'cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8', 'matmul'),
    ('gemm_fusion_dot.3', 'gemm_fusion_dot_3', 'matmul'),
    ('custom-call.9', 'flash_attention_fwd', 'attention'),  # Pallas Triton (pallas_kernels/)
    ('custom-call.11', '_q_tile_kernel', 'attention'),  # another kernel's custom call
    ('custom-call.2', SDPA, 'attention'),
    ('input_reduce_fusion.2', 'input_reduce_fusion_2', 'elementwise/reduction'),
    ('triton_softmax.1', 'triton_softmax_1', 'elementwise/reduction'),
    ('loop_transpose_fusion', 'loop_transpose_fusion', 'copy/transpose'),
    ('copy.5', 'MemcpyD2D', 'copy/transpose'),
    ('redzone_checker', 'redzone_checker', 'other'),
    # Kernel names of the H100's 125M step (2026-11-27), keyed by themselves (command buffers).
    (
      'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT',
      'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT',
      'matmul',
    ),
    ('anonymous_mosaic_gpu_kernel', 'anonymous_mosaic_gpu_kernel', 'attention'),
    ('wrapped_convert_85', 'wrapped_convert_85', 'elementwise/reduction'),
    ('input_concatenate_fusion_24', 'input_concatenate_fusion_24', 'copy/transpose'),
    ('memcpy128', 'memcpy128', 'copy/transpose'),
  ],
)
def test_category(op, kernel, kind):
  assert category(op, kernel) == kind and kind in CATEGORIES
