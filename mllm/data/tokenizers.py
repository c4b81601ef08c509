"""Tokenizers: 'byte' (UTF-8 bytes) and 'bpe' (Hugging Face `tokenizers` byte-level BPE).

Both share one interface (`Tokenizer`); `token_bytes[id]` is how many UTF-8 bytes an id stands for
(0 for specials), so a loss in nats per token converts to bits per byte.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol

import numpy as np

EOS, PAD = '<eos>', '<pad>'


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int
  pad_id: int
  token_bytes: np.ndarray  # int32 [vocab_size]

  def encode(self, text: str) -> list[int]: ...
  def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
  def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
  """Ids 0..255 are the UTF-8 bytes, 256 = <eos>, 257 = <pad>."""

  vocab_size = 258
  eos_id = 256
  pad_id = 257

  def __init__(self):
    self.token_bytes = np.array([1] * 256 + [0, 0], np.int32)

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    # Specials stand for no text; a cut through a multi-byte character decodes to U+FFFD.
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode('utf-8', errors='replace')


class BPETokenizer:
  """A `tokenizers.Tokenizer` (byte-level BPE, mllm's own, or an imported Hugging Face one) with an
  EOS and a pad token (mllm's: <eos> and <pad>)."""

  def __init__(self, tokenizer, eos: str = EOS, pad: str = PAD):
    self.tok = tokenizer
    # Text that happens to contain '<eos>' must stay text, or it would split documents.
    self.tok.encode_special_tokens = True
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = tokenizer.token_to_id(eos)
    self.pad_id = tokenizer.token_to_id(pad)
    if self.eos_id is None or self.pad_id is None:
      raise ValueError(f'a BPE tokenizer for mllm needs the special tokens {eos} and {pad}')
    from tokenizers import decoders

    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    self.token_bytes = np.array(
      [
        0 if (t := tokenizer.id_to_token(i)) is None or t in specials else _n_bytes(t, byte_level)
        for i in range(self.vocab_size)
      ],
      np.int32,
    )

  @classmethod
  def from_file(cls, path: str, eos: str = EOS, pad: str = PAD) -> BPETokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    return cls(HFTokenizer.from_file(path), eos, pad)

  @classmethod
  def train(
    cls, texts: Iterable[str], vocab_size: int, eos: str = EOS, pad: str = PAD
  ) -> BPETokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[eos, pad],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return cls(tok, eos, pad)

  def save(self, path: str) -> None:
    """Write tokenizer.json atomically (several processes may save the same file)."""
    tmp = f'{path}.tmp-{os.getpid()}'
    self.tok.save(tmp)
    os.replace(tmp, path)

  def to_str(self) -> str:
    return self.tok.to_str()

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _n_bytes(token: str, byte_level: bool) -> int:
  """UTF-8 bytes a vocabulary entry stands for. Byte-level BPE: one character per byte (GPT-2's
  byte-to-unicode map); SentencePiece-style: '▁' is a space and '<0xNN>' one byte."""
  if byte_level:
    return len(token)
  if len(token) == 6 and token.startswith('<0x') and token.endswith('>'):
    return 1
  return len(token.replace('\u2581', ' ').encode('utf-8'))
