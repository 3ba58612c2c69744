"""Every ``--help`` ends with examples (``fourd_mpi/cli/examples.py``), and every example parses.

The walk finds every parser of :func:`~fourd_mpi.cli.main.build_parser`, so a command added without examples
fails here; each example line is parsed as typed (the words after ``fourd-mpi``), the command after
``testbed mpiexec ... --`` too."""

from __future__ import annotations

import pytest

from fourd_mpi.cli.args import walk_parsers
from fourd_mpi.cli.examples import EXAMPLES, command_words, examples_of
from fourd_mpi.cli.main import build_parser, main

PARSERS = list(walk_parsers(build_parser()))
IDS = [" ".join(path) or "fourd-mpi" for path, _ in PARSERS]


@pytest.mark.parametrize("path, parser", PARSERS, ids=IDS)
def test_every_help_ends_with_examples_that_parse(path, parser, capsys):
    lines = examples_of(parser)
    assert 1 <= len(lines) <= 3, f"{' '.join(path) or 'fourd-mpi'}: {lines}"
    for line in lines:
        commands = command_words(line)
        assert commands, f"{line!r} runs no fourd-mpi command"
        assert any(argv[:len(path)] == list(path) for argv in commands), \
            f"{line!r} is not an example of {' '.join(path)}"
        for argv in commands:
            build_parser().parse_args(argv)  # a ConfigError (one line) names what does not parse
    with pytest.raises(SystemExit):
        main([*path, "--help"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith(lines[-1]) and "\nexamples:\n" in out  # printed as written, not re-wrapped
    for line in lines:
        assert f"\n  {line}\n" in out + "\n"


def test_the_table_names_only_commands_that_exist():
    assert set(EXAMPLES) == {path for path, _ in PARSERS}


def test_the_command_words_of_an_example():
    assert command_words("OMP_NUM_THREADS=1 mpiexec -n 8 .venv/bin/fourd-mpi run --steps 10  # ten steps") == [
        ["run", "--steps", "10"]]
    assert command_words("fourd-mpi completion bash > ~/.bash_completion") == [["completion", "bash"]]
    assert command_words("fourd-mpi testbed mpiexec -n 4 -- fourd-mpi verify --all-grids") == [
        ["testbed", "mpiexec", "-n", "4", "--", "fourd-mpi", "verify", "--all-grids"], ["verify", "--all-grids"]]
    assert command_words("python bench/gpu_bench.py") == []
