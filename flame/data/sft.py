"""Instruction and chat data (--training.data_format sft): records -> conversations -> tokens with labels.

Record shapes, told apart by a source's columns (the first that fits):
- ``messages``: a list of ``{"role", "content"}`` turns; roles system, user and assistant, any
  number of turns, a system turn optional;
- ``prompt`` / ``completion``: one user turn and the assistant's reply;
- ``instruction`` / ``input`` / ``output`` (Alpaca): the user turn is the instruction, followed
  by a blank line and the input when there is one; the output is the reply.
Every shape becomes the same list of messages, so equal content trains on equal tokens.

Rendering: the tokenizer's chat template (``apply_chat_template``), or DEFAULT_TEMPLATE when it
has none. The default writes each turn as ``<|role|>`` and a newline, then the content, turns
separated by a newline, and ends each assistant turn with the tokenizer's EOS (the model's
stop signal).

Targets (--training.sft_loss_on completion, the default): the assistant turns. They are found by
rendering prefixes: for assistant turn k, the conversation before it with the generation prompt
(what a model is given to answer) and the conversation through it; the characters between are
the turn as the assistant writes it: its reply and the template's end-of-turn marker. Both
renderings must start the whole conversation's rendering (a template that renders an earlier
turn differently once later turns follow is refused: no prefix would mark the turn). The whole
conversation is tokenized once, so its tokens are those inference sees, and a token is a target
when its characters overlap an assistant turn's. prompt+completion makes every token a target.
flame's document delimiters wrap a conversation like any document: the EOS they add after a
conversation that ends with an assistant turn is a target (it ends the reply).

Length: a conversation (delimiters included) longer than --training.context_len is dropped, or
with --training.truncate_long cut to its first context_len tokens (dropped if no target is
left); a source counts both (metrics data/<source>/dropped and .../truncated).
"""

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from datasets import Dataset
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from transformers import PreTrainedTokenizerBase

from flame.data.packing import TokenizedSource, WholeDocument
from flame.data.sources import SourceSpec, column_names, record_location
from flame.data.tokenizer import Delimiters
from flame.base.errors import ConfigError, DataError, gist

ROLES = ("system", "user", "assistant")
# shape -> (columns it needs, columns it reads when present)
SHAPES = {
    "messages": (("messages",), ()),
    "prompt/completion": (("prompt", "completion"), ()),
    "instruction/input/output": (("instruction", "output"), ("input",)),
}
SAMPLE = 64  # the first records of each SFT source, checked before training (the rest as they are read)
SPREAD_SAMPLE = 512  # and of a map-style one, records spread evenly over it

DEFAULT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and eos_token is defined %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{% if messages %}{{ '\\n' }}{% endif %}{{ '<|assistant|>\\n' }}{% endif -%}"
)


class BadRecord(Exception):
    """What is wrong with one record and how to fix it (the caller names the source and the record)."""


def record_columns(dataset, spec: SourceSpec) -> tuple[str, ...]:
    """The columns an SFT source's records are read from; ConfigError when no shape fits."""
    columns = column_names(dataset)
    for needed, optional in SHAPES.values():
        if all(name in columns for name in needed):
            return needed + tuple(name for name in optional if name in columns)
    raise ConfigError(
        f"dataset {spec.path} (--training.data_format sft) has no 'messages', 'prompt'+'completion' or "
        f"'instruction'+'output' columns; its columns are: {', '.join(columns) or 'none'}: convert its records to "
        "one of these shapes, or read it as text (--training.data_format text)"
    )


def _text(record: dict, column: str, optional: bool = False, where: str = "") -> str:
    value = record.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise BadRecord(f"{where}'{column}' holds {type(value).__name__}, not text; fix or remove the record")
    return value


