"""Errors raised by `jax_ppo.models` (and the rollout boundary) for bad inputs.

Every class is a `ValueError`, so callers that catch `ValueError` keep working and a command line
can print any of them as one line (no traceback): the message names the file, field or id and the
fix.

- `ModelFileError`: a checkpoint file is missing, truncated or corrupt (names the file).
  `MissingModelFileError` is also a `FileNotFoundError`.
- `UnsupportedModelError`: `config.json` describes an architecture this package does not
  implement (lists the supported ones).
- `PadTokenError`: a tokenizer has no usable pad token (names the fixes).
- `VocabularyError`: a token id lies outside the model's vocabulary (names the id, where it
  came from and the vocabulary size).
"""

from __future__ import annotations


class ModelError(ValueError):
  """Base class of the errors below."""


class ModelFileError(ModelError):
  """A checkpoint file (config.json, safetensors file or shard index) is unreadable."""


class MissingModelFileError(ModelFileError, FileNotFoundError):
  """A checkpoint file that should exist does not."""


class UnsupportedModelError(ModelError):
  """The checkpoint's `model_type` or one of its options is not implemented here."""


class PadTokenError(ModelError):
  """No pad token can be chosen without growing the vocabulary (or the chosen one is invalid)."""


class VocabularyError(ModelError):
  """A token id is negative or not below the model's `vocab_size`."""


__all__ = [
    "MissingModelFileError",
    "ModelError",
    "ModelFileError",
    "PadTokenError",
    "UnsupportedModelError",
    "VocabularyError",
]
