"""Tokenizer loading and the tokens that delimit documents."""

import functools
import os
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from flame.config_manager import ConfigError
from flame.data import builtin


@functools.cache
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A fast tokenizer from a directory, a hub name (local HF cache) or ``builtin:<name>``."""
    location = builtin.resolve(path) if builtin.is_builtin(path) else path
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as error:
        where = "directory" if os.path.isdir(location) else "name (not a local directory; offline runs need it in the HF cache)"
        raise ConfigError(f"cannot load tokenizer from {location} ({where}): {error}") from None
    if not tokenizer.is_fast:
        raise ConfigError(f"tokenizer {path} has no fast (Rust) implementation; flame tokenizes online and needs one")
    return tokenizer


@dataclass(frozen=True)
class Delimiters:
    """Tokens flame puts around every document itself, whatever the tokenizer adds on its own."""

    bos: int | None
    eos: int | None

    def wrap(self, ids: list[int]) -> list[int]:
        return ([self.bos] if self.bos is not None else []) + ids + ([self.eos] if self.eos is not None else [])


def document_delimiters(tokenizer: PreTrainedTokenizerBase) -> Delimiters:
    """EOS after each document and BOS before it, for whichever of the two the tokenizer defines.

    A tokenizer whose BOS and EOS are the same token (GPT-2 style) gets it once, as EOS.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None and eos is None:
        raise ConfigError(
            f"tokenizer {tokenizer.name_or_path} defines neither BOS nor EOS, so documents cannot be delimited; "
            "use a tokenizer that defines an eos_token"
        )
    if bos == eos:
        bos = None
    return Delimiters(bos=bos, eos=eos)
