"""Tables of studies and benchmarks: declared columns, mean ± std over seeds, a test for each gap.

One writer for the study report, ``--debug`` and the benchmarks: a :class:`Table` declares its
columns; :func:`summarize` turns a frame of runs (one row per run: a ``condition`` column and the
metric columns) into one :class:`RowSummary` per condition; :func:`to_markdown` and
:func:`to_latex` render them, with a legend naming the test, its correction, the number of runs
and alpha; :func:`differences_markdown` and :func:`differences_latex` render each row's
difference to the baseline with its 95 % confidence interval.

- ``†``: the cell differs from the baseline row by Welch's t-test over the runs (seeds),
  two-sided, one test per row and compared column; the table's tests are corrected together by
  Holm's step-down procedure (``Table.correction="holm"``, the default: a cell is marked when its
  Holm-adjusted p < alpha, which bounds the probability of any false mark in the table by alpha)
  or not at all (``correction=None``: p < alpha); the legend names the correction and counts the
  tests. A side with fewer than 2 runs is not tested.
- difference to the baseline: the row's mean minus the baseline's, with the Welch-Satterthwaite
  95 % confidence interval of the difference of means (``t`` quantile at the Welch degrees of
  freedom times the unpooled standard error); each interval is for its own comparison
  (not adjusted for the table's other comparisons).
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
    Satterthwaite, F. E. (1946). An approximate distribution of estimates of variance components.
    Biometrics Bulletin 2(6), 110-114.
    Holm, S. (1979). A simple sequentially rejective multiple test procedure. Scandinavian
    Journal of Statistics 6(2), 65-70.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
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
        alpha: significance level of the test (family-wise over the table with Holm).
        correction: ``"holm"`` (Holm-Bonferroni over the table's tests) or None (uncorrected).
        rows: the conditions the table shows, top to bottom; None: every condition.
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
    correction: Literal["holm"] | None = "holm"
    rows: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        keys = [c.key for c in self.columns]
        if not keys or len(set(keys)) != len(keys):
            raise ConfigError(f"table {self.name!r}: columns {keys}; give at least one, each key once")
        if self.test not in ("welch", None):
            raise ConfigError(f"table {self.name!r}: test={self.test!r}; use 'welch' or None")
        if not 0.0 < self.alpha < 1.0:
            raise ConfigError(f"table {self.name!r}: alpha={self.alpha}; use a value in (0, 1)")
        if self.correction not in ("holm", None):
            raise ConfigError(f"table {self.name!r}: correction={self.correction!r}; use 'holm' "
                              "or None")
        if self.rows is not None:
            object.__setattr__(self, "rows", tuple(self.rows))
            if not self.rows or len(set(self.rows)) != len(self.rows):
                raise ConfigError(f"table {self.name!r}: rows {list(self.rows)}; give each "
                                  "condition once, or None for all")
            if self.baseline is not None and self.baseline not in self.rows:
                raise ConfigError(f"table {self.name!r}: baseline {self.baseline!r} is not "
                                  "among its rows; add it to rows")


@dataclass(frozen=True)
class Difference:
    """A row's mean minus the baseline's, with a confidence interval of that difference."""

    estimate: float
    low: float
    high: float
    level: float = 0.95


@dataclass(frozen=True)
class Cell:
    """One condition's values of one column (NaN dropped, scaled), and its test against the baseline."""

    values: tuple[float, ...]
    p: float | None = None  # Welch p-value against the baseline; None: not tested
    p_adjusted: float | None = None  # p after the table's correction (Holm); = p uncorrected
    significant: bool = False  # p_adjusted < alpha
    bold: bool = False
    difference: Difference | None = None  # to the baseline; None: not tested

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


