"""The FlashAttention table (Dao et al. 2022, sec. 4.3 and app. E): time, FLOPs, bytes accessed and
scratch memory of dense attention against the tiled implementations as N grows, from
benchmarks/attention.py. On CPU the Pallas kernel runs in interpret mode: its times there say
nothing about GPU speed, its scratch memory does."""

from experiments.suite import BenchmarkSuite

SUITE = BenchmarkSuite(
  name='flash',
  description='dense vs tiled attention: time, FLOPs, bytes and memory against sequence length',
  module='benchmarks.attention',
  presets={
    'tiny': [
      '--impls=xla,blockwise',
      '--seq_lens=64,128',
      '--heads=2',
      '--head_dim=16',
      '--repeats=1',
      '--warmup=0',
    ],
    'cpu': [
      '--impls=xla,blockwise,pallas',
      '--seq_lens=256,512,1024,2048,4096',
      '--causal=true',
      '--repeats=3',
    ],
    # FlashAttention's own setting: 16k tokens a batch, 16 heads of 128 (width 2048).
    'gpu': [
      '--impls=xla,blockwise,pallas,cudnn',
      '--dtype=bfloat16',
      '--heads=16',
      '--head_dim=128',
      '--tokens_per_batch=16384',
      '--causal=both',
      '--seq_lens=512,1024,2048,4096,8192,16384',
    ],
  },
  paper_source='FlashAttention (A100, GPT-2 medium attention: N = 1024, d = 64, 16 heads, batch '
  '64, fwd+bwd): standard vs flash 66.6 vs 75.2 GFLOPs, 40.3 vs 4.4 GB HBM read/'
  'written, 41.7 vs 7.3 ms; memory linear in N for flash, quadratic for standard',
)
