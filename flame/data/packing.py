"""Documents -> tokens -> packed rows, each stage with a small positional state.

Every state here is a *position* (where a stream stands, how many documents of a read were
used, how far into a document packing got), never a copy of tokens: resuming re-reads and
re-tokenizes from that position, which is deterministic, so the rows after a resume are
exactly the rows an uninterrupted run would have produced.

Row semantics (fixed rows and varlen alike): a row is ``seq_len`` consecutive tokens of the
document stream. It is cut into segments at document boundaries and at the row's end, and a
segment that would grow past ``context_len`` tokens is cut there (counting from the
segment's start, which may be a row start inside a document); position ids restart at 0 in
each segment. The label
of a token is the next token of the same document and IGNORE_INDEX for a document's last
token, so no target crosses a document boundary (a target may cross a segment or row
boundary inside a document: it is still the true next token).
"""

import copy
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX

from flame.data.tokenizer import Delimiters

DOCUMENTS_PER_READ = 64  # documents read and tokenized together (batched tokenization is much faster)


class TokenizedSource:
    """A document stream tokenized in batches, handing out one delimited document at a time."""

    def __init__(self, stream, tokenize: Callable[[list], list[list[int]]], delimiters: Delimiters):
        self.stream, self.tokenize, self.delimiters = stream, tokenize, delimiters
        self._read_start = copy.deepcopy(stream.state_dict())  # stream position of the current read
        self._documents: list[np.ndarray] = []
        self._used = 0  # documents of the current read handed out
        self._skip = 0  # after a resume: documents of the re-read to pass over

    def next_document(self) -> np.ndarray:
        while self._used == len(self._documents):
            self._read_start = copy.deepcopy(self.stream.state_dict())
            texts = self.stream.read(DOCUMENTS_PER_READ)
            self._documents = [np.asarray(self.delimiters.wrap(ids), dtype=np.int64) for ids in self.tokenize(texts)]
            self._used, self._skip = min(self._skip, len(self._documents)), 0
        document = self._documents[self._used]
        self._used += 1
        return document

    def state_dict(self) -> dict:
        return {"stream": self._read_start, "used": self._used}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self._read_start, self._documents, self._used, self._skip = state["stream"], [], 0, state["used"]


class DocumentMixer:
    """Draws each next document from one of several sources with fixed probabilities."""

    def __init__(self, sources: Sequence[TokenizedSource], probabilities: Sequence[float], seed: int):
        self.sources = list(sources)
        weights = np.asarray(probabilities, dtype=np.float64)
        self.probabilities = weights / weights.sum()
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.documents_per_source = [0] * len(self.sources)

    def next_document(self) -> np.ndarray:
        index = 0 if len(self.sources) == 1 else int(self.rng.choice(len(self.sources), p=self.probabilities))
        self.documents_per_source[index] += 1
        return self.sources[index].next_document()

    def state_dict(self) -> dict:
        return {
            "rng": copy.deepcopy(self.rng.bit_generator.state),
            "sources": [source.state_dict() for source in self.sources],
            "documents_per_source": list(self.documents_per_source),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ValueError(f"checkpoint has {len(state['sources'])} data sources, the config {len(self.sources)}")
        self.rng.bit_generator.state = state["rng"]
        for source, source_state in zip(self.sources, state["sources"]):
            source.load_state_dict(source_state)
        self.documents_per_source = list(state["documents_per_source"])


class Packer:
    """Cuts the document stream into rows of ``seq_len`` tokens (see the module docstring)."""

    def __init__(self, documents: DocumentMixer, seq_len: int, context_len: int):
        self.documents, self.seq_len, self.context_len = documents, seq_len, context_len
        self._document_start = documents.state_dict()  # mixer position before the current document
        self._document: np.ndarray | None = None
        self._offset = 0  # tokens of the current document already packed

    def _next_document(self) -> None:
        self._document_start = self.documents.state_dict()
        self._document, self._offset = self.documents.next_document(), 0

    def next_row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """(input ids, labels, position ids, segment lengths) of the next row."""
        inputs, labels, positions, segments = [], [], [], []
        filled = 0
        while filled < self.seq_len:
            if self._document is None or self._offset == len(self._document):
                self._next_document()
            document, start = self._document, self._offset
            length = min(self.seq_len - filled, len(document) - start, self.context_len)
            end = start + length
            inputs.append(document[start:end])
            targets = document[start + 1 : end + 1]
            if end == len(document):
                targets = np.append(targets, IGNORE_INDEX)
            labels.append(targets)
            positions.append(np.arange(length))
            segments.append(length)
            filled += length
            self._offset = end
        return np.concatenate(inputs), np.concatenate(labels), np.concatenate(positions), segments

    def state_dict(self) -> dict:
        return {"document_start": self._document_start, "offset": self._offset, "started": self._document is not None}

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["document_start"])
        self._document, self._offset = None, 0
        if state["started"]:
            self._next_document()
            self._offset = state["offset"]


def collate_rows(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]]) -> tuple[dict, torch.Tensor]:
    """Rows -> (model inputs, labels) in torchtitan's batch format, with cu_seqlens over all rows."""
    input_ids = torch.from_numpy(np.stack([row[0] for row in rows]))
    labels = torch.from_numpy(np.stack([row[1] for row in rows]))
    position_ids = torch.from_numpy(np.stack([row[2] for row in rows]))
    lengths = [length for row in rows for length in row[3]]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    inputs = {
        "input": input_ids,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": torch.tensor(max(lengths), dtype=torch.int32),
    }
    return inputs, labels
