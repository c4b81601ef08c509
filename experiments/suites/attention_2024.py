"""Attention choices of 2024-26 against MHA, each at its own tuned learning rate: a sigmoid output
gate, headwise and elementwise (Qiu et al. 2025, arXiv 2505.06708: lower loss, and the first
token's attention mass falls), the value residual (ResFormer, Zhou et al. 2024, arXiv 2410.17897:
lower loss; modded-nanogpt −0.012 at 124M) and learned attention sinks (gpt-oss; StreamingLLM,
Xiao et al. 2024: a place for a head's spare attention, no loss change at the trained context),
and multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, Table 1 and sec. 2.1: "better
performance than MHA" at its scale with a cache of (d_c + d_R)·l numbers per token; at this
scale its defaults, d_c = 4·d_h, d_R = d_h / 2, a full-rank query, hold 796,032 non-embedding
parameters against MHA's 791,680 (+0.5%), and cache 1,152 bytes per token against MHA's 4,096:
the claim tested is parity). Run 2026-12-01 (results.md); MLA's gap is diagnosed by
attention_2024_mla_rank and attention_2024_mla_rope."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU

SUITE = Suite(
  name='attention_2024',
  description='MHA vs the attention output gate (headwise, elementwise), the value residual, '
  'attention sinks and MLA, each at its own learning rate',
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
    Variant('mla', overrides={'model.attention.kind': 'mla'}, expect='same'),
  ),
  presets=PRESETS_CPU_GELU,
  extra_metrics='decode',  # each row's decode tokens/s and KV-cache bytes per token
  paper_source='Qiu et al. 2025 (gated attention: lower loss); Zhou et al. 2024 (ResFormer: lower '
  'loss; modded-nanogpt −0.012 at 124M); gpt-oss / Xiao et al. 2024 (sinks: no loss change); '
  'DeepSeek-V2 (MLA: parity with MHA or better, at a fraction of its KV cache)',
)
