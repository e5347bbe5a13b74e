"""A node-local in-memory store of each rank's training state, so it outlives a worker restart.

``/dev/shm/meshmorph-<run>/node<n>/rank<r>-step<s>.pt``: a rank writes its pieces and small
state at a step boundary to a temporary name and renames it into place (atomic), so a worker
killed while writing leaves the previous step whole; the newest ``keep`` steps are kept. Across
nodes, node n also keeps node n - 1's newest files (``ring_copy``, every K steps; K from an
overhead budget, ``ring_interval_steps``), so a lost node's pieces survive on its neighbour.
"""

from __future__ import annotations

import io
import math
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from meshmorph.elastic.live.local_state import HeldPiece, LocalState, SmallState

SHM_ROOT = Path("/dev/shm")
"""Where node-local stores live: a memory file system."""
STORE_ROOT_ENV = "MESHMORPH_STORE_ROOT"
"""Names another root for this node's stores (one machine standing in for several nodes gives
each its own, so no node can read another's memory; tests, demos)."""


def store_root() -> Path:
    """``MESHMORPH_STORE_ROOT`` if set, else ``/dev/shm``."""
    root = os.environ.get(STORE_ROOT_ENV)
    return Path(root) if root else SHM_ROOT


_FILE = re.compile(r"^rank(\d+)-step(\d+)\.pt$")


def _files(folder: Path) -> Iterator[tuple[Path, int, int]]:
    """(path, rank, step) of every state file in ``folder``."""
    for entry in folder.iterdir() if folder.is_dir() else ():
        if match := _FILE.match(entry.name):
            yield entry, int(match[1]), int(match[2])


@dataclass(frozen=True, slots=True)
class StoredState:
    """One rank's state as a store holds it."""

    rank: int
    """The rank (of ``plan_json``) that held it."""
    step: int
    """Optimizer steps done when it was written."""
    plan_json: str
    """The plan the pieces are laid out by."""
    state: LocalState
    """Its pieces and small state."""


def newest_common(ranks: Iterable[int], *holdings: Mapping[int, list[int]]) -> int | None:
    """The newest step stored for every rank of ``ranks`` in one of ``holdings`` (rank ->
    steps); None: there is none."""
    held = [{s for steps in holdings for s in steps.get(r, [])} for r in ranks]
    common = set.intersection(*held) if held else set()
    return max(common) if common else None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80] or "run"


def to_bytes(rank: int, step: int, plan_json: str, state: LocalState) -> bytes:
    """A rank's state serialised (pieces copied out of any larger storage they view)."""
    pieces = [(p.key, p.offset, p.global_shape, p.tensor.detach().clone())
              for ps in state.pieces.values() for p in ps]
    small = {f.name: getattr(state.small, f.name) for f in fields(SmallState)}
    payload = {"rank": rank, "step": step, "plan": plan_json, "fingerprint": state.fingerprint,
               "pieces": pieces, "small": small}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> StoredState:
    """The inverse of ``to_bytes``."""
    payload: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=False)
    pieces: dict[str, list[HeldPiece]] = {}
    for key, offset, shape, tensor in payload["pieces"]:
        pieces.setdefault(key, []).append(HeldPiece(key, tuple(offset), tuple(shape), tensor))
    state = LocalState(pieces, SmallState(**payload["small"]), payload["fingerprint"])
    return StoredState(payload["rank"], payload["step"], payload["plan"], state)