def welch_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95
                     ) -> Difference | None:
    """``mean(a) - mean(b)`` with its Welch-Satterthwaite confidence interval; None with fewer
    than 2 values a side.

    The interval is ``d ± t_{(1+level)/2, nu} * se`` with ``se^2 = s_a^2/n_a + s_b^2/n_b`` and
    ``nu = se^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1))`` (Welch 1947, Satterthwaite
    1946); both sides constant: the interval is the point ``d``.
    """
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    estimate = float(np.mean(a) - np.mean(b))
    se2 = va + vb
    if se2 == 0.0:
        return Difference(estimate, estimate, estimate, level)
    df = se2**2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df) * math.sqrt(se2))
    return Difference(estimate, estimate - half, estimate + half, level)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given.

    Sorted ascending, ``p_(i)`` becomes ``max_{j <= i} min(1, (m - j + 1) p_(j))`` for ``m``
    tests; rejecting where the adjusted value is below alpha is Holm's step-down procedure, which
    controls the family-wise error rate at alpha. A NaN p-value (nothing to test) counts among the
    ``m`` tests, is ordered last and stays NaN.
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: (math.isnan(pvalues[i]), pvalues[i]))
    adjusted, running = [math.nan] * m, 0.0
    for rank, i in enumerate(order):
        if math.isnan(pvalues[i]):
            continue
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


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
    tested = {c.key: _tested_cells([_values(g, c) for g in groups], c, base)
              for c in table.columns}
    tested = _corrected(tested, table)
    columns = {c.key: _bold_cells(tested[c.key], c, base) for c in table.columns}
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


def _tested_cells(values: list[tuple[float, ...]], column: Column, base: int | None) -> list[Cell]:
    """One column's cells, each other row tested against the baseline row (p and difference)."""
    cells = [Cell(v) for v in values]
    if base is None or column.better is None:
        return cells
    for i, cell in enumerate(cells):
        if i != base:
            cells[i] = replace(cell, p=welch_p(cell.values, cells[base].values),
                               difference=welch_difference(cell.values, cells[base].values))
    return cells


def _corrected(columns: dict[str, list[Cell]], table: Table) -> dict[str, list[Cell]]:
    """Every tested cell of the table with its adjusted p (Holm over all of them, or as is) and
    whether that is below alpha."""
    where = [(key, i) for key, cells in columns.items() for i, c in enumerate(cells)
             if c.p is not None]
    raw = [columns[key][i].p for key, i in where]
    adjusted = holm(raw) if table.correction == "holm" else raw
    out = {key: list(cells) for key, cells in columns.items()}
    for (key, i), p in zip(where, adjusted, strict=True):
        out[key][i] = replace(out[key][i], p_adjusted=p, significant=p < table.alpha)
    return out


def _bold_cells(cells: list[Cell], column: Column, base: int | None) -> list[Cell]:
    """One column's bold marks (the rule of the module docstring) from its tested cells."""
    cells = list(cells)
    if base is None or column.better is None:
        return cells
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
    out = [f"{DAGGER} differs from {base.label} by Welch's t-test over the runs (two-sided; "
           + _correction_text(table, tested) + ")",
           f"Bold: a column's best mean if significantly better than {base.label} "
           f"({base.label} itself: if every other row is significantly worse)"]
    if untested:
        out.append(f"Not tested: cells with fewer than 2 runs, or against {base.label} with fewer")
    fixed = [c.title for c in table.columns if c.better is None]
    if fixed:
        out.append(f"Not compared: {', '.join(fixed)}")
    return out


def _correction_text(table: Table, tested: int) -> str:
    """What decides the dagger: Holm over the table's tests, or each test on its own."""
    if table.correction == "holm":
        return (f"Holm-Bonferroni over the table's {tested} tests, adjusted p < {table.alpha:g}")
    return f"p < {table.alpha:g}; {tested} tests, not corrected for multiple comparisons"


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
    body = [[row.label] + ([str(row.n)] if n else [])
            + [_cell_text(row.cells[c.key], row.n, c, latex=False) for c in table.columns]
            for row in rows]
    return _markdown(table, [table.row_header] + (["n"] if n else []), table.columns, body,
                     table.title, legend(rows, table))


