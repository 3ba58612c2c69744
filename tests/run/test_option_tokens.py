"""Command-line tokens written for a parsed option value (sweep scripts, resolved configs) parse back to it."""

from fourd_mpi.run.options import lookup


def test_byte_sizes_keep_a_unit_when_written_back():
    """A sweep value ``1KiB`` is parsed to 1024 bytes; the run command must say ``1024B`` (a bare number
    is GiB to ``--memory-limit``), found by the packed-sweep test."""
    option = lookup("memory-limit", "test")
    for text, expected in (("1KiB", 1024), ("3.5GiB", int(3.5 * 2**30)), ("0", 0), ("2GB", 2 * 10**9)):
        value = option.parse(text)
        assert value == expected
        (token,) = option.tokens(value)
        assert option.parse(token.split("=", 1)[1]) == expected


def test_plain_values_round_trip():
    for name, text in (("steps", "7"), ("algorithm", "megatron1d"), ("lr", "0.5"), ("overlap", "oag,ors")):
        option = lookup(name, "test")
        value = option.parse(text)
        (token,) = option.tokens(value)
        assert option.parse(token.split("=", 1)[1]) == value


def test_memory_limit_is_one_grammar_for_run_tune_and_model_predict():
    """``--memory-limit``: a size with a unit, a bare number of GiB, or none/0 (no limit); one parser
    (fourd_mpi.util.values.memory_limit) behind run, tune, model predict and model paper."""
    import argparse

    import pytest

    from fourd_mpi.cli.model_predict import PREDICT_OPTIONS
    from fourd_mpi.util.values import memory_limit

    gib = 1024 ** 3
    assert memory_limit("40") == memory_limit("40G") == memory_limit("40GiB") == 40 * gib
    assert memory_limit("3.5GiB") == 3.5 * gib and memory_limit("800MB") == 800 * 10 ** 6
    assert memory_limit("none") == memory_limit("0") == memory_limit("None") == 0
    for bad in ("nan", "inf", "-1", "lots", "40 apples"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size such as 80GiB"):
            memory_limit(bad)
    assert lookup("memory-limit", "test").type is memory_limit and PREDICT_OPTIONS["memory-limit"][0] is memory_limit
    assert lookup("memory-limit", "test").parse("40") == 40 * gib  # a sweep's bare 40 is 40 GiB, as in tune
