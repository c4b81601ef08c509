"""Attention choices of 2024-26 against MHA, each at its own tuned learning rate: a sigmoid output
gate, headwise and elementwise (Qiu et al. 2025, arXiv 2505.06708: lower loss, and the first
token's attention mass falls), the value residual (ResFormer, Zhou et al. 2024, arXiv 2410.17897:
lower loss; modded-nanogpt −0.012 at 124M) and learned attention sinks (gpt-oss; StreamingLLM,
Xiao et al. 2024: a place for a head's spare attention, no loss change at the trained context).
MLA joins when it lands. Defined and planned; not run yet."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

SUITE = Suite(
  name='attention_2024',
  description='MHA vs the attention output gate (headwise, elementwise), the value residual and '
  'attention sinks, each at its own learning rate',
  base='configs/base.py',
  variants=(
    Variant('mha'),
    Variant(
      'gate_headwise', overrides={'model.attention.output_gate': 'headwise'}, expect='better'
    ),
    Variant(
      'gate_elementwise', overrides={'model.attention.output_gate': 'elementwise'}, expect='better'
    ),
    Variant('value_residual', overrides={'model.attention.value_residual': True}, expect='better'),
    Variant('sinks', overrides={'model.attention.sinks': True}, expect='same'),
  ),
  presets=PRESETS,
  extra_metrics='decode',  # each row's decode tokens/s and KV-cache bytes per token
  paper_source='Qiu et al. 2025 (gated attention: lower loss); Zhou et al. 2024 (ResFormer: lower '
  'loss; modded-nanogpt −0.012 at 124M); gpt-oss / Xiao et al. 2024 (sinks: no loss change)',
)
