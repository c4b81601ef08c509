"""Diagnosis of `positions_2024`'s partial-RoPE rows: which frequencies the rotated dims carry.
mllm's default partial RoPE is GPT-NeoX's: the r rotated dims of a head take θ^(−2i/r), full
RoPE's whole range from 1 down to 1/θ on fewer planes. p-RoPE (Barbero et al. 2024 §6), whose
parity this suite's parent tests, keeps full RoPE's r/2 highest frequencies θ^(−2i/head_dim) and
drops the lowest: at head dim 16, fraction 1/4 turns at 1 and 0.32 rad/token (GPT-NeoX: 1 and
0.01), fraction 1/2 at 1, 0.32, 0.1, 0.03 (GPT-NeoX: 1, 0.1, 0.01, 0.001). Fraction 1/8 is left
out: one plane at θ^0 = 1 either way, the same network. If GPT-NeoX's frequencies are the cause,
the partial rows reach full RoPE here; if they stay behind, that is ruled out. The rows keep
their names (paired by name and seed with `positions_2024`'s); full RoPE's runs are the same and
are copied from there. Each row tunes its own rate and is also evaluated, without training, at 4x
the training context."""

import dataclasses

from experiments.suites import positions_2024

P_ROPE = {'model.position.rope.frequencies': 'highest'}
ROWS = ('partial_1_4', 'partial_1_2')

SUITE = dataclasses.replace(
  positions_2024.SUITE,
  name='positions_2024_p_rope',
  description="full RoPE vs p-RoPE (1/4, 1/2 of each head at full RoPE's highest frequencies, "
  'the lowest removed), at the training context and at 4x it',
  variants=tuple(
    dataclasses.replace(v, overrides={**v.overrides, **P_ROPE})
    if v.name.removesuffix('-at_4x') in ROWS
    else v
    for v in positions_2024.SUITE.variants
    if v.name.removesuffix('-at_4x') in ('rope', *ROWS)
  ),
  diagnoses={},
  diagnoses_of=positions_2024.SUITE.name,
)
