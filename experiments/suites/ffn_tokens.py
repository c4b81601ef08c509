"""Diagnosis of the `ffn` suite's gated rows that trail ReLU within noise (sigmoid GLU +0.105, bilinear
+0.051 at 1 M tokens, against Shazeer 2020, Table 1, where every gated variant beats ReLU):
ReLU, GLU, Bilinear and SwiGLU trained 4x longer (4 M tokens, ~4.7 tokens per parameter instead
of ~1.2), evaluated every 250 steps, so loss_vs_tokens.png shows whether the gap closes or the
curves cross with more training. Each variant at the rate the `ffn` suite tuned for it (lr_from)."""

from experiments.suites import ffn
from experiments.suites._longer import longer_copy

SUITE = longer_copy(
  ffn.SUITE,
  name='ffn_tokens',
  description='ReLU vs GLU / Bilinear / SwiGLU over 4x the tokens, eval loss against tokens',
  keep=('relu', 'glu', 'bilinear', 'swiglu'),
)
