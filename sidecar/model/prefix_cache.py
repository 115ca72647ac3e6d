"""The prefix cache: full KV blocks of rows that left the batch, kept for later requests.

Why: in multi-turn rollouts turn t + 1 repeats every token of turn t (its prompt, its response and
the tool's output after it), so without a cache each turn re-prefills the whole conversation, in
the target's cache and in the draft's. Within one weight version the blocks a finished (or
preempted) row filled stay in the pool, indexed by what they hold, and a request whose prefix
starts with them takes them instead of computing them (`runner.Runner.prefill` then prefills
only the rest). vLLM's automatic prefix caching is the model (its block hashes; this is our own
code): block j's key hashes block j - 1's key and block j's tokens, so one key names a whole
prefix, and a lookup walks a prompt's blocks until the first key the index lacks.

What a key covers:

- the weight version and whether the row drafts (the root of every chain): a push drops every
  entry anyway (`KVPages.drop_cache`), the version in the key keeps a stale entry unreachable even
  so; rows that draft and rows that do not never share a block (a row that does not draft writes
  its draft caches' first slots in a drafting round, `RowScheduler.shareable`);
- for a drafting row's block also the token after it: draft position t reads the trunk state h_t
  and the token x_{t+1}, so the draft KV of block j depends on one token past the block. A hit
  restores the target's and the draft's KV of a block together, or neither.

The blocks themselves stay in the pool's books (`kv_pages.KVPages`): a cached block some row
holds has refs > 0; one no row holds is *idle*, free for admission (it counts in `KVPages.free`)
and taken last, least recently used first, when the pool needs blocks (an eviction drops its
entry). Keys are 128-bit BLAKE2b digests: a collision (which would serve another prefix's KV) is
as likely as guessing a random 128-bit number.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class PrefixCacheCounters:
    """Monotonic counters of one prefix cache (`KVUsage` reports them)."""

    evictions: int = 0
    """Idle cached blocks taken for other tokens (their entries dropped)."""
    inserted: int = 0
    """Blocks entered into the index."""
    dropped: int = 0
    """Entries dropped by weight pushes (`PrefixCache.clear`)."""


def _digest(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class PrefixCache:
    """The index of cached blocks and the order in which idle ones are evicted (module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._index: dict[bytes, int] = {}  # key -> block
        self._entry: dict[int, tuple[bytes, int]] = {}  # block -> (its key, the weight version it was computed with)
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no row holds, least recently used first
        self.counters = PrefixCacheCounters()

    # ---- keys --------------------------------------------------------------------------------
    def keys(self, version: int, drafting: bool, tokens: list[int], n: int) -> list[bytes]:
        """The keys of the first `n` full blocks of `tokens` (a drafting row's need the token after
        each block: len(tokens) > n * block_size)."""
        bs = self.block_size
        if drafting and len(tokens) <= n * bs:
            raise ValueError(f"a drafting row's {n} blocks need {n * bs + 1} tokens, {len(tokens)} given")
        chain = hashlib.blake2b(f"specrl-prefix/{version}/{int(drafting)}".encode(), digest_size=16).digest()
        out = []
        for j in range(n):
            chain = _digest(chain, tokens[j * bs : (j + 1) * bs])
            out.append(_digest(chain, [tokens[(j + 1) * bs]]) if drafting else chain)
        return out

    # ---- the index ---------------------------------------------------------------------------
    def lookup(self, version: int, drafting: bool, prefix: list[int]) -> list[int]:
        """The cached blocks that hold `prefix`'s leading full blocks, as long a run as the index
        has; at least one token of `prefix` is left to prefill (its last state gives the first
        sampled token). Not taken: the caller holds them (`KVPages.acquire`) before the pool
        takes any block."""
        keys = self.keys(version, drafting, prefix, (len(prefix) - 1) // self.block_size)
        blocks = []
        for key in keys:
            b = self._index.get(key)
            if b is None:
                break
            if self._entry[b][1] != version:  # unreachable by the keys: a guard on the invariant
                raise RuntimeError(f"prefix cache block {b} holds version {self._entry[b][1]} KV, {version} serves")
            blocks.append(b)
        return blocks

    def insert(self, version: int, drafting: bool, tokens: list[int], blocks: list[int]) -> int:
        """Enter `blocks` (a row's first ones, each full of `tokens`' KV computed with `version`)
        into the index; a key already present keeps its block, a block already cached keeps its
        key. Returns the blocks entered."""
        entered = 0
        for key, b in zip(self.keys(version, drafting, tokens, len(blocks)), blocks, strict=True):
            if key in self._index or b in self._entry:
                continue
            self._index[key] = b
            self._entry[b] = (key, version)
            entered += 1
        self.counters.inserted += entered
        return entered

    def holds(self, block: int) -> bool:
        return block in self._entry

    def version_of(self, block: int) -> int:
        """The weight version a cached block's KV was computed with."""
        return self._entry[block][1]

    @property
    def cached(self) -> int:
        """Blocks in the index (idle or held by rows)."""
        return len(self._entry)

    @property
    def idle(self) -> int:
        """Cached blocks no row holds (free for admission, evicted when the pool needs them)."""
        return len(self._idle)

    # ---- the pool's side (`KVPages` calls these) ----------------------------------------------
    def park(self, block: int) -> None:
        """A cached block no row holds any more: idle, the most recently used."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle block a row takes again (a hit)."""
        del self._idle[block]

    def evict(self) -> int:
        """The least recently used idle block, its entry dropped (the pool reuses it)."""
        block, _ = self._idle.popitem(last=False)
        key, _ = self._entry.pop(block)
        del self._index[key]
        self.counters.evictions += 1
        return block

    def clear(self) -> list[int]:
        """Drop every entry (a weight push): returns the idle blocks, which the pool frees; blocks
        rows hold stop being cached (freed when the rows release them)."""
        idle = list(self._idle)
        self.counters.dropped += len(self._entry)
        self._index.clear()
        self._entry.clear()
        self._idle.clear()
        return idle
