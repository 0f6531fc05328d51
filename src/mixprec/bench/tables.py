"""The bench's one table writer: aligned plain text and Markdown, from a header and rows of strings."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["aligned", "markdown_table"]


def aligned(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[str] = ("workload", "mode")
) -> list[str]:
    """Columns padded to their widest cell (those named in ``left`` left-aligned, the rest right), a rule under
    the header; nothing is cut."""
    table = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [c.ljust(w) if h in left else c.rjust(w) for c, w, h in zip(row, widths, header, strict=True)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(table[0]), rule, *(line(row) for row in table[1:])]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table: the header, its rule, one line a row."""
    return [
        "| " + " | ".join(str(c) for c in header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]
