"""Documents -> tokens -> packed rows, each stage with a small positional state.

Every state here is a *position* (where a stream stands, how much of a read was used, how
far into a document packing got), never a copy of tokens: resuming re-reads and
re-tokenizes from that position, which is deterministic, so the rows after a resume are
exactly the rows an uninterrupted run would have produced. Shuffling is windowed for the
same reason: a window of documents (or rows) is produced, permuted with a seed that
depends only on its position, and handed out; the checkpoint records where the window
starts and how much of it was used.

Row semantics (fixed rows and varlen alike): a row is ``seq_len`` consecutive tokens of the
document stream. A document longer than ``context_len`` is split into the fewest pieces of
at most ``context_len`` tokens, of near-equal length (so splitting never leaves a 1-token
tail); rows cut pieces further at their ends. Each resulting segment attends only to itself:
its position ids start at 0. The label of a token is the next token of the same document and
IGNORE_INDEX for a document's last token, so no target crosses a document boundary (a target
may cross a segment or row boundary inside a document: it is still the true next token).
With ``document_mask`` off (plain concatenation), each row is cut only into the fewest
near-equal segments of at most ``context_len`` tokens, and labels still stop at document ends.

A WholeDocument (a conversation of an SFT source, flame.data.sft) brings its own labels and is
never cut: its source keeps it within ``context_len`` tokens, and when it does not fit in what
is left of a row, that rest is padding (its own segment, IGNORE_INDEX labels) and the document
opens the next row. Cut at a row end, its tail would train in the next row without the turns
it answers.
"""

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX

from flame.base.errors import DataError, gist, preview
from flame.config.curriculum import Curriculum
from flame.data.tokenizer import Delimiters, id_outside_vocabulary

DOCUMENTS_PER_READ = 64  # documents read and tokenized together (batched tokenization is much faster)
ROW_COUNTERS = ("tokens", "documents", "dropped", "truncated", "padding")  # Row.source_<name>, per source


def _permutation(size: int, *seed: int) -> np.ndarray:
    return np.random.default_rng(list(seed)).permutation(size)


@dataclass(frozen=True)
class WholeDocument:
    """A document packed whole into one segment, with its own labels (IGNORE_INDEX where it trains nothing)."""

    tokens: np.ndarray
    labels: np.ndarray
    dropped: int = 0  # documents its source dropped as too long just before handing this one out
    truncated: bool = False  # cut to context_len by its source

    def __len__(self) -> int:
        return len(self.tokens)


