"""A fault-injecting FUSE file system for the tests: a pass-through mirror of a backing directory whose
I/O fails on demand, from the kernel, as a failing disk or a network file system does.

    python tests/helpers/faultfs.py BACKING MOUNTPOINT CONTROL [--nolock]

runs in the foreground until unmounted (``fusermount -u MOUNTPOINT``) or until the process that started
it ends (it then unmounts itself: no mount outlives a killed test run). Needs ``/dev/fuse``, the
``mfusepy`` package and libfuse (Debian: ``fuse libfuse2``).

Faults, read from the JSON file ``CONTROL`` (outside the mount) before every operation, so a test changes
them at run time by rewriting that file (``os.replace``)::

    {"eio": {"match": ["*.events"],          # fnmatch patterns of file names (default: every file)
             "ops": ["write", "fsync"],      # which of write, fsync, read, truncate fail (default: all)
             "after_bytes": 0,               # bytes written to matching files before it fails (a short
                                             # write at the limit, then EIO)
             "armed_by": "inject-fault.touch"}}  # only once a file of that name was created in the mount
                                             # (after the control file last changed): a run's
                                             # ``--inject-fault RANK:STEP:touch`` creates it at a known step

A failing operation returns ``EIO`` (``"errno": "ENOSPC"`` etc. chooses another). Every fault that fired
is counted in ``CONTROL.hits`` (``{"write": 3, ...}``), so a test can check that the kernel really
delivered it.

``--nolock``: POSIX (``fcntl``/``lockf``) and BSD (``flock``) locks fail with ``ENOLCK``, as on an NFS
mount without a lock manager (``nolock``, no ``local_lock``) or some FUSE and Lustre mounts (a mount
option: the kernel decides at mount time whether the file system handles locks). Without it, locks are
the kernel's local ones and work as on a local disk.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import subprocess
import sys
import threading
import time

import mfusepy as fuse

#: operations a rule can fail
FAULT_OPS = ("write", "fsync", "read", "truncate")


class Faults:
    """The control file's rules, re-read when the file changes (``stat`` per operation)."""

    def __init__(self, control: str):
        self.control = control
        self.hits_path = control + ".hits"
        self._key = None
        self.rule = None
        self.armed = False
        self.written = 0
        self.hits = {}
        self.lock = threading.Lock()

    def _reload(self) -> None:
        try:
            st = os.stat(self.control)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key == self._key:
            return
        self._key = key
        rule = None
        if key is not None:
            try:
                with open(self.control) as fh:
                    rule = json.load(fh).get("eio")
            except (OSError, ValueError):
                rule = None
        self.rule = rule if isinstance(rule, dict) else None
        self.armed = self.rule is not None and not self.rule.get("armed_by")
        self.written = 0

    def created(self, path: str) -> None:
        """A file or directory ``path`` was created: arms a rule waiting for that name."""
        with self.lock:
            self._reload()
            if self.rule is not None and os.path.basename(path) == self.rule.get("armed_by"):
                self.armed = True

    def check(self, op: str, path, size: int = 0) -> int:
        """Bytes of ``size`` that may go through (``size`` when no fault applies); raises the fault."""
        with self.lock:
            self._reload()
            rule = self.rule
            if rule is None or not self.armed or op not in rule.get("ops", FAULT_OPS):
                return size
            name = os.path.basename(path or "")
            if not any(fnmatch.fnmatchcase(name, p) for p in rule.get("match", ["*"])):
                return size
            allowed = max(0, int(rule.get("after_bytes", 0)) - self.written) if op == "write" else 0
            if op == "write" and allowed > 0:
                done = min(size, allowed)
                self.written += done
                return done
            self.hits[op] = self.hits.get(op, 0) + 1
            tmp = f"{self.hits_path}.{os.getpid()}"
            with open(tmp, "w") as fh:
                json.dump(self.hits, fh)
            os.replace(tmp, self.hits_path)
            raise fuse.FuseOSError(getattr(errno, str(rule.get("errno", "EIO"))))


