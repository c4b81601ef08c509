"""Norm placements of 2024-26 against Pre-LN, at the configured learning rate and at 4x it
(not tuned: the claim is about a rate that is too high): sandwich norms (Gemma 2; Peri-LN, Kim et
al. 2025, arXiv 2502.02732: hidden-state variance flat with depth, better at high rates) and
OLMo 2's norm on the sublayers' outputs (Team OLMo 2025, arXiv 2501.00656, sec. 3.2: fewer loss
spikes). At the configured rate: no difference expected; at 4x, both ahead of Pre-LN at 4x.
Run 2026-12-01 (results.md); its contradictions are diagnosed by norms_2024_tuned."""

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU


def _times(factor: float):
  return lambda config: {'train.learning_rate': factor * config.train.learning_rate}


_TUNED = 'norms_2024_tuned'
_OWN_RATE = diagnosis.stays_behind(
  _TUNED, 'pre', cause='a rate tuned for Pre-LN', where='each at its own tuned rate', retuned=True
)
# Both placements that normalise a sublayer's output trail Pre-LN by ~0.15 at their own rates
# (sandwich; olmo2, the output norm with QK-norm): what is left is common to them, and nothing
# here has trained them past 1.2 tokens/param.
NOT_RULED_OUT = (
  'the token budget (1.2 tokens/param: the papers train 400M-7B models on billions of tokens), '
  'the norm on the sublayer output itself at this width'
)
QK_NORM_ALONE = diagnosis.stays_behind(
  _TUNED,
  'pre',
  cause="the missing QK-norm alone (OLMo 2's block)",
  where='with QK-norm (olmo2), each at its own tuned rate',
  retuned=True,
  as_variant='olmo2',
)
# Recomputed on every report from norms_2024 and norms_2024_tuned.
_DIAGNOSES = {
  'sandwich': diagnosis.unexplained(
    _OWN_RATE,
    not_ruled_out=NOT_RULED_OUT,
    rests_on='norms_2024 and norms_2024_tuned: sandwich − pre per seed',
  ),
  'output': diagnosis.unexplained(
    _OWN_RATE,
    QK_NORM_ALONE,
    not_ruled_out=NOT_RULED_OUT,
    rests_on='norms_2024 and norms_2024_tuned: output and olmo2 − pre per seed',
  ),
  # At 4x (0.012) the output norm without QK-norm ends with attention logits of ~3,000.
  'output-4x': diagnosis.removed_at_the_same_rate(
    _TUNED,
    as_variant='olmo2',
    of='norms_2024',
    baseline='pre-4x',
    cause="the missing QK-norm (OLMo 2 pairs it with the output norm)",
  ),
}

SUITE = Suite(
  name='norms_2024',
  description='Pre-LN vs sandwich (Gemma 2, Peri-LN) vs output norms (OLMo 2), at the configured '
  'rate and at 4x it',
  base='configs/base.py:placement=pre',
  variants=(
    Variant('pre', tune=False),
    Variant('sandwich', 'placement=sandwich', tune=False, expect='same'),
    Variant('output', 'placement=output', tune=False, expect='same'),
    Variant('pre-4x', 'placement=pre', derived=_times(4.0), tune=False, expect='worse'),
    Variant(
      'sandwich-4x',
      'placement=sandwich',
      derived=_times(4.0),
      tune=False,
      expect='better',
      versus='pre-4x',
    ),
    Variant(
      'output-4x',
      'placement=output',
      derived=_times(4.0),
      tune=False,
      expect='better',
      versus='pre-4x',
    ),
  ),
  presets=PRESETS_CPU_GELU,
  extra_metrics='layer_grad_norms+decode',  # and each row's decode tokens/s, KV bytes/token
  diagnoses=_DIAGNOSES,
  paper_source='Kim et al. 2025 (Peri-LN: stable at high rates); Team OLMo 2025 (OLMo 2: fewer '
  'spikes); Gemma 2 (Team et al. 2024)',
)
