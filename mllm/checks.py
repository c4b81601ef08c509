"""InputError and ConfigError, RunFault, and the small checks that config validation and every variant's own
rules (mllm/layers/, mllm/ops/) share: each raises a one-line ConfigError naming the key, the value
and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class InputError(ValueError):
  """A bad input the user can fix: `key=value: what is wrong and what is allowed`, on one line.

  `key` names a flag (`--workdir`), a file or a config key. Entry points print it and exit 2;
  ConfigError is the case of a config key, found by validation or by the run (a missing data file).
  """

  def __init__(self, key: str, value: Any = None, allowed: str | None = None):
    if allowed is None:  # re-raised by a library with just the message (absl's flag parser does)
      self.key = self.value = self.allowed = None
      super().__init__(key)
      return
    self.key, self.value, self.allowed = key, value, allowed
    super().__init__(f'{key}={value!r}: {allowed}')


class ConfigError(InputError):
  """A bad config value: `model.d_model=100: ...`."""


class RunFault(Exception):
  """A fault of the machine during a run (a full disk, a lost peer process): its message is one
  line saying what failed, what was kept and what to do. `fixable`: the user can fix the cause
  (space, permissions) and resume; entry points exit 2 then, else 1 (docs/training.md)."""

  fixable: bool = False


def input_error(key: str, value: Any, allowed: str) -> InputError:
  """The error for `key`: an InputError for a flag (`--workdir`), a ConfigError for a config key."""
  return (InputError if key.startswith('-') else ConfigError)(key, value, allowed)


def one_of(key: str, value: Any, allowed: Iterable[str], what: str) -> None:
  allowed = list(allowed)
  if value not in allowed:
    raise ConfigError(key, value, f'unknown {what}; allowed: ' + ', '.join(allowed))


def positive(key: str, value: Any, optional: bool = False) -> None:
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
    raise ConfigError(key, value, 'must be a positive number' + (' or None' if optional else ''))


def rate(key: str, value: Any) -> None:
  if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise ConfigError(key, value, 'a dropout rate must be in [0, 1)')


def integer(key: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    what = 'a positive integer' if minimum == 1 else f'an integer >= {minimum}'
    raise ConfigError(key, value, f'must be {what}' + (' or None' if optional else ''))


def number(key: str, value: Any, low: float, high: float, what: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
    raise ConfigError(key, value, f'{what}; allowed: {low} <= value <= {high}')


def first_line(err: BaseException, limit: int = 200) -> str:
  """'ErrorType: the first line of its message', for one-line errors that quote a library's."""
  text = str(err).strip().splitlines()
  return type(err).__name__ + (f': {text[0][:limit]}' if text else '')
