"""Diagnosis of `positions_2024`'s partial-RoPE rows: the same fractions with 2 heads of 64
dimensions instead of 8 heads of 16. At head dim 16 the fractions 1/8, 1/4, 1/2 rotate 2, 4 and 8
dimensions (1, 2 and 4 frequencies, GPT-NeoX's spacing base^(−2i/rotated)); the papers' models
rotate 16-64 of 64-256 (GPT-NeoX 20B: 24 of 96; p-RoPE, Barbero et al. 2024: Gemma's 256-dim
heads). On the tuning seed the loss grew as the rotated dims fell (1/2: +0.13, 1/4: +0.22,
1/8: +0.45 against full RoPE at each one's best rate): if too few rotated dimensions are the
cause, the gaps shrink here, where the same fractions rotate 8, 16 and 32. The K/V projections
grow with the heads (as in `positions_head_dim`); the comparison is within this suite and paired
by seed with `positions_2024`'s. Each row tunes its own rate. Each is also evaluated, without
training, at 4x the training context, as in `positions_2024`, where partial 1/2 lost less than full
RoPE there (−0.12 against the 'same' the suite expected): whether that holds at 64-dim heads is the
independent check before any explanation."""

from experiments.suite import Suite
from experiments.suites import positions_2024
from experiments.suites.positions_head_dim import with_wide_heads

SUITE = Suite(
  name='positions_2024_head_dim',
  description='full RoPE vs partial RoPE (1/8, 1/4, 1/2 of each head) with 2 heads of 64 (not 8 '
  'of 16), at the training context and at 4x it',
  base=positions_2024.SUITE.base,
  variants=with_wide_heads(
    positions_2024.SUITE,
    tuple(
      f'{name}{at}'
      for name in ('rope', 'partial_1_8', 'partial_1_4', 'partial_1_2')
      for at in ('', '-at_4x')
    ),
  ),
  presets=positions_2024.SUITE.presets,
  extra_metrics='decode',
  paper_source=positions_2024.SUITE.paper_source,
  diagnoses_of='positions_2024',
)
