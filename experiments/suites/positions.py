"""Positional schemes trained at context L and evaluated at L, 2L, 4L, 8L and 16L with the same
weights: the extrapolation table of the ALiBi paper (Press et al. 2022, Table 1 and Fig. 1).
Learned positions have no table entry past L (n/a)."""
import math

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

# ALiBi paper, WikiText-103, L = 512: perplexity at 512 and at ~2L (1012); eval_loss = ln(ppl).
_PPL_AT_L = {'sinusoidal': 20.05, 'rope': 20.07, 't5': 19.65, 'alibi': 19.73}

SUITE = Suite(
    name='positions',
    description='position schemes at the training context and extrapolated to 2-16x',
    base='configs/rope_swiglu.py',
    variants=tuple(Variant(kind, f'pos={kind}', paper=(
        {'eval_loss': math.log(_PPL_AT_L[kind])} if kind in _PPL_AT_L else {}))
        for kind in ('rope', 'none', 'learned', 'sinusoidal', 'shaw', 't5', 'alibi')),
    presets=PRESETS,
    extra_metrics='extrapolation',
    paper_source='Press et al. 2022, WikiText-103 at L = 512 (ln ppl); at 2L/5L/30L the paper has '
                 'sinusoidal 43.5/132/406, rotary 21.4/31.6/79.3, T5 18.8/20.4/OOM, ALiBi '
                 '18.7/18.4/18.3 ppl',
)
