"""The `shm` transport: tensor bytes in a shared-memory region on the same host.

The sender's region is an anonymous memory file (`memfd_create`): it has no name in any
directory, so no other process can find it by listing /dev/shm; it is mode 0600, and the only
way in is the sender's own descriptor, `/proc/<sender pid>/fd/<fd>`, which Linux lets a process
open only if it may inspect the sender (same user, same pid namespace, or root). The region is
sealed against shrinking (`F_SEAL_SHRINK`), so the sidecar can map it and copy from the mapping
at memory speed without the risk of SIGBUS from a region truncated under it. The region name
the manifest carries, "specrl-<pid>-<fd>-<token>", says where to open it, and the sidecar checks
that the file it opened is the memfd named with that token, private and sealed.

The sender maps the region once and copies each tensor in (one copy); the receiver copies each
tensor out of its read-only mapping into the staging buffer (one copy) and checksums that copy,
so a region rewritten after its checksum was sent is caught, and the staged bytes cannot change
after verification, which is what the atomic swap needs.

The receiver keeps a sender's region mapped between pushes (`MappedRegions`): mapping 1 GiB
costs ~0.1 s of page-table work on the project's VM, as much as copying it. A kept mapping is
re-checked at every push (the name still opens the very same private, sealed memfd) and dropped
when the sender's descriptor is gone, when a push from it fails, or after an idle interval, so a
departed sender's memory is not held for long.

Same host is proven, not assumed: `write_probe` puts a random nonce in a fresh region and the
sidecar must read it back (`read_probe`); a sidecar on another host (or in another pid
namespace, or of another user) cannot open it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import stat
import threading
from pathlib import Path

import numpy as np

from sidecar.errors import InvalidRequestError, TransportUnavailableError
from sidecar.weight_transport.checksum import copy_and_checksum

DEFAULT_PROC_DIR = Path("/proc")
"""Where the sidecar finds the sender's descriptors (tests point a "remote host" elsewhere)."""

_NAME = re.compile(r"specrl-(\d{1,10})-(\d{1,10})-([0-9a-f]{16})")
NONCE_BYTES = 32


