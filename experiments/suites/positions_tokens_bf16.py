"""The paired check that bfloat16 compute leaves the attention-bias schemes alone: `ffn_bf16`
checked bf16 on the FFN rows (all RoPE), but `positions_4m` (bf16, GELU) finds T5 +0.090 and
ALiBi +0.109 behind RoPE where `positions_tokens` (float32, SwiGLU, the same 4 M tokens) had them
ahead (−0.034, −0.064). RoPE, Shaw, T5 and ALiBi of `positions_tokens` again with
`model.dtype='bfloat16'`, each at the rate `positions_tokens` tuned for it in float32, on its 3
seeds and its 512 evaluation windows, so every run pairs with its float32 twin and bf16 is the one
difference. `python -m experiments.precision positions_tokens_bf16` compares the two. Not scored
against the papers (it repeats `positions_tokens`' rows). 12 runs, about 1 CPU hour with
--jobs=2."""

import dataclasses

from experiments.suite import Suite
from experiments.suites import positions_tokens
from experiments.suites._longer import BF16

ROWS = ('rope', 'shaw', 't5', 'alibi')

SUITE = Suite(
  name='positions_tokens_bf16',
  description='RoPE, Shaw, T5 and ALiBi of positions_tokens in bfloat16 compute, at the float32 '
  'rates (a paired precision check)',
  base=positions_tokens.SUITE.base,
  variants=tuple(
    dataclasses.replace(v, paper={}, expect='')
    for v in positions_tokens.SUITE.variants
    if v.name in ROWS
  ),
  presets={preset: {**own, **BF16} for preset, own in positions_tokens.SUITE.presets.items()},
  seeds=positions_tokens.SUITE.seeds,
  lr_from='positions_tokens',
  checks_method_of='positions_tokens',
)
