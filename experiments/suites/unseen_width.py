"""Does a user who changes the width keep a tuned rate? The default config at d_model 96 (6 heads
of 16, 3 layers, 400 steps: a width no other suite uses), as a new user would run it, at the
default rate and at half and twice it, on 2 paired seeds, under the standard parametrization
(as configured, and with the rate scaled by 256 / d_model as the default config's comment told a
user to), under µP (base: the default config's width 256 and head dim 32, or the head dim its
default derives), and as the default config now runs (config version 6: the standard
parametrization scales the given rate by standard.lr_base_d_model / d_model itself). Issue 62's measure: the default
rate within 0.02 nats of the better of half and twice itself. Measured before µP existed: under
the standard parametrization 3e-3 gave 3.2226 and 6e-3 gave 3.0874 (0.135 nats lost)."""

from experiments.suite import Suite, Variant

# The default config's rate and the base of µP (configs/base.py: d_model 256, 8 heads of 32).
DEFAULT_LR = 3e-3
MUP = {'model.parametrization.mup.base_d_model': 256, 'model.parametrization.mup.base_head_dim': 32}
MUP_DERIVED_HEAD = {'model.parametrization.mup.base_d_model': 256}
DEFAULT_CONFIG = {'model.parametrization.standard.lr_base_d_model': 256}


def _variants():
  # standard_scaled: the standard parametrization with the rule the default config's comment
  # states, the rate scaled by 256 / d_model (3e-3 → 8e-3).
  families = (('standard', 'standard', {}, 1.0), ('standard_scaled', 'standard', {}, 256 / 96))
  # mup: base head dim 32 (the default config's); mup_derived_head: its default None, which
  # reads the base head dim as base_d_model / n_heads = 256 / 6 (parametrization.py).
  families += (('mup', 'mup', MUP, 1.0), ('mup_derived_head', 'mup', MUP_DERIVED_HEAD, 1.0))
  # default_config: the default config itself (config version 6): its rate given as 3e-3 and
  # scaled by standard.lr_base_d_model (256) / 96 in the code, the path a user takes.
  families += (('default_config', 'standard', DEFAULT_CONFIG, 1.0),)
  for name, kind, extra, scale in families:
    for factor, label in ((1.0, 'default_lr'), (0.5, 'half_lr'), (2.0, 'twice_lr')):
      yield Variant(
        f'{name}-{label}',
        f'param={kind}',
        {**extra, 'train.learning_rate': float(f'{DEFAULT_LR * scale * factor:.6g}')},
        tune=False,
        versus='' if factor == 1.0 else f'{name}-default_lr',
      )
  # The diagnosis of µP's deficit: the default config ties the embedding and the readout, Tensor
  # Programs V's µP unties them. Each untied row against its tied twin at the same rate.
  for name, kind, extra, lr in (
    ('mup', 'mup', MUP, DEFAULT_LR),
    ('standard_scaled', 'standard', {}, 8e-3),
  ):
    yield Variant(
      f'{name}_untied-default_lr',
      f'param={kind}',
      {**extra, 'train.learning_rate': lr, 'model.tie_embeddings': False},
      tune=False,
      versus=f'{name}-default_lr',
    )


USER = {
  'model.d_model': 96,
  'model.n_heads': 6,
  'model.n_kv_heads': 6,
  'model.n_layers': 3,
  'train.steps': 400,
}

SUITE = Suite(
  name='unseen_width',
  description='the default rate at d_model 96 against half and twice it, standard and µP',
  base='configs/base.py',
  variants=tuple(_variants()),
  presets={'cpu': USER, 'tiny': {**USER, 'train.steps': 6, 'train.warmup_steps': 1}},
  seeds=2,
  paper_source="issue 62's check: the default rate within 0.02 nats of the better of half and "
  'twice itself at a width no suite uses',
)