class TokenizedSource:
    """A document stream tokenized in reads of ``window`` documents, one delimited document at a time.

    ``tokenize`` turns a list of texts into token id lists; None means the stream already
    holds token ids (pretokenized data), each below ``id_limit`` when given. ``shuffle_seed`` (a
    tuple) permutes each read. A record that cannot be encoded stops the run with a DataError naming
    it (the stream names its records: flame.data.streams), whatever the encoder raised.
    """

    def __init__(
        self,
        stream,
        tokenize: Callable[[list], list[list[int]]] | None,
        delimiters: Delimiters,
        window: int = DOCUMENTS_PER_READ,
        shuffle_seed: tuple[int, ...] | None = None,
        id_limit: int | None = None,
    ):
        self.stream, self.tokenize, self.delimiters = stream, tokenize, delimiters
        self.window, self.shuffle_seed, self.id_limit = window, shuffle_seed, id_limit
        self._read_start = copy.deepcopy(stream.state_dict())  # stream position of the current read
        self._reads = 0  # reads done before the current one (seeds its permutation)
        self._documents: list[np.ndarray] = []
        self._used = 0  # documents of the current read handed out
        self._skip = 0  # after a resume: documents of the re-read to pass over

    def next_document(self) -> np.ndarray:
        while self._used == len(self._documents):
            if self._documents:
                self._reads += 1
            self._read_start = copy.deepcopy(self.stream.state_dict())
            self._documents = self._encode_named(self.stream.read(self.window))
            if self.shuffle_seed is not None:
                order = _permutation(len(self._documents), *self.shuffle_seed, self._reads)
                self._documents = [self._documents[i] for i in order]
            self._used, self._skip = min(self._skip, len(self._documents)), 0
        document = self._documents[self._used]
        self._used += 1
        return document

    def _encode(self, documents: list) -> list:
        """A read's documents as delimited token arrays (subclasses may drop some: resuming re-encodes alike)."""
        ids = self.tokenize(documents) if self.tokenize is not None else documents
        return [np.asarray(self.delimiters.wrap(list(d)), dtype=np.int64) for d in ids]

    def _encode_named(self, documents: list) -> list:
        """``_encode``, with any failure a DataError naming the record that caused it."""
        try:
            encoded = self._encode(documents)
        except DataError:
            raise
        except Exception:
            self._refuse_the_failing_record(documents)
            raise  # no record fails alone
        if self.id_limit is not None and encoded:
            every = np.concatenate(encoded)  # the read's ids at once (delimiters are the tokenizer's own)
            if every.min() < 0 or every.max() >= self.id_limit:
                self._refuse_the_id_outside(documents)
        return encoded

    def _refuse_the_failing_record(self, documents: list) -> None:
        """Raise a DataError naming the first of ``documents`` that fails to encode alone (if one does)."""
        for index, document in enumerate(documents):
            try:
                self._encode([document])
            except Exception as cause:
                kind = "text" if self.tokenize is not None else "a list of token ids"
                if document is None:
                    what = "has no value (null)"
                elif self.tokenize is not None and not isinstance(document, str):
                    what = f"holds {type(document).__name__} {preview(document)}, not {kind}"
                else:
                    what = f"cannot be encoded: {gist(cause)} ({type(cause).__name__})"
                raise DataError(f"dataset {self.stream.name}: {self.stream.record_name(index, document)} {what}: fix "
                                "or remove that record, then run the same command again (the run resumes from its "
                                "last checkpoint)") from cause

    def _refuse_the_id_outside(self, documents: list) -> None:
        """Raise a DataError naming the first document holding an id outside the vocabulary (the read holds one)."""
        for index, document in enumerate(documents):
            ids = np.asarray(document, dtype=np.int64)
            outside = ids[(ids < 0) | (ids >= self.id_limit)]
            if len(outside):
                raise DataError(f"dataset {self.stream.name}: {self.stream.record_name(index, document)} "
                                f"{id_outside_vocabulary(int(outside[0]), self.id_limit)}")

    def state_dict(self) -> dict:
        return {"stream": self._read_start, "reads": self._reads, "used": self._used}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self._read_start, self._reads = state["stream"], state["reads"]
        self._documents, self._used, self._skip = [], 0, state["used"]


