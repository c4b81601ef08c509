"""Diagnosis of the `ffn` suite's old verdicts (GELU, Swish and GLU worse than ReLU, against
Shazeer 2020): the same four FFNs under the old initialisation, GPT-2's fixed std 0.02, but each at
its own tuned learning rate. Beside `ffn` (the width-aware default init, tuned rates) it separates
what the learning rate explained from what the initialisation did: at d_model 128, std 0.02 gives
FFN pre-activations of std ~0.23 (√128 · 0.02), where GELU, Swish and the sigmoid gate are nearly
linear."""

from experiments.suite import Suite
from experiments.suites import ffn

SUITE = Suite(
  name='ffn_fixed_init',
  description="the ffn suite's ReLU / GELU / Swish / GLU under the old fixed init (std 0.02), "
  'each at its own tuned learning rate',
  base=ffn.SUITE.base,
  variants=tuple(v for v in ffn.SUITE.variants if v.name in ('relu', 'gelu', 'swish', 'glu')),
  presets={
    name: {**overrides, 'model.init': 'fixed'} for name, overrides in ffn.SUITE.presets.items()
  },
  paper_source=ffn.SUITE.paper_source,
  diagnoses_of='ffn',
)
