"""Tile sizes, warps and pipeline stages of mllm's GPU flash-attention kernels, swept on a GPU.

    python -m benchmarks.attention_tune                        # Triton: N 4096 and 16384, causal, D 128
    python -m benchmarks.attention_tune --seq_lens=8192 --causal=false --head_dim=64
    python -m benchmarks.attention_tune --kernel=mgpu          # Mosaic GPU: block_k x ring slots

The setting of benchmarks/attention.py (bf16, --tokens_per_batch per batch, H query heads): for
every (block_q, block_k, num_warps, num_stages) the forward and the forward+backward of
`pallas_kernels.flash_attention_triton` are compiled and timed (median of --repeats after a warm-up),
and the best configuration of each pass is printed with its TFLOP/s (FlashAttention's convention:
forward 4·B·H·N²·D, halved when causal; forward+backward 3.5× that). block_q / block_k set the
tiles of both passes; `default_tiling` can then take each pass's best. `--kernel=mgpu` sweeps the
Mosaic GPU kernel (pallas_kernels/flash_attention_mgpu.py) instead: its query tile is fixed at 64
rows a warpgroup, so the knobs are block_k (--mgpu_blocks) and the slots of its copy rings
(--mgpu_steps); --warps / --stages do not apply to it. A configuration the
compiler refuses (shared memory, registers) is listed as n/a. `--kernel=jax_mgpu` sweeps JAX's
own Mosaic GPU flash attention (jax.experimental.pallas.ops.gpu.attention_mgpu: block_kv x
max_concurrent_steps, its backward on 64-row tiles), a reference for what Mosaic GPU reaches.
On a GPU, cuDNN's flash attention (`jax.nn.dot_product_attention(implementation='cudnn')`) is
timed first at the same shape and every row also prints its share of cuDNN (the issue's targets
are shares). On a CPU the kernels only interpret (cuDNN skipped, JAX's kernel refused): use tiny
sizes (--seq_lens=128 --tokens_per_batch=128 --blocks=32,64) to smoke-test.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels import flash_attention_mgpu, flash_attention_triton


def timed(fn, args, repeats: int) -> float:
  """Median seconds of a compiled call, after one warm-up."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def settings(args) -> list[tuple]:
  """(block_q, block_k, warps, stages) to try: the Triton grid, or the Mosaic GPU kernel's
  block_k x ring slots (block_q 64 and its warpgroups fixed; warps reported as None)."""

  def ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(',')]

  if args.kernel in ('mgpu', 'jax_mgpu'):
    return [
      (flash_attention_mgpu.TILE, bk, None, steps)
      for bk, steps in itertools.product(ints(args.mgpu_blocks), ints(args.mgpu_steps))
    ]
  blocks = ints(args.blocks)
  return list(itertools.product(blocks, blocks, ints(args.warps), ints(args.stages)))


def jax_reference_kernel(block_q: int, block_kv: int, steps: int, causal: bool):
  """JAX's Mosaic GPU attention at one tiling (its backward on 64 x 64 tiles); it applies no
  softmax scale, which changes no timing."""

  def attn(q, k, v):  # built when traced: a refusal (another jax's fields) is that row's n/a
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(
      block_q=block_q,
      block_kv=block_kv,
      max_concurrent_steps=steps,
      causal=causal,
      block_q_dkv=64,
      block_kv_dkv=64,
      block_q_dq=64,
      block_kv_dq=64,
    )
    return attention_mgpu.attention(q, k, v, config=config)

  return attn


def passes(attn, q, k, v, d_out, fwd_flops):
  """(name, jitted function, its arguments, FLOPs) of the forward and forward+backward."""

  def loss(q, k, v, d):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * d)

  return (
    ('fwd', jax.jit(attn), (q, k, v), fwd_flops),
    ('fwdbwd', jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v, d_out), 3.5 * fwd_flops),
  )


def cudnn_reference(q, k, v, d_out, fwd_flops, args) -> dict:
  """cuDNN's milliseconds for each pass at this shape ({} off a GPU)."""
  if jax.default_backend() != 'gpu':
    return {}
  attn = functools.partial(
    jax.nn.dot_product_attention,
    scale=args.head_dim**-0.5,
    is_causal=args.causal,
    implementation='cudnn',
  )
  ref = {}
  for name, fn, fn_args, flops in passes(attn, q, k, v, d_out, fwd_flops):
    ref[name] = timed(fn, fn_args, args.repeats) * 1e3
    print(
      f'N={q.shape[1]} cudnn {name}: {ref[name]:.2f} ms ({flops / ref[name] / 1e9:.0f} TFLOP/s)'
    )
  return ref


