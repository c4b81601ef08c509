"""The paired check that bfloat16 compute may replace float32 in the CPU suites: the `ffn` table
(9 rows, 5 seeds, 1 M tokens) again with `model.dtype='bfloat16'` (float32 parameters, optimizer
state and loss; bf16 matmuls and activations), each row at the rate `ffn` tuned for it in float32,
on the same seeds, so every run pairs with its float32 twin. On this CPU (AMD EPYC, AVX512-BF16)
a cpu-preset step takes 135 ms instead of 180 (benchmarks/results/train_step-cpu.md).
`python -m experiments.precision ffn_bf16` compares the two: each run's loss against its twin,
each row's Δ and verdict. Not scored against the papers (it repeats `ffn`'s rows)."""

import dataclasses

from experiments.suite import Suite
from experiments.suites import ffn
from experiments.suites._longer import BF16

SUITE = Suite(
  name='ffn_bf16',
  description='the ffn table in bfloat16 compute, at the float32 rates (a paired precision check)',
  base=ffn.SUITE.base,
  variants=tuple(dataclasses.replace(v, paper={}) for v in ffn.SUITE.variants),
  presets={preset: {**own, **BF16} for preset, own in ffn.SUITE.presets.items()},
  seeds=ffn.SUITE.seeds,
  lr_from='ffn',
  checks_method_of='ffn',
)
