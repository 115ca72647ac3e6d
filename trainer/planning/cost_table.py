"""Cost tables: what a decode round costs on a user's machine, measured by the engine there.

Why: a roofline says what the hardware allows, not what an engine achieves (BENCHMARKS.md,
"Adaptive speculation": this engine's step on an H100 is host time, ~25-30 ms whatever the
model). A table measured on the node — `specrl bench gpu` on a GPU, `specrl bench cost-table`
on the project's own workload — prices a round as the engine runs it; the plan then needs no
efficiency factors. Format (JSON; other keys are kept for the reader and ignored here):

    {"format": "specrl-cost-table", "version": 1,
     "tables": [{"name": "qwen3-8b", "device": "...", "source": "...", "date": "...",
                 "context_tokens": 152,                    # KV context the rounds ran at
                 "rounds": [{"batch": 1, "k": 0, "seconds": 0.0293}, ...],
                 "prefill": [{"rows": 1, "prompt_tokens": 128, "seconds": 0.041}, ...],
                 "request_seconds": 0.0,                   # fixed cost per generation request
                 "step_seconds": 0.0}]}                    # per engine step outside the timed rounds

`rounds`: seconds of one decode round (k draft steps and a (k+1)-token verify; k = 0 a plain
step). Between measured batch sizes a cost is interpolated linearly, beyond the largest
extrapolated from the last two (said in the plan), below the smallest the smallest's; a k not
measured at a batch is interpolated (or extrapolated) linearly from that batch's measured ks, or
takes the nearest batch's cost relative to plain. `step_seconds` is added to every round: the
host work of an engine step that a round's own timing leaves out (admission checks, finishing
rows); `specrl bench gpu` times whole steps and writes 0. Costs do not grow with context here:
the table says at which context they were measured.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "specrl-cost-table"
VERSION = 1


class CostTableError(ValueError):
    """A cost table that cannot be used, with what to fix."""


def _number(entry: Mapping[str, Any], key: str, where: str, *, integer: bool, least: float) -> float:
    if key not in entry:
        raise CostTableError(f"{where}: missing {key!r}")
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not float(v).is_integer()):
        raise CostTableError(f"{where}: {key!r} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(float(v)) or float(v) < least:
        raise CostTableError(f"{where}: {key!r} must be >= {least:g}, got {v!r}")
    return float(v)


class TableCosts:
    """`step_model.RoundCosts` from one measured table (see the module docstring)."""

    def __init__(self, table: Mapping[str, Any], where: str = "cost table") -> None:
        self.name = str(table.get("name", "table"))
        where = f"{where} {self.name!r}"
        rounds = table.get("rounds")
        if not isinstance(rounds, list) or not rounds:
            raise CostTableError(f"{where}: 'rounds' must be a non-empty list of {{batch, k, seconds}}")
        self.cells: dict[int, dict[int, float]] = {}
        for i, entry in enumerate(rounds):
            at = f"{where}, rounds[{i}]"
            if not isinstance(entry, Mapping):
                raise CostTableError(f"{at}: expected an object {{batch, k, seconds}}, got {entry!r}")
            b = int(_number(entry, "batch", at, integer=True, least=1))
            k = int(_number(entry, "k", at, integer=True, least=0))
            s = _number(entry, "seconds", at, integer=False, least=0)
            if s <= 0:
                raise CostTableError(f"{at}: 'seconds' must be > 0, got {s}")
            if k in self.cells.get(b, {}):
                raise CostTableError(f"{at}: batch {b}, k {k} is measured twice; keep one")
            self.cells.setdefault(b, {})[k] = s
        if not any(0 in row for row in self.cells.values()):
            raise CostTableError(f"{where}: no plain step (k = 0) measured at any batch size; plain is the baseline")
        self.batches = sorted(self.cells)
        self.prefill: list[tuple[int, int, float]] = []
        for i, entry in enumerate(table.get("prefill") or []):
            at = f"{where}, prefill[{i}]"
            self.prefill.append(
                (
                    int(_number(entry, "rows", at, integer=True, least=1)),
                    int(_number(entry, "prompt_tokens", at, integer=True, least=1)),
                    _number(entry, "seconds", at, integer=False, least=0),
                )
            )
        self.prefill.sort()
        self.request = (
            _number(table, "request_seconds", where, integer=False, least=0) if "request_seconds" in table else 0.0
        )
        self.step = _number(table, "step_seconds", where, integer=False, least=0) if "step_seconds" in table else 0.0
        self.context = table.get("context_tokens")
        self.device = str(table.get("device", "unknown device"))
        self.description = (
            f"measured cost table {self.name!r} ({self.device}; {table.get('source', 'source not given')})"
        )
        self.notes: set[str] = set()
        self._per_k: dict[int, np.ndarray] = {}

    def _at_batch(self, b: int, k: int) -> float:
        row = self.cells[b]
        if k in row:
            return row[k]
        ks = sorted(row)
        if len(ks) >= 2 and k > 0:
            i = min(max(bisect.bisect_left(ks, k), 1), len(ks) - 1)
            k0, k1 = ks[i - 1], ks[i]
            if k > ks[-1]:
                self.notes.add(f"k = {k} is priced by extrapolating the measured ks {ks} linearly at batch {b}")
            return row[k0] + (row[k1] - row[k0]) * (k - k0) / (k1 - k0)
        donors = [c for c in self.batches if k in self.cells[c] and 0 in self.cells[c]]
        if 0 in row and donors:
            near = min(donors, key=lambda c: (abs(math.log(c / b)), c))
            self.notes.add(f"k = {k} at batch {b} takes batch {near}'s cost relative to plain")
            return row[0] * self.cells[near][k] / self.cells[near][0]
        raise CostTableError(
            f"cost table {self.name!r}: cannot price k = {k} at batch {b} (measured there: k = {ks}); "
            f"measure k = {k} or two ks at some batch that also has k = 0"
        )

    def _grid(self, k: int) -> np.ndarray:
        """(batch, seconds at k) at every measured batch where k can be priced."""
        if k not in self._per_k:
            points, errors = [], []
            for b in self.batches:
                try:
                    points.append([b, self._at_batch(b, k)])
                except CostTableError as e:  # this batch cannot price k; the others may
                    errors.append(str(e))
            if not points:
                raise CostTableError(errors[0])
            self._per_k[k] = np.array(points)
        return self._per_k[k]

    def round_seconds(self, batch: np.ndarray, k: int, kv_tokens: np.ndarray) -> np.ndarray:
        grid = self._grid(k)
        bs, cs = grid[:, 0], grid[:, 1]
        batch = np.asarray(batch, dtype=float)
        out = np.interp(batch, bs, cs)
        beyond = batch > bs[-1]
        if beyond.any():
            self.notes.add(
                f"batch sizes above {int(bs[-1])} are priced by extrapolating the table's largest batches linearly"
            )
            slope = (cs[-1] - cs[-2]) / (bs[-1] - bs[-2]) if len(bs) >= 2 else 0.0
            out[beyond] = cs[-1] + max(slope, 0.0) * (batch[beyond] - bs[-1])
        return out + self.step

    def prefill_seconds(self, rows: int, prompt_tokens: int) -> float:
        if not self.prefill:
            self.notes.add("prefill not measured in the table: admissions cost nothing")
            return 0.0
        rs = np.array([r for r, _, _ in self.prefill], dtype=float)
        per_token = np.array([s / p for _, p, s in self.prefill])
        return float(np.interp(rows, rs, per_token)) * prompt_tokens

    def request_seconds(self) -> float:
        return self.request

    def leaves_out(self) -> list[str]:
        out = sorted(self.notes)
        ctx = f" (measured at ~{self.context} tokens of context)" if self.context else ""
        out.append(f"costs do not grow with the KV context{ctx}")
        return out


def read_cost_tables(path: Path) -> list[dict[str, Any]]:
    """The tables of a cost-table file, checked for format; errors say what to fix."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CostTableError(f"{path}: no such file; measure one with specrl bench gpu") from None
    except json.JSONDecodeError as e:
        raise CostTableError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CostTableError(f'{path}: not a cost table (expected "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise CostTableError(f"{path}: cost-table version {doc.get('version')!r}; this specrl reads version {VERSION}")
    tables = doc.get("tables")
    if not isinstance(tables, list) or not tables:
        raise CostTableError(f"{path}: 'tables' must be a non-empty list")
    return tables


def load_costs(path: Path, name: str | None = None) -> TableCosts:
    """One table of the file: the only one, or the one called `name`."""
    tables = read_cost_tables(path)
    names = [str(t.get("name", f"#{i}")) for i, t in enumerate(tables)]
    if name is None:
        if len(tables) > 1:
            raise CostTableError(f"{path} holds tables {', '.join(names)}: pick one with --costs-table NAME")
        return TableCosts(tables[0], str(path))
    if name not in names:
        raise CostTableError(f"{path} has no table {name!r}; it holds {', '.join(names)}")
    return TableCosts(tables[names.index(name)], str(path))


def cost_table_document(tables: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A cost-table file's content (what the measuring tools write)."""
    return {"format": FORMAT, "version": VERSION, **extra, "tables": tables}
