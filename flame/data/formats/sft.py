"""The sft format: chat and instruction records, trained on the assistant turns (the machinery: flame.data.sft)."""

from typing import Any

from transformers import PreTrainedTokenizerBase

from flame.data.formats.record import DataFormat, Option
from flame.data.packing import ROW_COUNTERS
from flame.data.sft import ChatEncoder, record_columns
from flame.data.sources import SourceSpec
from flame.data.tokenizer import Delimiters


def chat_encoder(dataset: Any, spec: SourceSpec, training: Any, tokenizer: PreTrainedTokenizerBase,
                 delimiters: Delimiters) -> ChatEncoder:
    """The source's record shape from its columns, and its first records encoded: bad ones fail before training."""
    encoder = ChatEncoder(tokenizer, delimiters, record_columns(dataset, spec), spec.path,
                          training.context_len, training.sft_loss_on, training.truncate_long)
    encoder.check_sample(dataset)
    return encoder


SFT = DataFormat(
    name="sft",
    summary="chat and instruction records ('messages', 'prompt'/'completion' or 'instruction'/'input'/'output'), "
            "rendered with the tokenizer's chat template; the assistant turns are the targets",
    encoder=chat_encoder,
    label="SFT",
    kind="chat",
    # a conversation is packed whole, and its turns must not attend to the conversation before it
    document_mask="keeps each conversation a document of its own",
    # packing whole conversations drops or cuts the long ones and pads rows: a source reports how many
    counters=ROW_COUNTERS,
    options=(Option("truncate_long", False), Option("sft_loss_on", "completion")),
    validation="the targets its training labels name (--training.sft_loss_on); conversations longer than "
               "--training.context_len dropped, or cut with --training.truncate_long, as in training",
)
