"""Diagnosis of MLA's gap to MHA in `attention_2024` (+0.160 at 1 M tokens, where DeepSeek-V2
finds parity or better): the rotated dims. MLA keeps position only in its decoupled part, d_R
dims of each query head against one key that all heads share (eq. 14); the defaults give d_R =
d_h / 2 = 8 at the cpu preset, four rotation frequencies, where MHA rotates all 16 dims of each
of its 8 heads' own keys. Here d_R = 16 = d_h. If MLA then reaches MHA, the position capacity of
its small shared key is what costs it at this width; if it stays behind, that is ruled out. Both
rows' rates are tuned as `attention_2024` tunes them (MHA's runs are the same and are copied from
there)."""

from experiments.suites import attention_2024

SUITE = attention_2024.mla_diagnosis(
  'attention_2024_mla_rope',
  'MHA vs MLA with as many rotated dims as a head has (d_R 16 against the default 8), '
  'each at its own learning rate',
  {'model.attention.mla.rope_head_dim': 16},
  not_ruled_out="the token budget (1.1 tokens/param), the weight decay on the latent's "
  'two-matrix product',
)
