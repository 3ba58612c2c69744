"""Typed values from text: the parsers behind command-line options and spec values.

Each parser takes the text a user wrote and returns the value, or raises
:class:`argparse.ArgumentTypeError` whose message says what was expected and what
came (argparse prints it as is; :meth:`fourd_mpi.run.options.Option.parse` turns it
into a :class:`~fourd_mpi.errors.ConfigError`). Pure: no MPI, no I/O.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, List

from fourd_mpi.errors import ConfigError
from fourd_mpi.util.units import GIB


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A parser of integers ``>= minimum`` whose message says so."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = "positive_int" if minimum == 1 else f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def int_in(minimum: int, maximum: int, what: str = "") -> Callable[[str], int]:
    """A parser of integers in ``[minimum, maximum]`` whose message names both bounds (and, when
    given, ``what`` the bound is about)."""
    base = int_at_least(minimum)

    def parse(text: str) -> int:
        value = base(text)  # below the minimum: its words (a positive integer, an integer >= 0)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum:,} to {maximum:,}"
                                             f"{' (' + what + ')' if what else ''}, got {value:,}")
        return value

    parse.__name__ = f"int_in_{minimum}_{maximum}"
    return parse


#: the most ranks the model, the tuner and the planners accept: 2^24 = 16,777,216, about 400 times
#: the GPU count of the largest machine of today's TOP500 (the enumeration of grids is then bounded)
MAX_RANKS = 1 << 24
rank_count = int_in(1, MAX_RANKS, "the most ranks the model plans for")

# The sane range of every count a user types (the option table and the other parsers use these), each
# far beyond any real use and small enough that no size computed from it overflows or exhausts memory
# before a check can say so: one line naming the bound instead of an OverflowError or MemoryError.
#: a grid axis (G_x, G_y, G_z, G_data, G_inter) or a count of ranks per node or per group
axis_size = int_in(1, MAX_RANKS, "at most the 2^24 ranks the model plans for")
#: ranks per part file (0: automatic)
group_size = int_in(0, MAX_RANKS, "at most the 2^24 ranks the model plans for")
#: transformer blocks (the largest published models have about 100)
MAX_LAYERS = 1 << 16
layer_count = int_in(1, MAX_LAYERS, "transformer blocks")
#: hidden and FFN widths, attention heads
MAX_WIDTH = 1 << 20
width = int_in(1, MAX_WIDTH, "a layer width")
head_count = int_in(1, 1 << 16, "attention heads")
#: vocabulary entries (0: no embedding or LM head)
vocab_size = int_in(0, 1 << 24, "vocabulary entries")
#: tokens of one sequence
seq_length = int_in(1, 1 << 24, "tokens per sequence")
#: a global batch in sequences
batch_size = int_in(1, 1 << 30, "sequences per global batch")
#: training steps: the trace stores them as 32-bit integers
MAX_STEPS = (1 << 31) - 1
step_count = int_in(1, MAX_STEPS, "the trace stores steps as 32-bit integers")
warmup_count = int_in(0, MAX_STEPS, "the trace stores steps as 32-bit integers")
#: seeds of NumPy's generators (every one of them takes 0 .. 2^32 - 1)
MAX_SEED = (1 << 32) - 1
seed_value = int_in(0, MAX_SEED, "a NumPy seed")
#: the seed of a run's synthetic weights and data: 32 bits select them, so every value of this range is a
#: distinct data set (negative seeds stay accepted, as before)
run_seed = int_in(-(1 << 31), (1 << 31) - 1, "a run's data is selected by 32 bits")
#: repetitions of a measurement (iterations, resamples, micro-batches, chunks)
MAX_REPEATS = 1 << 24
repeat_count = int_in(1, MAX_REPEATS, "repetitions")
#: distinct synthetic batches a run holds in memory
data_batch_count = int_in(1, 1 << 12, "synthetic batches held in memory")
#: items of a selection (--select-steps, --select-ranks) and the largest number in one
MAX_SELECTED = 1 << 20
MAX_SELECT_VALUE = MAX_STEPS  # > MAX_RANKS


def float_in(minimum: float, maximum: float, what: str = "a number") -> Callable[[str], float]:
    """A finite number from ``minimum`` to ``maximum`` (``what`` names it in the message)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not minimum <= value <= maximum:  # NaN and text fail here too
            raise argparse.ArgumentTypeError(f"expected {what} from {minimum:g} to {maximum:g}, got {text!r}")
        return value

    parse.__name__ = "float_in"
    return parse


def int_list_of(item: Callable[[str], int], what: str) -> Callable[[str], List[int]]:
    """A parser of comma lists whose items ``item`` parses (``--batch 1024,2048``); an empty list is refused."""

    def parse(text: str) -> List[int]:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r}")
        return [item(t) for t in items]

    parse.__name__ = f"list_of_{getattr(item, '__name__', 'int')}"
    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def poll_flops_value(text: str):
    """``--poll-flops``: ``auto`` (the string: sized from what the run measures) or a finite number > 0."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number of FLOPs, got {text!r}") from None


def text(value: str) -> str:
    """Text that says something: an empty or blank value (``--config ""``, ``--inject-fault ''``, a
    variable that expanded to nothing) is refused, not silently taken as "not given"."""
    if not str(value).strip():
        raise argparse.ArgumentTypeError(f"expected a value, got {value!r} (leave the option out for its default)")
    return value


def number(text: str) -> float:
    """Any float (``--lr``)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def integer(text: str) -> int:
    """Any integer (``--seed``)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_list(text: str) -> List[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``: numbers from 0 to :data:`MAX_SELECT_VALUE`, ranges ``A-B`` with
    ``A <= B`` (both given: ``1-`` is refused, not read as ``1``), at most :data:`MAX_SELECTED` items."""
    out: List[int] = []
    for part in str(text).split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            if dash and first.strip().isdigit() and not last.strip():
                raise argparse.ArgumentTypeError(f"{part!r}: a range needs its last number too, e.g. {first}-"
                                                 f"{int(first) + 3} (an open range is not supported)") from None
            raise argparse.ArgumentTypeError(f"expected a list like 0-3,8 (numbers >= 0), got {text!r}") from None
        if hi > MAX_SELECT_VALUE:
            raise argparse.ArgumentTypeError(f"{part!r}: {hi:,} is beyond the largest step or rank number, "
                                             f"{MAX_SELECT_VALUE:,}")
        if hi < lo:
            raise argparse.ArgumentTypeError(f"{part!r} is an empty range: write the smaller number first "
                                             f"({hi}-{lo})")
        if len(out) + hi - lo + 1 > MAX_SELECTED:
            raise argparse.ArgumentTypeError(f"{text!r} selects {len(out) + hi - lo + 1:,} items or more, beyond the "
                                             f"{MAX_SELECTED:,} a selection may hold (leave the option out for all)")
        out.extend(range(lo, hi + 1))
    return out


