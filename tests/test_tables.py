"""Study tables: hand-computed mean/std, Welch p-values, Holm's correction and the difference's
confidence interval against oracles, the dagger and bold rules, rendering."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from icr.errors import ConfigError
from studies.tables import (
    Column,
    Table,
    differences_latex,
    differences_markdown,
    has_differences,
    holm,
    latex_escape,
    legend,
    protocol_tables,
    record_table,
    summarize,
    to_latex,
    to_markdown,
    welch_difference,
    welch_p,
)


def frame(values: dict[str, list[float]], key: str = "m") -> pd.DataFrame:
    """One run per value: condition -> values of metric ``key``."""
    return pd.DataFrame([{"condition": c, key: v} for c, vs in values.items() for v in vs])


def table(better: str | None = "max", **kwargs) -> Table:
    return Table("t", "T", (Column("m", "M", better=better),), baseline="bl", **kwargs)


def cells(rows, key: str = "m") -> dict:
    return {r.condition: r.cells[key] for r in rows}


def line_of(text: str, label: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith(f"| {label} |")]
    return line


# ------------------------------------------------------------------------------ the numbers


def test_mean_and_std_by_hand():
    rows = summarize(frame({"bl": [1.0, 2.0, 3.0], "x": [2, 4, 4, 4, 5, 5, 7, 9]}), table())
    c = cells(rows)
    assert c["bl"].n == 3 and c["bl"].mean == pytest.approx(2.0) and c["bl"].std == pytest.approx(1.0)
    # sum of squared deviations from 5 is 32, over n - 1 = 7
    assert c["x"].mean == pytest.approx(5.0) and c["x"].std == pytest.approx(math.sqrt(32 / 7))
    assert "2.0 ± 1.0" in line_of(to_markdown(rows, table()), "bl")


def welch_by_formula(a: list[float], b: list[float]) -> float:
    """Welch (1947): t over the unpooled standard error, Welch-Satterthwaite df, two-sided p."""
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return 2 * stats.t.sf(abs(t), df)


@pytest.mark.parametrize("a, b", [([1.0, 2.0, 3.5], [2.0, 3.0, 7.0, 9.0]),
                                  ([16.1, 17.9, 18.5], [15.0, 16.2, 16.9]),
                                  ([0.30, 0.31], [0.20, 0.26, 0.21, 0.19, 0.25])])
def test_welch_p_matches_the_formula(a, b):
    expected = welch_by_formula(a, b)
    assert welch_p(a, b) == pytest.approx(expected, rel=1e-9)
    rows = summarize(frame({"bl": b, "x": a}), table())
    assert cells(rows)["x"].p == pytest.approx(expected, rel=1e-9)
    assert cells(rows)["bl"].p is None  # the baseline is not tested against itself


def test_welch_p_edge_cases():
    assert welch_p([1.0], [1.0, 2.0]) is None and welch_p([1.0, 2.0], [3.0]) is None
    assert math.isnan(welch_p([1.0, 1.0], [1.0, 1.0]))  # constant and equal: nothing to test
    rows = summarize(frame({"bl": [1.0, 1.0], "x": [1.0, 1.0]}), table())
    assert not cells(rows)["x"].significant


# ------------------------------------------------------------------------------ dagger and bold

BL, CLOSE, FAR = [10.0, 11.0, 12.0], [10.5, 11.5, 12.5], [20.0, 21.0, 22.0]


def test_dagger_exactly_on_the_significant_row():
    rows = summarize(frame({"bl": BL, "close": CLOSE, "far": FAR}), table())
    c = cells(rows)
    assert c["close"].p > 0.5 and c["far"].p < 1e-3
    assert [c[k].significant for k in ("bl", "close", "far")] == [False, False, True]
    md, tex = to_markdown(rows, table()), to_latex(rows, table())
    assert "†" in line_of(md, "far") and "†" not in line_of(md, "close") + line_of(md, "bl")
    assert line_of_tex(tex, "far").endswith("\\textbf{21.0 $\\pm$ 1.0}$^\\dagger$ \\\\")
    assert "dagger" not in line_of_tex(tex, "close") + line_of_tex(tex, "bl")
    assert "Welch's t-test" in md and "p < 0.05" in md and "2 tests" in md and "3 runs per row" in md


def test_significance_is_two_sided_but_bold_needs_better():
    worse = [1.0, 2.0, 3.0]
    rows = summarize(frame({"bl": BL, "worse": worse}), table())
    c = cells(rows)
    assert c["worse"].significant and not c["worse"].bold
    assert c["bl"].bold  # best, and the only other row is significantly worse


@pytest.mark.parametrize("runs, bold", [
    ({"bl": BL, "close": CLOSE, "far": FAR}, "far"),  # best and significantly better than bl
    ({"bl": BL, "close": CLOSE}, None),  # best mean, but the seeds overlap bl's: no bold
    ({"bl": FAR, "close": [22.5, 21.5, 20.5], "low": BL}, None),  # best overlaps bl
    ({"bl": FAR, "low": BL, "lower": [1.0, 2.0, 3.0]}, "bl"),  # bl best, all others worse
    ({"bl": FAR, "low": BL, "near": [19.5, 20.5, 21.5]}, None),  # bl best, one row overlaps
    ({"bl": BL, "a": FAR, "b": FAR[::-1]}, ["a", "b"]),  # tied for the best, both beat bl
    ({"bl": FAR, "a": FAR, "low": BL}, None),  # bl tied with a row it does not beat
])
def test_bold_rule(runs, bold):
    rows = summarize(frame(runs), table())
    expected = bold if isinstance(bold, list) else [bold] if bold else []
    assert [r.condition for r in rows if r.cells["m"].bold] == expected
    md = to_markdown(rows, table())
    assert md.count("**") == 2 + 2 * len(expected)  # the caption's **T.** and each bold cell


def test_better_min():
    runs = {"bl": BL, "lower": [1.0, 2.0, 3.0], "higher": FAR}
    rows = summarize(frame(runs), table("min"))
    c = cells(rows)
    assert c["lower"].bold and c["lower"].significant
    assert c["higher"].significant and not c["higher"].bold
    rows = summarize(frame({"bl": BL, "higher": FAR}), table("min"))
    assert cells(rows)["bl"].bold  # smaller is better: bl wins, the other row is worse


def test_uncompared_column_and_no_test():
    rows = summarize(frame({"bl": BL, "far": FAR}), table(None))
    assert not any(c.significant or c.bold or c.p is not None for c in cells(rows).values())
    t = table(test=None)
    rows = summarize(frame({"bl": BL, "far": FAR}), t)
    assert not any(c.significant or c.bold for c in cells(rows).values())
    assert "Welch" not in to_markdown(rows, t) and "†" not in to_markdown(rows, t)


def test_baseline_defaults_to_the_first_row_and_must_exist():
    t = Table("t", "T", (Column("m", "M"),))
    rows = summarize(frame({"far": FAR, "bl": BL}), t, order=["bl", "far"])
    assert rows[0].baseline and cells(rows)["far"].significant
    with pytest.raises(ConfigError, match="baseline 'bl'"):
        summarize(frame({"far": FAR}), table())


# ------------------------------------------------------------------------------ missing and single runs


def test_missing_values_and_conditions():
    runs = pd.concat([frame({"bl": BL, "x": FAR}), frame({"x": [math.nan]})], ignore_index=True)
    runs.loc[0, "m"] = math.nan  # one baseline seed lost its metric
    rows = summarize(runs, table(), order=["bl", "x", "absent"], labels={"absent": "never ran"})
    c = cells(rows)
    assert c["bl"].n == 2 and c["bl"].mean == pytest.approx(11.5)
    assert [r.n for r in rows] == [3, 4, 0] and c["absent"].n == 0 and math.isnan(c["absent"].mean)
    md = to_markdown(rows, table())
    assert "| n |" in md  # rows differ in their number of runs
    assert line_of(md, "never ran") == "| never ran | 0 | – |"
    assert "11.5 ± 0.7 (n=2)" in line_of(md, "bl") and "(n=3)" in line_of(md, "x")
    assert "–: no value" in md and "the runs of each row (column n)" in md
    assert "--" in line_of_tex(to_latex(rows, table()), "never ran")


def line_of_tex(text: str, label: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith(f"{label} &")]
    return line


def test_absent_column():
    t = Table("t", "T", (Column("m", "M"), Column("nope", "N")), baseline="bl")
    md = to_markdown(summarize(frame({"bl": BL, "x": FAR}), t), t)
    assert line_of(md, "x") == "| x | **21.0 ± 1.0**† | – |"


def test_single_run_rows():
    rows = summarize(frame({"bl": BL, "one": [30.0]}), table())
    c = cells(rows)
    assert c["one"].p is None and not c["one"].significant and math.isnan(c["one"].std)
    assert not c["one"].bold  # the best mean, but untested
    md = to_markdown(rows, table())
    assert line_of(md, "one") == "| one | 1 | 30.0 |"
    assert "Not tested against bl (fewer than 2 runs), so nothing is bold" in md
    rows = summarize(frame({"bl": BL, "one": [30.0], "far": FAR}), table())
    assert "Not tested: cells with fewer than 2 runs" in to_markdown(rows, table())
    # A single run with a higher mean (an ensemble row) does not take the bold from the best
    # tested row.
    c = cells(summarize(frame({"bl": BL, "far": FAR, "one": [max(FAR) + 100.0]}), table()))
    assert c["far"].bold and not c["one"].bold


# ------------------------------------------------------------------------------ rendering


COLUMNS = (Column("i1", "R@1", "i2t"), Column("i5", "R@5", "i2t"), Column("t1", "R@1", "t2i"),
           Column("rsum", "rsum"), Column("L_rec", "L_rec", better="min", unit="nats", digits=3),
           Column("lambda", "lambda", better=None, unit="", digits=2))


def wide() -> pd.DataFrame:
    g = np.random.default_rng(0)
    return pd.DataFrame([{"condition": c, "i1": 10 + s + g.normal(), "i5": 40 + g.normal(),
                          "t1": 8 + g.normal(), "rsum": 180 + g.normal(), "L_rec": 0.3 + 0.01 * g.normal(),
                          "lambda": 0.1} for c, s in (("bl", 0), ("lag", 10)) for _ in range(3)])


def test_group_headers_and_units():
    t = Table("ltd", "Table 1", COLUMNS, baseline="bl", caption="Test split.")
    rows = summarize(wide(), t, labels={"lag": "L_lag & eta=20%"})
    md = to_markdown(rows, t)
    assert "| Condition | i2t R@1 | i2t R@5 | t2i R@1 | rsum | L_rec | lambda |" in md
    assert md.startswith("**Table 1.** Test split.")
    assert "In %: i2t R@1, i2t R@5, t2i R@1, rsum. In nats: L_rec." in md
    assert "Not compared: lambda" in md and "0.10 ± 0.00" in md
    tex = to_latex(rows, t)
    assert "\\multicolumn{2}{c}{i2t} & \\multicolumn{1}{c}{t2i} &  &  &  \\\\" in tex
    assert "\\cmidrule(lr){2-3} \\cmidrule(lr){4-4}" in tex
    assert "Condition & R@1 & R@5 & R@1 & rsum & L\\_rec & lambda \\\\" in tex
    assert "\\begin{tabular}{lrrrrrr}" in tex and "\\label{tab:ltd}" in tex
    assert "L\\_lag \\& eta=20\\% & " in tex and "In \\%: i2t" in tex and "p $<$ 0.05" in tex
    one_unit = Table("u", "", COLUMNS[:3])
    assert "All values in %." in legend(summarize(wide(), one_unit), one_unit)


def test_latex_groups_shift_with_the_n_column():
    t = Table("ltd", "Table 1", COLUMNS[:3], baseline="bl")
    runs = pd.concat([wide(), pd.DataFrame([{"condition": "few", "i1": 1.0}])], ignore_index=True)
    tex = to_latex(summarize(runs, t), t)
    assert "\\cmidrule(lr){3-4} \\cmidrule(lr){5-5}" in tex and "Condition & n & R@1" in tex


def test_latex_escape():
    assert latex_escape("a_b & 5% #1 {x} $y ~ ^") == (
        "a\\_b \\& 5\\% \\#1 \\{x\\} \\$y \\textasciitilde{} \\textasciicircum{}")
    assert latex_escape("\\cmd") == "\\textbackslash{}cmd"
    assert latex_escape("± † –") == "$\\pm$ $^\\dagger$ --"


def test_scale_and_digits():
    t = Table("t", "", (Column("f", "F", digits=2, scale=100.0),))
    md = to_markdown(summarize(frame({"a": [0.1234, 0.1334]}, key="f"), t), t)
    assert "12.84 ± 0.71" in md


def test_markdown_escapes_pipes():
    rows = summarize(frame({"bl": BL}), table(), labels={"bl": "a|b"})
    assert "| a\\|b | 11.0 ± 1.0 |" in to_markdown(rows, table())


# ------------------------------------------------------------------------------ --debug


def test_record_table_puts_val_and_test_side_by_side():
    t = Table("ltd", "Table 1", (Column("test_rsum", "rsum"), Column("lambda", "lambda", better=None,
                                                                     unit="", digits=2)),
              baseline="contrastive", caption="Confirmation seeds.")
    record = {"epoch": 2, "val_rsum": 101.24, "test_rsum": 99.0, "lambda": 0.5}
    md = record_table(record, t)
    assert line_of(md, "val") == "| val | 101.2 | 0.50 |"
    assert line_of(md, "test") == "| test | 99.0 | 0.50 |"
    assert "| Split | rsum | lambda |" in md and "Confirmation" not in md
    assert "†" not in md and "Welch" not in md and "One run per row" in md
    md = record_table({"val_rsum": 100.0}, t, caption="Epoch 3.")
    assert "| test |" not in md and "Epoch 3." in md


# ------------------------------------------------------------------------------ declarations


def test_declaration_errors():
    with pytest.raises(ConfigError, match="better"):
        Column("m", "M", better="up")
    with pytest.raises(ConfigError, match="each key once"):
        Table("t", "T", (Column("m", "M"), Column("m", "M2")))
    with pytest.raises(ConfigError, match="alpha"):
        Table("t", "T", (Column("m", "M"),), alpha=5.0)
    with pytest.raises(ConfigError, match="test"):
        Table("t", "T", (Column("m", "M"),), test="mannwhitney")
    with pytest.raises(ConfigError, match="'condition' column"):
        summarize(pd.DataFrame({"m": [1.0]}), table())


def test_alpha_decides_significance():
    runs = frame({"bl": BL, "mid": [11.5, 12.5, 13.5]})
    p = cells(summarize(runs, table()))["mid"].p
    assert 0.05 < p < 0.2  # t = 1.5 / sqrt(2 / 3), 4 df
    assert not cells(summarize(runs, table()))["mid"].significant
    loose = table(alpha=0.2)
    rows = summarize(runs, loose)
    assert cells(rows)["mid"].significant and cells(rows)["mid"].bold
    assert "adjusted p < 0.2)" in to_markdown(rows, loose)


# ------------------------------------------------------------------------------ Holm


@pytest.mark.parametrize("p, adjusted", [
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max
    ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
    ([0.5, 0.6], [1.0, 1.0]),  # 2 x 0.5 = 1; capped at 1
    ([0.02, math.nan, 0.04], [0.06, math.nan, 0.08]),  # NaN counts in m = 3, stays NaN
    ([0.001], [0.001]),  # one test: nothing to correct
    ([], []),
])
def test_holm_by_hand(p, adjusted):
    assert holm(p) == pytest.approx(adjusted, nan_ok=True)


def test_holm_rejects_as_the_step_down_procedure():
    """Holm (1979): reject H_(1..k-1) for the first k with p_(k) > alpha / (m - k + 1)."""
    g = np.random.default_rng(0)
    for _ in range(200):
        p = list(g.uniform(0, 0.1, size=g.integers(1, 8)))
        order = sorted(range(len(p)), key=p.__getitem__)
        rejected = set()
        for rank, i in enumerate(order):
            if p[i] > 0.05 / (len(p) - rank):
                break
            rejected.add(i)
        assert {i for i, a in enumerate(holm(p)) if a < 0.05} == rejected


def test_holm_corrects_over_the_whole_table():
    """Two columns, two rows: the four tests are corrected together, so a cell that would be
    marked alone (p about 0.03) is not marked among four."""
    two = Table("t", "T", (Column("a", "A"), Column("b", "B")), baseline="bl")
    runs = pd.DataFrame([{"condition": c, "a": a, "b": b} for c, col_a, col_b in (
        ("bl", BL, BL), ("x", [12.5, 13.5, 14.0], CLOSE), ("y", CLOSE, CLOSE))
        for a, b in zip(col_a, col_b, strict=True)])
    rows = summarize(runs, two)
    x = rows[1].cells["a"]
    p = [r.cells[k].p for r in rows[1:] for k in ("a", "b")]
    assert 0.01 < x.p < 0.05 and x.p_adjusted == pytest.approx(holm(p)[0])
    assert x.p_adjusted == pytest.approx(4 * x.p) and not x.significant
    md = to_markdown(rows, two)
    assert "Holm-Bonferroni over the table's 4 tests, adjusted p < 0.05" in md
    assert "†" not in line_of(md, "x")
    plain = replace(two, correction=None)
    rows = summarize(runs, plain)
    assert rows[1].cells["a"].significant and rows[1].cells["a"].p_adjusted == rows[1].cells["a"].p
    assert "4 tests, not corrected for multiple comparisons" in to_markdown(rows, plain)


# ------------------------------------------------------------------------------ differences


@pytest.mark.parametrize("a, b", [([1.0, 2.0, 3.5], [2.0, 3.0, 7.0, 9.0]),
                                  ([16.1, 17.9, 18.5], [15.0, 16.2, 16.9]),
                                  ([0.30, 0.31], [0.20, 0.26, 0.21, 0.19, 0.25])])
def test_difference_interval_matches_scipy_and_the_formula(a, b):
    diff = welch_difference(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert diff.estimate == pytest.approx(np.mean(a) - np.mean(b))
    assert (diff.low, diff.high) == pytest.approx((ci.low, ci.high), rel=1e-9)
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert diff.high - diff.estimate == pytest.approx(half, rel=1e-9)
    # 0 lies outside the interval exactly when the two-sided p is below 0.05
    assert (diff.low > 0 or diff.high < 0) == (welch_p(a, b) < 0.05)
    wider = welch_difference(a, b, level=0.99)
    assert wider.low < diff.low and wider.high > diff.high


def test_difference_edge_cases():
    assert welch_difference([1.0], [1.0, 2.0]) is None
    point = welch_difference([2.0, 2.0], [1.0, 1.0])
    assert (point.estimate, point.low, point.high) == (1.0, 1.0, 1.0)


def test_differences_table():
    rows = summarize(frame({"bl": BL, "close": CLOSE, "far": FAR, "one": [5.0]}), table())
    assert has_differences(rows, table())
    md = differences_markdown(rows, table())
    assert "| bl |" not in md and md.startswith("**T: difference to bl.**")
    assert line_of(md, "far") == "| far | +10.0 [+7.7, +12.3]† |"  # scipy: 7.733, 12.267
    assert line_of(md, "close") == "| close | +0.5 [−1.8, +2.8] |"
    assert line_of(md, "one") == "| one | – |"
    assert "95 % Welch-Satterthwaite confidence interval" in md and "Holm-Bonferroni" in md
    assert "–: fewer than 2 runs on a side" in md
    tex = differences_latex(rows, table())
    assert "\\label{tab:t_vs_baseline}" in tex
    assert line_of_tex(tex, "far").endswith("+10.0 [+7.7, +12.3]$^\\dagger$ \\\\")
    assert "$-$1.8" in line_of_tex(tex, "close")
    assert not has_differences(summarize(frame({"bl": BL, "x": FAR}), table(None)), table(None))


def test_table_rows_must_hold_the_baseline():
    with pytest.raises(ConfigError, match="baseline 'bl' is not among its rows"):
        table(rows=("x", "y"))
    with pytest.raises(ConfigError, match="each condition once"):
        table(rows=("bl", "bl"))
    with pytest.raises(ConfigError, match="correction"):
        table(correction="bonferroni")


def test_imports_neither_ray_nor_mlflow():
    code = ("import sys, studies.tables; "
            "print(sorted(m for m in ('ray', 'mlflow', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_run_description_holds_the_tables_that_fit_and_names_the_others():
    """MLflow cuts a tag past its limit mid-row (ltd_probe's three tables: 10,554 characters);
    the description keeps whole tables, in order, within the bytes every store keeps, and names
    the rest."""
    from studies.report import fit_description
    from studies.tracking import MAX_TAG_BYTES

    limit = MAX_TAG_BYTES
    tables = [Table(name, name.upper(), (Column("m", "M"),)) for name in ("a", "b", "c")]
    small = ["| a |", "| b |", "| c |"]
    assert fit_description(small, tables) == "| a |\n\n| b |\n\n| c |"
    big = ["x" * (limit // 2), "y" * (limit // 2), "z"]
    text = fit_description(big, tables)
    assert len(text) <= limit
    assert text.startswith("x" * (limit // 2) + "\n\n")
    assert "y" not in text and "z" not in text.replace("`report/", "")
    assert text.endswith("More tables among this run's artifacts: `report/b.md`, `report/c.md`.")
    wide = ["\u00b1" * (limit // 4), "\u00b1" * (limit // 4)]  # 2 bytes a character in UTF-8
    assert fit_description(wide, tables[:2]).startswith(wide[0] + "\n\nMore tables")


# ------------------------------------------------------------------------------ COCO 1K


def test_protocol_tables_add_the_1k_table_only_when_runs_carry_it():
    t = Table("table1", "Table 1", (Column("test_i2t_R_at_1", "R@1", "i2t"),
                                    Column("test_rsum", "rsum"),
                                    Column("lambda", "lambda", better=None, unit="")),
              baseline="a", caption="test split")
    runs = pd.DataFrame([{"condition": c, "test_i2t_R_at_1": v, "test_rsum": 3 * v,
                          "test_1k_i2t_R_at_1": v + 10, "test_1k_rsum": 3 * v + 30,
                          "test_1k_fold_images": 1000.0, "lambda": 1.0}
                         for c, v in (("a", 40.0), ("a", 42.0), ("b", 50.0), ("b", 52.0))])
    full, folds = protocol_tables((t,), runs)
    assert full is t
    assert folds.name == "table1_1k" and [c.key for c in folds.columns] == [
        "test_1k_i2t_R_at_1", "test_1k_rsum"]  # lambda has no 1K value
    assert "5 folds of 1,000 images" in folds.caption and "not comparable" not in folds.caption
    rows = summarize(runs, folds, ["a", "b"])
    assert rows[0].cells["test_1k_rsum"].mean == pytest.approx(153.0)
    assert protocol_tables((t,), runs.drop(columns=[c for c in runs if "1k_" in c])) == (t,)
    scaled = protocol_tables((t,), runs.assign(test_1k_fold_images=4.0))[1]
    assert "5 folds of 4 images" in scaled.caption and "not comparable" in scaled.caption


def test_record_table_of_the_1k_table_shows_the_test_row():
    t = Table("t", "T", (Column("test_rsum", "rsum"),))
    record = {"val_rsum": 100.0, "test_rsum": 90.0, "test_1k_rsum": 120.0,
              "test_1k_fold_images": 4.0}
    tables = protocol_tables((t,), record)
    md = record_table(record, tables[1])
    assert line_of(md, "test") == "| test | 120.0 |" and "| val |" not in md
