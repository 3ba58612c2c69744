"""``util.table``: the one table formatter (tabulate) behind every command's tables, and its one Markdown dialect."""

import pandas as pd
import pytest

from fourd_mpi.analysis.tables import format_table
from fourd_mpi.util.table import markdown_escape, numeric_column, render
from fourd_mpi.util.text import format_rows


def test_plain_table_prints_cells_as_given_numbers_right_text_left():
    text = render([["a", "0.05739", "1.2e+07"], ["bb", "3891.6", "-"]], ["name", "median s", "flops"])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "median", "s", "flops"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    # the digits exactly as the caller formatted them (no re-parsing: 0.05739 is not 0.0574, 1.2e+07 not 12000000)
    assert "0.05739" in lines[2] and "1.2e+07" in lines[2] and "3891.6" in lines[3]
    assert lines[2].startswith("a ") and lines[2].rstrip().endswith("1.2e+07")  # text left, numbers right
    assert lines[2].index("0.05739") + len("0.05739") == lines[3].index("3891.6") + len("3891.6")
    assert all(line == line.rstrip() for line in lines)


def test_markdown_is_one_github_pipe_dialect_with_escaped_bars():
    text = render([["x|y", "1.5"]], ["what", "value"], "markdown")
    head, rule, row = text.splitlines()
    assert head.startswith("| what") and head.endswith("|")
    assert [c.strip() for c in rule.strip("|").split("|")][1].endswith(":")  # the number column aligned right
    assert "x\\|y" in row and markdown_escape("a|b") == "a\\|b"
    # every command's markdown is the same dialect: the pandas tables and the plain rows
    df = pd.DataFrame({"what": ["x"], "value": [1.5]})
    assert format_table(df, "markdown").splitlines()[1] == format_rows([{"what": "x", "value": 1.5}],
                                                                       "markdown").splitlines()[1]


def test_numeric_columns_and_refusals():
    assert numeric_column(["1", "-", "2.5e-3"]) and not numeric_column(["-", ""]) and not numeric_column(["1", "x"])
    assert render([[None, 1]], ["a", "b"]).splitlines()[2].split() == ["-", "1"]
    assert render([], ["a", "b"]).splitlines()[0].split() == ["a", "b"]
    assert all(line.startswith("  ") for line in render([["1"]], ["a"], indent="  ").splitlines())
    with pytest.raises(ValueError, match="2 cells"):
        render([["1"]], ["a", "b"])
    with pytest.raises(ValueError, match="style"):
        render([["1"]], ["a"], "html")
    with pytest.raises(ValueError, match="align"):
        render([["1"]], ["a"], align=["centre"])