class DocumentMixer:
    """Picks the source of each next document so that ``probabilities`` hold.

    unit="documents": each document is drawn at random with these probabilities.
    unit="tokens": the source furthest below its share of the tokens so far goes next
    (deterministic; token fractions stay within one document of the target).
    """

    def __init__(self, sources: Sequence[TokenizedSource], probabilities: Sequence[float], seed: int, unit: str,
                 phases: Sequence[Sequence[float]] = ()):
        self.sources, self.unit = list(sources), unit
        # the mixture of each data phase (flame.config.curriculum), the run's own first
        self.mixtures = [np.asarray(p, dtype=np.float64) / np.sum(p) for p in (probabilities, *phases)]
        self.phase = 0
        self.probabilities = self.mixtures[0]
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.tokens = [0] * len(self.sources)  # of this phase: its shares count from its start

    def set_phase(self, phase: int) -> None:
        if phase != self.phase:
            self.phase, self.probabilities, self.tokens = phase, self.mixtures[phase], [0] * len(self.sources)

    def next_document(self) -> tuple[int, np.ndarray]:
        """(source index, tokens) of the next document."""
        if len(self.sources) == 1:
            index = 0
        elif self.unit == "tokens":
            below = self.probabilities * sum(self.tokens) - np.asarray(self.tokens)
            index = int(np.argmax(np.where(self.probabilities > 0, below, -np.inf)))  # a source left out stays out
        else:
            index = int(self.rng.choice(len(self.sources), p=self.probabilities))
        document = self.sources[index].next_document()
        self.tokens[index] += len(document)
        return index, document

    def state_dict(self) -> dict:
        return {
            "rng": copy.deepcopy(self.rng.bit_generator.state),
            "sources": [source.state_dict() for source in self.sources],
            "tokens": list(self.tokens),
            "phase": self.phase,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ValueError(f"checkpoint has {len(state['sources'])} data sources, the config {len(self.sources)}")
        self.rng.bit_generator.state = state["rng"]
        for source, source_state in zip(self.sources, state["sources"]):
            source.load_state_dict(source_state)
        self.phase = state.get("phase", 0)  # a state saved before data phases existed is in the run's mixture
        self.probabilities = self.mixtures[self.phase]
        self.tokens = list(state["tokens"])


@dataclass
class Row:
    """One packed row and what it holds."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segments: list[int]  # lengths of the attention segments, in order
    source_tokens: np.ndarray  # tokens of the row from each source
    source_documents: np.ndarray  # documents starting in the row, per source
    source_dropped: np.ndarray  # per source: documents dropped as too long (WholeDocument.dropped)
    source_truncated: np.ndarray  # per source: documents cut to context_len
    source_padding: np.ndarray  # per source: padding put before its next whole document, which did not fit


def balanced_pieces(length: int, context_len: int) -> list[int]:
    """The fewest pieces of at most ``context_len`` tokens covering ``length``, near-equal in size."""
    count = -(-length // context_len)
    base, extra = divmod(length, count)
    return [base + 1] * extra + [base] * (count - extra)


class Packer:
    """Cuts the document stream into rows of ``seq_len`` tokens (see the module docstring).

    With a ``curriculum`` (flame.config.curriculum), each row is made for the step that will train it: its context
    length and data phase are that step's. A document keeps the pieces it was cut into when it was drawn.
    """

    def __init__(
        self, documents: DocumentMixer, seq_len: int, context_len: int, document_mask: bool = True, pad_id: int = 0,
        curriculum: Curriculum = Curriculum(),
    ):
        self.documents, self.seq_len, self.context_len = documents, seq_len, context_len
        self.document_mask, self.pad_id, self.curriculum = document_mask, pad_id, curriculum
        self._context = context_len  # of the row being made
        self._document_context = context_len  # the current document's pieces were cut for this context
        self.sources = len(documents.sources)
        self._document_start = documents.state_dict()  # mixer position before the current document
        self._document: np.ndarray | None = None
        self._labels: np.ndarray | None = None  # a WholeDocument's own labels; None: the next tokens
        self._source = 0
        self._offset = 0  # tokens of the current document already packed
        self._piece_ends: list[int] = []  # where the current document's pieces end

    def _next_document(self) -> np.ndarray | WholeDocument:
        self._document_start = self.documents.state_dict()
        self._source, document = self.documents.next_document()
        whole = isinstance(document, WholeDocument)
        self._document, self._labels = (document.tokens, document.labels) if whole else (document, None)
        self._offset = 0
        # Python ints: the segment lengths come from them, and a batch's longest one must stay on the host (a
        # numpy int becomes a tensor in the DataLoader, goes to the GPU, and every attention call reads it back)
        self._document_context = self._context
        self._piece_ends = np.cumsum(balanced_pieces(len(self._document), self._context)).tolist()
        return document

    def next_row(self, step: int | None = None) -> Row:
        """The next row; ``step``: the step it is for (read only with a curriculum)."""
        if self.curriculum and step is not None:
            self._context = self.curriculum.context_len(step, self.context_len)
            self.documents.set_phase(self.curriculum.phase(step))
        inputs, labels, segments = [], [], []
        counts = {name: np.zeros(self.sources, dtype=np.int64) for name in ROW_COUNTERS}
        filled = 0
        while filled < self.seq_len:
            if self._document is None or self._offset == len(self._document):
                drawn = self._next_document()
                if isinstance(drawn, WholeDocument):  # counted as drawn: a resume re-draws it uncounted
                    counts["dropped"][self._source] += drawn.dropped
                    counts["truncated"][self._source] += drawn.truncated
            document, start = self._document, self._offset
            if self._labels is not None and filled and len(document) > self.seq_len - filled:
                padding = self.seq_len - filled  # the whole document opens the next row
                inputs.append(np.full(padding, self.pad_id, dtype=np.int64))
                labels.append(np.full(padding, IGNORE_INDEX, dtype=np.int64))
                segments.append(padding)
                counts["padding"][self._source] += padding
                break
            counts["documents"][self._source] += start == 0
            piece_end = next(end for end in self._piece_ends if end > start)
            end = min(start + self.seq_len - filled, piece_end if self.document_mask else len(document))
            inputs.append(document[start:end])
            if self._labels is not None:
                targets = self._labels[start:end]
            else:
                targets = document[start + 1 : end + 1]
                if end == len(document):
                    targets = np.append(targets, IGNORE_INDEX)
            labels.append(targets)
            segments.append(end - start)
            counts["tokens"][self._source] += end - start
            filled += end - start
            self._offset = end
        if not self.document_mask:  # plain concatenation: the row in near-equal context_len segments
            segments = balanced_pieces(self.seq_len, self._context) if self._context < self.seq_len else [self.seq_len]
        positions = np.concatenate([np.arange(length) for length in segments])
        return Row(np.concatenate(inputs), np.concatenate(labels), positions, segments,
                   **{f"source_{name}": count for name, count in counts.items()})

    def state_dict(self) -> dict:
        return {"document_start": self._document_start, "offset": self._offset, "started": self._document is not None,
                "context": self._document_context}

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["document_start"])
        self._document, self._labels, self._offset = None, None, 0
        self._context = state.get("context", self.context_len)  # the pieces of the document it was inside
        if state["started"]:
            self._next_document()
            self._offset = state["offset"]


class RowShuffler:
    """Hands out the packer's rows in windows of ``window`` rows, each permuted by its position."""

    def __init__(self, packer: Packer, window: int, seed: tuple[int, ...]):
        self.packer, self.window, self.seed = packer, window, seed
        self._window_start = packer.state_dict()
        self._windows = 0
        self._window_step: int | None = None  # the step the current window's rows were made for
        self._rows: list[Row] = []
        self._used = 0

    def next_row(self, step: int | None = None) -> Row:
        """The next row of the window; a new window is made for ``step`` (the curriculum's step, if any)."""
        if self._used == len(self._rows):
            if self._rows:
                self._windows += 1
            self._window_start, self._window_step = self.packer.state_dict(), step
            rows = [self.packer.next_row(step) for _ in range(self.window)]
            self._rows = [rows[i] for i in _permutation(self.window, *self.seed, self._windows)]
            self._used = 0
        row = self._rows[self._used]
        self._used += 1
        return row

    def state_dict(self) -> dict:
        return {"window_start": self._window_start, "windows": self._windows, "used": self._used,
                "window_step": self._window_step}

    def load_state_dict(self, state: dict) -> None:
        self.packer.load_state_dict(state["window_start"])
        self._window_start, self._windows, self._rows, self._used = state["window_start"], state["windows"], [], 0
        if state["used"]:
            self.next_row(state.get("window_step"))  # re-produce the window as it was made, then skip what was used
            self._used = state["used"]


def collate_rows(rows: list[Row]) -> tuple[dict, torch.Tensor]:
    """Rows -> (model inputs, labels) in torchtitan's batch format, with cu_seqlens over all rows."""
    input_ids = torch.from_numpy(np.stack([row.input_ids for row in rows]))
    labels = torch.from_numpy(np.stack([row.labels for row in rows]))
    position_ids = torch.from_numpy(np.stack([row.position_ids for row in rows]))
    lengths = [length for row in rows for length in row.segments]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    inputs = {
        "input": input_ids,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(lengths),
    }
    return inputs, labels
