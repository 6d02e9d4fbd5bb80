"""Real packed varlen batches for the GPU benchmarks: the builtin Python-stdlib corpus, tokenized
with the builtin BPE tokenizer, documents (EOS-terminated) packed into rows of ``tokens`` with
documents longer than ``context_len`` split, as flame's loader does. Works with no network."""

import glob
import json

import torch

from flame.data import builtin
from flame.data.tokenizer import load_tokenizer


def packed_batches(tokens: int, count: int, context_len: int = 4096, device: str = "cuda"):
    """``count`` batches of (input_ids [1, tokens], labels [1, tokens], cu_seqlens, max_seqlen)."""
    tokenizer = load_tokenizer("builtin:python-stdlib-bpe")
    paths = sorted(glob.glob(builtin.resolve("builtin:python-stdlib") + "/*.jsonl"))
    texts = (json.loads(line)["text"] for path in paths for line in open(path))
    batches, ids, lengths = [], [], []
    for text in texts:
        document = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        while document:
            piece, document = document[: min(context_len, tokens + 1 - len(ids))], document[context_len:]
            ids += piece
            lengths.append(len(piece))
            if len(ids) > tokens:  # a row of tokens + 1 (for the shifted targets)
                lengths[-1] -= len(ids) - tokens
                batch = torch.tensor(ids[: tokens + 1], device=device)
                cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
                batches.append((batch[None, :-1], batch[None, 1:], cu_seqlens, max(lengths)))
                if len(batches) == count:
                    return batches
                ids, lengths = [], []
                break
    raise RuntimeError("the builtin corpus is too small for that many batches")
