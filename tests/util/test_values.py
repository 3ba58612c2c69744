"""``util.values.byte_size``: the one parser of sizes (``--memory-limit``, ``bench collectives --min-size``,
``testbed up --burst``), known answers for every spelling its callers accept and the one line for the rest."""

import argparse

import pytest

from fourd_mpi.errors import ConfigError
from fourd_mpi.util.values import SizeError, byte_size

KIB, MIB, GIB, TIB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40


# text, bytes with decimal=True (KB = 1000, the default), bytes with decimal=False (KB = 1024, bench and tc)
@pytest.mark.parametrize("text, decimal, binary", [
    ("0", 0, 0),
    ("0K", 0, 0),
    ("1073741824B", GIB, GIB),
    ("8b", 8, 8),
    ("64K", 64 * KIB, 64 * KIB),
    ("64k", 64 * KIB, 64 * KIB),
    ("64 K", 64 * KIB, 64 * KIB),
    ("64KiB", 64 * KIB, 64 * KIB),
    ("64 kib", 64 * KIB, 64 * KIB),
    ("64Ki", 64 * KIB, 64 * KIB),
    ("64KB", 64_000, 64 * KIB),
    ("64kb", 64_000, 64 * KIB),
    ("1MiB", MIB, MIB),
    ("800M", 800 * MIB, 800 * MIB),
    ("800MB", 800_000_000, 800 * MIB),
    ("800 MiB", 800 * MIB, 800 * MIB),
    ("2 GB", 2_000_000_000, 2 * GIB),
    ("2GB", 2_000_000_000, 2 * GIB),
    ("3.5G", int(3.5 * GIB), int(3.5 * GIB)),
    ("3.5GiB", int(3.5 * GIB), int(3.5 * GIB)),
    ("1T", TIB, TIB),
    ("1TiB", TIB, TIB),
    ("1TB", 10 ** 12, TIB),
    (".5K", 512, 512),
    ("8.K", 8 * KIB, 8 * KIB),
    ("1e3K", 1000 * KIB, 1000 * KIB),
    ("1.5B", 1, 1),  # a fraction of a byte is dropped
    ("  4 MiB ", 4 * MIB, 4 * MIB),
])
def test_byte_size_known_answers(text, decimal, binary):
    assert byte_size(text) == decimal
    assert byte_size(text, bare=True) == decimal
    assert byte_size(text, decimal=False, bare=True) == binary


@pytest.mark.parametrize("text, value", [("4096", 4096), ("8", 8), ("1e3", 1000), (" 64 ", 64), ("1.9", 1)])
def test_a_bare_number_is_bytes_only_where_asked(text, value):
    assert byte_size(text, bare=True) == byte_size(text, decimal=False, bare=True) == value
    with pytest.raises(SizeError, match=f"^size '{text}' does not parse: expected a size: a number and a unit"):
        byte_size(text)


UNIT_LINE = ("does not parse: expected a size: a number and a unit (B; K, M, G, T and KiB .. TiB: powers of 1024; "
             "KB .. TB: powers of 1000), or 0, e.g. 3.5GiB or 800MB")
BARE_LINE = ("does not parse: expected a size: bytes, or a number and a unit (B; K, M, G, T, KB .. TB and KiB .. "
             "TiB: all powers of 1024), e.g. 64K or 4096")


@pytest.mark.parametrize("text", ["", "lots", "K", "kb", "-1", "-1G", "-0", "nan", "inf", "infK", "1e400", "1e308T",
                                  "3 parsecs", "64 furlongs", "64kk", "64bi", "64k ib", "0x10", "1,024", "64 K B",
                                  "64kbb", "64iib", "64i", "64kiib"])
def test_bad_sizes_are_one_line_naming_the_value_what_and_an_example(text):
    with pytest.raises(SizeError) as unit_required:
        byte_size(text)
    assert str(unit_required.value) == f"size {text!r} {UNIT_LINE}"
    with pytest.raises(SizeError) as bare:
        byte_size(text, decimal=False, bare=True, what="burst")
    assert str(bare.value) == f"burst {text!r} {BARE_LINE}"
    assert "\n" not in str(bare.value)


def test_the_error_is_a_config_error_and_argparse_prints_its_line():
    assert issubclass(SizeError, ConfigError) and issubclass(SizeError, argparse.ArgumentTypeError)
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--size", type=byte_size)
    with pytest.raises(argparse.ArgumentError, match=r"argument --size: size 'lots' does not parse: expected a size"):
        parser.parse_args(["--size", "lots"])
