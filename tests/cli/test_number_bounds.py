"""Every number bounded where it is parsed, in one line that names the bound.

Before: ``--layers 2^63`` was an OverflowError on ``run``, ``info`` and ``tune``; ``run --steps 2^63``
was accepted; ``bench collectives --max-size 1e308`` (also ``2^63``, ``4G``) and ``--iters 2^63`` grew
memory until killed; ``compare --seed -1`` and ``model compare-axonn --batch 0`` were tracebacks;
``--select-steps 0-999999999999`` a MemoryError; ``--select-steps 3-1`` exported nothing with exit 0
and ``1-`` meant step 1 only; a profile with ``beta_s_per_byte: .nan`` or ``alpha_s: .inf`` was
accepted and changed ``tune``'s winner. The commands that run under MPI are parsed here without it
(a bad option is refused before MPI starts).
"""

from __future__ import annotations

import argparse

import pytest
from conftest import REPO

from fourd_mpi.cli.main import main
from fourd_mpi.util.values import int_list

BIG = str(2 ** 63)
TRACE = str(REPO / "results" / "samples" / "weak-1.h5")

PROBES = [
    (["run", "--layers", BIG], "argument --layers: expected an integer from 1 to 65,536 (transformer blocks)"),
    (["info", "--layers", BIG], "argument --layers: expected an integer from 1 to 65,536"),
    (["tune", "--ranks", "8", "--layers", BIG], "argument --layers: expected an integer from 1 to 65,536"),
    (["run", "--steps", BIG], "argument --steps: expected an integer from 1 to 2,147,483,647 (the trace stores "
                              "steps as 32-bit integers)"),
    (["run", "--hidden", BIG], "argument --hidden: expected an integer from 1 to 1,048,576"),
    (["run", "--gx", BIG], "argument --gx: expected an integer from 1 to 16,777,216"),
    (["run", "--seed", BIG], "argument --seed: expected an integer from -2,147,483,648 to 2,147,483,647 (a run's "
                             "data is selected by 32 bits)"),
    (["bench", "collectives", "--max-size", "1e308"], "argument --max-size: '1e308' is larger than the largest "
                                                      "message, 1G (1,073,741,824 bytes)"),
    (["bench", "collectives", "--max-size", "4G"], "'4G' is larger than the largest message"),
    (["bench", "collectives", "--max-size", BIG], "is larger than the largest message"),
    (["bench", "collectives", "--max-size", "inf"], "argument --max-size: message size 'inf' does not "
                                                     "parse: expected a size: bytes, or a number and a unit"),
    (["bench", "collectives", "--iters", BIG], "argument --iters: expected an integer from 1 to 1,048,576"),
    (["bench", "collectives", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["bench", "collectives", "--factor", "1"], "argument --factor: expected an integer >= 2, got 1"),
    (["compare", TRACE, "--baseline", TRACE, "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["model", "compare-axonn", "--batch", "0"], "argument --batch: expected a positive integer, got 0"),
    (["model", "compare-axonn", "--batch", ","], "argument --batch: expected a comma list of global batches"),
    (["export", "perfetto", TRACE, "-o", "x.json", "--select-steps", "0-999999999999"],
     "'0-999999999999': 999,999,999,999 is beyond the largest step or rank number, 2,147,483,647"),
    (["export", "perfetto", TRACE, "-o", "x.json", "--select-steps", "3-1"],
     "'3-1' is an empty range: write the smaller number first (1-3)"),
    (["plot", "timeline", TRACE, "-o", "x.png", "--select-steps", "1-"],
     "'1-': a range needs its last number too, e.g. 1-4"),
    (["trace", "recover", "x.ranks", "--jobs", BIG], "argument --jobs: expected an integer from 1 to 4,096"),
    # model predict: every size with run's and tune's bounds (before: --layers 10000000 grew to 15 GB,
    # --memory-limit nan printed "does NOT fit in nan GiB")
    *[(["model", "predict", "--grid", "1x1x1x1", "--batch", "8", f"--{opt}", value], message)
      for opt, value, message in (
        ("layers", "10000000", "argument --layers: expected an integer from 1 to 65,536 (transformer blocks)"),
        ("hidden", BIG, "argument --hidden: expected an integer from 1 to 1,048,576"),
        ("ffn-hidden", "0", "argument --ffn-hidden: expected a positive integer, got 0"),
        ("heads", BIG, "argument --heads: expected an integer from 1 to 65,536"),
        ("seq", BIG, "argument --seq: expected an integer from 1 to 16,777,216"),
        ("batch", BIG, "argument --batch: expected an integer from 1 to 1,073,741,824"),
        ("vocab", BIG, "argument --vocab: expected an integer from 0 to 16,777,216"),
        ("ginter", BIG, "argument --ginter: expected an integer from 1 to 16,777,216"),
        ("microbatches", BIG, "argument --microbatches: expected an integer from 1 to 16,777,216"),
        ("ranks-per-node", BIG, "argument --ranks-per-node: expected an integer from 1 to 16,777,216"),
        ("memory-limit", "nan", "argument --memory-limit: expected a size such as 80GiB or 800MB, a number of GiB "
                                "(40) or none (0: no limit), got 'nan'"),
        ("memory-limit", "inf", "argument --memory-limit: expected a size such as 80GiB or 800MB, a number of GiB "
                                "(40) or none (0: no limit), got 'inf'"),
        ("memory-limit", "-1", "argument --memory-limit: expected a size such as 80GiB or 800MB"),
        ("dw-window", BIG, "--dw-window: expected an integer from 1 to 65,536"),
    )],
]


@pytest.mark.parametrize("argv, message", PROBES, ids=[" ".join(p[0])[:50] for p in PROBES])
def test_a_number_out_of_its_range_is_one_line_naming_the_bound(argv, message, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "Traceback" not in err, err
    assert message in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_selections():
    assert int_list("0-3,8") == [0, 1, 2, 3, 8] and int_list("5") == [5]
    assert len(int_list(f"0-{2 ** 20 - 1}")) == 2 ** 20
    with pytest.raises(argparse.ArgumentTypeError, match="beyond the 1,048,576 a selection may hold"):
        int_list(f"0-{2 ** 20}")
    with pytest.raises(argparse.ArgumentTypeError, match="numbers >= 0"):
        int_list("-1")


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "-1.0e-9"])
def test_a_profile_with_a_non_finite_or_negative_cost_is_refused(value, tmp_path, capfd):
    laptop = (REPO / "fourd_mpi" / "perf" / "profiles" / "laptop.yaml").read_text()
    assert "beta_s_per_byte: " in laptop
    head, tail = laptop.split("beta_s_per_byte: ", 1)
    number = tail.split("}")[0].split(",")[0].split("\n")[0]
    profile = tmp_path / "bad.yaml"
    profile.write_text((head + "beta_s_per_byte: " + value + tail[len(number):]).replace("name: laptop", "name: bad"))
    assert main(["tune", "--ranks", "8", "--model", "gpt-tiny", "--profile", str(profile)]) == 2
    line = capfd.readouterr().err.strip()
    assert "\n" not in line and "beta_s_per_byte" in line, line
    expected = "is less than the minimum of 0" if value.startswith("-1") else "is not a finite number"
    assert expected in line, line


def test_model_predict_config_values_have_the_command_line_bounds(tmp_path, capfd):
    config = tmp_path / "p.yaml"
    config.write_text("layers: 10000000\nmemory_limit: .nan\n")
    assert main(["model", "predict", "--config", str(config), "--grid", "1x1x1x1", "--batch", "8"]) == 2
    line = capfd.readouterr().err.strip()
    assert line == (f"fourd-mpi: error: --config {config}: layers: expected an integer from 1 to 65,536 "
                    "(transformer blocks), got 10,000,000"), line