def conversation(record: dict) -> list[dict[str, str]]:
    """A record of any shape as messages ``[{"role", "content"}]``, checked; BadRecord if it cannot train."""
    if "messages" in record:
        turns = record["messages"]
        if not isinstance(turns, list) or not turns:
            raise BadRecord("'messages' is not a list of turns; give [{\"role\": ..., \"content\": ...}, ...]")
        messages = []
        for index, turn in enumerate(turns):
            if not isinstance(turn, dict) or "role" not in turn:
                raise BadRecord(f"message {index} has no 'role'; give each turn a role and a content")
            if turn["role"] not in ROLES:
                raise BadRecord(f"message {index} has the unknown role {turn['role']!r}; roles are "
                                f"{', '.join(ROLES)}: fix or remove the record")
            messages.append({"role": turn["role"], "content": _text(turn, "content", where=f"message {index}: ")})
    elif "prompt" in record:
        messages = [{"role": "user", "content": _text(record, "prompt")},
                    {"role": "assistant", "content": _text(record, "completion")}]
    else:
        instruction, extra = _text(record, "instruction"), _text(record, "input", optional=True)
        messages = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction},
                    {"role": "assistant", "content": _text(record, "output")}]
    if not any(message["role"] == "assistant" for message in messages):
        roles = ", ".join(message["role"] for message in messages)
        raise BadRecord(f"no assistant turn (roles: {roles}), so nothing to train on; fix or remove the record")
    return messages


