"""Diagnosis of the `positions` suite's absolute rows (learned +0.32 and sinusoidal +0.21 worse
than RoPE at their tuned rates, where the literature has them within a few percent): the same
four schemes with 2 heads of 64 dimensions instead of 8 heads of 16 (GQA with 2 K/V heads), the
head size of the papers' models. An absolute scheme adds positions to the residual stream, and
attention must turn them into offsets through q·k inside each head: a 16-dimensional head may be
too small to hold the many frequencies a sharp previous-token or copying head needs, where RoPE
rotates every head by 8 frequencies for free. If the gaps shrink here, head size is the cause.
The K/V projections grow with the heads (857 k parameters, not 759 k); the comparison is within
this suite. Each variant tunes its own learning rate (the head layout may move it)."""

import dataclasses

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


SUITE = Suite(
  name='positions_head_dim',
  description='RoPE vs none / learned / sinusoidal with 2 heads of 64 (not 8 of 16)',
  base=positions.SUITE.base,
  variants=with_wide_heads(positions.SUITE, ('rope', 'none', 'learned', 'sinusoidal')),
  presets=positions.SUITE.presets,
  paper_source=positions.SUITE.paper_source,
  diagnoses_of='positions',
)