def to_latex(rows: Sequence[RowSummary], table: Table) -> str:
    """The table as a LaTeX ``table`` float (booktabs), the legend in its caption."""
    n = int(len({r.n for r in rows}) > 1)  # an n column only if rows differ; else the legend says n
    body = [[latex_escape(row.label)] + [str(row.n)] * n
            + [_cell_text(row.cells[c.key], row.n, c, latex=True) for c in table.columns]
            for row in rows]
    return _latex(table, table.name, [table.row_header] + ["n"] * n, table.columns, body,
                  table.title, legend(rows, table))


def _markdown(table: Table, lead: list[str], columns: Sequence[Column], body: list[list[str]],
              title: str, notes: str) -> str:
    head = lead + [c.title for c in columns]
    lines = [head, [":---"] + ["---:"] * (len(head) - 1), *body]
    text = "\n".join("| " + " | ".join(x.replace("|", r"\|") for x in line) + " |" for line in lines)
    caption = " ".join(p for p in (f"**{title}.**" if title else "", table.caption) if p)
    return "\n\n".join(p for p in (caption, text, notes) if p) + "\n"


def _latex(table: Table, label: str, lead: list[str], columns: Sequence[Column],
           body: list[list[str]], title: str, notes: str) -> str:
    caption = (f"{title}." if title else "", table.caption, notes)
    lines = [f"% {label}: needs \\usepackage{{booktabs}}", "\\begin{table}[t]", "\\centering",
             "\\caption{" + " ".join(latex_escape(p) for p in caption if p) + "}",
             f"\\label{{tab:{label}}}",
             "\\begin{tabular}{l" + "r" * (len(lead) - 1 + len(columns)) + "}", "\\toprule",
             *_latex_groups(columns, lead=len(lead)),
             " & ".join(latex_escape(h) for h in lead + [c.header for c in columns]) + " \\\\",
             "\\midrule", *(" & ".join(line) + " \\\\" for line in body)]
    return "\n".join(lines + ["\\bottomrule", "\\end{tabular}", "\\end{table}"]) + "\n"


# -- differences to the baseline ------------------------------------------------------------------


def has_differences(rows: Sequence[RowSummary], table: Table) -> bool:
    """Whether any cell of ``rows`` has a difference to the baseline (a second table to write)."""
    return any(c.difference is not None for r in rows for c in r.cells.values())


def differences_markdown(rows: Sequence[RowSummary], table: Table) -> str:
    """Each non-baseline row's difference to the baseline per compared column, with its 95 %
    confidence interval (``+1.2 [-0.3, +2.7]``), in Markdown; † as in the main table."""
    columns, body, notes = _differences(rows, table)
    lines = [[r.label] + [_difference_text(r.cells[c.key], c, latex=False) for c in columns]
             for r in body]
    return _markdown(table, [table.row_header], columns, lines, _difference_title(table, rows),
                     notes)


def differences_latex(rows: Sequence[RowSummary], table: Table) -> str:
    """:func:`differences_markdown` as a LaTeX ``table`` float (label ``tab:<name>_vs_baseline``)."""
    columns, body, notes = _differences(rows, table)
    lines = [[latex_escape(r.label)] + [_difference_text(r.cells[c.key], c, latex=True)
                                        for c in columns] for r in body]
    return _latex(table, f"{table.name}_vs_baseline", [table.row_header], columns, lines,
                  _difference_title(table, rows), notes)


def _difference_title(table: Table, rows: Sequence[RowSummary]) -> str:
    base = next((r.label for r in rows if r.baseline), "the baseline")
    return f"{table.title}: difference to {base}" if table.title else f"Difference to {base}"


