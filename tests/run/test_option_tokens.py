"""Command-line tokens written for a parsed option value (sweep scripts, resolved configs) parse back to it."""

from fourd_mpi.run.options import lookup


def test_byte_sizes_keep_a_unit_when_written_back():
    """A sweep value ``1KiB`` is parsed to 1024 bytes; the run command must say ``1024B`` (a bare number
    is refused by ``--memory-limit``), found by the packed-sweep test."""
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
