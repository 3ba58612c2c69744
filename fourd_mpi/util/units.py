"""Byte units, defined once: binary (IEC) powers of 1024, as every ``GiB`` the model, the tuner and the
messages print (:func:`fourd_mpi.util.text.human_bytes` writes sizes in them). Integers, so that a count of
them stays a byte count (``4 * MIB``); dividing by one gives a float (``need / GIB``)."""

#: bytes in a KiB, MiB, GiB, TiB
KIB = 2 ** 10
MIB = 2 ** 20
GIB = 2 ** 30
TIB = 2 ** 40