def sweep(n: int, args) -> list[dict]:
  batch = max(1, args.tokens_per_batch // n)
  keys = jax.random.split(jax.random.key(n), 4)
  shape = (batch, n, args.heads, args.head_dim)
  q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
  fwd_flops = 4 * batch * args.heads * n * n * args.head_dim / (2 if args.causal else 1)
  ref = cudnn_reference(q, k, v, d_out, fwd_flops, args)
  rows = []
  for bq, bk, warps, stages in settings(args):
    common = dict(scale=args.head_dim**-0.5, causal=args.causal, block_k=bk)
    if args.kernel == 'mgpu':  # warps: fixed by the kernel; stages: its rings' slots
      attn = functools.partial(flash_attention_mgpu.flash_attention, steps=stages, **common)
    elif args.kernel == 'jax_mgpu':
      attn = jax_reference_kernel(bq, bk, stages, args.causal)
    else:
      attn = functools.partial(
        flash_attention_triton.flash_attention,
        block_q=bq,
        num_warps=warps,
        num_stages=stages,
        **common,
      )

    row = dict(N=n, batch=batch, block_q=bq, block_k=bk, warps=warps, stages=stages)
    for name, fn, fn_args, flops in passes(attn, q, k, v, d_out, fwd_flops):
      try:
        seconds = timed(fn, fn_args, args.repeats)
      except Exception as e:  # refused by the compiler: too much shared memory, say
        row[name] = None
        row[f'{name}_error'] = (
          f'{type(e).__name__}: {(str(e).strip().splitlines() or [""])[0][:120]}'
        )
        continue
      row[name] = seconds * 1e3
      row[f'{name}_tflops'] = flops / seconds / 1e12
      if name in ref:
        row[f'{name}_of_cudnn'] = ref[name] / row[name]
    rows.append(row)
    print(
      f"N={n} B={batch} block_q={bq} block_k={bk} warps={warps} stages={stages}: "
      + ', '.join(describe(row, p) for p in ('fwd', 'fwdbwd')),
      flush=True,
    )
  return rows


def describe(row: dict, name: str) -> str:
  """'fwd 1.23 ms (300 TFLOP/s, 0.72 of cuDNN)', or the compiler's refusal."""
  if not row[name]:
    return f"{name} n/a ({row[name + '_error']})"
  share = row.get(f'{name}_of_cudnn')
  share = f', {share:.2f} of cuDNN' if share else ''
  return f"{name} {row[name]:.2f} ms ({row[name + '_tflops']:.0f} TFLOP/s{share})"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__,
  )
  p.add_argument('--seq_lens', default='4096,16384')
  p.add_argument('--tokens_per_batch', type=int, default=16384)
  p.add_argument('--heads', type=int, default=16)
  p.add_argument('--head_dim', type=int, default=128)
  p.add_argument('--causal', choices=['true', 'false'], default='true')
  p.add_argument('--blocks', default='64,128', help='values tried for block_q and block_k')
  p.add_argument('--warps', default='4,8')
  p.add_argument('--stages', default='2,3')
  p.add_argument('--kernel', choices=['triton', 'mgpu', 'jax_mgpu'], default='triton')
  p.add_argument('--mgpu_blocks', default='64,128,192,256', help='--kernel=mgpu: block_k values')
  p.add_argument('--mgpu_steps', default='2,3', help='--kernel=mgpu: ring slots')
  p.add_argument('--repeats', type=int, default=5)
  args = p.parse_args(argv)
  args.causal = args.causal == 'true'
  if args.kernel == 'jax_mgpu' and jax.default_backend() != 'gpu':
    p.error(
      f"--kernel=jax_mgpu needs a GPU (JAX's kernel has no interpreter; this backend is "
      f"{jax.default_backend()!r}); allowed here: --kernel=triton or mgpu"
    )
  print(
    f'{args.kernel} kernel; {jax.devices()[0].device_kind}, jax {jax.__version__}; '
    f'H {args.heads}, D {args.head_dim}, '
    f"{'causal' if args.causal else 'full'}, {args.tokens_per_batch} tokens per batch, bf16"
  )
  for n in [int(x) for x in args.seq_lens.split(',')]:
    rows = sweep(n, args)
    for name in ('fwd', 'fwdbwd'):
      ok = [r for r in rows if r[name]]
      if ok:
        best = min(ok, key=lambda r: r[name])
        print(
          f"best {name} at N={n}: block_q={best['block_q']} block_k={best['block_k']} "
          f"warps={best['warps']} stages={best['stages']}: {describe(best, name)}"
        )


if __name__ == '__main__':
  main()
