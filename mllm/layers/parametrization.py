"""How every weight is initialised and scaled: the initialisation schemes (`model.init`) and the
parametrizations (`model.parametrization.kind`), which say how initialisation, learning rates, the
attention scale and the logits change with the width, so a rate tuned at one width transfers (a
parametrization in the sense of Yang et al.: init, multipliers and rates together).

    standard  every width as configured (fan-in init, one learning rate, 1/√d_head, logits as
              computed): the best rate falls as the width grows, so the peak rate is scaled by
              standard.lr_base_d_model / d_model (256: train.learning_rate is the rate tuned at
              d_model 256; None: the rate as given).
    mup       µP for Adam (Yang et al. 2022, "Tensor Programs V", arXiv 2203.03466, Table 3 with
              the output multiplier of its Appendix B): with the width multiplier
              m = d_model / mup.base_d_model,
                hidden matrices (q, k, v, out, the FFN's, the experts', the router): fan-in init
                  (as standard), Adam learning rate × 1/m;
                embeddings and position tables ("input weights"), norms and biases: init and rate
                  independent of the width (a table's std is 1/√base_d_model, not 1/√d_model);
                the output: logits × 1/m (the readout's multiplier; its rate is not scaled),
                  tied or untied;
                attention: scores × √(base head dim) / d_head (1/d_head in the limit, instead
                  of 1/√d_head); the base head dim defaults to base_d_model / n_heads, right
                  where the heads widen: a sweep that adds heads of a fixed size sets
                  mup.base_head_dim to that size (or model.head_dim), else its scores' scale
                  drifts as √(1 / n_heads).
              At d_model = base_d_model it is the standard parametrization exactly.

Each is a class registered under its config name; one with settings declares them as a frozen
`Settings` (mllm/variant_config.py), its section `model.parametrization.<name>`.

Initialisation schemes (`model.init`): the std of every weight matrix and lookup table. Every weight
is drawn from N(0, std²). A scheme gives the std from the model config, the weight's role and, for a
matrix, its fan-in (the input dimension it sums over):

    'table'  a lookup table: the token embedding (= the tied head), the untied head, the learned
             position table, Shaw's relative tables
    'in'     a matrix whose output stays inside its branch: q, k, v, FFN gate and up, the MoE
             router, the experts' gate and up
    'out'    a residual branch's output projection: attention out, FFN down, the experts' down

Output projections are further divided by √(2·n_layers) when `model.depth_scaled_init` (GPT-2,
Radford et al. 2019, sec. 2.3): 2·n_layers branches add their outputs to the residual stream, so
its variance at the top stays that of one branch.

Not here, under every scheme: the T5 relative-bias table keeps HF T5's d_model^-½ (a bias, not a
projection), the MoE noise router starts at zero (Shazeer et al. 2017), norm scales at 1.
"""

from __future__ import annotations

import dataclasses
import math

from mllm.checks import ConfigError
from mllm.variant_config import at_least, setting, settings_of


@dataclasses.dataclass(frozen=True)
class StandardSettings:
  lr_base_d_model: int | None = setting(
    256,
    'the d_model train.learning_rate is tuned at: the peak rate is scaled by lr_base_d_model / '
    'd_model, as the best rate halves when the width doubles (experiments/results/defaults, '
    'defaults_d128, unseen_width); None: the rate as given',
    at_least(1),
  )


class Standard:
  """No width-dependent factors in the model; the peak learning rate scales as 1/d_model from
  `lr_base_d_model` (the measured rule: the best rate halves as the width doubles)."""

  Settings = StandardSettings

  @staticmethod
  def learning_rate_scale(cfg) -> float:
    base = settings_of(Standard, cfg.parametrization).lr_base_d_model
    return 1.0 if base is None else base / cfg.d_model

  @staticmethod
  def width_multiplier(cfg) -> float:
    del cfg
    return 1.0

  @staticmethod
  def attention_scale(cfg, head_dim: int) -> float:
    del cfg
    return head_dim**-0.5

  @staticmethod
  def check(m, p: str) -> None:
    del m, p


@dataclasses.dataclass(frozen=True)
class MuPSettings:
  base_d_model: int = setting(
    256,
    'the width at which µP equals the standard parametrization (where the rate was tuned)',
    at_least(1),
  )
  base_head_dim: int | None = setting(
    None,
    'the head dim at the base width (the attention scale is √base_head_dim / d_head); None: a set '
    'model.head_dim, else base_d_model / n_heads (the heads keep their count as the width grows)',
    at_least(1),
  )