class NodeStore:
    """The state of one node's ranks (and its ring neighbour's copy) in shared memory."""

    def __init__(self, run_id: str, node: int, *, root: Path | None = None, keep: int = 2
                 ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (steps kept per rank), got {keep}")
        self.run_dir = (root or store_root()) / f"meshmorph-{_safe(run_id)}"
        self.dir = self.run_dir / f"node{node}"
        self.node, self.keep = node, keep
        self.pinned: set[int] = set()
        """Steps kept past ``keep`` (the newest ring-copied step: the lost node's copy is of that
        step, so the survivors need their own files of it too)."""

    @property
    def replicas(self) -> Path:
        """Where this node keeps the ring copy of the previous node's ranks' files."""
        return self.dir / "replicas"

    def write(self, rank: int, step: int, data: bytes, folder: Path | None = None) -> Path:
        """Write one rank's serialised state for ``step`` atomically; prune older steps."""
        folder = folder or self.dir
        folder.mkdir(parents=True, exist_ok=True)
        final = self.path(rank, step, folder)
        staging = folder / f".rank{rank}-step{step}.{os.getpid()}.partial"
        staging.write_bytes(data)
        os.replace(staging, final)
        for old in self.steps(folder).get(rank, [])[:-self.keep]:
            if old not in self.pinned or folder != self.dir:
                self.path(rank, old, folder).unlink(missing_ok=True)
        return final

    def save(self, rank: int, step: int, plan_json: str, state: LocalState) -> Path:
        """Write this rank's state at a step boundary."""
        return self.write(rank, step, to_bytes(rank, step, plan_json, state))

    def steps(self, folder: Path | None = None) -> dict[int, list[int]]:
        """Rank -> steps stored for it, oldest first."""
        found: dict[int, list[int]] = {}
        for _, rank, step in _files(folder or self.dir):
            found.setdefault(rank, []).append(step)
        return {rank: sorted(steps) for rank, steps in sorted(found.items())}

    def newest_common_step(self, ranks: list[int]) -> int | None:
        """The newest step stored for every rank of ``ranks`` (None: there is none)."""
        return newest_common(ranks, self.steps())

    def path(self, rank: int, step: int, folder: Path | None = None) -> Path:
        return (folder or self.dir) / f"rank{rank}-step{step}.pt"

    def load(self, rank: int, step: int, folder: Path | None = None) -> StoredState:
        """One rank's state at ``step``; a missing file names what the store does hold."""
        path = self.path(rank, step, folder)
        if not path.is_file():
            raise FileNotFoundError(f"node store {path.parent} has no state of rank {rank} at "
                                    f"step {step} (it holds {self.steps(folder)}); recover from "
                                    "the ring copy or the newest checkpoint")
        return from_bytes(path.read_bytes())

    def keep_only(self, ranks: set[int], step: int) -> None:
        """Remove every file but those of ``ranks`` at ``step`` from this node's folder, and the
        ring copies (after a reshape the store holds the new plan's state alone)."""
        for entry, rank, stored in _files(self.dir):
            if rank not in ranks or stored != step:
                entry.unlink(missing_ok=True)
        shutil.rmtree(self.replicas, ignore_errors=True)
        self.pinned = set()

    def clear(self) -> None:
        """Remove this run's stores on this node (at the end of a run)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)


def ring_partner(node: int, num_nodes: int) -> int | None:
    """The node that keeps node ``node``'s copy (None with a single node)."""
    return None if num_nodes < 2 else (node + 1) % num_nodes


def ring_interval_steps(node_state_bytes: int, link_bytes_per_s: float, step_time_s: float,
                        overhead_budget: float = 0.02) -> int:
    """K: copy a node's state to its ring neighbour every K steps, so that the copy time spread
    over K steps costs at most ``overhead_budget`` of the step time:
    ``copy_s / (K * step_time_s) <= budget``, i.e. ``K = ceil(copy_s / (budget * step_time_s))``."""
    if not 0 < overhead_budget <= 1 or step_time_s <= 0 or link_bytes_per_s <= 0:
        raise ValueError(f"need 0 < overhead_budget <= 1, step_time_s > 0 and a positive link "
                         f"bandwidth; got {overhead_budget}, {step_time_s}, {link_bytes_per_s}")
    copy_s = node_state_bytes / link_bytes_per_s  # one node's files over one link
    return max(1, math.ceil(copy_s / (overhead_budget * step_time_s)))


def ring_copy(store: NodeStore, rank: int, step: int, local_rank_peers: dict[str, int]) -> int:
    """Send this rank's stored file of ``step`` to the same local rank on the next node and keep
    the one the previous node sends (collective over the default group; ``local_rank_peers``
    holds the global ranks ``next`` and ``prev``). Returns the bytes sent."""
    import torch.distributed as dist

    def exchange(out: torch.Tensor, into: torch.Tensor) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, local_rank_peers["next"]),
                                            dist.P2POp(dist.irecv, into, local_rank_peers["prev"])]):
            work.wait()

    out = torch.frombuffer(bytearray(store.path(rank, step).read_bytes()), dtype=torch.uint8)
    size_in = torch.empty(2, dtype=torch.int64)
    exchange(torch.tensor([out.numel(), rank], dtype=torch.int64), size_in)
    incoming = torch.empty(int(size_in[0]), dtype=torch.uint8)
    exchange(out, incoming)
    store.write(int(size_in[1]), step, incoming.numpy().tobytes(), folder=store.replicas)
    return out.numel()