class SizeError(ConfigError, argparse.ArgumentTypeError):
    """A size that does not parse (:func:`byte_size`): a :class:`ConfigError` to code that validates specs,
    an :class:`argparse.ArgumentTypeError` to argparse, which then prints its one line as it is."""


#: a size: a number, then a unit of a prefix (none: bytes; K, M, G, T), ``i`` and ``b`` (``64kib``, ``64kb``,
#: ``64k``, ``64b``); a repeated ``i`` or ``b`` (``64kbb``) reads as one, as ``bench collectives`` always read it
_SIZE = re.compile(r"(?P<num>.*?)\s*(?:(?P<prefix>[kmgt])(?P<i>i?))?(?P<b>b?)", re.I | re.S)
_PREFIX_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def byte_size(text: str, *, decimal: bool = True, bare: bool = False, what: str = "size") -> int:
    """Bytes of a size: the one parser of sizes (``--memory-limit`` through :func:`memory_limit`, ``bench
    collectives --min-size/--max-size``, ``testbed up --burst``, ``bench/gpu_copy.py --sizes``). A number (what
    ``float`` reads, finite and not negative; a fraction of a byte is dropped) and a unit, case-insensitive, with
    or without a space between them:

    - ``B``: bytes; ``K``, ``M``, ``G``, ``T`` and ``KiB`` .. ``TiB``: powers of 1024;
    - ``KB`` .. ``TB``: the spelling the callers disagree on, so ``decimal`` says: powers of 1000 where True (the
      default: ``--memory-limit``, ``gpu_copy.py``; ``2GB`` = 2*10^9), powers of 1024 where False (``bench
      collectives`` and ``testbed up --burst``, as tc(8) reads ``64kb`` = 65,536);
    - no unit: bytes where ``bare`` (``bench collectives``, ``--burst``: ``4096``); elsewhere only ``0`` (a bare
      ``40`` could mean bytes or, as :func:`memory_limit` reads it, GiB).

    Known answers: ``"64K"`` = ``"64 KiB"`` = 65,536; ``"1MiB"`` = 1,048,576; ``"3.5GiB"`` = 3,758,096,384;
    ``"2 GB"`` = 2,000,000,000 (``decimal=False``: 2,147,483,648); ``"4096"`` (``bare``) = 4,096. Anything else:
    a one-line :class:`SizeError` naming ``what`` and the text, what was expected and an example. Range checks
    (at least one byte, at most a buffer) are the callers'."""
    match = _SIZE.fullmatch(str(text).strip())
    try:  # float reads "nan" and "-0" too: both refused below
        number = float(match.group("num")) if match and "-" not in match.group("num")[:1] else None
    except ValueError:
        number = None
    prefix, i, b = (match.group(g) or "" for g in ("prefix", "i", "b")) if match else ("", "", "")
    if number is not None and ((prefix, i, b) != ("", "", "") or bare or number == 0):
        decimal_b = decimal and b and not i
        value = number * (1000 if decimal_b else 1024) ** _PREFIX_POWER[prefix.lower()]
        if 0 <= value < float("inf"):
            return int(value)
    units = ("B; K, M, G, T and KiB .. TiB: powers of 1024; KB .. TB: powers of 1000" if decimal
             else "B; K, M, G, T, KB .. TB and KiB .. TiB: all powers of 1024")
    raise SizeError(f"{what} {text!r} does not parse: expected a size: "
                    + (f"bytes, or a number and a unit ({units}), e.g. 64K or 4096" if bare
                       else f"a number and a unit ({units}), or 0, e.g. 3.5GiB or 800MB"))


def memory_limit(text: str) -> int:
    """``--memory-limit`` of every command (run, tune, model predict, model paper; sweep specs): bytes per rank,
    0 for no limit. One grammar: a size with a unit (``80GiB``, ``80G``, ``3.5GiB``, ``800MB``: units of
    :func:`byte_size`), a bare number of GiB (``40`` = 40 GiB), or ``none``/``0`` (no limit). NaN, inf and
    negative numbers are refused. Known answers: ``"40"`` and ``"40G"`` -> 42,949,672,960; ``"none"`` -> 0."""
    word = str(text).strip().lower()
    if word in ("none", "0"):
        return 0
    try:
        value = float(word)
    except ValueError:
        value = None
    if value is not None:
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a size such as 80GiB or 800MB, a number of GiB (40) or none "
                                             f"(0: no limit), got {text!r}")
        return int(value * GIB)
    try:
        return byte_size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GiB or 800MB, a number of GiB (40) or none "
                                         f"(0: no limit), got {text!r}") from None
