"""Host backups in POSIX shared memory: snapshots of the protected state and a log of batches.

The region (``/dev/shm/<name>``) is owned by C++ (``pimhbm._core.ShmRegion``) and outlives the
training process: a process killed with SIGKILL restarts from the newest complete snapshot plus
a replay of the logged batches, without reading a disk checkpoint. JAX sees the region's memory
through zero-copy DLPack views (``ShmRegion.jax``). The region is this user's alone (created
exclusively, mode 0600; owner and mode checked on open) and one process uses it at a time (a
lock, held until :meth:`HostBackup.close`).

Layout (every offset 256-byte aligned):
  header      magic, version, sizes, the layout's fingerprint, the run's binding; its MAC
  2 snapshot slots (the newer is written while the older stays valid), each:
              step, complete flag, MAC; then every tensor of the state and its digest table
  batch log   a ring of records: step, valid flag, MAC; the batch's arrays

Nothing read from the region is used before its MAC verifies: HMAC-SHA256 (16 bytes kept) with
a key that lives outside the region (:func:`snapshot_key`: a file of this user's, mode 0600),
so a process that can write the region cannot forge a record. A slot's MAC covers the run, the
slot's step and its digest tables; the tensors are checked against those tables on the devices
when a snapshot is restored (the restore's scrub), so neither can be replaced, with or without
the other. A record that fails its check is not used: a slot is passed over for the older one,
a batch is made again by the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import _core

MAGIC = b"PIMHBMS2"
VERSION = 2
_ALIGN = 256
_HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sqqqqq16s32s")  # magic, version, sizes, ring; fingerprint, run
_SLOT = struct.Struct("<qq16s")  # step, complete, MAC
_RECORD = struct.Struct("<qq16s")  # step, valid, MAC
_MAC_BYTES = 16
KEY_BYTES = 32

log = logging.getLogger(__name__)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    digest_table: bool = False  # a digest table: covered by its slot's MAC

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


def specs_of(named: Iterable[tuple[str, Any]], digest_tables: bool = False) -> list[TensorSpec]:
    """TensorSpecs of (name, array or ShapeDtypeStruct) pairs, in order."""
    return [TensorSpec(n, tuple(int(d) for d in a.shape), jnp.dtype(a.dtype).name, digest_tables)
            for n, a in named]


def snapshot_key(path: str | None = None) -> bytes:
    """The key of the regions' MACs: ``path`` (default $PIMHBM_KEY_FILE, else
    ~/.config/pimhbm/snapshot.key), made with fresh random bytes the first time (exclusively,
    mode 0600). A key file another user owns, or that others may read, is refused."""
    path = path or os.environ.get("PIMHBM_KEY_FILE") or os.path.join(
        os.path.expanduser("~"), ".config", "pimhbm", "snapshot.key")
    if not os.path.exists(path):
        _make_key(path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"snapshot key {path}: owned by uid {st.st_uid} with mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}; it must be this user's "
                                  f"(uid {os.geteuid()}) and readable by no one else")
        key = f.read()
    if len(key) != KEY_BYTES:
        raise ValueError(f"snapshot key {path} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def _make_key(path: str) -> None:
    """A fresh key at ``path``, whole or not at all: written aside, then linked into place (a
    process that made one first wins; a reader never sees a part of one)."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    aside = f"{path}.{secrets.token_hex(8)}"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        os.link(aside, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(aside)


class RegionError(ValueError):
    """The region is not this run's backup, or it is damaged where nothing else can stand in."""


