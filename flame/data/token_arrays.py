"""Token ids other tools wrote, read in place as documents (their formats: flame.data.formats.tokens).

- Megatron-LM's indexed datasets: a ``.bin`` of token ids and its ``.idx`` (the MMIDIDX index: a
  header, then every sequence's length and byte offset, then the sequence index where each
  document starts). A document is Megatron's document: its sequences, in order.
- Flat arrays of token ids: a raw file (nanoGPT's ``train.bin``, OLMo's headerless ``.npy``
  memmaps), a ``.npy`` with its header, or llm.c's ``.bin`` (256 int32s of header). A document
  ends after each boundary id (the EOS, or --training.separator_token's), which stays with the
  document it ends, as flame's own delimiter does for text. One scan finds them as the source opens.

Both are a map-style dataset of one column, ``input_ids`` (``TokenArray``), that the text format's
machinery reads as token ids: delimited by flame's delimiters (not doubled where a document has
them), read in the seeded per-epoch order of every map-style source, dealt to the data shards and
resumed by position (flame.data.streams.MapStream). Files are memory-mapped on first use and a
pickled copy (a dataloader worker's) maps its own, so that no tokens travel with a pickle.
"""

import glob
import os
import struct
from abc import ABC, abstractmethod

import numpy as np
from torchtitan.tools.logging import logger

from flame.base.errors import ConfigError

COLUMN = "input_ids"
SAMPLE_WINDOWS, SAMPLE_TOKENS = 16, 4096  # the ids checked against the vocabulary, spread over a file
SCAN_TOKENS = 1 << 24  # ids compared at a time while finding document ends
RAW_DTYPES = ("uint16", "uint32")  # --training.token_dtype's choices besides auto

# Megatron-LM's index header: magic, version (1), dtype code, sequences, document indices (documents + 1)
MEGATRON_HEADER = struct.Struct("<9sQBQQ")
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
# llm.c's (and modded-nanogpt's) .bin: 256 int32s (magic, version, token count, ...), then the ids
LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {(20240520, 1): "uint16", (20240801, 7): "uint32"}
NPY_MAGIC = b"\x93NUMPY"


def _matches(path: str) -> list[str]:
    """The paths a dataset entry names: a glob's matches (sorted), else the path itself, existing or not."""
    return sorted(glob.glob(path)) if glob.has_magic(path) else [path]


def is_megatron(path: str) -> bool:
    """A Megatron pair: a .idx, a .bin beside its .idx, or a prefix that is no file itself but has either."""
    for match in _matches(path)[:1]:
        stem, extension = os.path.splitext(match)
        if extension in (".idx", ".bin"):
            return extension == ".idx" or os.path.isfile(stem + ".idx")
        return not os.path.exists(match) and any(os.path.isfile(match + end) for end in (".idx", ".bin"))
    return False


def is_flat(path: str) -> bool:
    """A flat token file: a .npy, or a .bin without a Megatron .idx beside it."""
    for match in _matches(path)[:1]:
        stem, extension = os.path.splitext(match)
        return extension == ".npy" or extension == ".bin" and not os.path.isfile(stem + ".idx")
    return False


class TokenFile(ABC):
    """One file's documents; ``tokens()`` is the file's ids, memory-mapped on first use."""

    path: str
    dtype: np.dtype
    offset: int  # bytes before the first id
    count: int  # ids in the file

    @abstractmethod
    def __len__(self) -> int:
        """Its documents."""

    @abstractmethod
    def document(self, index: int) -> np.ndarray:
        """The ids of its document ``index``."""

    def tokens(self) -> np.ndarray:
        return self._map("tokens", self.path, self.dtype, self.offset, self.count)

    def _map(self, name: str, path: str, dtype, offset: int, count: int) -> np.ndarray:
        maps = self.__dict__.setdefault("_maps", {})
        if name not in maps:
            maps[name] = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
        return maps[name]

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_maps"}

    def check_ids(self, vocab_size: int, tokenizer: str, fix: str) -> None:
        """Ids spread over the file are ids of ``tokenizer`` (0 <= id < vocab_size), else ConfigError with ``fix``."""
        tokens = self.tokens()
        starts = np.unique(np.linspace(0, max(self.count - SAMPLE_TOKENS, 0), SAMPLE_WINDOWS).astype(np.int64))
        sample = np.concatenate([tokens[start : start + SAMPLE_TOKENS] for start in starts])
        low, high = int(sample.min()), int(sample.max())
        if low < 0 or high >= vocab_size:
            wrong = low if low < 0 else high
            raise ConfigError(f"{self.path}: token id {wrong} (in a sample of {len(sample)} {self.dtype} ids) is not "
                              f"one of the {vocab_size} ids of tokenizer {tokenizer}: {fix}")