def _differences(rows: Sequence[RowSummary], table: Table
                 ) -> tuple[list[Column], list[RowSummary], str]:
    columns = [c for c in table.columns if c.better is not None]
    body = [r for r in rows if not r.baseline]
    base = next((r for r in rows if r.baseline), None)
    label = base.label if base is not None else "the baseline"
    levels = {c.difference.level for r in body for c in r.cells.values() if c.difference}
    level = f"{100 * levels.pop():g} %" if len(levels) == 1 else "the stated"
    tested = sum(r.cells[c.key].p is not None for r in body for c in columns)
    notes = [f"Row mean minus the mean of {label}, with the {level} Welch-Satterthwaite "
             "confidence interval of the difference of means (unpooled standard error, Welch "
             "degrees of freedom); each interval is for its own comparison, not adjusted for the "
             "table's others",
             f"{DAGGER} as in the main table (Welch's t-test; "
             + _correction_text(table, tested) + ")"]
    if any(r.cells[c.key].difference is None for r in body for c in columns):
        notes.append(f"{MISSING}: fewer than 2 runs on a side")
    notes += _unit_sentences(replace(table, columns=tuple(columns))) if columns else []
    return columns, body, ". ".join(notes) + "."


def _difference_text(cell: Cell, column: Column, latex: bool) -> str:
    diff = cell.difference
    if diff is None:
        return "--" if latex else MISSING
    d = column.digits
    minus = "$-$" if latex else "−"

    def signed(x: float) -> str:
        return (minus if x < 0 else "+") + f"{abs(x):.{d}f}"

    text = f"{signed(diff.estimate)} [{signed(diff.low)}, {signed(diff.high)}]"
    if cell.significant:
        text += r"$^\dagger$" if latex else DAGGER
    return text


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


# -- protocols: COCO's 5-fold 1K beside its 5K -----------------------------------------------

FOLDS_PREFIX = "test_1k_"  # the test metrics of the 5-fold protocol (icr.metrics.protocols)
FOLD_IMAGES = "test_1k_fold_images"  # the images a fold held: 1,000 on COCO


def fold_table(table: Table, keys: Iterable[str], fold_images: float | None = None
               ) -> Table | None:
    """The table over the 5-fold 1K protocol: each ``test_`` column read from its ``test_1k_``
    metric, when ``keys`` (the runs' metrics) hold it; None when they hold none (a dataset
    reported in full only: Flickr30K, the embedded benchmark). ``fold_images`` goes in the
    caption (1,000 on COCO; a scaled-down fixture's folds are smaller, and it says so)."""
    keys = set(keys)
    columns = tuple(replace(c, key=FOLDS_PREFIX + c.key[len("test_"):]) for c in table.columns
                    if c.key.startswith("test_") and FOLDS_PREFIX + c.key[len("test_"):] in keys)
    if not columns:
        return None
    size = "" if fold_images is None or math.isnan(fold_images) else f" of {fold_images:,.0f} images"
    scaled = ("" if fold_images in (None, 1000.0) else
              "; folds smaller than COCO's 1,000 images: not comparable with published 1K numbers")
    caption = (f"COCO 1K: the test split in 5 folds{size}, each metric the mean over the folds"
               f"{scaled}; " + table.caption).rstrip("; ")
    return replace(table, name=f"{table.name}_1k", title=f"{table.title} (1K)", columns=columns,
                   caption=caption, references=())


def protocol_tables(tables: Sequence[Table], frame: pd.DataFrame | Mapping[str, float]
                    ) -> tuple[Table, ...]:
    """The declared tables, each followed by its 5-fold 1K table (:func:`fold_table`) when the
    runs (a frame of runs, or one run's metrics) carry its ``test_1k_`` metrics: on COCO every
    study's report holds its 5K and its 1K tables, with nothing declared twice."""
    if isinstance(frame, pd.DataFrame):
        keys = list(frame.columns)
        sizes = frame[FOLD_IMAGES].dropna() if FOLD_IMAGES in frame else pd.Series(dtype=float)
        fold_images = float(sizes.iloc[0]) if sizes.nunique() == 1 else None
    else:
        keys, fold_images = list(frame), frame.get(FOLD_IMAGES)
    out: list[Table] = []
    for table in tables:
        out.append(table)
        folds = fold_table(table, keys, fold_images)
        if folds is not None:
            out.append(folds)
    return tuple(out)


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
