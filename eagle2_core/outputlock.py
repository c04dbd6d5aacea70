"""One run at a time per output file: `eagle2 generate` resumes by reading which ids an output
already holds, so two runs started on the same file would both see none done and both answer
every prompt. The run holds an exclusive lock for its whole length; a second one is refused.

The lock is `flock` on a sidecar `PATH.lock` (not on the output itself, which `--restart`
truncates and the writer reopens). The kernel drops a flock when its holder dies, kill -9
included, so a lock left by a dead run never blocks the next one; the pid written into the
sidecar is only there to name the holder in the refusal.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not guarded there
    fcntl = None


class OutputLocked(Exception):
    """Another live process holds the output's lock."""

    def __init__(self, path: str, pid: int | None):
        self.path, self.pid = path, pid
        holder = f"process {pid}" if pid else "another process"
        super().__init__(f"{path}: {holder} is already writing this output; wait for it to finish or use another -o")


def lock_path(path: str) -> str:
    return path + ".lock"


def _holder(fd: int) -> int | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


@contextmanager
def lock_output(path: str):
    """Hold `path`'s lock for the block; OutputLocked at once if a live process holds it."""
    if fcntl is None or path == "-":
        yield
        return
    sidecar = lock_path(path)
    while True:
        fd = os.open(sidecar, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputLocked(path, holder) from None
        try:
            same = os.stat(sidecar).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        # A run that finished between our open and our lock removed the sidecar: our lock is on
        # a file nobody will open again, so lock the current one instead.
        os.close(fd)
    try:
        # Ours now: the pid of a dead holder may still be in the file, so replace it.
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:  # a full disk: the pid only names us in a refusal, the flock is the lock
            pass
        yield
    finally:
        try:
            os.unlink(sidecar)  # while still locked, so nobody can take a lock on it after us
        except OSError:
            pass
        os.close(fd)  # closing drops the flock