class FaultFS(fuse.Operations):
    """Pass-through of ``backing`` (paths relative to it), descriptors as file handles."""

    use_ns = True
    flag_nullpath_ok = True  # hard_remove: I/O on an unlinked open file comes without a path

    def __init__(self, backing: str, faults: Faults):
        self.backing = os.path.realpath(backing)
        self.faults = faults

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    # metadata ---------------------------------------------------------------------------------------
    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime", "st_ctime")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def access(self, path, amode):
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._real(path))

    def readlink(self, path):
        return os.readlink(self._real(path))

    def statfs(self, path):
        st = os.statvfs(self._real(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}

    def chmod(self, path, mode):
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.lchown(self._real(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        os.utime(self._real(path), ns=times)
        return 0

    # names ------------------------------------------------------------------------------------------
    def mkdir(self, path, mode):
        os.mkdir(self._real(path), mode)
        self.faults.created(path)
        return 0

    def rmdir(self, path):
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path):
        os.unlink(self._real(path))
        return 0

    def rename(self, old, new):
        os.rename(self._real(old), self._real(new))
        return 0

    def link(self, target, source):
        os.link(self._real(source), self._real(target))
        return 0

    def symlink(self, target, source):
        os.symlink(source, self._real(target))
        return 0

    def mknod(self, path, mode, dev):
        os.mknod(self._real(path), mode, dev)
        self.faults.created(path)
        return 0

    # files ------------------------------------------------------------------------------------------
    def open(self, path, flags):
        return os.open(self._real(path), flags)

    def create(self, path, mode, flags):
        fd = os.open(self._real(path), flags | os.O_CREAT, mode)
        self.faults.created(path)
        return fd

    def read(self, path, size, offset, fh):
        self.faults.check("read", path)
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        allowed = self.faults.check("write", path, len(data))
        return os.pwrite(fh, data[:allowed], offset)

    def truncate(self, path, length, fh=None):
        self.faults.check("truncate", path)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)
        return 0

    def fsync(self, path, datasync, fh):
        self.faults.check("fsync", path)
        os.fsync(fh)
        return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)
        return 0


class NoLocks(FaultFS):
    """POSIX and BSD locks refused with ENOLCK (ENOSYS would make the kernel fall back to local locks)."""

    def lock(self, path, fh, cmd, lock):
        raise fuse.FuseOSError(errno.ENOLCK)

    def flock(self, path, fh, op):
        raise fuse.FuseOSError(errno.ENOLCK)


def unmount_when_orphaned(mountpoint: str, parent: int) -> None:
    """The process that started us ended (a killed test run): unmount, so no mount stays behind."""
    while os.getppid() == parent:
        time.sleep(0.5)
    for cmd in (["fusermount", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        try:
            if subprocess.run(cmd, capture_output=True).returncode == 0:
                return
        except FileNotFoundError:  # no fusermount (root mounts without it)
            continue


def main(argv) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 3:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    backing, mountpoint, control = args
    operations = (NoLocks if "--nolock" in argv else FaultFS)(backing, Faults(os.path.abspath(control)))
    threading.Thread(target=unmount_when_orphaned, args=(mountpoint, os.getppid()), daemon=True).start()
    # hard_remove: an unlinked open file is gone at once (no .fuse_hidden* file, st_nlink 0 as on a disk);
    # attribute and entry caches off: a test that changes the backing directory sees it at once;
    # direct_io: no page cache in between, every read and write reaches the rules (a read of what was
    # just written fails too, as on a disk that died)
    fuse.FUSE(operations, mountpoint, foreground=True, nothreads=False, hard_remove=True, attr_timeout=0,
              entry_timeout=0, negative_timeout=0, direct_io=True, fsname="faultfs", subtype="faultfs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