@dataclass
class ChatEncoder:
    """Turns one SFT source's records into WholeDocuments (see the module docstring)."""

    tokenizer: PreTrainedTokenizerBase
    delimiters: Delimiters
    columns: tuple[str, ...]
    source: str
    context_len: int
    loss_on: str = "completion"
    truncate_long: bool = False

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        """``messages`` in the tokenizer's chat template (or DEFAULT_TEMPLATE); BadRecord if the template fails."""
        template = None if self.tokenizer.chat_template else DEFAULT_TEMPLATE
        try:  # a batch of one conversation: the template decides what an empty one renders to
            return self.tokenizer.apply_chat_template(
                [messages], chat_template=template, add_generation_prompt=generation_prompt, tokenize=False
            )[0]
        except Exception as error:  # jinja2's errors and the templates' own raise_exception
            raise BadRecord(
                f"the chat template of tokenizer {self.tokenizer.name_or_path} fails on it ({gist(error)}); fix "
                "the record to what the template takes, or give a tokenizer whose template takes it "
                "(--model.tokenizer_path)"
            ) from None

    def text_and_turns(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its targets."""
        text = self.render(messages)
        if self.loss_on == "prompt+completion":
            return text, [(0, len(text))]
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.render(messages[:k], generation_prompt=True), self.render(messages[: k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise BadRecord(
                    f"the chat template of tokenizer {self.tokenizer.name_or_path} renders turn {k} differently once "
                    "later turns follow, so its assistant tokens cannot be found; give a tokenizer whose template "
                    "renders a conversation as its turns in order (--model.tokenizer_path), or train on every token "
                    "(--training.sft_loss_on prompt+completion)"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def encode(self, records: list[dict], name: Callable[[int], str]) -> tuple[list[WholeDocument], int]:
        """(the records' documents in order, how many were dropped as too long); DataError names a bad record."""
        texts, spans, last_roles = [], [], []
        for index, record in enumerate(records):
            try:
                messages = conversation(record)
                text, turns = self.text_and_turns(messages)
            except BadRecord as bad:
                raise DataError(f"dataset {self.source}, {name(index)}: {bad}") from None
            texts.append(text)
            spans.append(turns)
            last_roles.append(messages[-1]["role"])
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        documents, dropped = [], 0
        for index, (ids, offsets) in enumerate(zip(encoded["input_ids"], encoded["offset_mapping"])):
            document = self._document(ids, offsets, spans[index], last_roles[index] == "assistant")
            if document is None:
                raise DataError(f"dataset {self.source}, {name(index)}: its assistant turns render to no token, so "
                                "nothing would train; fix or remove the record")
            if len(document) > self.context_len:
                document = self._truncated(document) if self.truncate_long else None
            if document is None:
                dropped += 1
            else:
                documents.append(document)
        return documents, dropped

    def _document(self, ids: list[int], offsets, spans, ends_with_reply: bool) -> WholeDocument | None:
        starts = np.asarray([start for start, _ in offsets], dtype=np.int64).reshape(-1)
        ends = np.maximum(np.asarray([end for _, end in offsets], dtype=np.int64).reshape(-1), starts + 1)
        targets = np.zeros(len(ids), dtype=bool)
        for first, last in spans:  # a token straddling a turn's edge carries some of the turn: a target
            targets |= (starts < last) & (ends > first)
        head, tail = self.delimiters.ends(ids)
        tail_is_target = ends_with_reply or self.loss_on == "prompt+completion"
        targets = np.concatenate([np.zeros(len(head), bool), targets, np.full(len(tail), tail_is_target)])
        tokens = np.asarray(head + ids + tail, dtype=np.int64)
        if not targets[1:].any():
            return None
        labels = np.append(np.where(targets[1:], tokens[1:], IGNORE_INDEX), IGNORE_INDEX)
        return WholeDocument(tokens, labels)

    def _truncated(self, document: WholeDocument) -> WholeDocument | None:
        labels = document.labels[: self.context_len]
        if (labels == IGNORE_INDEX).all():
            return None
        return WholeDocument(document.tokens[: self.context_len], labels, truncated=True)

    def documents(self, stream, window: int, shuffle_seed: tuple[int, ...] | None = None) -> "ChatSource":
        """The source's conversations from ``stream``, as its format's record reads them (flame.data.formats.sft)."""
        return ChatSource(stream, self, window, shuffle_seed)

    def check_sample(self, dataset) -> None:
        """Encode the first records before training, and of a map-style source also SPREAD_SAMPLE spread over it: bad
        records, columns and templates fail here, in one line (the others when a rank reads them)."""
        columns = dataset.select_columns(list(self.columns))
        if isinstance(columns, Dataset):
            rows = sorted({*range(min(SAMPLE, len(columns))),
                           *np.linspace(0, len(columns) - 1, min(SPREAD_SAMPLE, len(columns))).astype(int).tolist()})
            records = [columns[row] for row in rows]
        else:
            rows, records = list(range(SAMPLE)), list(columns.take(SAMPLE))
        _, dropped = self.encode(records, lambda index: record_location(self.source, rows[index]))
        if dropped:
            logger.warning(
                f"dataset {self.source}: {dropped} of the {len(records)} conversations checked are longer than "
                f"--training.context_len {self.context_len} tokens and are dropped; raise --training.seq_len "
                "(and context_len), or pass --training.truncate_long to keep their beginnings"
            )


def padding_token(tokenizer: PreTrainedTokenizerBase, delimiters: Delimiters) -> int:
    """The id that pads a row where the next conversation does not fit (its labels are ignored)."""
    for token in (tokenizer.pad_token_id, delimiters.eos, delimiters.bos):
        if token is not None:
            return token
    return 0


class ChatSource(TokenizedSource):
    """A TokenizedSource of an SFT source: reads of records become WholeDocuments, too long ones dropped.

    A read's dropped conversations ride on the first document it hands out (WholeDocument.dropped),
    so a resume, which re-reads and skips what was handed out, counts none twice.
    """

    def __init__(self, stream, encoder: ChatEncoder, window: int, shuffle_seed: tuple[int, ...] | None = None):
        super().__init__(stream, None, encoder.delimiters, window, shuffle_seed)
        self.encoder = encoder
        self._dropped = 0  # dropped in this call's reads (handed over with the document it returns)
        self._empty_since: int | None = None  # the stream's epoch when reads began to keep nothing

    def _record_name(self, records: list[dict]) -> Callable[[int], str]:
        rows = getattr(self.stream, "last_read", None)
        if rows is not None:
            return lambda index: record_location(self.encoder.source, rows[index])
        return lambda index: (f"a record streamed to data shard {self.stream.consumer} in epoch {self.stream.epoch} "
                              f"({json.dumps(records[index], default=str)[:80]}...)")

    def _encode(self, records: list) -> list:
        documents, dropped = self.encoder.encode(records, self._record_name(records))
        if not self._skip:  # a resume's re-read: its drops were counted before the checkpoint
            self._dropped += dropped
        self._check_progress(bool(documents))
        return documents

    def _check_progress(self, kept: bool) -> None:
        """Refuse a source whose conversations are all too long: it would read epoch after epoch forever."""
        epoch = self.stream.epoch
        if kept:
            self._empty_since = None
        elif self._empty_since is None:
            self._empty_since = epoch
        elif epoch >= self._empty_since + 2:
            raise DataError(
                f"dataset {self.encoder.source}: every conversation data shard {self.stream.consumer} read in a whole "
                f"epoch is longer than --training.context_len {self.encoder.context_len} tokens; raise "
                "--training.seq_len (and context_len), or pass --training.truncate_long"
            )

    def next_document(self) -> WholeDocument:
        document = super().next_document()
        if self._dropped:
            document, self._dropped = dataclasses.replace(document, dropped=self._dropped), 0
        return document

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._dropped, self._empty_since = 0, None