def parse_region_name(name: str) -> tuple[int, int, str]:
    """(pid, fd, token) of a region name; InvalidRequestError for anything else, so a client
    cannot make a sidecar open arbitrary files."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise InvalidRequestError(
            f"shared-memory region name {name!r} is not 'specrl-<pid>-<fd>-<16 hex digits>'; "
            "use the name the sender's region has"
        )
    return int(m.group(1)), int(m.group(2)), m.group(3)


class ShmRegion:
    """The sender's region: a private, shrink-sealed memfd, grown on demand, mapped once and
    reused across pushes; freed on close (or when the sender dies: nothing is left behind)."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self.fd = os.memfd_create(f"specrl-{self.token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.fchmod(self.fd, 0o600)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.name = f"specrl-{os.getpid()}-{self.fd}-{self.token}"
        self.size = 0
        self._map: mmap.mmap | None = None
        self._view: np.ndarray | None = None

    @property
    def path(self) -> Path:
        """Where this process can open the region again (tests damage it through here)."""
        return Path(f"/proc/self/fd/{self.fd}")

    def ensure(self, nbytes: int) -> None:
        """Make the region at least `nbytes` long (grow only: it is sealed against shrinking)."""
        if nbytes > self.size:
            self._unmap()
            os.ftruncate(self.fd, nbytes)
            self.size = nbytes
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self.fd, nbytes, flags=flags)
            self._view = np.frombuffer(self._map, dtype=np.uint8)

    def write(self, offset: int, data: np.ndarray) -> int:
        """Copy `data` (a uint8 array) to `offset`, once; returns the CRC-32 of the bytes written."""
        if self._view is None or offset + data.nbytes > self.size:
            raise ValueError(f"{data.nbytes} bytes at offset {offset} do not fit the {self.size}-byte region")
        return copy_and_checksum(self._view[offset : offset + data.nbytes], data.reshape(-1))

    def _unmap(self) -> None:
        self._view = None
        if self._map is not None:
            _close_map(self._map)
            self._map = None

    def close(self) -> None:
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class ShmReader:
    """The receiver's read-only handle on a sender's region for one push."""

    def __init__(self, name: str, proc_dir: Path = DEFAULT_PROC_DIR) -> None:
        pid, fd, token = parse_region_name(name)
        self.name = name
        path = Path(proc_dir) / str(pid) / "fd" / str(fd)
        self._path, self._token = path, token
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TransportUnavailableError(
                f"shared-memory region {name!r} does not exist here (another host or pid namespace, or the "
                "sender closed it); the sender must push over grpc"
            ) from None
        except OSError as e:
            raise TransportUnavailableError(f"cannot open shared-memory region {name!r}: {e}") from None
        try:
            self._check(path, token)
        except BaseException:
            os.close(self._fd)
            raise
        self._map: mmap.mmap | None = None
        self._view: np.ndarray | None = None

    def _check(self, path: Path, token: str) -> None:
        st = os.fstat(self._fd)
        try:
            target = os.readlink(path)
        except OSError:
            target = ""
        if not target.startswith(f"/memfd:specrl-{token}"):
            raise TransportUnavailableError(
                f"shared-memory region {self.name!r} names a descriptor that is not the sender's region; refusing it"
            )
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise TransportUnavailableError(
                f"shared-memory region {self.name!r} is not a private (mode 0600) file of this user; refusing it"
            )
        if not fcntl.fcntl(self._fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise TransportUnavailableError(f"shared-memory region {self.name!r} is not sealed against shrinking")

    def revalidate(self) -> None:
        """Before reusing a kept reader for another push: TransportUnavailableError unless its
        name still opens the file this reader holds, and that file is still the sender's
        private, sealed region."""
        try:
            now = os.stat(self._path)
        except OSError:
            raise TransportUnavailableError(
                f"shared-memory region {self.name!r} is gone (the sender closed it or exited); "
                "the sender must set up a new region"
            ) from None
        own = os.fstat(self._fd)
        if (now.st_dev, now.st_ino) != (own.st_dev, own.st_ino):
            raise TransportUnavailableError(
                f"shared-memory region {self.name!r} names another file than the region mapped before; refusing it"
            )
        self._check(self._path, self._token)

    def _mapped(self, end: int) -> np.ndarray:
        """A read-only view covering byte `end`, remapped if the sender grew the region."""
        if self._view is None or self._view.nbytes < end:
            size = os.fstat(self._fd).st_size
            if size < end:
                raise InvalidRequestError(
                    f"shared-memory region {self.name!r} ends at byte {size}, before byte {end} that the push "
                    "placed there (wrong offset or length); push again"
                )
            self._view = None
            if self._map is not None:
                _close_map(self._map)
            # MAP_POPULATE: map every page in one call instead of faulting them in one by one.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self._fd, size, flags=flags, prot=mmap.PROT_READ)
            self._view = np.frombuffer(self._map, dtype=np.uint8)
        return self._view

    def read_into(self, offset: int, out: np.ndarray) -> int:
        """Fill `out` (a writable uint8 array) from `offset` and return the CRC-32 of what was
        copied; InvalidRequestError if the region ends first (a wrong offset: it cannot have
        shrunk, it is sealed)."""
        view = self._mapped(offset + out.nbytes)
        return copy_and_checksum(out.reshape(-1), view[offset : offset + out.nbytes])

    def close(self) -> None:
        self._view = None
        if self._map is not None:
            _close_map(self._map)
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MappedRegions:
    """The receiver's readers of sender regions, kept mapped between pushes.

    `acquire` hands out a kept reader for the name (re-checked) or opens a new one; `release`
    keeps it for the next push (at most `max_regions`, least recently used dropped first) or
    closes it. Kept readers are closed after `keep_s` seconds without a push (0: never kept).
    One push uses a reader at a time: a reader is out of the cache while acquired.
    """

    def __init__(self, proc_dir: Path = DEFAULT_PROC_DIR, keep_s: float = 60.0, max_regions: int = 2) -> None:
        self.proc_dir = Path(proc_dir)
        self.keep_s = keep_s
        self.max_regions = max_regions
        self._kept: dict[str, ShmReader] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def acquire(self, name: str) -> ShmReader:
        with self._lock:
            reader = self._kept.pop(name, None)
        if reader is not None:
            try:
                reader.revalidate()
                return reader
            except BaseException:
                reader.close()  # gone or replaced: open the name afresh (which refuses it if it must)
        return ShmReader(name, self.proc_dir)

    def release(self, reader: ShmReader, *, keep: bool) -> None:
        """After a push: keep the reader mapped for the next one (`keep`: the push succeeded),
        or close it."""
        if not keep or self.keep_s <= 0:
            reader.close()
            return
        with self._lock:
            self._kept[reader.name] = reader
            evicted = []
            while len(self._kept) > self.max_regions:
                evicted.append(self._kept.pop(next(iter(self._kept))))
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.keep_s, self.close)
            self._timer.daemon = True
            self._timer.start()
        for r in evicted:
            r.close()

    @property
    def kept(self) -> list[str]:
        with self._lock:
            return list(self._kept)

    def close(self) -> None:
        """Unmap and close every kept reader (after the idle interval, or at shutdown)."""
        with self._lock:
            kept, self._kept = self._kept, {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        for r in kept.values():
            r.close()


def _close_map(m: mmap.mmap) -> None:
    """Unmap now, or, while an array view of it is still alive somewhere (an abandoned push's
    frame), when that view is collected."""
    with contextlib.suppress(BufferError):
        m.close()


def write_probe() -> tuple[ShmRegion, bytes]:
    """A fresh private region holding a random nonce; the caller closes it."""
    region = ShmRegion()
    nonce = secrets.token_bytes(NONCE_BYTES)
    region.ensure(NONCE_BYTES)
    region.write(0, np.frombuffer(nonce, dtype=np.uint8))
    return region, nonce


def read_probe(name: str, proc_dir: Path = DEFAULT_PROC_DIR) -> bytes:
    """The nonce in a sender's probe region (TransportUnavailableError if it cannot be opened)."""
    out = np.zeros(NONCE_BYTES, dtype=np.uint8)
    with ShmReader(name, proc_dir) as r:
        r.read_into(0, out)
    return out.tobytes()
