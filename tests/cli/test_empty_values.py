"""Every option and positional of every command that takes a value refuses ``''`` in one line, exit 2, no
traceback: walked from the parser itself (:func:`fourd_mpi.cli.main.build_parser`), so a new option is
covered the day it is added. Text values get the one refusal of :func:`fourd_mpi.cli.args.refuse_empty_values`
(``expected a value, got ''``); typed ones (numbers, sizes, lists) their own line, which names the ''.
Before: ``model predict --profile ''`` (and its other ``type=str`` options), ``compare --ignore ''`` and the
old spelling ``bench collectives --table ''`` took the empty value."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.cli.args import EMPTY_ALLOWED, walk_parsers
from fourd_mpi.cli.main import build_parser, main
from fourd_mpi.errors import ConfigError

PARSER = build_parser()


def value_actions():
    """``(command words, option or positional, action)`` of every action that takes a value."""
    out = []
    for words, parser in walk_parsers(PARSER):
        for action in parser._actions:
            if (action.nargs == 0 or isinstance(action, (argparse._SubParsersAction, argparse._HelpAction,
                                                         argparse._VersionAction))
                    or action.nargs in (argparse.REMAINDER, argparse.PARSER) or action.dest in EMPTY_ALLOWED):
                continue
            out.append((words, action.option_strings[-1] if action.option_strings else action.dest, action))
    return out


ACTIONS = value_actions()


def test_the_walk_finds_the_options_that_took_an_empty_value():
    found = {(" ".join(words), name) for words, name, _ in ACTIONS}
    assert len(found) > 300
    for case in [("model predict", "--profile"), ("model predict", "--grid"), ("compare", "--ignore"),
                 ("bench collectives", "--table"), ("sweep render", "--out"), ("results list", "--grid"),
                 ("trace recover", "--output"), ("testbed down", "--name")]:
        assert case in found, case


@pytest.mark.parametrize("words, name, action", ACTIONS, ids=[f"{' '.join(w)} {n}" for w, n, _ in ACTIONS])
def test_an_empty_value_is_refused_in_one_line(words, name, action):
    """At parsing (the command never starts): a :class:`ConfigError` of one line, which the entry point prints as
    its one line with exit 2 (below, through :func:`main`, for one option of each kind)."""
    argv = [*words, *([name, ""] if action.option_strings else [""])]
    with pytest.raises(ConfigError) as refused:
        PARSER.parse_args(argv)
    message = str(refused.value)
    assert "\n" not in message and "''" in message, message
    if action.type is None or getattr(action.type, "__name__", "") in ("text", "required_text"):
        assert "expected a value, got ''" in message, message


@pytest.mark.parametrize("argv", [
    ["model", "predict", "--profile", ""], ["compare", "--ignore", ""], ["sweep", "render", "--out", ""],
    ["results", "list", "--grid", ""], ["trace", "recover", ""], ["tune", "--ranks", ""],
    ["export", "--format", ""], ["testbed", "down", "--name", ""],
])
def test_main_prints_the_refusal_in_one_line(argv, capfd):
    assert main(argv) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "''" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["model", "predict", "--profile", ""],
    ["bench", "collectives", "--table", ""],
])
def test_the_entry_point_refuses_it(argv):
    """Through the installed entry point (bench: rank 0 of a one-rank launch says it)."""
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", *argv], capture_output=True, text=True, timeout=120,
                          env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "expected a value, got ''" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_predict_config_value_is_refused_like_the_option(tmp_path, capfd):
    config = tmp_path / "p.yaml"
    config.write_text('profile: ""\n')
    assert main(["model", "predict", "--config", str(config), "--batch", "16", "--grid", "1x1x1x1"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == f"fourd-mpi: error: --config {config}: profile: expected a value, got '' (leave the option out for " \
                  "its default)"
