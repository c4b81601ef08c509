"""Diagnosis of `norms_2024`'s contradictions: sandwich norms +0.190 and the output norm +0.760
behind Pre-LN at the configured rate (3e-3, where both papers train every placement at one rate
and find them level or ahead), and the output norm +0.490 behind at 4x it.

Two causes are tested at once, each by its own row. The rate: a norm on a sublayer's output
makes the sublayer's function blind to its weights' scale, which moves the best rate, and 3e-3 is
a grid step below Pre-LN's own best at this size (6e-3 in `attention_2024`); here every placement
is tuned as `attention_2024` tunes MHA (Pre-LN's runs are the same and are copied from there).
QK-norm: OLMo 2 adds it with the output norm (Team OLMo 2025, sec. 3.2: the two together are its
stability change), since under the output norm no norm stands before the attention's
projections; `norms_2024`'s output rows, without it, end with attention logits of 264-369
(3,049-3,200 at 4x) against Pre-LN's 27-30. `olmo2` is OLMo 2's block: the output norm and QK-norm
over the whole projection, as transformers' Olmo2 has it."""

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites import norms_2024

_OLMO2 = {'model.attention.qk_norm': True, 'model.attention.qk_norm_over': 'projection'}

# This table's own rows contradict too (each placement expected level with Pre-LN): what they rule
# out and what they leave is what norms_2024's rows say (its _DIAGNOSES), their rates tuned here.
_RATES = diagnosis.rates_tuned('norms_2024_tuned', 'pre')
_DIAGNOSES = {
  variant: diagnosis.unexplained(
    _RATES,
    *((norms_2024.QK_NORM_ALONE,) if variant == 'output' else ()),
    not_ruled_out=norms_2024.NOT_RULED_OUT,
    rests_on=f'norms_2024_tuned: {variant} − pre per seed',
  )
  for variant in ('sandwich', 'output', 'olmo2')
}

SUITE = Suite(
  name='norms_2024_tuned',
  description='Pre-LN vs sandwich vs the output norm, without and with QK-norm (the OLMo 2 '
  'block), each at its own learning rate',
  base=norms_2024.SUITE.base,
  variants=(
    Variant('pre'),
    Variant('sandwich', 'placement=sandwich', expect='same'),
    Variant('output', 'placement=output', expect='same'),
    Variant('olmo2', 'placement=output', overrides=_OLMO2, expect='same'),
  ),
  presets=norms_2024.SUITE.presets,
  extra_metrics='layer_grad_norms',
  diagnoses=_DIAGNOSES,
  diagnoses_of='norms_2024',
  paper_source=norms_2024.SUITE.paper_source,
)
