"""User-facing errors.

A :class:`ConfigError` means "the input is wrong, here is what to change". It is
raised by pure validation code that every rank runs on identical inputs *before*
any collective, so every rank raises the same message and nobody is left waiting
in a collective. The CLI turns it into a one-line message and a non-zero exit on
every rank.
"""


class ConfigError(ValueError):
    """Invalid user input (grid, model sizes, presets, options)."""


class BackendError(RuntimeError):
    """The requested array backend or device cannot be used on this rank."""


class TraceError(ConfigError):
    """A trace file or per-rank spool directory that cannot be written or read as asked."""


class DamagedTraceError(TraceError):
    """A readable trace whose values cannot be analysed as they are (NaN or negative times, a rank's
    events missing): offline commands skip it unless ``--allow-damaged``."""


class Terminated(BaseException):
    """SIGTERM (a scheduler's time limit or ``scancel``, ``kill``, ``timeout``) raised as an exception in
    the main thread while ``fourd-mpi run`` runs, as Ctrl-C raises :class:`KeyboardInterrupt`: the run
    records ``interrupted: SIGTERM ...`` in its spool, its trace writers remove their temporary files,
    and the job exits with status 143 (128 + 15). A ``BaseException``, so no ``except Exception`` swallows it."""
