"""A run's parts, as every step sees them: the config, the policy, the sidecars, the task, the
tokenizer and the run directory (`Run`); and how a slow phase is announced (`phase`)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from sidecar.client.fleet import Fleet
from trainer.policy.policy import Policy
from trainer.policy.reference import ReferencePolicy
from trainer.rl.config import RLConfig
from trainer.rl.environments import Environment
from trainer.rl.ranks import is_leader
from trainer.rl.run_dir import RunDir
from trainer.rl.tasks import Task
from trainer.tokenizer import Tokenizer


@dataclass(kw_only=True, slots=True)
class Run:
    """What a step needs: the config, policy, sidecars, task and tokenizer."""

    cfg: RLConfig
    policy: Policy
    sidecars: Fleet | None
    """The fleet; None on the ranks > 0 of a multi-process run (only rank 0 talks to sidecars)."""
    task: Task | Environment
    """What problems come from: a single-turn task, or a multi-turn environment."""
    tokenizer: Tokenizer
    run_dir: RunDir
    reference: ReferencePolicy | None = None
    """The frozen reference policy of the KL penalty (when algorithm.kl_coef > 0)."""
    generating: threading.Lock = field(default_factory=threading.Lock)
    """Held while a step's rollout or an evaluation generates (rank 0): with generation running
    ahead in a thread of its own, an evaluation waits for the batch in progress, so neither's
    speculation counters take in the other's decoding."""

    @property
    def leader(self) -> bool:
        """Rank 0 (or a single process): generates, rewards, pushes, evaluates and writes the run."""
        return is_leader()

    @property
    def fleet(self) -> Fleet:
        if self.sidecars is None:
            raise RuntimeError("only rank 0 talks to the sidecars")
        return self.sidecars


@contextlib.contextmanager
def phase(desc: str, enabled: bool = True) -> Iterator[None]:
    """Say that a slow phase started and how long it took (on stderr, between progress bars)."""
    if enabled:
        tqdm.write(f"{desc} ...", file=sys.stderr)
    t = time.perf_counter()
    yield
    if enabled:
        tqdm.write(f"{desc}: done in {time.perf_counter() - t:.1f}s", file=sys.stderr)
