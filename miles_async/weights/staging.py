"""The trainer's shared-memory staging buffer, for an engine on this node that maps it (the embedded engine's
same-node ``tensor`` route, ``shared_memory.py``): each bucket is written once into a ``/dev/shm`` file and only
its layout (file, offset, dtype, shape per tensor) travels over HTTP; the engine copies from its mapping of
the file straight into its parameters.

The buffer is one file per bucket, each kept mapped here and reused by the next update (the same model
makes the same buckets): no fresh pages to fault in per update, and no copy beyond the one write. Each file is
a memfd, which has no name to leak: it goes when the sender closes it (on close, and when an update fails) or
when this process ends however it ends (a trainer actor is often killed outright), and the engines reach it as
``/proc/<this pid>/fd/<fd>``. Without memfd (not Linux) the files are in /dev/shm: removed on close, on a failed
update and at exit (``weakref.finalize``); one left by a process killed outright carries its pid in its name and
is swept by the next buffer made on the node.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "miles-async-wstage-"
_ALIGN = 64  # every tensor starts on a cache line (and on its element size, for the engine's views)

Bucket = list[tuple[str, torch.Tensor]]
# One file of the staged weights as the engine reads it: {"path", "tensors": [[name, dtype, shape, offset]]}.
Segment = dict


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the staging files of processes that no longer run (killed before their finalizer ran)."""
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _remove(os.path.join(directory, name))
            removed.append(name)
    if removed:
        logger.info("removed %d weight staging files of exited processes from %s", len(removed), directory)
    return removed


class _File:
    """One shared-memory file, mapped here as a uint8 tensor: a memfd (no name anywhere, so nothing to leak:
    its memory goes when this process closes it and the engines drop their mappings; engines open it as
    ``/proc/<pid>/fd/<fd>``), or where there is no memfd a file in ``directory``."""

    def __init__(self, directory: str, nbytes: int):
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.size = nbytes
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
            self._finalizer = weakref.finalize(self, os.close, fd)
        else:
            self.path = os.path.join(directory, name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._finalizer = weakref.finalize(self, _remove, self.path)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._finalizer()
            raise
        finally:
            if not self.path.startswith("/proc/"):
                os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer's note on buffers it cannot resize
            self.data = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        # Not mmap.close(): it would unmap under a view still alive (a bucket being posted); the mapping goes
        # with its last reference (torch.frombuffer holds the mmap). The file (or the memfd) goes now.
        self.data = None
        self._map = None
        self._finalizer()


def _layout(bucket: Bucket) -> tuple[list[int], int]:
    offsets, end = [], 0
    for _, t in bucket:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, max(end, _ALIGN)


class StagingBuffer:
    """The staging files of one sender, one per bucket, reused while each still fits its bucket."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self._files: list[_File] = []
        self._swept = False

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self._files]

    def _file(self, index: int, nbytes: int) -> _File:
        if index < len(self._files) and self._files[index].size >= nbytes:
            return self._files[index]
        if not self._swept:
            sweep_stale(self.directory)
            self._swept = True
        made = _File(self.directory, nbytes)
        if index < len(self._files):
            self._files[index].close()
            self._files[index] = made
        else:
            self._files.append(made)
        return made

    def write(self, buckets: Iterable[Bucket]) -> tuple[list[Segment], int]:
        """Copy every bucket into its file (one copy: the cast to the engine's dtype happened in ``iter_buckets``);
        returns the segments for the engine and the bytes written. Files beyond the last bucket are dropped."""
        segments: list[Segment] = []
        written = 0
        count = 0
        for index, bucket in enumerate(buckets):
            offsets, size = _layout(bucket)
            f = self._file(index, size)
            tensors = []
            for (name, t), off in zip(bucket, offsets):
                n = t.numel() * t.element_size()
                f.data[off : off + n].view(t.dtype).view(t.shape).copy_(t.detach())
                tensors.append([name, dtype_name(t.dtype), list(t.shape), off])
                written += n
            segments.append({"path": f.path, "tensors": tensors})
            count = index + 1
        for f in self._files[count:]:
            f.close()
        del self._files[count:]
        return segments, written

    def buckets(self, segments: list[Segment]) -> Iterator[Bucket]:
        """The staged tensors again, as buckets of views of the files (for engines that take them over HTTP)."""
        by_path = {f.path: f for f in self._files}
        for seg in segments:
            data = by_path[seg["path"]].data
            bucket = []
            for name, dtype, shape, off in seg["tensors"]:
                dt = getattr(torch, dtype)
                n = dt.itemsize * int(torch.Size(shape).numel())
                bucket.append((name, data[off : off + n].view(dt).view(shape)))
            yield bucket

    def close(self) -> None:
        """Unmap and remove every file (an engine's mapping of one stays valid until the engine drops it)."""
        for f in self._files:
            f.close()
        self._files = []