class FlatFile(TokenFile):
    """A flat array of ids (``dtype`` with its byte order); a document ends after each ``boundary`` id, and at the
    end of the file."""

    def __init__(self, path: str, dtype: str, offset: int, count: int, boundary: int):
        self.path, self.dtype, self.offset, self.count = path, np.dtype(dtype), offset, count
        if boundary > np.iinfo(self.dtype).max:
            raise ConfigError(f"{path}: the document boundary id {boundary} does not fit its {self.dtype} ids: "
                              "set --training.token_dtype uint32")
        tokens = self.tokens()
        head = tokens[: min(count, 1 << 16) // 2 * 2]  # before the scan: a file read with the wrong dtype stops here
        if offset == 0 and self.dtype == np.uint16 and len(head) >= 64 and not head[1::2].any() and head.any():
            raise ConfigError(f"{path}: every other id of its first {len(head)} is 0, as when uint32 ids are read "
                              "as uint16: set --training.token_dtype uint32")
        ends = [np.flatnonzero(tokens[start : start + SCAN_TOKENS] == boundary) + (start + 1)
                for start in range(0, count, SCAN_TOKENS)]
        bounds = np.concatenate([np.zeros(1, dtype=np.int64), *ends])
        self.bounds = bounds if bounds[-1] == count else np.append(bounds, count)
        if len(self.bounds) == 2 and count > 100_000:
            logger.warning(f"{path}: no document boundary (id {boundary}) in its {count} ids, so it is one document, "
                           "cut at --training.context_len; name the token that ends its documents with "
                           "--training.separator_token")

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def document(self, index: int) -> np.ndarray:
        return self.tokens()[self.bounds[index] : self.bounds[index + 1]]


def _flat_layout(path: str, given: str | None, default: str) -> tuple[str, int, int]:
    """(dtype, header bytes, ids) of a flat file: from its .npy or llm.c header, else ``given`` or ``default``."""
    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        head = stream.read(LLMC_HEADER_BYTES)
        stream.seek(0)
        if head.startswith(NPY_MAGIC):
            version = np.lib.format.read_magic(stream)
            reader = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = reader(stream)
            if dtype.kind not in "iu" or fortran and len(shape) > 1:
                order = "Fortran-ordered " if dtype.kind in "iu" else ""
                raise ConfigError(f"{path} holds a {order}{dtype} array, not token ids: write the ids as a flat "
                                  "uint16 or uint32 array")
            return _agreed(path, dtype.str, given, "its .npy header"), stream.tell(), int(np.prod(shape))
    ints = np.frombuffer(head[:12], dtype="<i4") if len(head) == LLMC_HEADER_BYTES else ()
    if len(ints) and (int(ints[0]), int(ints[1])) in LLMC_DTYPES:
        dtype = _agreed(path, LLMC_DTYPES[int(ints[0]), int(ints[1])], given, "its llm.c header")
        return dtype, LLMC_HEADER_BYTES, int(ints[2])
    dtype = given or default
    if size % np.dtype(dtype).itemsize:
        raise ConfigError(f"{path} holds {size} bytes, not a whole number of {dtype} ids: set --training.token_dtype "
                          f"to the dtype the file was written with ({' or '.join(RAW_DTYPES)})")
    return dtype, 0, size // np.dtype(dtype).itemsize


def _agreed(path: str, dtype: str, given: str | None, where: str) -> str:
    if given is not None and np.dtype(given).itemsize != np.dtype(dtype).itemsize:
        raise ConfigError(f"{path} holds {np.dtype(dtype)} ids ({where} says so), not {given}: drop "
                          "--training.token_dtype (the file says its dtype), or give the file written with the dtype "
                          "you meant")
    return dtype


def flat_files(path: str, given: str | None, default: str, boundary: int) -> list[FlatFile]:
    """The flat token files ``path`` names (a glob: every match), their layouts read and checked."""
    files = []
    for match in _matches(path):
        if not os.path.isfile(match):
            raise ConfigError(f"token file {match} does not exist; give a .npy or .bin of token ids (or a glob of "
                              "them)")
        dtype, offset, count = _flat_layout(match, given, default)
        if os.path.getsize(match) < offset + count * np.dtype(dtype).itemsize:
            raise ConfigError(f"{match}: its header promises {count} {dtype} ids and the file is shorter: it was cut "
                              "short; write it again")
        if count == 0:
            raise ConfigError(f"token file {match} holds no token ids: remove it from the datasets")
        files.append(FlatFile(match, dtype, offset, count, boundary))
    if not files:
        raise ConfigError(f"{path} matches no files; give a .npy or .bin of token ids (or a glob of them)")
    return files


class MegatronFile(TokenFile):
    """A Megatron-LM .bin/.idx pair (``prefix``.bin, ``prefix``.idx), its index checked against its data."""

    def __init__(self, prefix: str):
        self.path, self.index_path, self.offset = prefix + ".bin", prefix + ".idx", 0
        for name in (self.index_path, self.path):
            if not os.path.isfile(name):
                raise ConfigError(f"Megatron dataset {prefix}: {name} does not exist; give the prefix of a .bin/.idx "
                                  "pair (Megatron-LM's preprocess_data.py writes both)")
        with open(self.index_path, "rb") as stream:
            head = stream.read(MEGATRON_HEADER.size)
        if len(head) < MEGATRON_HEADER.size or not head.startswith(MEGATRON_MAGIC):
            raise ConfigError(f"{self.index_path} is not a Megatron index (no MMIDIDX header): give the .idx "
                              "Megatron-LM wrote, or --training.data_format numpy for a flat token file")
        _, version, code, self.sequences, indices = MEGATRON_HEADER.unpack(head)
        if version != 1:
            raise ConfigError(f"{self.index_path}: Megatron index version {version}; flame reads version 1 "
                              "(Megatron-LM's MMIDIDX): write it again with Megatron-LM's preprocess_data.py")
        dtype = MEGATRON_DTYPES.get(code)
        if dtype is None or np.dtype(dtype).kind not in "iu":
            raise ConfigError(f"{self.index_path}: dtype code {code} ({dtype or 'unknown'}) is not one of token ids: "
                              "give a Megatron dataset of token ids (uint16 or int32)")
        self.dtype, self.documents = np.dtype(dtype), indices - 1
        expected = MEGATRON_HEADER.size + 12 * self.sequences + 8 * indices
        size = os.path.getsize(self.index_path)
        if size not in (expected, expected + self.sequences):  # + one mode byte per sequence: multimodal data
            raise ConfigError(f"{self.index_path} holds {size} bytes, its header promises {expected}: the index is "
                              "cut short or damaged; write it again")
        if self.documents < 1 or self.sequences < 1:
            raise ConfigError(f"Megatron dataset {prefix} holds no documents: remove it from the datasets")
        starts = self._index("starts")
        if starts[0] != 0 or starts[-1] != self.sequences:
            raise ConfigError(f"{self.index_path}: its documents do not span its {self.sequences} sequences: the index "
                              "is damaged; write it again")
        data_bytes = int(self._index("pointers")[-1]) + int(self._index("lengths")[-1]) * self.dtype.itemsize
        if os.path.getsize(self.path) != data_bytes:
            raise ConfigError(f"{self.path} holds {os.path.getsize(self.path)} bytes, but {self.index_path} lists "
                              f"{data_bytes} bytes of {self.dtype} ids: the two files are not one pair (or one was "
                              "cut short); give a .bin with the .idx written with it")
        self.count = data_bytes // self.dtype.itemsize

    def _index(self, name: str) -> np.ndarray:
        """The index's arrays: sequence lengths, sequence byte offsets, each document's first sequence (and the end)."""
        lengths = MEGATRON_HEADER.size
        offset, dtype, count = {"lengths": (lengths, np.int32, self.sequences),
                                "pointers": (lengths + 4 * self.sequences, np.int64, self.sequences),
                                "starts": (lengths + 12 * self.sequences, np.int64, self.documents + 1)}[name]
        return self._map(name, self.index_path, dtype, offset, count)

    def __len__(self) -> int:
        return self.documents

    def document(self, index: int) -> np.ndarray:
        first, last = self._index("starts")[index : index + 2].tolist()
        tokens, size = self.tokens(), self.dtype.itemsize
        pieces = [tokens[pointer // size : pointer // size + length] for pointer, length in
                  zip(self._index("pointers")[first:last].tolist(), self._index("lengths")[first:last].tolist())]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else tokens[:0]


def megatron_files(path: str) -> list[MegatronFile]:
    """The Megatron pairs ``path`` names: a prefix, its .bin or .idx, or a glob of them (one pair per prefix)."""
    prefixes = sorted({os.path.splitext(match)[0] if match.endswith((".idx", ".bin")) else match
                       for match in _matches(path)})
    if not prefixes:
        raise ConfigError(f"{path} matches no files; give a Megatron .bin/.idx prefix (or a glob of .idx files)")
    return [MegatronFile(prefix) for prefix in prefixes]


class TokenArray:
    """Token files' documents as a map-style dataset of one column, ``input_ids`` (a list of ints per row).

    Row ``i`` is the i-th document of the files in order; ``select`` keeps some (the validation set's).
    """

    def __init__(self, files: list[TokenFile], rows: np.ndarray | None = None):
        self.files, self.rows = files, rows
        self.starts = np.cumsum([0, *(len(file) for file in files)])

    def __len__(self) -> int:
        return int(self.starts[-1]) if self.rows is None else len(self.rows)

    def __getitem__(self, key) -> dict:
        if isinstance(key, (int, np.integer)):
            return {COLUMN: self._ids(int(key))}
        return {COLUMN: [self._ids(int(index)) for index in key]}

    def _ids(self, index: int) -> list[int]:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        if self.rows is not None:
            index = int(self.rows[index])
        file = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.files[file].document(index - int(self.starts[file])).tolist()

    def select(self, indices) -> "TokenArray":
        picked = np.asarray(list(indices), dtype=np.int64)
        return TokenArray(self.files, picked if self.rows is None else self.rows[picked])

    def select_columns(self, columns: list[str]) -> "TokenArray":
        if list(columns) != [COLUMN]:
            raise ValueError(f"a token array has one column, {COLUMN}, not {columns}")
        return self
