"""Tables of studies and benchmarks: declared columns, mean ± std over seeds, a test for each gap.

One writer for the study report, ``--debug`` and the benchmarks: a :class:`Table` declares its
columns; :func:`summarize` turns a frame of runs (one row per run: a ``condition`` column and the
metric columns) into one :class:`RowSummary` per condition; :func:`to_markdown` and
:func:`to_latex` render them, with a legend naming the test, the number of runs and alpha.

- ``†``: the cell differs from the baseline row by Welch's t-test over the runs (seeds),
  two-sided, p < alpha; one test per row and compared column, uncorrected for multiple
  comparisons (the legend counts them). A side with fewer than 2 runs is not tested.
- bold: a column's best mean, only when the test separates it from the baseline: a row's best
  mean significantly better than the baseline's; the baseline's own when every other row is
  significantly worse. Rows tied for the best mean (a searched condition that picked a fixed
  condition's config, trained on the same seeds) are each judged so. Bold never marks a gap the
  seeds do not support; it claims a win over the baseline, not over the runner-up. Only rows of
  2 or more runs compete: a single run (an ensemble row) is shown untested and does not keep the
  best tested row from its bold.
  Columns with ``better=None`` (e.g. lambda) are not compared.

References:
    Welch, B. L. (1947). The generalization of "Student's" problem when several different
    population variances are involved. Biometrika 34(1-2), 28-35.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats

from icr.errors import ConfigError

EVAL_SPLITS = ("val", "test")  # metric prefixes that :func:`record_table` swaps
DAGGER, PLUS_MINUS, MISSING = "†", "±", "–"


@dataclass(frozen=True)
class Column:
    """One column: a metric of the runs frame and how to show it.

    Args:
        key: metric name in the runs frame, e.g. ``test_i2t_R_at_1``.
        header: column header, e.g. ``R@1``.
        group: header spanning the consecutive columns of the same group, e.g. ``i2t``.
        better: ``"max"`` or ``"min"`` if rows are compared on it (test, bold); None if not.
        unit: stated in the legend, e.g. ``"%"``; empty for unitless values.
        digits: decimals of mean and std.
        scale: factor applied to the values first, e.g. 100 for a fraction shown in %.
    """

    key: str
    header: str
    group: str = ""
    better: Literal["max", "min"] | None = "max"
    unit: str = "%"
    digits: int = 1
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.better not in ("max", "min", None):
            raise ConfigError(f"column {self.key!r}: better={self.better!r}; use 'max', 'min' or None")
        if self.digits < 0:
            raise ConfigError(f"column {self.key!r}: digits={self.digits}; use 0 or more")

    @property
    def title(self) -> str:
        """The header with its group, e.g. ``i2t R@1`` (Markdown has no spanning headers)."""
        return f"{self.group} {self.header}".strip()


@dataclass(frozen=True)
class Table:
    """A table a study or benchmark declares.

    Args:
        name: identifier, also the LaTeX label ``tab:<name>``.
        title: first words of the caption.
        columns: the columns, left to right.
        baseline: the condition every other row is tested against; None: the first row.
        test: ``"welch"`` (Welch's t-test over the runs) or None (no test, nothing bold).
        alpha: significance level of the test.
        caption: what the table shows (split, checkpoint), after the title.
        row_header: header of the label column.
        references: extra rows ``(label, prefix, replacement)`` read from the same runs with each
            column key's ``prefix`` replaced (e.g. ``probe/`` -> ``probe_ref/input/``: the probes
            of the raw inputs that every run logs beside its own); the report appends them.
    """

    name: str
    title: str
    columns: tuple[Column, ...]
    baseline: str | None = None
    test: Literal["welch"] | None = "welch"
    alpha: float = 0.05
    caption: str = ""
    row_header: str = "Condition"
    references: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        keys = [c.key for c in self.columns]
        if not keys or len(set(keys)) != len(keys):
            raise ConfigError(f"table {self.name!r}: columns {keys}; give at least one, each key once")
        if self.test not in ("welch", None):
            raise ConfigError(f"table {self.name!r}: test={self.test!r}; use 'welch' or None")
        if not 0.0 < self.alpha < 1.0:
            raise ConfigError(f"table {self.name!r}: alpha={self.alpha}; use a value in (0, 1)")


@dataclass(frozen=True)
class Cell:
    """One condition's values of one column (NaN dropped, scaled), and its test against the baseline."""

    values: tuple[float, ...]
    p: float | None = None  # Welch p-value against the baseline; None: not tested
    significant: bool = False  # p < alpha
    bold: bool = False

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation (ddof 1); NaN with fewer than 2 values."""
        return float(np.std(self.values, ddof=1)) if self.n > 1 else math.nan


@dataclass(frozen=True)
class RowSummary:
    condition: str
    label: str
    n: int  # runs of the condition
    cells: dict[str, Cell]  # column key -> cell
    baseline: bool = False


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test of equal means; None with fewer than 2 values a side.

    NaN when both sides are constant and equal (nothing to test); 0 when both are constant and differ.
    """
    if len(a) < 2 or len(b) < 2:
        return None
    with warnings.catch_warnings():  # scipy warns on (near-)constant samples; the p stays defined
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def summarize(
    runs: pd.DataFrame, table: Table, order: Sequence[str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> list[RowSummary]:
    """Per condition in ``order`` (default: as they appear): its runs' cells, tested against the baseline.

    Args:
        runs: one row per run, a ``condition`` column and the columns' metric keys (absent keys
            and NaN are missing values; a condition without runs gives a row of missing cells).
        table: the declared table.
        order: the conditions, top to bottom; conditions of ``runs`` not listed are left out.
        labels: row label per condition (default: the condition).
    """
    if "condition" not in runs:
        raise ConfigError(f"table {table.name!r}: the runs frame has no 'condition' column; add one")
    order = list(dict.fromkeys(runs["condition"])) if order is None else list(order)
    labels = labels or {}
    base = _baseline_index(table, order)
    groups = [runs[runs["condition"] == condition] for condition in order]
    columns = {c.key: _column_cells([_values(g, c) for g in groups], c, table.alpha, base)
               for c in table.columns}
    return [RowSummary(condition, str(labels.get(condition, condition)), len(group),
                       {key: cells[i] for key, cells in columns.items()}, i == base)
            for i, (condition, group) in enumerate(zip(order, groups, strict=True))]


def _baseline_index(table: Table, order: list[str]) -> int | None:
    if table.test is None or not order:
        return None
    name = order[0] if table.baseline is None else table.baseline
    if name not in order:
        raise ConfigError(f"table {table.name!r}: baseline {name!r} is not a row ({order}); "
                          "name one of them in Table(baseline=...)")
    return order.index(name)


def _values(group: pd.DataFrame, column: Column) -> tuple[float, ...]:
    if column.key not in group:
        return ()
    values = pd.to_numeric(group[column.key], errors="coerce").dropna()
    return tuple(float(v) * column.scale for v in values)


def _column_cells(values: list[tuple[float, ...]], column: Column, alpha: float,
                  base: int | None) -> list[Cell]:
    """One column's cells: tested against the baseline row, the bold rule of the module docstring."""
    cells = [Cell(v) for v in values]
    if base is None or column.better is None:
        return cells
    for i, cell in enumerate(cells):
        if i != base:
            p = welch_p(cell.values, cells[base].values)
            cells[i] = replace(cell, p=p, significant=p is not None and p < alpha)
    sign = 1.0 if column.better == "max" else -1.0
    filled = [i for i, c in enumerate(cells) if c.n >= 2]  # a single run cannot be tested
    top = max((sign * cells[i].mean for i in filled), default=math.nan)
    best = [i for i in filled if sign * cells[i].mean == top]  # more than one: a tie, each judged
    for i in best:
        others = [cells[j] for j in filled if j != i]
        if i == base:  # the baseline wins only if every other row is significantly worse
            cells[i] = replace(cells[i], bold=bool(others) and all(c.significant for c in others))
        else:
            cells[i] = replace(cells[i], bold=cells[i].significant)
    return cells


# -- rendering ----------------------------------------------------------------------------------


def legend(rows: Sequence[RowSummary], table: Table) -> str:
    """The sentences under a table: spread, test, bold rule, untested cells, units, missing cells."""
    parts, ns = [], {r.n for r in rows}
    if max(ns, default=0) > 1:
        n = f"{ns.pop()} runs per row" if len(ns) == 1 else "the runs of each row (column n)"
        parts.append(f"Mean {PLUS_MINUS} std (ddof 1) over {n}")
    elif rows:
        parts.append("One run per row")
    base = next((r for r in rows if r.baseline), None)
    compared = [c for c in table.columns if c.better is not None]
    if base is not None and compared and len(rows) > 1:
        parts += _test_sentences(rows, table, base, compared)
    cells = [(r, c) for r in rows for c in r.cells.values()]
    if any(0 < c.n < r.n for r, c in cells):
        parts.append("n=k: a cell over fewer runs than its row")
    if any(c.n == 0 for _, c in cells):
        parts.append(f"{MISSING}: no value")
    parts += _unit_sentences(table)
    return ". ".join(parts) + "." if parts else ""


def _test_sentences(rows: Sequence[RowSummary], table: Table, base: RowSummary,
                    compared: list[Column]) -> list[str]:
    others = [r.cells[c.key] for r in rows if not r.baseline for c in compared]
    tested = sum(c.p is not None for c in others)
    untested = any(c.n and c.p is None for c in others)
    if not tested:
        return [f"Not tested against {base.label} (fewer than 2 runs), so nothing is bold"]
    out = [f"{DAGGER} differs from {base.label} by Welch's t-test over the runs (two-sided, "
           f"p < {table.alpha:g}; {tested} tests, not corrected for multiple comparisons)",
           f"Bold: a column's best mean if significantly better than {base.label} "
           f"({base.label} itself: if every other row is significantly worse)"]
    if untested:
        out.append(f"Not tested: cells with fewer than 2 runs, or against {base.label} with fewer")
    fixed = [c.title for c in table.columns if c.better is None]
    if fixed:
        out.append(f"Not compared: {', '.join(fixed)}")
    return out


def _unit_sentences(table: Table) -> list[str]:
    units = {c.unit for c in table.columns}
    if len(units) == 1:
        return [f"All values in {units.pop()}"] if table.columns[0].unit else []
    return [f"In {unit}: " + ", ".join(c.title for c in table.columns if c.unit == unit)
            for unit in dict.fromkeys(c.unit for c in table.columns) if unit]


def _cell_text(cell: Cell, row_n: int, column: Column, latex: bool) -> str:
    if not cell.n:
        return "--" if latex else MISSING
    d = column.digits
    pm = r"$\pm$" if latex else PLUS_MINUS
    text = f"{cell.mean:.{d}f}" if cell.n == 1 else f"{cell.mean:.{d}f} {pm} {cell.std:.{d}f}"
    if cell.n < row_n:
        text += f" (n={cell.n})"
    if cell.bold:
        text = f"\\textbf{{{text}}}" if latex else f"**{text}**"
    if cell.significant:
        text += r"$^\dagger$" if latex else DAGGER
    return text


def to_markdown(rows: Sequence[RowSummary], table: Table) -> str:
    """The table in GitHub Markdown: a caption line, the table, the legend."""
    n = len({r.n for r in rows}) > 1  # else the legend states n
    head = [table.row_header] + (["n"] if n else []) + [c.title for c in table.columns]
    lines = [head, [":---"] + ["---:"] * (len(head) - 1)]
    for row in rows:
        lines.append([row.label] + ([str(row.n)] if n else [])
                     + [_cell_text(row.cells[c.key], row.n, c, latex=False) for c in table.columns])
    body = "\n".join("| " + " | ".join(x.replace("|", r"\|") for x in line) + " |" for line in lines)
    caption = " ".join(p for p in (f"**{table.title}.**" if table.title else "", table.caption) if p)
    return "\n\n".join(p for p in (caption, body, legend(rows, table)) if p) + "\n"


def to_latex(rows: Sequence[RowSummary], table: Table) -> str:
    """The table as a LaTeX ``table`` float (booktabs), the legend in its caption."""
    n = int(len({r.n for r in rows}) > 1)  # an n column only if rows differ; else the legend says n
    caption = (f"{table.title}." if table.title else "", table.caption, legend(rows, table))
    lines = [f"% {table.name}: needs \\usepackage{{booktabs}}", "\\begin{table}[t]", "\\centering",
             "\\caption{" + " ".join(latex_escape(p) for p in caption if p) + "}",
             f"\\label{{tab:{table.name}}}",
             "\\begin{tabular}{l" + "r" * (n + len(table.columns)) + "}", "\\toprule",
             *_latex_groups(table.columns, lead=1 + n),
             " & ".join(latex_escape(h) for h in [table.row_header] + ["n"] * n
                        + [c.header for c in table.columns]) + " \\\\", "\\midrule"]
    for row in rows:
        cells = [_cell_text(row.cells[c.key], row.n, c, latex=True) for c in table.columns]
        lines.append(" & ".join([latex_escape(row.label)] + [str(row.n)] * n + cells) + " \\\\")
    return "\n".join(lines + ["\\bottomrule", "\\end{tabular}", "\\end{table}"]) + "\n"


def _latex_groups(columns: Sequence[Column], lead: int) -> list[str]:
    """The group header row (``\\multicolumn``) and its ``\\cmidrule`` s; none without groups."""
    if not any(c.group for c in columns):
        return []
    spans, rules, start = [""] * lead, [], lead + 1
    for group, members in itertools.groupby(columns, key=lambda c: c.group):
        width = len(list(members))
        if group:
            spans.append(f"\\multicolumn{{{width}}}{{c}}{{{latex_escape(group)}}}")
            rules.append(f"\\cmidrule(lr){{{start}-{start + width - 1}}}")
        else:
            spans += [""] * width
        start += width
    return [" & ".join(spans) + " \\\\", " ".join(rules)]


_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
          "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
          "<": "$<$", ">": "$>$", PLUS_MINUS: r"$\pm$", DAGGER: r"$^\dagger$", MISSING: "--"}


def latex_escape(text: str) -> str:
    """Plain text (labels, headers, legend) as LaTeX: specials escaped, ±, † and – as macros."""
    return "".join(_LATEX.get(ch, ch) for ch in text)


# -- one run: --debug ---------------------------------------------------------------------------


def record_table(record: Mapping[str, float], table: Table,
                 splits: Sequence[str] = EVAL_SPLITS, caption: str = "") -> str:
    """One history record (one run, one epoch) in Markdown: a row per split, the table's columns.

    A column key with a split prefix (``test_i2t_R_at_1``) is read as ``val_i2t_R_at_1`` on the
    val row; other keys (``lambda``) are the same on every row. Splits without any value are left
    out; nothing is tested; ``caption`` replaces the table's (which describes the study's runs).
    """
    frame = pd.DataFrame([{"condition": split, **{
        c.key: record.get(_as_split(c.key, split) or c.key, math.nan) for c in table.columns}}
        for split in splits])
    order = [s for s in splits if any(_as_split(c.key, s) in record for c in table.columns)]
    plain = replace(table, test=None, row_header="Split", caption=caption)
    return to_markdown(summarize(frame, plain, order or list(splits)), plain)


def _as_split(key: str, split: str) -> str | None:
    """``test_x`` as ``<split>_x``; None for a key without a split prefix (e.g. ``lambda``)."""
    head, sep, rest = key.partition("_")
    return f"{split}_{rest}" if sep and head in EVAL_SPLITS else None
