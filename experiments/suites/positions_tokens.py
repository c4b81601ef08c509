"""Diagnosis of the `positions` suite's absolute rows (learned and sinusoidal positions trail RoPE
at 1 M tokens after per-variant lr tuning, and learned positions are no better than none; at the
training length the literature puts absolute positions within a few percent of rotary: Press et
al. 2022, sinusoidal 20.05 vs rotary 20.07 ppl; Vaswani et al. 2017, Table 3 E, learned ~
sinusoidal): RoPE, none, learned and sinusoidal trained 4x longer (4 M tokens), evaluated every
250 steps, so loss_vs_tokens.png shows whether the absolute schemes close the gap with training
(a token-budget effect: RoPE hands attention relative offsets that absolute positions must learn
to compute through q and k) or keep it; ALiBi, Shaw and T5 beside them, for their own direction
at 4 M tokens. Each variant at the rate the `positions` suite tuned for it (lr_from), except RoPE,
learned, sinusoidal, ALiBi, Shaw and T5, whose rates are tuned again at 4 M tokens (retune_lr):
learned and sinusoidal still trail RoPE there, and a rate tuned at a quarter of the budget (a
factor-2 grid, all three at its 6e-3) is the first suspect (2026-11-28: ruled out; RoPE and sinusoidal move
to 4.24e-3, learned stays, and both gaps widen). ALiBi, Shaw and T5 are tuned again as well
(2026-11-28), so that they too meet the re-tuned RoPE at rates of this budget; NoPE, +0.59 behind,
stays at its 1 M-token rate (no rate closes that). No extrapolation measure (the question is the
training length). The 21 table runs at `positions`' rates are of one code version (2026-11-27):
the 12 of 2026-11-25 were trained again, since the same seed under the other code drew other
initial weights (RoPE seed 0: 2.1835 then, 2.2574 now)."""

from experiments.suites import positions
from experiments.suites._longer import longer_copy

SUITE = longer_copy(
  positions.SUITE,
  name='positions_tokens',
  description='RoPE vs none / learned / sinusoidal / ALiBi / Shaw / T5 over 4x the tokens, eval '
  'loss against tokens',
  keep=('rope', 'none', 'learned', 'sinusoidal', 'alibi', 'shaw', 't5'),
  retune_lr=('rope', 'learned', 'sinusoidal', 'alibi', 'shaw', 't5'),
  # The absolute rows still trail RoPE at 4 M tokens: scored here too, with the same diagnosis as
  # in `positions` (their gaps are still closing over the last half of these runs).
  diagnoses={k: positions.SUITE.diagnoses[k] for k in ('learned', 'sinusoidal')},
)
