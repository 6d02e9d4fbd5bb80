"""The text format (the default): documents in one column, text tokenized online or token ids used as given."""

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from flame.data.formats.record import DataFormat
from flame.data.packing import TokenizedSource
from flame.data.sources import SourceSpec, document_column
from flame.data.tokenizer import Delimiters


@dataclass
class TextEncoder:
    """One text source: each value of ``columns`` is a document, delimited by flame (flame.data.tokenizer)."""

    columns: str
    tokenizer: PreTrainedTokenizerBase | None  # None: the column holds token ids (pretokenized data)
    delimiters: Delimiters
    vocabulary: int  # the tokenizer's size: given token ids must be below it

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        # no special tokens: document boundaries are flame's delimiters, whatever the tokenizer would add
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def documents(self, stream: Any, window: int, shuffle_seed: tuple[int, ...] | None = None) -> TokenizedSource:
        if self.tokenizer is None:
            return TokenizedSource(stream, None, self.delimiters, window, shuffle_seed, id_limit=self.vocabulary)
        return TokenizedSource(stream, self.tokenize, self.delimiters, window, shuffle_seed)


def text_encoder(dataset: Any, spec: SourceSpec, training: Any, tokenizer: PreTrainedTokenizerBase,
                 delimiters: Delimiters) -> TextEncoder:
    """--training.text_column, else 'text', 'content' or 'input_ids'; ConfigError when none is there."""
    column, token_ids = document_column(dataset, spec, training.text_column)
    return TextEncoder(column, None if token_ids else tokenizer, delimiters, len(tokenizer))


TEXT = DataFormat(
    name="text",
    summary="documents: a column of text ('text', 'content' or --training.text_column), tokenized online, or of "
            "token ids ('input_ids'), used as given; every token is a target",
    encoder=text_encoder,
    label="text",
    kind="text",
    validation="every token of its documents",
)
