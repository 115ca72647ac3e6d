"""The receiving side of `WeightService.PushWeights`: stage, verify, hand over for the swap.

A push is a manifest, the tensor bytes on one transport, and a commit. The receiver checks the
manifest against the model's own tensor specs before a single byte is staged, stages every
tensor directly into a buffer of its final dtype and shape (so a push never holds more than one
extra copy of the model), checks each piece's CRC-32 and order as it arrives and each tensor's
CRC-32 when it is complete, and returns a fully verified set of tensors (`StagedWeights`) that
the scheduler swaps in at an engine step boundary. Any failure raises a specific
`sidecar.errors` exception and nothing is applied.

The transports (see proto/specrl/v1/weights.proto, "Transports"):
- grpc: `WeightChunk`s on the stream; a staging thread checksums and copies each chunk while
  the receiving thread waits for the next message.
- shm: one `WeightPlaced` per tensor names its offset in the sender's region; the staging
  thread reads it into the staging buffer (one copy) and checksums that copy.
- collective: the receiving thread takes each bucket's broadcast (bounded by the group's
  timeout) before it reads the bucket's `WeightPlaced` items, then checksums the staged bytes.

Everything here is synchronous and called from the PushWeights handler's thread (the servicer
only converts statuses), plus `prepare_transport` for PrepareTransport.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sidecar.errors import (
    DeltaBaseError,
    InvalidRequestError,
    NonFiniteWeightsError,
    PushCancelledError,
    PushInProgressError,
    SpecrlError,
    StaleVersionError,
    TransportUnavailableError,
    UnknownTensorError,
    WeightMismatchError,
)
from sidecar.server.weight_transports import (
    CollectivePlane,
    ReceivingPlane,
    ShmPlane,
    StagedTensor,
    StreamPlane,
)
from sidecar.types import (
    CollectivePlacement,
    CollectiveRendezvous,
    PreparedTransport,
    PushItem,
    ShmPlacement,
    ShmProbe,
    TensorSpec,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightPlaced,
    WeightSelector,
    WeightTransport,
)
from sidecar.weight_transport import collective, shm
from sidecar.weight_transport.checksum import crc32
from sidecar.weight_transport.delta import apply_delta
from sidecar.weight_transport.shm import DEFAULT_PROC_DIR
from sidecar.weight_transport.tensors import is_finite, tensor_bytes

_IN_FLIGHT = 2
"""Pieces a receiver holds beyond the one being read (bounds memory to a few chunk sizes)."""


@dataclass(kw_only=True, slots=True)
class TransportOffer:
    """Which transports a sidecar offers besides the gRPC stream (always offered)."""

    shm: bool = True
    """Offer `shm` (a same-host sender proves itself with a probe before using it)."""
    proc_dir: Path = DEFAULT_PROC_DIR
    """Where the senders' region descriptors are found (/proc; a test points it elsewhere to
    play a sidecar on another host)."""
    shm_keep_mapped_s: float = 60.0
    """Keep a sender's region mapped this long after a push (mapping costs ~0.1 s per GiB; the
    next push reuses it). 0: map and unmap at every push."""
    collective: bool = True
    """Offer `collective` (join a torch.distributed group a sender sets up)."""
    sparse_deltas: bool = True
    """Accept sparse delta tensors (whatever the plane): the receiver keeps the tensors of the
    last applied push as the base to rebuild from, ~1x the model in host memory."""

    def __post_init__(self) -> None:
        self.proc_dir = Path(self.proc_dir)
        if not self.shm_keep_mapped_s >= 0:
            raise ValueError(f"shm_keep_mapped_s must be >= 0 seconds, got {self.shm_keep_mapped_s}")

    @property
    def offered(self) -> list[WeightTransport]:
        out = [WeightTransport.GRPC]
        if self.shm:
            out.append(WeightTransport.SHM)
        if self.collective:
            out.append(WeightTransport.COLLECTIVE)
        return out


@dataclass(kw_only=True, slots=True)
class StagedWeights:
    """A verified push, ready to apply."""

    version: int
    selector: WeightSelector
    tensors: dict[str, torch.Tensor]
    bytes_received: int
    receive_seconds: float
    transport: WeightTransport = WeightTransport.GRPC


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
        keep_staging: bool,
        transports: TransportOffer | None = None,
    ) -> None:
        """`keep_staging`: keep the buffers an applied push leaves free (the engine's displaced
        tensors, or the staged ones where it copied them) and receive the next push into them:
        no fresh memory to fault in (the largest single cost of a push on a small machine), at
        the price of ~1x the model staying resident between pushes (the peak is the same).
        Only for engines whose `adopt_weights` hands back buffers that nothing else holds, as
        TorchEngine's does."""
        self._model_specs = model_specs
        self._served_version = served_version
        self._lock = threading.Lock()
        self._keep_staging = keep_staging
        self._spare: dict[str, torch.Tensor] = {}  # buffers nothing serves: the next push's staging
        self.transports = transports or TransportOffer()
        # The tensors of the last applied push and the version it made served: what a delta
        # is rebuilt from (only while that version is still the served one).
        self._base: dict[str, torch.Tensor] = {}
        self._base_version = 0
        self.groups = collective.GroupRegistry()
        self.regions = shm.MappedRegions(self.transports.proc_dir, self.transports.shm_keep_mapped_s)
        self._push_group: str | None = None  # the collective group the claimed push names

    # --- transports ------------------------------------------------------------------------

    def _require(self, transport: WeightTransport) -> None:
        if transport not in self.transports.offered:
            raise TransportUnavailableError(
                f"this sidecar does not offer the {transport.value} transport; push over grpc"
            )

    def prepare_transport(self, request: ShmProbe | CollectiveRendezvous) -> PreparedTransport:
        """PrepareTransport: read a probe region back, or join a collective group (blocking,
        bounded by the request's timeout). TransportUnavailableError if that transport is not
        offered or cannot be set up here."""
        if isinstance(request, ShmProbe):
            self._require(WeightTransport.SHM)
            return PreparedTransport(shm_nonce=shm.read_probe(request.region, self.transports.proc_dir))
        self._require(WeightTransport.COLLECTIVE)
        if request.rank == 0:
            raise InvalidRequestError("rank 0 is the sender's; give the sidecar a rank from 1 to world_size-1")
        group = collective.join_group(
            group_id=request.group_id,
            backend=request.backend,
            host=request.host,
            port=request.port,
            rank=request.rank,
            world_size=request.world_size,
            timeout_s=request.timeout_s,
        )
        self.groups.add(group)
        return PreparedTransport(group_id=group.group_id)

    def close(self) -> None:
        self.groups.close()
        self.regions.close()

    # --- one push ---------------------------------------------------------------------------

    def claim(self, items: Iterator[PushItem] | None = None) -> _PushClaim:
        """Reserve the receiver for the push `items`; PushInProgressError if another one holds
        it. A push refused so still ends the collective group its manifest names (read for
        that alone), as the sender drops its end after the refusal (see `_push_ended`)."""
        if not self._lock.acquire(blocking=False):
            if items is not None:
                self._retire_group_of(items)
            raise PushInProgressError(
                "another weight push is being received or applied; retry after it finishes "
                "(pushes to one sidecar are serialised)"
            )
        self._push_group = None
        return _PushClaim(self._lock, self._push_ended)

    def _retire_group_of(self, items: Iterator[PushItem]) -> None:
        try:
            first = next(items, None)
        except SpecrlError:  # a stream that broke names no group
            return
        if isinstance(first, WeightManifest) and isinstance(first.data_plane, CollectivePlacement):
            self.groups.retire(first.data_plane.group_id)

    def _push_ended(self, failed: bool) -> None:
        """A claimed push that failed (refused, broken, cancelled, or not applied) retires the
        collective group it named, as the sender drops its end after any failed push: the
        bucket broadcasts of a push that stopped part-way, or that was refused before the
        sidecar took them, leave the two ends out of step, and a group neither end uses again
        would hold its sockets and threads until the sidecar stops. The sender's next push
        over collective prepares a new group (which closes the retired one)."""
        group, self._push_group = self._push_group, None
        if failed and group is not None:
            self.groups.retire(group)

    def receive(self, items: Iterator[PushItem], *, is_active: Callable[[], bool] = lambda: True) -> StagedWeights:
        """Consume a whole push stream (manifest, chunks or placed tensors, commit, end of stream)
        and return the verified tensors. Raises InvalidRequestError (malformed stream or
        checksum), UnknownTensorError, WeightMismatchError, StaleVersionError,
        TransportUnavailableError (the transport failed) or PushCancelledError."""
        first = _next_item(items, is_active, "the manifest")
        if first is None:
            raise InvalidRequestError("the push stream is empty; send a manifest, the chunks, then a commit")
        if not isinstance(first, WeightManifest):
            raise InvalidRequestError(
                f"the first message of a push was a {_kind(first)}, not the manifest; send the manifest first"
            )
        if isinstance(first.data_plane, CollectivePlacement):
            self._push_group = first.data_plane.group_id
        started = time.perf_counter()
        staged = self._check_manifest(first)
        plane = self._open_plane(first, staged)
        chunk_count = 0
        bytes_received = 0
        commit: WeightCommit | None = None
        # Bound the loop: one-byte chunks, a commit and one stray message at worst.
        max_items = sum(t.spec.wire_length for t in staged) + len(staged) + 2
        # Checksumming and copying (which release the GIL) run on a staging thread while this
        # one waits for the next message; at most _IN_FLIGHT pieces are held at a time.
        in_flight: collections.deque[Future[None]] = collections.deque()
        received = False
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrl-stage") as stager:
                try:
                    for _ in range(max_items):
                        plane.before_next_item()
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
                        in_flight.append(stager.submit(plane.accept(item, chunk_count)))
                        chunk_count += 1
                        bytes_received += len(item.data) if isinstance(item, WeightChunk) else item.byte_length
                        while len(in_flight) > _IN_FLIGHT:
                            in_flight.popleft().result()
                    else:
                        raise InvalidRequestError(
                            f"the push stream has more than {max_items} messages for {len(staged)} tensors; "
                            "send each tensor's bytes once, then the commit"
                        )
                    while in_flight:
                        in_flight.popleft().result()
                    received = True
                finally:
                    for f in in_flight:
                        f.cancel()
        finally:
            plane.close(ok=received)
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
            if t.received != t.spec.wire_length:
                raise InvalidRequestError(
                    f"tensor {i} {t.spec.name!r} got {t.received} of {t.spec.wire_length} bytes at the commit; "
                    "send every byte of every manifest tensor"
                )
            if t.spec.byte_length == 0 and t.spec.crc32 != 0:
                raise InvalidRequestError(f"tensor {t.spec.name!r} is empty but its manifest crc32 is not 0")
        tensors = {t.spec.name: self._rebuilt(t) for t in staged}
        broken = [name for name, t in tensors.items() if not is_finite(t)]
        if broken:
            raise NonFiniteWeightsError(
                f"{len(broken)} pushed tensor(s) hold NaN or infinite values, e.g. {broken[:3]}; nothing was "
                f"applied and version {self._served_version()} still serves. The training run has probably "
                "diverged: push finite weights"
            )
        return StagedWeights(
            version=first.version,
            selector=first.selector,
            tensors=tensors,
            bytes_received=bytes_received,
            receive_seconds=time.perf_counter() - started,
            transport=first.transport,
        )

    def _rebuilt(self, t: StagedTensor) -> torch.Tensor:
        """A full tensor's staging buffer; a delta's tensor rebuilt from the base, bit-exact
        against the manifest's CRC-32 of the reconstructed tensor or refused."""
        if t.spec.delta is None:
            return t.finished()
        rebuilt = apply_delta(self._base[t.spec.name], t.spec.delta, t.bytes_view(), t.spec.name)
        got = crc32(tensor_bytes(rebuilt)) if rebuilt.numel() else 0
        if got != t.spec.crc32:
            raise DeltaBaseError(
                f"tensor {t.spec.name!r} rebuilt from its delta has CRC-32 {got:#010x}, not the manifest's "
                f"{t.spec.crc32:#010x}: the delta or the base it was computed on differs from this sidecar's; "
                "nothing applied, push the full tensors"
            )
        return rebuilt

    def _check_deltas(self, manifest: WeightManifest, served: int) -> None:
        """DeltaBaseError unless every delta tensor can be rebuilt from a base this sidecar holds
        for exactly the manifest's base_version, which must be the served version."""
        deltas = [s for s in manifest.tensors if s.delta is not None]
        if not deltas:
            return
        if not self.transports.sparse_deltas:
            raise DeltaBaseError("this sidecar does not accept delta tensors; push the full tensors")
        if manifest.base_version != served:
            raise DeltaBaseError(
                f"the deltas were computed against version {manifest.base_version} but this sidecar serves "
                f"version {served}; nothing applied, push the full tensors"
            )
        if self._base_version != served:
            raise DeltaBaseError(
                f"this sidecar holds no base for version {served} (it serves weights it did not receive as a push "
                "since it started); push the full tensors"
            )
        for s in deltas:
            base = self._base.get(s.name)
            if base is None or base.dtype != s.dtype or tuple(base.shape) != tuple(s.shape):
                raise DeltaBaseError(
                    f"this sidecar holds no base of tensor {s.name!r} for version {served}; push it in full"
                )

    def _open_plane(self, manifest: WeightManifest, staged: list[StagedTensor]) -> ReceivingPlane:
        where = manifest.data_plane
        if where is None:
            return StreamPlane(staged)
        if isinstance(where, ShmPlacement):
            self._require(WeightTransport.SHM)
            return ShmPlane(staged, self.regions, self.regions.acquire(where.region))
        self._require(WeightTransport.COLLECTIVE)
        return CollectivePlane(staged, self.groups, where)

    def _check_manifest(self, manifest: WeightManifest) -> list[StagedTensor]:
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
        self._check_deltas(manifest, served)
        reuse = {
            s.name: self._spare.pop(s.name)
            for s in manifest.tensors
            if s.delta is None and _reusable(self._spare.get(s.name), s) is not None
        }
        if any(self._base.get(n) is b for n, b in reuse.items()):
            # An engine that copies what it is given leaves the base's tensors as the spare
            # buffers, and full tensors are about to be received into them: the base (but for
            # this push's delta tensors, rebuilt into fresh memory first) is void until `keep`
            # takes the applied push as the new one. (An engine that adopts the staged tensors
            # hands back the displaced ones instead, and the base stays whole.)
            self._base = {s.name: self._base[s.name] for s in manifest.tensors if s.delta is not None}
            self._base_version = -1
        return [StagedTensor(s, reuse.get(s.name)) for s in manifest.tensors]

    def keep(self, staged: StagedWeights, free: Mapping[str, torch.Tensor] | None = None) -> None:
        """After an applied push: keep its tensors as the base of later deltas (when deltas are
        accepted; they are what the engine now serves, or an exact copy of it) and, with
        keep_staging, `free` as the next push's staging buffers: what the engine handed back
        (`Engine.adopt_weights`), by default the staged tensors themselves (an engine that
        copies; the next push then voids the base it receives full tensors into, see
        `_check_manifest`)."""
        if self.transports.sparse_deltas:
            self._base.update(staged.tensors)
            self._base_version = staged.version
        if self._keep_staging:
            self._spare.update(staged.tensors if free is None else free)


# --- transports, receiving side ------------------------------------------------------------


class _PushClaim:
    """Context manager around one push: tells the receiver whether the push failed (an
    exception left the block), then releases its push lock."""

    def __init__(self, lock: threading.Lock, ended: Callable[[bool], None]) -> None:
        self._lock = lock
        self._ended = ended

    def __enter__(self) -> _PushClaim:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            self._ended(exc_type is not None)
        finally:
            self._lock.release()


def _kind(item: PushItem) -> str:
    return {WeightManifest: "manifest", WeightChunk: "chunk", WeightPlaced: "placed tensor", WeightCommit: "commit"}[
        type(item)
    ]


def _next_item(items: Iterator[PushItem], is_active: Callable[[], bool], what: str) -> PushItem | None:
    """The next push item, None at the end of the stream; PushCancelledError if the client left."""
    try:
        return next(items)
    except StopIteration:
        if not is_active():
            raise PushCancelledError(f"the client went away while the sidecar waited for {what}") from None
        return None


__all__ = ["StagedWeights", "TransportOffer", "WeightReceiver"]
