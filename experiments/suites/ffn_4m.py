"""The headline FFN table at 4 M tokens (4.8 tokens per parameter, out of early training): every
row of `ffn` (Shazeer 2020, Table 1, at matched parameters, and MoE top-2) over 2,000 steps,
evaluated every 250, each row's rate tuned again at this budget around the one `ffn` chose
(a √2 grid, widened past an edge up to twice a side) on 2 tuning seeds, then 13 paired seeds:
planned at 10 (`python -m experiments plan ffn --noise_from ffn_tokens --steps 2000`: 10 seeds
resolve 0.03 nats at the table's level with `ffn_tokens`' noise, σ 0.0177), whose own noise
(σ 0.0209) then asked for 13 (`plan ffn_4m`); seeds 10-12 trained 2026-12-02. 60 tuning and 117
table runs, 2,118 run-minutes.
Every evaluation reads the whole validation split (about 1,400 windows of 128 tokens, not the first
512: `train.eval_batches` 0), so no run of `ffn_tokens` is reused (their evaluation read 512)."""

from experiments import diagnosis
from experiments.suites import ffn
from experiments.suites._longer import headline_copy

SUITE = headline_copy(
  ffn.SUITE,
  name='ffn_4m',
  description='the FFN variants at matched parameters over 4 M tokens (the headline table)',
  seeds=13,
  diagnoses={
    **{k: ffn.SUITE.diagnoses[k] for k in ('swish', 'bilinear')},
    # GLU's token budget read from this table's own curves (13 seeds, evaluated every 250
    # steps), not `ffn_tokens`' 3: its gap here at 4 M tokens is its own.
    'glu': diagnosis.token_budget('ffn_4m', baseline='relu'),
    'swiglu': ffn.SWIGLU_AT_4M,
    # Both trail ReLU by more as training goes on; ffn_4m_init tests SwiGLU's cause on them.
    **{
      name: diagnosis.unexplained(
        diagnosis.rates_tuned('ffn_4m', baseline='relu'),
        diagnosis.budget_ruled_out('ffn_4m', baseline='relu'),
        not_ruled_out="the fan_in initialisation (SwiGLU's cause; ffn_4m_init tests it), the "
        'hidden width, the corpus (ffn_4m_kjv)',
        rests_on=f'ffn_4m: {name} − relu per seed along training',
      )
      for name in ('geglu', 'reglu')
    },
  },
)
