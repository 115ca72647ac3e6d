"""The `shm` transport: tensor bytes in a POSIX shared-memory region on the same host.

The sender owns a region (a file under /dev/shm named "specrl-<random>", created with O_EXCL
and mode 0600, so only processes of the same user can open it), grows it to the push's size
and writes each tensor at its offset with one copy (`pwrite`). The receiver opens the region
by the name the manifest gives and reads each tensor straight into its staging buffer with one
copy (`preadv`), then checksums that copy. Reading through the file descriptor rather than a
mapping is deliberate: a region truncated under a mapping would kill the sidecar with SIGBUS;
a short read is just an error. Checksumming the staged copy (not the region) means a region
rewritten after its checksum was sent is caught, and the staged bytes cannot change after
verification, which is what the atomic swap needs.

Same host is proven, not assumed: `write_probe` puts a random nonce in a fresh region and the
sidecar must read it back (`read_probe`); another host's (or another user's) sidecar cannot.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path

import numpy as np

from sidecar.errors import InvalidRequestError, TransportUnavailableError

DEFAULT_SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory lives on Linux (tmpfs)."""

_NAME = re.compile(r"specrl-[A-Za-z0-9_-]{1,120}")
NONCE_BYTES = 32


def check_region_name(name: str) -> None:
    """Only names in specrl's namespace: a client cannot make a sidecar open arbitrary files."""
    if not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"shared-memory region name {name!r} is not 'specrl-' followed by letters, digits, '-' or '_'; "
            "use the name the sender created"
        )


def _open_private(path: Path) -> int:
    """Open an existing region read-only; it must be a regular file of this user, mode 0600-ish."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TransportUnavailableError(
            f"shared-memory region {path.name!r} does not exist here (another host or /dev/shm, or it was "
            "unlinked); the sender must push over grpc"
        ) from None
    except OSError as e:
        raise TransportUnavailableError(f"cannot open shared-memory region {path.name!r}: {e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise TransportUnavailableError(
            f"shared-memory region {path.name!r} is not a private (mode 0600) file of this user; refusing it"
        )
    return fd


class ShmRegion:
    """The sender's region: created private, grown on demand, reused across pushes, unlinked on
    close. (A sender killed with SIGKILL leaves it behind in /dev/shm: the name says who made it.)"""

    def __init__(self, directory: Path = DEFAULT_SHM_DIR) -> None:
        self.directory = Path(directory)
        self.name = f"specrl-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = self.directory / self.name
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.size = 0

    def ensure(self, nbytes: int) -> None:
        """Make the region at least `nbytes` long (tmpfs allocates pages as they are written)."""
        if nbytes > self.size:
            os.ftruncate(self._fd, nbytes)
            self.size = nbytes

    def write(self, offset: int, data: np.ndarray) -> None:
        """Copy `data` (a uint8 array) to `offset`, once."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __del__(self) -> None:
        self.close()


class ShmReader:
    """The receiver's handle on a sender's region for one push."""

    def __init__(self, name: str, directory: Path = DEFAULT_SHM_DIR) -> None:
        check_region_name(name)
        self.name = name
        self._fd = _open_private(Path(directory) / name)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill `out` (a writable uint8 array) from `offset`; InvalidRequestError if the region
        ends first (truncated, or a wrong offset)."""
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise InvalidRequestError(
                    f"shared-memory region {self.name!r} ends at byte {offset + done}, before the "
                    f"{len(view)} bytes at offset {offset} the push placed there (truncated region or wrong "
                    "offset); push again"
                )
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_probe(directory: Path = DEFAULT_SHM_DIR) -> tuple[ShmRegion, bytes]:
    """A fresh private region holding a random nonce; the caller closes (unlinks) it."""
    region = ShmRegion(directory)
    nonce = secrets.token_bytes(NONCE_BYTES)
    region.ensure(NONCE_BYTES)
    region.write(0, np.frombuffer(nonce, dtype=np.uint8))
    return region, nonce


def read_probe(name: str, directory: Path = DEFAULT_SHM_DIR) -> bytes:
    """The nonce in a sender's probe region (TransportUnavailableError if it cannot be opened)."""
    out = np.zeros(NONCE_BYTES, dtype=np.uint8)
    with ShmReader(name, directory) as r:
        r.read_into(0, out)
    return out.tobytes()
