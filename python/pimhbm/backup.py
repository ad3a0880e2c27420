"""Host backups in POSIX shared memory: snapshots of the protected state and a log of batches.

The region (``/dev/shm/<name>``) is owned by C++ (``pimhbm._core.ShmRegion``) and outlives the
training process: a process killed with SIGKILL restarts from the newest complete snapshot plus
a replay of the logged batches, without reading a disk checkpoint. JAX sees the region's memory
through zero-copy DLPack views (``ShmRegion.jax``).

Layout (every offset 256-byte aligned):
  header      magic, version, layout fingerprint, sizes
  2 snapshot slots (the newer is written while the older stays valid), each:
              step, complete flag, then every tensor of the state and its digest table
  batch log   a ring of records: step, valid flag, the batch's arrays
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import _core

MAGIC = b"PIMHBMS1"
_ALIGN = 256
_HEADER_BYTES = 4096
_SLOT_HEADER = 64  # step (int64), complete (int64), spare


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


def specs_of(named: Iterable[tuple[str, Any]]) -> list[TensorSpec]:
    """TensorSpecs of (name, array or ShapeDtypeStruct) pairs, in order."""
    return [TensorSpec(n, tuple(int(d) for d in a.shape), jnp.dtype(a.dtype).name) for n, a in named]


class HostBackup:
    """Snapshots and the batch log in one shared-memory region.

    ``tensors`` lists what a snapshot holds (state tensors and their digest tables, in the
    order the snapshot op gets them); ``batch`` what one batch holds; ``ring`` how many batches
    the log keeps (at least the snapshot interval plus the steps in flight)."""

    def __init__(self, name: str, tensors: list[TensorSpec], batch: list[TensorSpec],
                 ring: int, *, create: bool):
        if ring < 1:
            raise ValueError("the batch log needs at least one record")
        self.name = name
        self.tensors = tensors
        self.batch = batch
        self.ring = ring
        self.fingerprint = hashlib.sha256(json.dumps(
            [[t.name, list(t.shape), t.dtype] for t in tensors] + ["batch"] +
            [[t.name, list(t.shape), t.dtype] for t in batch] + [ring]).encode()).digest()[:16]
        # Layout.
        self.tensor_offsets: list[int] = []
        at = _SLOT_HEADER
        for t in tensors:
            at = _align(at)
            self.tensor_offsets.append(at)
            at += t.nbytes
        self.slot_bytes = _align(at)
        self.slot_base = [_HEADER_BYTES, _HEADER_BYTES + self.slot_bytes]
        self.batch_offsets: list[int] = []
        at = 16
        for t in batch:
            at = _align(at)
            self.batch_offsets.append(at)
            at += t.nbytes
        self.record_bytes = _align(at)
        self.log_base = _HEADER_BYTES + 2 * self.slot_bytes
        self.nbytes = self.log_base + ring * self.record_bytes

        if create:
            self.region = _core.ShmRegion.create(name, self.nbytes)
            self._header()[:] = 0
            self._write_header()
            for slot in (0, 1):
                self._slot_header(slot)[:] = 0
            for r in range(ring):
                self._record_header(r)[:] = 0
            self._pinning = None
            self.region.pin()
            self._reopened = False
        else:
            self.region = _core.ShmRegion.open(name)
            self._check_header()
            # A resuming process reads a snapshot first and writes the next one later: it reads
            # from the pageable pages and locks the region in the background after
            # (pin_rest_in_background), off the restore's critical path; wait_pinned() before
            # the next snapshot is written.
            self._pinning = None
            self._reopened = True

    @property
    def pinned(self) -> bool:
        """Whether the region is page-locked (waits for a pinning still in progress)."""
        self.wait_pinned()
        return self.region.pinned

    def wait_pinned(self) -> None:
        """Returns once a reopened region is page-locked (pinning it now if no restore began
        the background pinning)."""
        if self._pinning is not None:
            self._pinning.join()
        elif self._reopened:
            self.region.pin()

    # -- header ------------------------------------------------------------------------------

    def _header(self) -> np.ndarray:
        return self.region.numpy(0, [_HEADER_BYTES], "uint8")

    def _write_header(self) -> None:
        h = struct.pack("<8s16sqqqq", MAGIC, self.fingerprint, self.nbytes, self.slot_bytes,
                        self.record_bytes, self.ring)
        self._header()[:len(h)] = np.frombuffer(h, np.uint8)

    def _check_header(self) -> None:
        if self.region.nbytes < self.nbytes:
            raise ValueError(f"shared memory /{self.name} holds {self.region.nbytes} bytes; this "
                             f"run's layout needs {self.nbytes}")
        magic, fp, nbytes, _, _, ring = struct.unpack_from("<8s16sqqqq", self._header().tobytes())
        if magic != MAGIC:
            raise ValueError(f"shared memory /{self.name} is not a pimhbm backup")
        if fp != self.fingerprint or ring != self.ring:
            raise ValueError(f"shared memory /{self.name} was written for another state layout "
                             "(tensor names, shapes, dtypes or ring size differ)")

    # -- snapshots ---------------------------------------------------------------------------

    def _slot_header(self, slot: int) -> np.ndarray:
        return self.region.numpy(self.slot_base[slot], [2], "int64")

    def offsets(self, slot: int) -> list[int]:
        """Byte offsets in the region of every tensor of snapshot slot ``slot``."""
        return [self.slot_base[slot] + o for o in self.tensor_offsets]

    def slot_for_next(self) -> int:
        """The slot to write next: the older one (never the newest complete snapshot)."""
        steps = [self.snapshot_step(s) for s in (0, 1)]
        if steps[0] is None:
            return 0
        if steps[1] is None:
            return 1
        return 0 if steps[0] < steps[1] else 1

    def begin(self, slot: int, step: int) -> None:
        """Marks ``slot`` incomplete before its tensors are overwritten with step ``step``."""
        h = self._slot_header(slot)
        h[1] = 0
        h[0] = step

    def complete(self, slot: int) -> None:
        self._slot_header(slot)[1] = 1

    def snapshot_step(self, slot: int) -> int | None:
        h = self._slot_header(slot)
        return int(h[0]) if h[1] == 1 else None

    def newest(self) -> list[tuple[int, int]]:
        """(step, slot) of the complete snapshots, newest first."""
        found = [(s, i) for i in (0, 1) if (s := self.snapshot_step(i)) is not None]
        return sorted(found, reverse=True)

    def snapshot_arrays(self, slot: int) -> list[np.ndarray]:
        """NumPy views (no copy) of the tensors of snapshot slot ``slot``, for putting on the
        devices. A reopened region is not page-locked yet: a put from its pageable pages is
        faster than locking them first (bench/NOTES.md, recovery v4-v6). Lock the region with
        pin_rest_in_background() once the puts are done (a registration running beside them
        slows them down)."""
        return [self.region.numpy(o, [t.nbytes], "uint8").view(np.dtype(jnp.dtype(t.dtype)))
                .reshape(t.shape) for o, t in zip(self.offsets(slot), self.tensors)]

    def pin_rest_in_background(self) -> None:
        """Starts page-locking a reopened region on a background thread; the next snapshot
        waits for it (wait_pinned())."""
        if self._reopened and self._pinning is None and not self.region.pinned:
            self._pinning = threading.Thread(target=self.region.pin, name=f"pin /{self.name}",
                                             daemon=True)
            self._pinning.start()

    def snapshot_views(self, slot: int) -> list[jax.Array]:
        """Zero-copy JAX (CPU) arrays over the tensors of snapshot slot ``slot``."""
        return [self.region.jax(o, list(t.shape), t.dtype)
                for o, t in zip(self.offsets(slot), self.tensors)]

    # -- batch log ---------------------------------------------------------------------------

    def _record_header(self, r: int) -> np.ndarray:
        return self.region.numpy(self.log_base + r * self.record_bytes, [2], "int64")

    def log_batch(self, step: int, arrays: list[np.ndarray]) -> None:
        """Writes the batch of step ``step`` into the ring (replacing the oldest record)."""
        r = step % self.ring
        h = self._record_header(r)
        h[1] = 0
        base = self.log_base + r * self.record_bytes
        for off, t, a in zip(self.batch_offsets, self.batch, arrays):
            a = np.ascontiguousarray(a)
            if tuple(a.shape) != t.shape or a.dtype.name != t.dtype:
                raise ValueError(f"batch array {t.name} is {a.dtype}{a.shape}, the log holds "
                                 f"{t.dtype}{t.shape}")
            self.region.numpy(base + off, [a.nbytes], "uint8")[:] = a.view(np.uint8).reshape(-1)
        h[0] = step
        h[1] = 1

    def logged_batch(self, step: int) -> list[np.ndarray] | None:
        """The logged batch of ``step`` (copies), or None if the ring no longer holds it."""
        r = step % self.ring
        h = self._record_header(r)
        if h[1] != 1 or h[0] != step:
            return None
        base = self.log_base + r * self.record_bytes
        return [self.region.numpy(base + off, list(t.shape), t.dtype).copy()
                for off, t in zip(self.batch_offsets, self.batch)]

    def last_logged_step(self) -> int | None:
        steps = [int(self._record_header(r)[0]) for r in range(self.ring)
                 if self._record_header(r)[1] == 1]
        return max(steps) if steps else None

    # -- lifetime ----------------------------------------------------------------------------

    @staticmethod
    def unlink(name: str) -> bool:
        return _core.ShmRegion.unlink(name)
