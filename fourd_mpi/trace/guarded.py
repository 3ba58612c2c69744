"""The file object under the HDF5 writer: every write checked, so that HDF5 never sees an I/O error
(:class:`GuardedFile`, used by :mod:`fourd_mpi.trace.writer` and :mod:`fourd_mpi.trace.parts`)."""

from __future__ import annotations

import io
import os
from typing import List, Optional


class GuardedFile(io.RawIOBase):
    """The file under the HDF5 writer (h5py's file-object driver): HDF5 never sees an I/O error.

    HDF5 2.0 / h5py 3.16 crash (SIGSEGV, at the latest when the interpreter exits) after a write of
    the default ``sec2`` driver fails and the file is closed: the failed dataset or file close leaves
    half-closed objects behind (reproduced without MPI by filling a small tmpfs). So the first
    failing write is kept in :attr:`error`, and it and every later write go to an in-memory overlay
    that reads see as well: HDF5 sees a consistent file, closes it cleanly, and the writer discards
    the temporary file and reports :attr:`error`. The overlay holds at most what HDF5 writes after
    the failure (its caches at close and the rest of one append).
    """

    def __init__(self, path: str):
        super().__init__()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.pos = 0
        self.error: Optional[OSError] = None
        self._overlay: List[tuple] = []
        self._end = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self._size() + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _size(self) -> int:
        return max(self._end, os.fstat(self.fd).st_size)

    def readinto(self, buffer) -> int:
        n = min(len(buffer), max(0, self._size() - self.pos))
        data = bytearray(os.pread(self.fd, n, self.pos))
        data.extend(bytes(n - len(data)))
        for offset, blob in self._overlay:
            lo, hi = max(offset, self.pos), min(offset + len(blob), self.pos + n)
            if lo < hi:
                data[lo - self.pos:hi - self.pos] = blob[lo - offset:hi - offset]
        buffer[:n] = data
        self.pos += n
        return n

    def write(self, data) -> int:
        view = memoryview(data).cast("B")  # no copy: HDF5's buffer goes to pwrite as it is
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as exc:
                self.error = exc
        if self.error is not None:  # reads apply the pieces in write order: the newest last
            self._overlay.append((self.pos, bytes(view)))
        self.pos += len(view)
        self._end = max(self._end, self.pos)
        return len(view)

    def truncate(self, size: Optional[int] = None) -> int:
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
        self._end = size
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._overlay = []
        super().close()
