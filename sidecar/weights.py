"""Weight streaming: the receiving side of `WeightService.PushWeights` and the sending side.

A trainer pushes new policy and draft weights after every optimizer step. The protocol
(proto/specrl/v1/weights.proto) is a client stream: a manifest, checksummed chunks, a commit.
The receiver here stages every tensor directly into a preallocated buffer of its final dtype
and shape (so a push never holds more than one extra copy of the model: peak memory stays
near 2x the model, not 3-4x as with byte lists that are joined and then converted), checks
each chunk's CRC-32 and order as it arrives, each tensor's CRC-32 when it is complete, the
manifest against the model's own tensor specs before a single byte is staged, and hands a
fully verified set of tensors to the scheduler, which swaps it in at an engine step boundary.
Any failure raises a specific `sidecar.errors` exception and nothing is applied.

Checksums: CRC-32 with the zlib polynomial (`zlib.crc32`, or ISA-L's identical and ~10x faster
`isal_zlib.crc32` when the optional `fast` extra is installed). The running checksum of a tensor is
not recomputed over its bytes: it is combined from the chunk checksums the receiver computes
anyway (`crc32_combine`, zlib's GF(2) operator method), so each byte is checksummed once on
each side.

The sender, `iter_push_requests`, streams tensors one at a time (a generator of tensors is
consumed lazily, so a trainer can gather and send one tensor at a time), and puts each
tensor's checksum on its last chunk (`WeightChunk.tensor_crc32`): a streaming sender cannot
know it when it writes the manifest.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.errors import (
    InvalidRequestError,
    PushCancelledError,
    PushInProgressError,
    StaleVersionError,
    UnknownTensorError,
    WeightMismatchError,
)
from sidecar.types import PushItem, TensorSpec, WeightChunk, WeightCommit, WeightManifest, WeightSelector

try:  # ISA-L's SIMD CRC-32: the same polynomial and values as zlib's, ~10x faster
    from isal.isal_zlib import crc32
except ImportError:  # the optional `fast` extra is not installed
    from zlib import crc32

if sys.byteorder != "little":  # the wire format is little-endian; so is every supported host
    raise ImportError("sidecar.weights needs a little-endian host (the specrl.v1 tensor bytes are little-endian)")

_IN_FLIGHT = 2
"""Chunks a receiver holds beyond the one being read (bounds memory to a few chunk sizes)."""

DEFAULT_CHUNK_BYTES = 4 << 20
"""4 MiB: large enough that per-message overhead is negligible, far below the 64 MiB limit."""

# --- CRC-32 combination (zlib's crc32_combine, which Python's zlib does not expose) ---------

_CRC_POLY = 0xEDB88320


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: Sequence[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


_ZERO_BYTE_POWERS: list[tuple[int, ...]] = []  # [n]: the operator for 2**n zero bytes
_POWERS_LOCK = threading.Lock()


def _zeros_power(n: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC-32 register over 2**n zero bytes (built once)."""
    with _POWERS_LOCK:
        if not _ZERO_BYTE_POWERS:
            op = [_CRC_POLY] + [1 << i for i in range(31)]  # one zero bit
            for _ in range(3):  # 2, 4, 8 zero bits = one zero byte
                op = _gf2_square(op)
            _ZERO_BYTE_POWERS.append(tuple(op))
        while len(_ZERO_BYTE_POWERS) <= n:
            _ZERO_BYTE_POWERS.append(tuple(_gf2_square(_ZERO_BYTE_POWERS[-1])))
        return _ZERO_BYTE_POWERS[n]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B).

    Advances crc1 over len2 zero bytes with one precomputed operator per set bit of len2
    (a few microseconds), then adds crc2: CRC-32 is linear over GF(2).
    """
    n = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_power(n), crc1)
        len2 >>= 1
        n += 1
    return crc1 ^ crc2


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    A push allocates a model-sized set of staging tensors, most of them below glibc's mmap
    threshold, so without a trim a sidecar would keep ~1x the model of dead heap after every
    push (the next push reuses it, so the peak is unaffected; the idle footprint is not).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def prefer_mmap_for_large_buffers(threshold_bytes: int = 8 << 20) -> bool:
    """Make glibc serve every allocation >= `threshold_bytes` with its own mmap (returned to the
    OS on free) instead of letting its dynamic threshold grow past tensor-sized buffers, which
    would then fragment the heap during every push. The default, 8 MiB, stays above the 4 MiB
    chunk messages, whose heap blocks are reused from one message to the next (an mmap per
    message would page-fault every received byte twice). Process-wide: call it once
    from the process's entry point (`specrl serve` does). Returns False where unsupported."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    m_mmap_threshold = -3
    return bool(mallopt is not None and mallopt(m_mmap_threshold, threshold_bytes) == 1)


