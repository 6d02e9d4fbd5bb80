"""Data: dataset specs -> HF datasets or token files (token_arrays) -> per-rank shards -> tokenized documents
(one record per data format, formats/) -> packed rows -> the per-rank stateful loader; the validation set."""