class HostBackup:
    """Snapshots and the batch log in one shared-memory region.

    ``tensors`` lists what a snapshot holds (state tensors and their digest tables, in the
    order the snapshot op gets them); ``batch`` what one batch holds; ``ring`` how many batches
    the log keeps (at least the snapshot interval plus the steps in flight). ``run``: the
    binding of the run (bytes that say which model, configuration, initial state and data it
    is); a region written by another run is refused. ``key``: the MACs' (snapshot_key())."""

    def __init__(self, name: str, tensors: list[TensorSpec], batch: list[TensorSpec],
                 ring: int, *, create: bool, run: bytes = b"", key: bytes | None = None):
        if ring < 1:
            raise ValueError("the batch log needs at least one record")
        self.name, self.tensors, self.batch, self.ring = name, tensors, batch, ring
        self.run = hashlib.sha256(run).digest()
        self._key = key if key is not None else snapshot_key()
        self.fingerprint = hashlib.sha256(json.dumps(
            [[t.name, list(t.shape), t.dtype, t.digest_table] for t in tensors] + ["batch"] +
            [[t.name, list(t.shape), t.dtype] for t in batch] + [ring]).encode()).digest()[:16]
        self._lay_out()
        # slot -> the step of its good snapshot as this process knows it (sealed here, or
        # checked once; None: none): choosing the slot to write next then checks no MAC again
        # (a slot's covers megabytes of digest tables). A restore still checks its slot.
        self._trusted: dict[int, int | None] = {0: None, 1: None} if create else {}
        self._pinning = None
        self._reopened = not create
        if create:
            self.region = _core.ShmRegion.create(name, self.nbytes)  # a new region: all zeros
            self._write_header()
            self.region.pin()
        else:
            # A resuming process reads a snapshot first and writes the next one later: it reads
            # from the pageable pages and locks the region in the background after
            # (pin_rest_in_background), off the restore's critical path; wait_pinned() before
            # the next snapshot is written.
            self.region = _core.ShmRegion.open(name)
            try:
                self.check_header()
            except Exception:
                self.region.release()
                raise

    def _lay_out(self) -> None:
        self.tensor_offsets: list[int] = []
        at = _SLOT.size
        for t in self.tensors:
            at = _align(at)
            self.tensor_offsets.append(at)
            at += t.nbytes
        self.slot_bytes = _align(at)
        self.slot_base = [_HEADER_BYTES, _HEADER_BYTES + self.slot_bytes]
        self.batch_offsets: list[int] = []
        at = _RECORD.size
        for t in self.batch:
            at = _align(at)
            self.batch_offsets.append(at)
            at += t.nbytes
        self.record_bytes = _align(at)
        self.log_base = _HEADER_BYTES + 2 * self.slot_bytes
        self.nbytes = self.log_base + self.ring * self.record_bytes

    def _mac(self, *parts: bytes | np.ndarray) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()[:_MAC_BYTES]

    def _bytes(self, offset: int, n: int) -> np.ndarray:
        return self.region.numpy(offset, [n], "uint8")

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

    def _header_payload(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.nbytes, self.slot_bytes, self.record_bytes,
                            self.ring, self.fingerprint, self.run)

    def _write_header(self) -> None:
        payload = self._header_payload()
        h = payload + self._mac(b"header", payload)
        self._bytes(0, len(h))[:] = np.frombuffer(h, np.uint8)

    def check_header(self) -> None:
        where = f"shared memory /{self.name}"
        if self.region.nbytes < _HEADER_BYTES:
            raise RegionError(f"{where} holds {self.region.nbytes} bytes: not a pimhbm backup")
        raw = self._bytes(0, _HEADER.size + _MAC_BYTES).tobytes()
        payload, mac = raw[:_HEADER.size], raw[_HEADER.size:]
        magic, version, nbytes, *_, fingerprint, run = _HEADER.unpack(payload)
        if magic != MAGIC or version != VERSION:
            raise RegionError(f"{where} is not a pimhbm backup of this version")
        if not hmac.compare_digest(mac, self._mac(b"header", payload)):
            raise RegionError(f"{where}: its header fails its check (damaged, or written with "
                              "another key): not used")
        if fingerprint != self.fingerprint or nbytes != self.nbytes:
            raise RegionError(f"{where} was written for another state layout (tensor names, "
                              "shapes, dtypes or ring size differ)")
        if run != self.run:
            raise RegionError(f"{where} was written by another run (its model, configuration, "
                              "initial parameters or data differ): not resumed from")
        if self.region.nbytes < self.nbytes:
            raise RegionError(f"{where} holds {self.region.nbytes} bytes; this run's layout "
                              f"needs {self.nbytes}")

    def rebind(self, run: bytes) -> None:
        """A new run in the same region: its binding in the header; every snapshot and logged
        batch forgotten."""
        self.run = hashlib.sha256(run).digest()
        self._trusted = {0: None, 1: None}
        for slot in (0, 1):
            self._slot_header(slot)[:] = 0
        for r in range(self.ring):
            self._record_header(r)[:] = 0
        self._write_header()

    # -- snapshots ---------------------------------------------------------------------------

    def _slot_header(self, slot: int) -> np.ndarray:
        return self._bytes(self.slot_base[slot], _SLOT.size)

    def _slot_fields(self, slot: int) -> tuple[int, int, bytes]:
        return _SLOT.unpack(self._slot_header(slot).tobytes())

    def _slot_mac(self, slot: int, step: int) -> bytes:
        tables = [self._bytes(o, t.nbytes) for o, t in zip(self.offsets(slot), self.tensors)
                  if t.digest_table]
        return self._mac(b"slot", self.run, struct.pack("<qq", slot, step), *tables)

    def offsets(self, slot: int) -> list[int]:
        """Byte offsets in the region of every tensor of snapshot slot ``slot``."""
        return [self.slot_base[slot] + o for o in self.tensor_offsets]

    def slot_for_next(self) -> int:
        """The slot to write next: one that holds no snapshot that verifies, else the older one
        (never the newest good snapshot). The snapshot to be kept is checked again even when
        this process sealed it: host memory can change after a seal, and writing over the
        older slot would then leave no snapshot that verifies."""
        for s in (0, 1):
            if s not in self._trusted:
                self._trusted[s] = self.snapshot_step(s) if self.verified(s) else None
        steps = [self._trusted[0], self._trusted[1]]
        if steps[0] is None:
            return 0
        if steps[1] is None:
            return 1
        older, newer = (0, 1) if steps[0] < steps[1] else (1, 0)
        if not self.verified(newer):
            log.warning("/%s: the snapshot of step %d (slot %d) no longer verifies: the next "
                        "snapshot goes there, the older one is kept", self.name, steps[newer],
                        newer)
            self._trusted[newer] = None
            return newer
        return older

    def begin(self, slot: int, step: int) -> None:
        """Marks ``slot`` incomplete before its tensors are overwritten with step ``step``."""
        self._trusted[slot] = None
        self._slot_header(slot)[:] = np.frombuffer(_SLOT.pack(step, 0, bytes(_MAC_BYTES)),
                                                   np.uint8)

    def complete(self, slot: int) -> None:
        """Seals ``slot`` (its copies are done): its MAC, then the complete flag."""
        step, _, _ = self._slot_fields(slot)
        header = self._slot_header(slot)
        header[:] = np.frombuffer(_SLOT.pack(step, 0, self._slot_mac(slot, step)), np.uint8)
        header[8:16] = np.frombuffer(struct.pack("<q", 1), np.uint8)
        self._trusted[slot] = step

    def snapshot_step(self, slot: int) -> int | None:
        """The step of a complete slot (not yet checked: see :meth:`verified`)."""
        step, complete, _ = self._slot_fields(slot)
        return step if complete == 1 else None

    def verified(self, slot: int) -> bool:
        """Whether the slot's header and digest tables are as sealed (its MAC)."""
        step, complete, mac = self._slot_fields(slot)
        return complete == 1 and hmac.compare_digest(mac, self._slot_mac(slot, step))

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
        return [self._bytes(o, t.nbytes).view(np.dtype(jnp.dtype(t.dtype))).reshape(t.shape)
                for o, t in zip(self.offsets(slot), self.tensors)]

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
        return self._bytes(self.log_base + r * self.record_bytes, _RECORD.size)

    def _record_mac(self, step: int, arrays: list[np.ndarray]) -> bytes:
        raw = [np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays]
        return self._mac(b"batch", self.run, struct.pack("<q", step), *raw)

    def log_batch(self, step: int, arrays: list[np.ndarray]) -> None:
        """Writes the batch of step ``step`` into the ring (replacing the oldest record)."""
        r = step % self.ring
        h = self._record_header(r)
        h[8:16] = 0  # not valid while it is written
        base = self.log_base + r * self.record_bytes
        for off, t, a in zip(self.batch_offsets, self.batch, arrays):
            a = np.ascontiguousarray(a)
            if tuple(a.shape) != t.shape or a.dtype.name != t.dtype:
                raise ValueError(f"batch array {t.name} is {a.dtype}{a.shape}, the log holds "
                                 f"{t.dtype}{t.shape}")
            self._bytes(base + off, a.nbytes)[:] = a.view(np.uint8).reshape(-1)
        h[:] = np.frombuffer(_RECORD.pack(step, 0, self._record_mac(step, arrays)), np.uint8)
        h[8:16] = np.frombuffer(struct.pack("<q", 1), np.uint8)

    def logged_batch(self, step: int) -> list[np.ndarray] | None:
        """The logged batch of ``step`` (copies), or None if the ring no longer holds it or its
        record fails its check (then the caller makes the batch again)."""
        r = step % self.ring
        logged, valid, mac = _RECORD.unpack(self._record_header(r).tobytes())
        if valid != 1 or logged != step:
            return None
        base = self.log_base + r * self.record_bytes
        arrays = [self.region.numpy(base + off, list(t.shape), t.dtype).copy()
                  for off, t in zip(self.batch_offsets, self.batch)]
        if not hmac.compare_digest(mac, self._record_mac(step, arrays)):
            log.warning("the logged batch of step %d in /%s fails its check: made again",
                        step, self.name)
            return None
        return arrays

    def last_logged_step(self) -> int | None:
        steps = []
        for r in range(self.ring):
            step, valid, _ = _RECORD.unpack(self._record_header(r).tobytes())
            if valid == 1:
                steps.append(step)
        return max(steps) if steps else None

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Gives the region up (another process may open it now); views stay valid."""
        self.region.release()

    @staticmethod
    def unlink(name: str) -> bool:
        return _core.ShmRegion.unlink(name)
