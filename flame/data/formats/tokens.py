"""The megatron and numpy formats: token ids other tools wrote, read in place (the machinery: flame.data.token_arrays).

Their documents are token ids, read as the text format reads a column of them (TextEncoder without a
tokenizer): flame's delimiters around each document, not doubled where the file has them. A path a
text entry names is read as one of these when its files tell (``detect``): text cannot read them.
"""

from typing import Any

from transformers import PreTrainedTokenizerBase

from flame.base.errors import ConfigError
from flame.data.formats.record import DataFormat, Option
from flame.data.formats.text import TextEncoder
from flame.data.sources import SourceSpec
from flame.data.token_arrays import (
    COLUMN,
    TokenArray,
    TokenFile,
    flat_files,
    is_flat,
    is_megatron,
    megatron_files,
)
from flame.data.tokenizer import Delimiters

UINT16_IDS = 1 << 16  # a vocabulary this large or smaller fits uint16 ids


def token_encoder(dataset: Any, spec: SourceSpec, training: Any, tokenizer: PreTrainedTokenizerBase,
                  delimiters: Delimiters) -> TextEncoder:
    """The token ids of each document, delimited as a text source's (no tokenizing)."""
    return TextEncoder(COLUMN, None, delimiters, len(tokenizer))


def _checked(files: list[TokenFile], tokenizer: PreTrainedTokenizerBase, fix: str) -> TokenArray:
    """The files as one source, once a sample of each file's ids is of ``tokenizer`` (else ConfigError with ``fix``)."""
    for file in files:
        file.check_ids(len(tokenizer), tokenizer.name_or_path, fix)
    return TokenArray(files)


def open_megatron(spec: SourceSpec, training: Any, tokenizer: PreTrainedTokenizerBase,
                  delimiters: Delimiters) -> TokenArray:
    """The Megatron pairs of ``spec.path``, checked (header, sizes, a sample of ids against the tokenizer)."""
    return _checked(megatron_files(spec.path), tokenizer,
                    "it was written with another tokenizer: set --model.tokenizer_path to that one")


def open_numpy(spec: SourceSpec, training: Any, tokenizer: PreTrainedTokenizerBase,
               delimiters: Delimiters) -> TokenArray:
    """The flat token files of ``spec.path``, split into documents after each EOS (or separator) id."""
    boundary = delimiters.eos if delimiters.eos is not None else tokenizer.eos_token_id
    if boundary is None:
        raise ConfigError(f"numpy source {spec.path}: its documents end at the tokenizer's EOS and tokenizer "
                          f"{tokenizer.name_or_path} has none: name the token that ends them with "
                          "--training.separator_token")
    default = "uint16" if len(tokenizer) <= UINT16_IDS else "uint32"
    given = None if training.token_dtype == "auto" else training.token_dtype
    files = flat_files(spec.path, given, default, boundary)
    return _checked(files, tokenizer, "the file holds ids of another tokenizer, or of another dtype: set "
                    "--model.tokenizer_path to its tokenizer, or --training.token_dtype to its dtype")


MEGATRON = DataFormat(
    name="megatron",
    summary="Megatron-LM indexed datasets: a .bin/.idx pair (its prefix, either file, or a glob), read in place; "
            "a document is Megatron's document; every token is a target",
    encoder=token_encoder,
    label="Megatron",
    kind="Megatron .bin/.idx",
    validation="every token of its documents",
    opener=open_megatron,
    detect=is_megatron,
)

NUMPY = DataFormat(
    name="numpy",
    summary="flat arrays of token ids (a .npy, nanoGPT's raw .bin, llm.c's .bin, or a glob of them), read in place; "
            "a document ends after each EOS (or --training.separator_token) id; every token is a target",
    encoder=token_encoder,
    label="numpy",
    kind="flat token-file",
    options=(Option("token_dtype", "auto"),),
    validation="every token of its documents",
    opener=open_numpy,
    detect=is_flat,
)
