"""Diagnosis of the gated FFNs' gaps to ReLU in the headline table (`ffn_4m`, 4 M tokens: GLU
+0.124, Bilinear +0.190, GEGLU +0.159, SwiGLU +0.156, ReGLU +0.184): ReLU and the five gated rows
again under GPT-2's fixed N(0, 0.02) init instead of the preset's fan_in, each rate tuned again
for it (around `ffn`'s, a √2 grid widened past an edge, on tuning seed 1000), 3 paired seeds,
evaluated as `ffn_4m` is (the whole validation split, bfloat16 compute), so its seeds pair with
`ffn_4m`'s. `ffn_tokens_init` found SwiGLU's gap cut from +0.158 to +0.035 this way; this asks
whether the init is every gated row's cause. About 7 CPU run-hours (3.5 hours with --jobs=2)."""

from experiments.suites import ffn
from experiments.suites._longer import BF16, WHOLE_SPLIT, longer_copy

GATED_AND_RELU = ('relu', 'glu', 'bilinear', 'geglu', 'swiglu', 'reglu')

SUITE = longer_copy(
  ffn.SUITE,
  name='ffn_4m_init',
  description='ReLU and the gated FFNs over 4 M tokens under the fixed N(0, 0.02) init',
  keep=GATED_AND_RELU,
  retune_lr=GATED_AND_RELU,
  overrides={**WHOLE_SPLIT, **BF16, 'model.init': 'fixed'},
  diagnoses_of='ffn_4m',
  seeds=3,
)
