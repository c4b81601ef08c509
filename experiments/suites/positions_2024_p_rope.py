"""Diagnosis of `positions_2024`'s partial-RoPE rows: which frequencies the rotated dims carry.
mllm's default partial RoPE is GPT-NeoX's: the r rotated dims of a head take θ^(−2i/r), full
RoPE's whole range from 1 down to 1/θ on fewer planes. p-RoPE (Barbero et al. 2024 §6), whose
parity this suite's parent tests, keeps full RoPE's r/2 highest frequencies θ^(−2i/head_dim) and
drops the lowest: at head dim 16, fraction 1/4 turns at 1 and 0.32 rad/token (GPT-NeoX: 1 and
0.01), fraction 1/2 at 1, 0.32, 0.1, 0.03 (GPT-NeoX: 1, 0.1, 0.01, 0.001). Fraction 1/8 is left
out: one plane at θ^0 = 1 either way, the same network. If GPT-NeoX's frequencies are the cause,
the partial rows reach full RoPE here; if they stay behind, that is ruled out. The rows keep
their names (paired by name and seed with `positions_2024`'s); full RoPE's runs are copied from an
identical configuration's at this code (`ffn_2024`'s gelu row). Each row tunes its own rate and is
also evaluated, without training, at 4x the training context. Run 2026-12-02 (3 seeds, 1 M tokens):
p-RoPE 1/2 reaches full RoPE (+0.007 [−0.021, +0.035]; GPT-NeoX's 1/2: +0.075), so GPT-NeoX's
spacing is the cause of `positions_2024`'s 1/2 gap; p-RoPE 1/4 falls further behind (+0.274,
against +0.173), so it is not at 1/4. At 4x the context p-RoPE 1/4 loses less than full RoPE
(−0.120) and 1/2 more (+0.071), both within noise since the 4x rows are pooled apart
(2026-12-02: their seeds spread 4x as far as the 1x rows' here). With 64-dim heads
(`positions_2024_p_rope_head_dim`) p-RoPE 1/4 is within noise of full RoPE, +0.067 [−0.14, +0.28],
its gap shrinking by +0.207 [−0.028, +0.442] per seed: a lead, not a diagnosis."""

import dataclasses

from experiments import diagnosis
from experiments.suites import positions_2024

P_ROPE = {'model.position.rope.frequencies': 'highest'}
ROWS = ('partial_1_4', 'partial_1_2')
_GPT_NEOX = "at GPT-NeoX's frequencies"
_DIAGNOSES = {
  # With 64-dim heads (8 planes down to 0.1 rad/token, not 2 fast ones) p-RoPE 1/4 is within
  # noise of full RoPE, but that suite's seeds spread too far to show the gap shrank: a lead.
  'partial_1_4': diagnosis.unexplained(
    diagnosis.rates_tuned('positions_2024_p_rope', 'rope'),
    not_ruled_out="the token budget (1.2 tokens/param); the rotated planes' count at head dim 16 (2 "
    "planes, both fast: 1 and 0.32 rad/token, none of full RoPE's slow ones)",
    rests_on='positions_2024_p_rope, positions_2024 and positions_2024_p_rope_head_dim: eval loss '
    '− rope per seed',
    leads=(
      diagnosis.elsewhere('positions_2024', 'rope', where=_GPT_NEOX),
      diagnosis.closes_in(
        'positions_2024_p_rope_head_dim',
        of='positions_2024_p_rope',
        baseline='rope',
        cause='the rotated planes (8 with 64-dim heads, not 2)',
      ),
    ),
  ),
  **{
    f'{name}-at_4x': diagnosis.unexplained(
      not_ruled_out='which of the rotated frequencies carry the extrapolation, and the gap at the '
      'training context carried to 4x it',
      rests_on='positions_2024_p_rope and positions_2024: eval loss − rope-at_4x per seed',
      leads=(diagnosis.elsewhere('positions_2024', 'rope-at_4x', where=_GPT_NEOX),),
    )
    for name in ROWS
  },
}

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
  diagnoses=_DIAGNOSES,
  diagnoses_of=positions_2024.SUITE.name,
)