# --- tensors as bytes -----------------------------------------------------------------------


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The C-contiguous little-endian bytes of a CPU tensor, as a uint8 array view (no copy when
    the tensor is already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 (zlib polynomial) of a tensor's C-contiguous little-endian bytes: the checksum of
    `TensorSpec.crc32`, of a push manifest and of DescribeWeights(include_checksums)."""
    return crc32(tensor_bytes(tensor))


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))


# --- receiving ------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class StagedWeights:
    """A verified push, ready to apply."""

    version: int
    selector: WeightSelector
    tensors: dict[str, torch.Tensor]
    bytes_received: int
    receive_seconds: float


class _StagedTensor:
    """One manifest entry being received into its final buffer."""

    __slots__ = ("buffer", "crc", "received", "scheduled", "spec", "view")

    def __init__(self, spec: TensorSpec, buffer: torch.Tensor | None = None) -> None:
        self.spec = spec
        self.buffer: torch.Tensor | None = buffer  # allocated on the first chunk unless reused
        self.view: np.ndarray | None = None  # uint8 view of buffer
        self.scheduled = 0  # bytes accepted by the receiving thread
        self.received = 0  # bytes checked and copied by the staging thread
        self.crc = 0

    def write(self, offset: int, data: bytes | memoryview) -> None:
        if self.buffer is None:
            self.buffer = torch.empty(self.spec.shape, dtype=self.spec.dtype)
        if self.view is None:
            self.view = tensor_bytes(self.buffer)
        self.view[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.received += len(data)

    def finished(self) -> torch.Tensor:
        if self.buffer is None:  # a zero-byte tensor gets no chunks
            self.buffer = torch.empty(self.spec.shape, dtype=self.spec.dtype)
        return self.buffer


def _reusable(buffer: torch.Tensor | None, spec: TensorSpec) -> torch.Tensor | None:
    if buffer is None or buffer.dtype != spec.dtype or tuple(buffer.shape) != tuple(spec.shape):
        return None
    return buffer


class WeightReceiver:
    """Receives one push at a time and verifies it against the model's tensor specs.

    `model_specs(selector)` returns what an update of that part must contain (the engine's
    `weight_specs`); `served_version()` the version now served. Neither touches the engine
    from the receiving thread: the scheduler answers them from its snapshot.
    """

    def __init__(
        self,
        *,
        model_specs: Callable[[WeightSelector], list[TensorSpec]],
        served_version: Callable[[], int],
        keep_staging: bool = False,
    ) -> None:
        """`keep_staging`: keep the staging tensors after an applied push and receive the next
        push into them: no fresh memory to fault in (the largest single cost of a push on a
        small machine), at the price of ~1x the model staying resident between pushes (the
        peak is the same). Only for engines whose `update_weights` copies what it is given,
        as TorchEngine does."""
        self._model_specs = model_specs
        self._served_version = served_version
        self._lock = threading.Lock()
        self._keep_staging = keep_staging
        self._kept: dict[str, torch.Tensor] = {}

    def claim(self) -> _PushClaim:
        """Reserve the receiver for one push; PushInProgressError if another one holds it."""
        if not self._lock.acquire(blocking=False):
            raise PushInProgressError(
                "another weight push is being received or applied; retry after it finishes "
                "(pushes to one sidecar are serialised)"
            )
        return _PushClaim(self._lock)

    def receive(self, items: Iterator[PushItem], *, is_active: Callable[[], bool] = lambda: True) -> StagedWeights:
        """Consume a whole push stream (manifest, chunks, commit, end of stream) and return the
        verified tensors. Raises InvalidRequestError (malformed stream or checksum),
        UnknownTensorError, WeightMismatchError, StaleVersionError or PushCancelledError."""
        first = _next_item(items, is_active, "the manifest")
        if first is None:
            raise InvalidRequestError("the push stream is empty; send a manifest, the chunks, then a commit")
        if not isinstance(first, WeightManifest):
            raise InvalidRequestError(
                f"the first message of a push was a {_kind(first)}, not the manifest; send the manifest first"
            )
        started = time.perf_counter()
        staged = self._check_manifest(first)
        chunk_count = 0
        bytes_received = 0
        commit: WeightCommit | None = None
        # Bound the loop: one-byte chunks, a commit and one stray message at worst.
        max_items = sum(t.spec.byte_length for t in staged) + len(staged) + 2
        # Checksumming and copying a chunk (which release the GIL) run on a staging thread while
        # this one waits for the next message; at most _IN_FLIGHT chunks are held at a time.
        in_flight: collections.deque[Future[None]] = collections.deque()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrl-stage") as stager:
            try:
                for _ in range(max_items):
                    item = _next_item(items, is_active, "a chunk or the commit")
                    if item is None:
                        break
                    if commit is not None:
                        raise InvalidRequestError(
                            f"a {_kind(item)} arrived after the commit; the commit must be the last message of a push"
                        )
                    if isinstance(item, WeightManifest):
                        raise InvalidRequestError(
                            "a second manifest arrived; a push carries exactly one manifest, first"
                        )
                    if isinstance(item, WeightCommit):
                        commit = item
                        continue
                    t = self._accept_chunk(staged, item, chunk_count)
                    in_flight.append(stager.submit(_verify_and_copy, t, item, chunk_count))
                    chunk_count += 1
                    bytes_received += len(item.data)
                    while len(in_flight) > _IN_FLIGHT:
                        in_flight.popleft().result()
                else:
                    raise InvalidRequestError(
                        f"the push stream has more than {max_items} messages for {len(staged)} tensors; "
                        "send each tensor's bytes once, then the commit"
                    )
                while in_flight:
                    in_flight.popleft().result()
            finally:
                for f in in_flight:
                    f.cancel()
        if commit is None:
            raise InvalidRequestError(
                f"the push stream ended after {chunk_count} chunks without a commit (truncated); "
                "send the commit as the last message"
            )
        if commit.chunk_count != chunk_count:
            raise InvalidRequestError(
                f"the commit counts {commit.chunk_count} chunks but {chunk_count} arrived; chunks were lost, push again"
            )
        for i, t in enumerate(staged):
            if t.received != t.spec.byte_length:
                raise InvalidRequestError(
                    f"tensor {i} {t.spec.name!r} got {t.received} of {t.spec.byte_length} bytes at the commit; "
                    "send every byte of every manifest tensor"
                )
            if t.spec.byte_length == 0 and t.spec.crc32 != 0:
                raise InvalidRequestError(f"tensor {t.spec.name!r} is empty but its manifest crc32 is not 0")
        return StagedWeights(
            version=first.version,
            selector=first.selector,
            tensors={t.spec.name: t.finished() for t in staged},
            bytes_received=bytes_received,
            receive_seconds=time.perf_counter() - started,
        )

    def _check_manifest(self, manifest: WeightManifest) -> list[_StagedTensor]:
        served = self._served_version()
        if manifest.version <= served:
            raise StaleVersionError(
                f"version {manifest.version} is not newer than the served version {served}; "
                f"push with a version > {served} (versions strictly increase)"
            )
        expected = {s.name: s for s in self._model_specs(manifest.selector)}
        every = {s.name for s in self._model_specs(WeightSelector.ALL)}
        seen: set[str] = set()
        for spec in manifest.tensors:
            if spec.name in seen:
                raise InvalidRequestError(f"tensor {spec.name!r} appears twice in the manifest; list each tensor once")
            seen.add(spec.name)
            if spec.name not in every:
                raise UnknownTensorError(
                    f"the model has no tensor {spec.name!r}; use the checkpoint naming contract "
                    "(DescribeWeights lists the expected names)"
                )
            want = expected.get(spec.name)
            if want is None:
                raise WeightMismatchError(
                    f"tensor {spec.name!r} is not part of the {manifest.selector.name} selector; "
                    "push it with a selector that includes it (ALL, TARGET or DRAFT)"
                )
            if spec.dtype != want.dtype:
                raise WeightMismatchError(
                    f"tensor {spec.name!r} has dtype {spec.dtype} but the model serves {want.dtype}; "
                    f"convert it to {want.dtype} before pushing"
                )
            if tuple(spec.shape) != tuple(want.shape):
                raise WeightMismatchError(
                    f"tensor {spec.name!r} has shape {list(spec.shape)} but the model's is {list(want.shape)}"
                )
        missing = [n for n in expected if n not in seen]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise WeightMismatchError(
                f"the manifest lacks {len(missing)} tensor(s) of the {manifest.selector.name} selector: {shown}; "
                "a push must replace the whole selected part"
            )
        kept, self._kept = self._kept, {}
        return [_StagedTensor(s, _reusable(kept.pop(s.name, None), s)) for s in manifest.tensors]

    def keep(self, staged: StagedWeights) -> None:
        """Take an applied push's tensors back for the next push (a no-op unless keep_staging)."""
        if self._keep_staging:
            self._kept = dict(staged.tensors)

    @staticmethod
    def _accept_chunk(staged: list[_StagedTensor], chunk: WeightChunk, number: int) -> _StagedTensor:
        """Structural checks of a chunk (index, order, bounds), in the receiving thread."""
        if chunk.tensor_index >= len(staged):
            raise InvalidRequestError(
                f"chunk {number} names tensor index {chunk.tensor_index} but the manifest has {len(staged)} tensors"
            )
        t = staged[chunk.tensor_index]
        if chunk.offset != t.scheduled:
            raise InvalidRequestError(
                f"chunk {number} of tensor {t.spec.name!r} starts at byte {chunk.offset} but {t.scheduled} bytes "
                "were received so far; send each tensor's chunks in order"
            )
        if t.scheduled + len(chunk.data) > t.spec.byte_length:
            raise InvalidRequestError(
                f"chunk {number} runs past the end of tensor {t.spec.name!r} "
                f"({t.scheduled} + {len(chunk.data)} > {t.spec.byte_length} bytes)"
            )
        t.scheduled += len(chunk.data)
        if chunk.tensor_crc32 is not None and t.scheduled != t.spec.byte_length:
            raise InvalidRequestError(
                f"chunk {number} carries tensor_crc32 but is not the last chunk of tensor {t.spec.name!r}"
            )
        return t


def _verify_and_copy(t: _StagedTensor, chunk: WeightChunk, number: int) -> None:
    """Checksum a chunk and copy it into its tensor's buffer (on the staging thread, in order)."""
    crc = crc32(chunk.data)
    if crc != chunk.crc32:
        raise InvalidRequestError(
            f"chunk {number} of tensor {t.spec.name!r} at byte {chunk.offset} has CRC-32 {crc:#010x}, "
            f"not the {chunk.crc32:#010x} it was sent with; the bytes were corrupted, push again"
        )
    t.write(chunk.offset, chunk.data)
    t.crc = crc32_combine(t.crc, crc, len(chunk.data))
    if t.received == t.spec.byte_length:
        want = chunk.tensor_crc32 if chunk.tensor_crc32 is not None else t.spec.crc32
        if t.crc != want:
            raise InvalidRequestError(
                f"tensor {t.spec.name!r} has CRC-32 {t.crc:#010x} but was announced with {want:#010x}; "
                "its bytes differ from what the sender checksummed, push again"
            )


class _PushClaim:
    """Context manager releasing the receiver's push lock."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> _PushClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _kind(item: PushItem) -> str:
    return {WeightManifest: "manifest", WeightChunk: "chunk", WeightCommit: "commit"}[type(item)]


def _next_item(items: Iterator[PushItem], is_active: Callable[[], bool], what: str) -> PushItem | None:
    """The next push item, None at the end of the stream; PushCancelledError if the client left."""
    try:
        return next(items)
    except StopIteration:
        if not is_active():
            raise PushCancelledError(f"the client went away while the sidecar waited for {what}") from None
        return None


# --- sending --------------------------------------------------------------------------------


def iter_push_requests(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int,
    selector: WeightSelector = WeightSelector.ALL,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    specs: Sequence[TensorSpec] | None = None,
) -> Iterator[PushItem]:
    """The items of one push: manifest, chunks (each tensor's CRC-32 on its last chunk), commit.

    `named_tensors` is a mapping (a state dict) or an iterable of (name, tensor) pairs consumed
    lazily, one tensor in memory at a time; an iterable needs `specs` (the manifest, in the
    order the tensors will come; `SidecarClient.describe_weights` gives it). A tensor that does
    not match its spec raises ValueError, which ends the stream without a commit, so the sidecar
    applies nothing.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if version <= 0:
        raise ValueError(f"version must be > 0 (the sidecar starts at 0 and versions increase), got {version}")
    pairs: Iterable[tuple[str, torch.Tensor]] = (
        named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    )
    if isinstance(named_tensors, Mapping):
        if specs is None:
            specs = [spec_of(n, t) for n, t in named_tensors.items()]
    elif specs is None:
        raise ValueError(
            "streaming an iterable of tensors needs specs= (the manifest, e.g. from describe_weights); "
            "or pass a mapping of name to tensor"
        )
    manifest_specs = [TensorSpec(name=s.name, dtype=s.dtype, shape=tuple(s.shape)) for s in specs]
    yield WeightManifest(version=version, selector=selector, tensors=manifest_specs)
    count = 0
    index = -1
    for index, (name, tensor) in enumerate(pairs):
        if index >= len(manifest_specs):
            raise ValueError(f"tensor {name!r} is beyond the {len(manifest_specs)} tensors of the manifest")
        spec = manifest_specs[index]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"tensor {index} is {name!r} {tensor.dtype} {list(tensor.shape)} but the manifest announced "
                f"{spec.name!r} {spec.dtype} {list(spec.shape)}"
            )
        view = tensor_bytes(tensor)
        total = view.nbytes
        crc = 0
        for offset in range(0, total, chunk_bytes):
            data = memoryview(view[offset : offset + chunk_bytes].data)  # no copy: the encoder's join copies once
            chunk_crc = crc32(data)
            crc = crc32_combine(crc, chunk_crc, len(data))
            last = offset + len(data) >= total
            yield WeightChunk(
                tensor_index=index,
                offset=offset,
                data=data,
                crc32=chunk_crc,
                tensor_crc32=crc if last else None,
            )
            count += 1
        del view
    if index + 1 != len(manifest_specs):
        raise ValueError(f"the tensors ended after {index + 1} of the {len(manifest_specs)} manifest entries")
    yield WeightCommit(chunk_count=count)
