"""Diagnosis of `positions_2024_p_rope`'s 1/4 row: p-RoPE with 2 heads of 64 instead of 8 of 16.
At head dim 16, p-RoPE 1/4 rotates two planes, both fast (1 and 0.32 rad/token), and trailed
full RoPE by +0.274 where 1/2 (four planes, down to 0.03) was level with it. Barbero et al.'s heads
are 256 wide: 1/4 keeps 32 planes there. With 64-dim heads 1/4 rotates 8 planes (down to 0.1
rad/token) and 1/2 rotates 16: if too few planes at head dim 16 are p-RoPE 1/4's cause, its gap
closes here. Full RoPE's runs are `positions_2024_head_dim`'s (the same configuration, copied);
each row tunes its own rate and is also evaluated, without training, at 4x the context. Run
2026-12-02 (3 seeds, 1 M tokens): 1/4 +0.067 [−0.144, +0.278] and 1/2 −0.029 [−0.240, +0.182],
both within noise of full RoPE (p-RoPE's parity), at 4x too; but with 2 heads the seeds spread
(pooled σ 0.056 at the training context, against 0.007 at head dim 16), so the 1/4 row's shrink from +0.274 is not
resolved: a lead for `positions_2024_p_rope`'s 1/4 row."""

import dataclasses

from experiments.suites import positions_2024_p_rope
from experiments.suites.positions_head_dim import with_wide_heads

SUITE = dataclasses.replace(
  positions_2024_p_rope.SUITE,
  name='positions_2024_p_rope_head_dim',
  description="full RoPE vs p-RoPE (1/4, 1/2 of each head at full RoPE's highest frequencies) "
  'with 2 heads of 64 (not 8 of 16), at the training context and at 4x it',
  variants=with_wide_heads(
    positions_2024_p_rope.SUITE, tuple(v.name for v in positions_2024_p_rope.SUITE.variants)
  ),
  diagnoses={},
  diagnoses_of=positions_2024_p_rope.SUITE.name,
)
