"""Built-in corpus and tokenizer that exist on every machine, with no download.

``builtin:python-stdlib`` is the source code (with its docstrings and comments) of the
running Python's standard library, written as jsonl shards. A document is one top-level
unit of a file (its header, a function, a class), so that even a small batch mixes many
files: whole files (thousands of tokens each) would fill a debug batch with one file.
``builtin:python-stdlib-bpe`` is a byte-level BPE tokenizer trained on that text. Both are
built on first use into the cache (``$FLAME_CACHE``, default ``~/.cache/flame``) and reused.
Building is atomic (write to a temporary folder, then rename), so concurrent ranks or runs
never see half a corpus.
"""

import json
import os
import re
import shutil
import sysconfig
import tempfile
from pathlib import Path

from flame.base.errors import ConfigError

PREFIX = "builtin:"
CORPUS = "python-stdlib"
TOKENIZER = "python-stdlib-bpe"
_VERSION = "v1"
_SHARDS = 8
_VOCAB_SIZE = 4096
_EOS = "<|endoftext|>"
_TOP_LEVEL = re.compile(r"^(?=(?:@|def |async def |class ))", re.MULTILINE)
_MIN_DOCUMENT_CHARS = 300
_MAX_DOCUMENT_CHARS = 4000


def cache_dir() -> Path:
    return Path(os.environ.get("FLAME_CACHE", Path.home() / ".cache" / "flame"))


def is_builtin(spec: str) -> bool:
    return spec.startswith(PREFIX)


def resolve(spec: str) -> str:
    """Path of the built-in dataset or tokenizer named by ``spec``, building it if needed."""
    name = spec.removeprefix(PREFIX)
    builders = {CORPUS: _build_corpus, TOKENIZER: _build_tokenizer}
    if name not in builders:
        raise ConfigError(f"unknown built-in '{spec}'; available: {', '.join(PREFIX + n for n in builders)}")
    target = cache_dir() / "builtin" / f"{name}-{_VERSION}"
    if not target.exists():
        _build_atomically(target, builders[name])
    return str(target)


def _build_atomically(target: Path, build) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        os.rename(staging, target)
    except OSError:
        if not target.exists():  # a concurrent builder did not win the rename either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _build_corpus(out: Path) -> None:
    files = _stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    shards = [open(out / f"train-{i:05d}-of-{_SHARDS:05d}.jsonl", "w") for i in range(_SHARDS)]
    index = 0
    for path in files:
        for text in _top_level_units(path.read_text(encoding="utf-8", errors="replace")):
            record = {"text": text, "source": str(path.relative_to(root))}
            shards[index % _SHARDS].write(json.dumps(record) + "\n")
            index += 1
    for shard in shards:
        shard.close()


def _top_level_units(source: str) -> list[str]:
    """A file cut before each top-level def/class/decorator; short pieces join the next one,
    long ones (data tables, huge classes) are cut at line ends into pieces of at most 4000 chars."""
    units, pending = [], ""
    for piece in _TOP_LEVEL.split(source):
        pending += piece
        if len(pending) >= _MIN_DOCUMENT_CHARS:
            units.extend(_cut_lines(pending))
            pending = ""
    if pending.strip():
        units.extend(_cut_lines(pending))
    return units


def _cut_lines(text: str) -> list[str]:
    pieces, current = [], ""
    for line in text.splitlines(keepends=True):
        if current and len(current) + len(line) > _MAX_DOCUMENT_CHARS:
            pieces.append(current)
            current = ""
        current += line
    return pieces + [current] if current else pieces


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(resolve(PREFIX + CORPUS))
    texts = []
    for shard in sorted(corpus.glob("*.jsonl"))[: _SHARDS // 4]:  # a quarter of the text is plenty
        texts.extend(json.loads(line)["text"] for line in open(shard))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=_EOS)
    wrapped.save_pretrained(out)