class MuP:
  """µP for Adam (module docstring)."""

  Settings = MuPSettings

  @staticmethod
  def learning_rate_scale(cfg) -> float:
    """1: µP scales each hidden matrix's rate itself (`learning_rate_factors`)."""
    del cfg
    return 1.0

  @staticmethod
  def width_multiplier(cfg) -> float:
    return cfg.d_model / settings_of(MuP, cfg.parametrization).base_d_model

  @staticmethod
  def attention_scale(cfg, head_dim: int) -> float:
    """√(the head dim at the base width) / d_head: d_model // n_heads scales with the width, a
    set head_dim does not (then it is 1/√d_head)."""
    s = settings_of(MuP, cfg.parametrization)
    base = s.base_head_dim or cfg.head_dim or s.base_d_model / cfg.n_heads
    return base**0.5 / head_dim

  @staticmethod
  def check(m, p: str) -> None:
    if m.init != 'fan_in':
      raise ConfigError(
        f'{p}.init',
        m.init,
        "µP scales a fan-in init with the width; allowed with model.parametrization.kind='mup': "
        "'fan_in'",
      )
    if m.attention.softmax_scale is not None:
      raise ConfigError(
        f'{p}.attention.softmax_scale',
        m.attention.softmax_scale,
        "µP sets the attention scale from the width; allowed with model.parametrization.kind='mup':"
        ' None',
      )


PARAMETRIZATIONS = {'standard': Standard, 'mup': MuP}


def _chosen(cfg):
  return PARAMETRIZATIONS[cfg.parametrization.kind]


def width_multiplier(cfg) -> float:
  """m = d_model / base_d_model under µP; 1 under the standard parametrization."""
  return _chosen(cfg).width_multiplier(cfg)


def attention_scale(cfg, head_dim: int) -> float:
  """The scores' scale: 1/√d_head, or under µP √(base head dim)/d_head (the same at the base)."""
  return _chosen(cfg).attention_scale(cfg, head_dim)


def table_std_factor(cfg) -> float:
  """A lookup table's std relative to the init scheme's 1/√d_model: √m makes it 1/√base_d_model,
  independent of the width, under µP (an input weight's fan-in is the one-hot's, constant)."""
  return width_multiplier(cfg) ** 0.5


def output_multiplier(cfg) -> float:
  """The logits' factor: 1/m."""
  return 1.0 / width_multiplier(cfg)


def learning_rate_scale(cfg) -> float:
  """The factor on train.learning_rate's peak: the standard parametrization's
  lr_base_d_model / d_model (1 with None), µP's 1."""
  return _chosen(cfg).learning_rate_scale(cfg)


def learning_rate_factors(cfg) -> tuple[float, float]:
  """(the factor on train.learning_rate's peak, a hidden matrix's rate multiplier; the rest's is
  1): the standard parametrization's (lr_base_d_model / d_model, 1), µP's (1, 1/m)."""
  chosen = _chosen(cfg)
  return chosen.learning_rate_scale(cfg), 1.0 / chosen.width_multiplier(cfg)


def check_parametrization(m, p: str = 'model') -> None:
  from mllm.variant_config import check_variant_keys

  check_variant_keys(m.parametrization, f'{p}.parametrization', PARAMETRIZATIONS, 'parametrization')
  PARAMETRIZATIONS[m.parametrization.kind].check(m, p)


# --------------------------------------------------------------------------------------------
# Initialisation schemes (model.init).
# --------------------------------------------------------------------------------------------

ROLES = ('table', 'in', 'out')


def fixed_std(cfg, role: str, fan_in: int | None) -> float:
  """GPT-2 (Radford et al. 2019): one std, `model.init_std` (0.02, chosen for d_model 768), for
  every matrix and table, whatever its width. At d_model 128 it gives pre-activations of std
  ~0.23, where GELU / Swish / sigmoid gates are nearly linear."""
  del role, fan_in
  return cfg.init_std


def fan_in_std(cfg, role: str, fan_in: int | None) -> float:
  """LeCun et al. 1998 ("Efficient BackProp", sec. 4.6), the "standard parametrisation":
  std = 1/√fan_in, so every output of a matrix has the variance of one of its inputs. A table has
  no fan-in of its own; it gets 1/√d_model, the tied head's fan-in, so initial logits are O(1)
  (and an untied head gets the same, so tying does not change the initial scale)."""
  return (cfg.d_model if role == 'table' else fan_in) ** -0.5


def small_init_std(cfg, role: str, fan_in: int | None) -> float:
  """Nguyen & Salazar 2019 ("Transformers without Tears"), GPT-NeoX's small_init: every matrix
  and table std = √(2 / (5·d_model)), Xavier's √(2 / (fan_in + fan_out)) of the FFN's d → 4d
  projection used for all weights; below 1/√d_model, so the residual stream starts small."""
  del role, fan_in
  return math.sqrt(2 / (5 * cfg.d_model))


INIT_SCHEMES = {'fixed': fixed_std, 'fan_in': fan_in_std, 'small_init': small_init_std}


def weight_std(cfg, role: str, fan_in: int | None = None) -> float:
  """The std of a weight of `role` (ROLES) under the scheme `cfg.init` (cfg: the model config);
  `fan_in` is required for the matrices ('in', 'out')."""
  if role not in ROLES:
    raise ValueError(f'role {role!r}; allowed: {", ".join(ROLES)}')
  if role != 'table' and fan_in is None:
    raise ValueError(f'a {role!r} matrix needs its fan_in')
  std = INIT_SCHEMES[cfg.init](cfg, role, fan_in)
  if role == 'table':
    std = std * table_std_factor(cfg)  # µP: independent of the width (parametrization.py)
  if role == 'out' and cfg.depth_scaled_init:
    std = std / (2 * cfg.n_layers) ** 0.5
  return std
