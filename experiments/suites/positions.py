"""Positional schemes trained at context L and evaluated at L, 2L, 4L, 8L and 16L with the same
weights: the extrapolation table of the ALiBi paper (Press et al. 2022, Table 1 and Fig. 1).
Learned positions have no table entry past L (n/a). Sinusoidal runs with Vaswani's √d_model
embedding scale."""

import math

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

# ALiBi paper, WikiText-103, L = 512: perplexity at 512 and at ~2L (1012); eval_loss = ln(ppl).
_PPL_AT_L = {'sinusoidal': 20.05, 'rope': 20.07, 't5': 19.65, 'alibi': 19.73}

# Directions where the ALiBi paper has no number: learned and sinusoidal absolute positions gave
# "nearly identical results" (Vaswani et al. 2017, Table 3 row E), so learned ~ sinusoidal ~
# rotary; a decoder without positions learns some but trails (Haviv et al. 2022, Table 1).
_EXPECT = {'learned': 'same', 'none': 'worse'}

# positions_tokens trains these rows 4x longer, evaluated every 250 steps: whether the absolute
# schemes' gap to RoPE is a token-budget effect, recomputed from its runs at every report.
_DIAGNOSES = {
  kind: diagnosis.token_budget('positions_tokens', baseline='rope', of='positions')
  for kind in ('learned', 'sinusoidal')
}


def _variant(kind: str) -> Variant:
  paper = {'eval_loss': math.log(_PPL_AT_L[kind])} if kind in _PPL_AT_L else {}
  # Vaswani et al. (sec. 3.4) multiply token embeddings by √d_model: without it the unit-scale
  # sinusoids drown token vectors initialised at std 0.02.
  derived = (
    (lambda config: {'model.embed_scale': config.model.d_model**0.5})
    if kind == 'sinusoidal'
    else None
  )
  return Variant(kind, f'pos={kind}', paper=paper, derived=derived, expect=_EXPECT.get(kind, ''))


SUITE = Suite(
  name='positions',
  description='position schemes at the training context and extrapolated to 2-16x',
  base='configs/rope_swiglu.py',
  variants=tuple(
    _variant(kind) for kind in ('rope', 'none', 'learned', 'sinusoidal', 'shaw', 't5', 'alibi')
  ),
  refine_lr=('rope', 'learned', 'sinusoidal'),
  presets=PRESETS,
  extra_metrics='extrapolation',
  diagnoses=_DIAGNOSES,
  paper_source='Press et al. 2022, WikiText-103 at L = 512 (ln ppl); at 2L/5L/30L the paper has '
  'sinusoidal 43.5/132/406, rotary 21.4/31.6/79.3, T5 18.8/20.4/OOM, ALiBi '
  '18.7/18.4/18.3 ppl',
)
