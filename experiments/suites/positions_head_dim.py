"""Diagnosis of the `positions` suite's absolute rows (learned +0.32 and sinusoidal +0.21 worse
than RoPE at their tuned rates, where the literature has them within a few percent): the same
four schemes with 2 heads of 64 dimensions instead of 8 heads of 16 (GQA with 2 K/V heads), the
head size of the papers' models. An absolute scheme adds positions to the residual stream, and
attention must turn them into offsets through q·k inside each head: a 16-dimensional head may be
too small to hold the many frequencies a sharp previous-token or copying head needs, where RoPE
rotates every head by 8 frequencies for free. If the gaps shrink here, head size is the cause.
The K/V projections grow with the heads (857 k parameters, not 759 k); the comparison is within
this suite. Each variant tunes its own learning rate (the head layout may move it). Run
2026-11-27 (3 seeds, 1 M tokens): the gaps do not shrink (learned +0.40, sinusoidal +0.31), so
head size is ruled out for `positions`' rows (their diagnosis there is the token budget,
`positions_tokens`). Here the two rows contradict the literature as `positions`' do, at the same
1.2 tokens/param; whether they close with tokens at these heads is not measured (the trend at 8
heads of 16 is a lead)."""

import dataclasses

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites import positions

HEADS = {'model.n_heads': 2, 'model.n_kv_heads': 2}  # d_model 128: head_dim 64, MHA


def with_wide_heads(donor: Suite, names: tuple[str, ...]) -> tuple[Variant, ...]:
  """`donor`'s rows `names`, in its order, with 2 heads of 64 (HEADS) over their overrides."""
  return tuple(
    dataclasses.replace(v, overrides={**v.overrides, **HEADS})
    for v in donor.variants
    if v.name in names
  )


_DIAGNOSES = {
  name: diagnosis.unexplained(
    diagnosis.rates_tuned('positions_head_dim', 'rope'),
    not_ruled_out='the token budget at these heads (1.2 tokens/param; with 8 heads of 16 the gap '
    'shrinks over 4 M tokens, still behind at the end: a lead)',
    rests_on='positions_head_dim, positions and positions_tokens: eval loss − rope per seed',
    leads=(
      diagnosis.elsewhere('positions', 'rope', where='with 8 heads of 16'),
      diagnosis.token_budget('positions_tokens', baseline='rope', of='positions'),
    ),
  )
  for name in ('learned', 'sinusoidal')
}

SUITE = Suite(
  name='positions_head_dim',
  description='RoPE vs none / learned / sinusoidal with 2 heads of 64 (not 8 of 16)',
  base=positions.SUITE.base,
  variants=with_wide_heads(positions.SUITE, ('rope', 'none', 'learned', 'sinusoidal')),
  presets=positions.SUITE.presets,
  paper_source=positions.SUITE.paper_source,
  diagnoses=_DIAGNOSES,
  diagnoses_of='positions',
)
