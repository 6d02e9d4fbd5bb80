"""Tokenizer loading and the tokens that delimit documents."""

import functools
import os
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from flame.data import builtin
from flame.base import hub
from flame.base.errors import ConfigError, gist

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# the files a tokenizer's vocabulary is read from: a fast tokenizer's tokenizer.json, or what transformers
# converts a slow tokenizer's from (sentencepiece models, BPE's vocab.json, WordPiece's vocab.txt)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                    "vocab.txt")
# ordinary (not special) tokens a tokenizer must have: with fewer, every text tokenizes to little more than the
# document delimiters, and a run trains on those alone
MIN_ORDINARY_TOKENS = 2
_GIVE = "give a directory holding tokenizer.json, a hub name in the local HF cache (org/name), or builtin:python-stdlib-bpe"


def _check_tokenizer_location(location: str) -> None:
    """A local path that cannot hold a tokenizer, refused as such (transformers would take it for a hub name)."""
    if not os.path.exists(location) and not hub.is_hub_name(location):
        raise ConfigError(f"--model.tokenizer_path {location} does not exist; {_GIVE}")
    if os.path.isfile(location):
        raise ConfigError(f"--model.tokenizer_path {location} is a file; {_GIVE}")


@functools.cache
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A fast tokenizer from a directory, a hub name (local HF cache) or ``builtin:<name>``."""
    location = builtin.resolve(path) if builtin.is_builtin(path) else path
    _check_tokenizer_location(location)
    try:
        if os.path.exists(location):
            tokenizer = AutoTokenizer.from_pretrained(location)
        else:  # a hub name (a path that does not exist was refused above)
            tokenizer = hub.cache_first(f"--model.tokenizer_path {location}", hub.download_remedy(location),
                                        lambda: AutoTokenizer.from_pretrained(location))
    except ConfigError:
        raise
    except Exception as error:  # transformers raises many kinds, some spanning lines
        if os.path.isdir(location) and not any(os.path.isfile(os.path.join(location, f)) for f in TOKENIZER_FILES):
            raise ConfigError(f"--model.tokenizer_path {location} holds no {' or '.join(TOKENIZER_FILES)}; {_GIVE}") from None
        if os.path.isdir(location) and not any(os.path.isfile(os.path.join(location, f)) for f in VOCABULARY_FILES):
            raise ConfigError(
                f"--model.tokenizer_path {location} holds no vocabulary: none of {', '.join(VOCABULARY_FILES)} is "
                f"there (only the tokenizer's settings); copy the tokenizer's vocabulary file into it, or {_GIVE}"
            ) from None
        if os.path.isdir(location):
            raise ConfigError(f"cannot load the tokenizer in {location}: {gist(error)}; {_GIVE}") from None
        raise ConfigError(
            f"--model.tokenizer_path {location} is not a local directory, nor a hub name in the local HF cache or "
            f"on the hub ({gist(error)}); {_GIVE}"
        ) from None
    if not tokenizer.is_fast:
        raise ConfigError(f"tokenizer {path} has no fast (Rust) implementation; flame tokenizes online and needs one")
    _check_vocabulary(tokenizer, location)
    return tokenizer


def _check_vocabulary(tokenizer: PreTrainedTokenizerBase, location: str) -> None:
    """Refuse a tokenizer without a real vocabulary: transformers builds one from a folder whose vocabulary file is
    missing (a LlamaTokenizer without its tokenizer.model holds only <unk>, <s> and </s>), and every text then
    tokenizes to nothing but the delimiters flame adds."""
    special = set(tokenizer.added_tokens_decoder)
    ordinary = sum(1 for token_id in tokenizer.get_vocab().values() if token_id not in special)
    if ordinary >= MIN_ORDINARY_TOKENS:
        return
    names = ", ".join(str(token) for token in list(tokenizer.added_tokens_decoder.values())[:4])
    if os.path.isfile(os.path.join(location, "tokenizer.json")):
        lacks = "its tokenizer.json holds no vocabulary"
    elif missing := [name for name in type(tokenizer).vocab_files_names.values()
                     if os.path.isdir(location) and not os.path.isfile(os.path.join(location, name))]:
        lacks = f"the folder lacks {' and '.join(missing)}, where {type(tokenizer).__name__} reads its vocabulary"
    else:
        lacks = "its files hold no vocabulary"
    raise ConfigError(
        f"--model.tokenizer_path {location} has no real vocabulary: {ordinary} ordinary tokens (flame needs at least "
        f"{MIN_ORDINARY_TOKENS}) beside {len(special)} special ones ({names}), so every text would tokenize to its "
        f"delimiters alone; {lacks}: copy the tokenizer's vocabulary there, or {_GIVE}"
    )


@dataclass(frozen=True)
class Delimiters:
    """Tokens flame puts around every document itself, whatever the tokenizer adds on its own."""

    bos: int | None
    eos: int | None

    def ends(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """The tokens ``wrap`` puts before and after ``ids``: BOS and EOS, unless ``ids`` has them there already."""
        head = [self.bos] if self.bos is not None and ids[:1] != [self.bos] else []
        tail = [self.eos] if self.eos is not None and ids[-1:] != [self.eos] else []
        return head, tail

    def wrap(self, ids: list[int]) -> list[int]:
        """``ids`` with BOS before and EOS after (not doubled where pretokenized data has them)."""
        head, tail = self.ends(ids)
        return head + ids + tail


def document_delimiters(
    tokenizer: PreTrainedTokenizerBase, mode: str = "auto", separator: str | None = None
) -> Delimiters:
    """The delimiters for ``mode`` (see --training.delimiters) and ``tokenizer``.

    auto: EOS after each document and BOS before it, for whichever the tokenizer defines; a
    tokenizer whose BOS and EOS are the same token (GPT-2 style) gets it once, as EOS.
    ``separator`` names a token that ends documents when the tokenizer defines neither.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if separator is not None:
        separator_id = tokenizer.convert_tokens_to_ids(separator)
        if separator_id is None or separator_id == tokenizer.unk_token_id:
            raise ConfigError(f"--training.separator_token {separator!r} is not a token of {tokenizer.name_or_path}")
        eos = separator_id
    wanted = {"auto": (bos is not None, eos is not None), "eos": (False, True), "bos": (True, False),
              "bos+eos": (True, True)}[mode]
    for name, want, token, fix in (
        ("BOS", wanted[0], bos, "use --training.delimiters eos (or auto)"),
        ("EOS", wanted[1], eos, "use --training.delimiters bos, or name an end token with --training.separator_token"),
    ):
        if want and token is None:
            raise ConfigError(
                f"--training.delimiters {mode} needs a {name} token but tokenizer {tokenizer.name_or_path} has none: {fix}"
            )
    if bos is None and eos is None:
        raise ConfigError(
            f"tokenizer {tokenizer.name_or_path} defines neither BOS nor EOS, so documents cannot be delimited; "
            "name a token to end documents with --training.separator_token"
        )
    if mode == "auto" and bos == eos:
        wanted = (False, True)
    return Delimiters(bos=bos if wanted[0] else None, eos=eos if wanted[1] else None)


def id_outside_vocabulary(token_id: int, vocabulary: int, tokenizer: str = "") -> str:
    """What is wrong with a given token id outside [0, vocabulary), and the fix (a clause after "record N ")."""
    if token_id < 0:
        return f"holds token id {token_id}: token ids are never negative: fix how the data was written"
    whose = f"--model.tokenizer_path {tokenizer}" if tokenizer else "the tokenizer"
    return (f"holds token id {token_id}, outside the vocabulary of {whose} (ids 0 to "
            f"{vocabulary - 1}): it was tokenized with another tokenizer: give that one (with a model whose "
            "vocab_size covers it), or tokenize the text again")

