"""Diagnosis of MLA's gap to MHA in `attention_2024` (+0.160 at 1 M tokens, on every seed and at
every rate of its grid, where DeepSeek-V2 finds parity or better): the latent's rank. At the cpu
preset MLA's defaults (d_c = 4·d_h = 64) make K^C and V, 128 numbers each per token, from one
64-number latent, half the model's width. Here d_c = 128 = d_model, so the latent compresses
neither below what the residual stream holds (and the cache grows from 72 to 136 numbers a layer).
If MLA then reaches MHA, the latent's rank is what costs it at this width; if it stays behind, the
rank is ruled out. Both rows' rates are tuned as `attention_2024` tunes them (MHA's runs are the
same and are copied from there)."""

from experiments.suites import attention_2024

SUITE = attention_2024.mla_diagnosis(
  'attention_2024_mla_rank',
  "MHA vs MLA with a latent as wide as the model (d_c 128 against the default 64), "
  'each at its own learning rate',
  {'model.attention.mla.kv_lora_rank': 128},
  not_ruled_out="the rotated dims (d_R 8 here), the token budget (1.1 tokens/param), the weight "
  "decay on the latent's two-matrix product",
)
