"""Run options declared once: the overlap travels typed, defaults come from the option table only, and an
old second spelling (``--cache-weights``) is a hidden alias that says so.

The stored forms (``RunOptions.as_dict``, the resolved config and its index key, the ``check_same``
settings) are known answers computed before the overlap was typed: old traces and ``compare`` still match.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import pytest

from fourd_mpi.cli.main import build_parser
from fourd_mpi.core.grid import GridShape
from fourd_mpi.results.index import config_key
from fourd_mpi.run.build import resolved_settings
from fourd_mpi.run.options import (
    MODEL_SIZES,
    RUN_OPTIONS,
    defaults,
    resolve_values,
    resolved_config,
    run_options,
)
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import resolve_model


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:16]


#: (option values, world size) -> sha256 prefixes of json.dumps of as_dict, resolved_settings and the resolved
#: config, and the index's config key; computed with the overlap still a string
KNOWN = [
    (({}, 1), ("adaa048758d535d0", "4a8f9b9d9171cec8", "311d1b20a6906f81", "806f0af187fc39fb")),
    (({"overlap": "all", "cache_weights": True, "prefetch_depth": 2, "chunks": 3, "gz": 2, "gx": 2}, 4),
     ("8e373ce7ca34fe3f", "c993f7b14f51a64b", "b0da6c7167a8508f", "59cac0d636f7c2f1")),
    (({"overlap": "oag,ors", "steps": 5, "warmup": 0, "dtype": "float64", "gz": 2}, 2),
     ("1cf1640c7b919421", "9cd98d4fd04e7f47", "40df292b11943229", "e37537fea0ad7de0")),
    (({"overlap": "none", "algorithm": "pipeline", "ginter": 2, "microbatches": 2}, 4),
     ("129ce45d6f969604", "b4f3672eea8a7b85", "b65be0216a676b70", "1207d14ab8ba1c0a")),
]


@pytest.mark.parametrize("given, expected", KNOWN)
def test_the_stored_forms_of_the_options_are_unchanged(given, expected):
    values, world = given
    # the hashes were taken when poll was the default progress; the default is now auto, which a run resolves
    # (its trace stores the strategy that ran): with poll named, every stored form is as before
    options = resolve_values({"progress": "poll", **values}, world)
    config = resolved_config("gpt-tiny", options)
    assert (_sha(options.as_dict()), _sha(resolved_settings(options)), _sha(config), config_key(config)) == expected
    default = resolve_values(values, world).as_dict()
    assert default["progress"] == "auto" and {**default, "progress": "poll"} == options.as_dict()


def test_the_overlap_is_parsed_once_into_a_config():
    options = resolve_values({"overlap": "ors,oag", "prefetch_depth": 2, "chunks": 3, "gz": 2}, 2)
    assert options.overlap == OverlapConfig(oag=True, ors=True, prefetch_depth=2, chunks=3)
    stored = options.as_dict()
    assert (stored["overlap"], stored["cache_weights"], stored["prefetch_depth"], stored["chunks"]) == \
        ("oag,ors", False, 2, 3)


def test_both_spellings_of_cache_make_one_run():
    old = resolve_values({"overlap": "all", "cache_weights": True}, 1)
    new = resolve_values({"overlap": "all,cache"}, 1)
    assert old == new and new.overlap.cache
    assert new.as_dict()["overlap"] == "all" and new.as_dict()["cache_weights"] is True
    assert resolved_config("gpt-tiny", old) == resolved_config("gpt-tiny", new)


@pytest.mark.parametrize("text", ["none", "all", "oag", "od,dp", "oag,ors,oar,dp,od,oup", "all,cache", "cache"])
def test_the_stored_overlap_text_parses_back_to_the_same_config(text):
    config = OverlapConfig.parse(text, prefetch_depth=3, chunks=4)
    again = OverlapConfig.parse(config.option_text + (",cache" if config.cache else ""), 3, 4)
    assert again == config


def test_every_resolved_default_is_the_tables():
    table = defaults()
    config = resolved_config("gpt-tiny", resolve_values({}, 1))
    inferred = set(MODEL_SIZES) | {"gdata", "gz", "gy", "gx"}  # from the preset and the world: no defaults
    checked = [o for o in RUN_OPTIONS if o.name in config and o.dest not in inferred]
    assert len(checked) > 20
    for option in checked:
        assert config[option.name] == table[option.dest], option.name
    args = build_parser().parse_args(["run"])
    for option in RUN_OPTIONS:
        assert getattr(args, option.dest) == option.default, option.name


def test_options_built_directly_take_the_tables_defaults():
    options = run_options(resolve_model("gpt-tiny"), GridShape(1, 1, 1, 1), steps=3, overlap="oag")
    assert options.steps == 3 and options.overlap == OverlapConfig(oag=True)
    stored = options.as_dict()
    for option in RUN_OPTIONS:
        if option.dest in stored and option.dest not in ("model", "steps", "overlap"):
            assert stored[option.dest] == option.default, option.name


def test_the_overlap_numbers_have_one_default():
    """``--prefetch-depth`` and ``--chunks``: the table, its help, :class:`OverlapConfig` and its parse all take
    the one constant of :mod:`fourd_mpi.step.overlap`."""
    from fourd_mpi.step.overlap import DEFAULT_CHUNKS, DEFAULT_PREFETCH_DEPTH

    table = {o.dest: o for o in RUN_OPTIONS}
    for dest, default in (("prefetch_depth", DEFAULT_PREFETCH_DEPTH), ("chunks", DEFAULT_CHUNKS)):
        assert table[dest].default == default and f"(default {default})" in table[dest].help, dest
        assert getattr(OverlapConfig(), dest) == getattr(OverlapConfig.parse("oag,od"), dest) == default, dest


def test_cache_weights_is_a_hidden_old_spelling(capfd):
    parser = build_parser()
    run = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    assert "--cache-weights" not in run.format_help() and "--overlap" in run.format_help()
    args = parser.parse_args(["run", "--overlap", "all", "--cache-weights"])
    err = capfd.readouterr().err
    assert err.count("note: --cache-weights is deprecated, use --overlap ...,cache") == 1 and len(err.splitlines()) == 1
    assert resolve_values(vars(args), 1).overlap == OverlapConfig.parse("all,cache")
    parser.parse_args(["run", "--overlap", "all,cache"])
    assert capfd.readouterr().err == ""
