"""The support table, generated from the capability records (flame.models.support).

    flame models                  the table, as plain text (python -m flame.models in a checkout)
    flame models --markdown       docs/models.md's table (with its legend)
    flame models --write_docs     rewrite docs/models.md's table between its markers
"""

from pathlib import Path

from flame.base.cli import ArgumentParser
from flame.models.support import (
    FLA_COMPILED_SLOWER,
    GENERIC,
    RECORDS,
    Documents,
    ModelSupport,
)

MODELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN = "<!-- BEGIN support table: python -m flame.models --markdown -->"
END = "<!-- END support table -->"
COLUMNS = ("model type", "from", "family", "documents isolated", "compile", "TP", "CP", "needs", "HF export", "notes")
_ISOLATED = {
    Documents.ATTENTION: "yes (flame's attention)",
    Documents.CU_SEQLENS: "yes (cu_seqlens)",
    Documents.ROWS_WHOLE: "no (rows whole)",
}
_LIBRARIES = ("transformers", "custom_models", "fla")
LEGEND = """\
- **documents isolated**: whether a token sees only its own document when documents are packed into rows:
  through flame's document attention (transformers models), through `cu_seqlens` over one row (fla), or
  not: each row is one sequence (flame warns; `--training.no-varlen` with short rows limits the mixing).
- **compile**: `--training.compile` (**eager**: its compiled blocks train slower than eager, so the flag
  leaves them eager and the log says so. Every fla type: fla runs its token mixers outside the compiled
  graph, and each fla type measured at 340M trained slower compiled; the notes name the measured ones, and
  [performance](performance.md#compiled-against-eager) gives their figures; **no**: its blocks fail to
  compile, so the flag leaves them eager too and the log says why: a job file that compiles, like the
  standard run's, trains every type); **TP**, **CP**: `--parallelism.tensor_parallel_degree` and
  `--parallelism.context_parallel_degree` (softmax attention all-gathers K/V over the CP ranks; fla's CP
  kernels pass the recurrent state between them). What a type cannot do is refused at preflight.
- **needs**: a CUDA GPU for fla's Triton kernels, bf16 compute for kernels that refuse float32 (on GPUs,
  with FSDP under tensor or pipeline parallelism), packages fla does not install (preflight prints the
  command). A model with a learned position table is refused when this job's documents (rows, for types
  that keep rows whole) are longer than it.
- **HF export**: the architecture `--checkpoint.export_as auto` (the default) exports under, and whether
  loading it without flame needs flash-attn: fla's layers named here call it (with an option: when the
  model config sets it), and refuse to build or run without it unless `flame.register()` runs first. fla's
  `transformer` exports as `llama`, which loads in plain transformers.
- Any other transformers causal LM trains like the last row; these rows come from
  `flame/models/support.py`."""


def export_cell(record: ModelSupport) -> str:
    """What --checkpoint.export_as auto writes for this type, and what loading it needs besides transformers and fla."""
    if record.exports_as_llama:
        return "llama"
    callers = [c.layer + (f" with {c.option}" if c.option else "") for c in record.flash_attn_callers]
    return f"native; flash-attn for {', '.join(callers)}" if callers else "native"


def row(record: ModelSupport) -> tuple[str, ...]:
    """The table's cells for one record."""
    needs = []
    if record.cuda_only:
        needs.append("CUDA GPU")
    if record.float32_refused_by:
        needs.append(f"bf16 ({record.float32_refused_by})")
    needs += [f"{p.module} ({p.option})" if p.option else p.module for p in record.packages]
    notes = []
    if record.documents is Documents.ROWS_WHOLE:
        notes.append(f"not isolated: {record.not_isolated_because}")
    if record.compile_fails:
        notes.append(f"--training.compile leaves its blocks eager, they do not compile: {record.compile_fails}")
    if record.compile_slower and record.compile_slower is not FLA_COMPILED_SLOWER:  # fla's default: under the table
        notes.append(f"--training.compile leaves its blocks eager: {record.compile_slower}")
    if spikes := record.gradient_spikes:
        notes.append(f"gradient spikes with attn_mode {spikes.attn_mode} (warned on GPUs)")
    if record.notes:
        notes.append(record.notes)
    model_type = "any other" if record is GENERIC else record.model_type
    return (
        model_type, record.library, record.family, _ISOLATED[record.documents],
        "no" if record.compile_fails else "eager" if record.compile_slower else "yes",
        "yes" if record.tensor_parallel_plan else "no",
        record.context_parallel.value, ", ".join(needs) or "-", export_cell(record), "; ".join(notes),
    )


def rows() -> list[tuple[str, ...]]:
    """Every record, transformers' first, then custom models', then fla's, each by name; the generic record last."""
    records = sorted(RECORDS.values(), key=lambda r: (_LIBRARIES.index(r.library), r.model_type))
    return [row(record) for record in [*records, GENERIC]]


def plain_table() -> str:
    table = [COLUMNS, *rows()]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(COLUMNS) - 1)]  # notes: not padded
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(cells, widths)), cells[-1]]).rstrip() for cells in table)


def markdown_table() -> str:
    """docs/models.md's support table and its legend."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for model_type, *cells in rows():
        lines.append("| " + " | ".join([f"`{model_type}`" if model_type != "any other" else model_type, *cells]) + " |")
    return "\n".join(lines) + "\n\n" + LEGEND


def page_with_table(text: str) -> str:
    """``text`` (docs/models.md) with the generated table between its markers."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"docs/models.md needs one line {BEGIN!r} and one line {END!r} after it, around the support table")
    head, rest = text.split(BEGIN + "\n", 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame models", description="What flame supports, per model type.")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="docs/models.md's Markdown table")
    output.add_argument("--write_docs", action="store_true", help=f"rewrite the table in {MODELS_PAGE}")
    args = parser.parse_args(argv)
    if args.write_docs:
        MODELS_PAGE.write_text(page_with_table(MODELS_PAGE.read_text()))
        print(f"wrote the support table into {MODELS_PAGE}")
    else:
        print(markdown_table() if args.markdown else plain_table())
    return 0
