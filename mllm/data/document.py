"""What every data source yields: documents, each named by a stable key that decides its split."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class Document:
  key: str
  text: str


class Source:
  """Base class: `documents()` and `describe()`."""

  def documents(self) -> Iterator[Document]:
    raise NotImplementedError

  def describe(self) -> dict[str, Any]:
    raise NotImplementedError
