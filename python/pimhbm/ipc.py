"""Repair from a replica in another process by a one-sided pull over CUDA IPC.

After a fault every process of a run decides the same repairs (each sees every device's
summary). For each (source device, target device, tensor) pair of those repairs:

1. the process that holds the source exports the source tensor's and digest table's memory
   (``pimhbm._core.ipc_export``: for cudaMalloc'd memory the CUDA IPC handle of the
   allocation; for a cuMemCreate allocation, as XLA's allocator makes them, a ticket for a
   file descriptor of the allocation, which this process hands over a Unix socket to a process
   of its own user -- each side checks the other's credentials; and the offset in the
   allocation) and publishes them in jax.distributed's key-value store, under keys that hold a
   random nonce of the run;
2. the process that holds the target reads them (bounded wait), maps the peer's memory once
   (cached) and runs the chunk-repair kernel on its own stream, reading the peer GPU directly
   (``pimhbm._core.ipc_pull``: each chunk checked against the source's digest before it is
   written, the target checked after) -- no NCCL call, no work on the healthy GPU;
3. it publishes the outcome; every process reads every outcome, publishes its conclusion and
   reads everyone's (each wait bounded), so all decide alike -- or stop.

The source's process waits for the outcomes before it goes on, so nothing rewrites memory a
peer is reading. Memory that cannot be exported or mapped (a build without CUDA, devices that
are not GPUs, an allocator whose memory has no IPC handle, two devices of one process) makes
the round "unavailable" (so does any error of an export): the caller then uses the collective
transport. A chunk that does not
verify makes it "failed" (the caller goes to the host snapshot); a pull or a process that does
not answer in time, or any other error of a pull, "fatal" (a kernel may still be writing: the
run stops).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import Any

import jax

import pimhbm
from pimhbm import _core

PREFIX = "pimhbm/ipc"
log = logging.getLogger(__name__)  # each phase of a round, at DEBUG level


class Unavailable(RuntimeError):
    """This run's memory cannot be pulled over CUDA IPC (the reason is the message)."""


class Fatal(RuntimeError):
    """A pull did not finish in time (its kernel may still be writing a device's state) or a
    process did not answer: the run cannot go on in this process."""


@dataclasses.dataclass
class Pull:
    """Chunks of one tensor (and its digest table) from ``source``'s copy into ``target``'s."""

    name: str  # a key unique within the round, the same in every process
    source: Any  # jax Device
    target: Any
    chunks: list[int]
    src: tuple[jax.Array, jax.Array]  # (tensor, table) whose shards live on the devices
    dst: tuple[jax.Array, jax.Array]
    chunk_bytes: int


def _on(x: jax.Array, device: Any) -> jax.Array:
    return next(s.data for s in x.addressable_shards if s.device == device)


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise Unavailable("CUDA IPC pulls need jax.distributed (one process per device group)")
    return client


# Outcomes, from best to worst; a round's decision is the worst outcome of any pull.
_RANK = {b"ok": 0, b"unavailable": 1, b"failed": 2, b"fatal": 3}


def _worst(outcomes: list[bytes]) -> bytes:
    return max(outcomes, key=lambda o: _RANK[o.split(b" ", 1)[0]], default=b"ok")


def _export(p: Pull) -> bytes:
    if p.source.platform != "gpu" or p.target.platform != "gpu":
        raise Unavailable(f"the devices are not GPUs ({p.source.platform})")
    if p.source.process_index == p.target.process_index:
        raise Unavailable("source and target are devices of one process")
    return b"".join(_core.ipc_export(_on(a, p.source).unsafe_buffer_pointer(),
                                     p.source.local_hardware_id) for a in p.src)


def _pull(p: Pull, blob: bytes, timeout_ms: int) -> bytes:
    """The pull's outcome; any other error (a CUDA error, a pull not finished in time) is
    raised, and run_round makes it this process's "fatal" outcome."""
    half = len(blob) // 2
    t, table = (_on(a, p.target) for a in p.dst)
    try:
        status = _core.ipc_pull(p.target.local_hardware_id, p.chunks, t.unsafe_buffer_pointer(),
                                table.unsafe_buffer_pointer(), t.nbytes, p.chunk_bytes,
                                blob[:half], blob[half:], timeout_ms)
    except _core.IpcUnavailable as err:
        return b"unavailable " + str(err).encode()
    bad = [c for c, s in zip(p.chunks, status) if s != pimhbm.REPAIRED]
    return b"ok" if not bad else f"failed chunks {bad} did not verify".encode()


def run_nonce(run_id: str, timeout_ms: int) -> str:
    """A random nonce of this run, the same in every process (process 0 draws it): the keys of
    the rounds hold it, so that they cannot be known, or written, before the run is going."""
    client = _client()
    key = f"{PREFIX}/{run_id}/nonce"
    if jax.process_index() == 0:
        client.key_value_set_bytes(key, secrets.token_hex(16).encode())
    try:
        return client.blocking_key_value_get_bytes(key, timeout_ms).decode()
    except Exception as err:  # the store's timeout (an XLA runtime error)
        raise Fatal(f"no run nonce from process 0 within {timeout_ms} ms: {err}") from err


def run_round(run_id: str, round_id: int, pulls: list[Pull], timeout_ms: int) -> int:
    """Runs every pull of a round (each process its own part); returns the chunks repaired.
    Every process comes to the same decision: raises Unavailable when IPC cannot serve this run
    (use another transport), RuntimeError when a pull failed (a chunk did not verify), Fatal
    when a pull or a process did not finish in time. Each wait is bounded by ``timeout_ms``,
    the whole round by four times that."""
    client = _client()
    me = jax.process_index()
    start = time.monotonic()
    prefix = f"{PREFIX}/{run_id}/{round_id}"

    def get(key: str, within: int) -> bytes:  # waits until `within` timeouts from the start
        left = int(within * timeout_ms - (time.monotonic() - start) * 1000)
        try:
            return client.blocking_key_value_get_bytes(key, max(left, 1))
        except Exception as err:  # the store's timeout (an XLA runtime error)
            raise Fatal(f"no answer for {key} within {within * timeout_ms} ms: {err}") from err

    # 1. Exports of what this process holds (an error is published in place of the handles).
    for p in pulls:
        if p.source.process_index == me:
            try:
                blob = _export(p)
            except Exception as err:  # noqa: BLE001 -- whatever it is, the peers must hear it
                # (memory without an IPC handle, a driver without the entry point, ...): the
                # round is "unavailable" everywhere, never a peer left waiting for the export.
                known = isinstance(err, (Unavailable, _core.IpcUnavailable))
                blob = b"!" + (str(err) if known else f"{type(err).__name__}: {err}").encode()
            client.key_value_set_bytes(f"{prefix}/export/{p.name}", blob)
            log.debug("round %s: exported %s (%d bytes)", prefix, p.name, len(blob))
    # 2. Pulls into this process's devices; each outcome published.
    for p in pulls:
        if p.target.process_index != me:
            continue
        try:
            blob = get(f"{prefix}/export/{p.name}", 1)
            outcome = (b"unavailable " + blob[1:] if blob.startswith(b"!")
                       else _pull(p, blob, timeout_ms))
        except Exception as err:  # noqa: BLE001 -- no answer in time, or anything unforeseen:
            outcome = b"fatal " + str(err).encode()  # the peers hear it rather than wait
        client.key_value_set_bytes(f"{prefix}/outcome/{p.name}", outcome)
        log.debug("round %s: pulled %s: %s", prefix, p.name, outcome[:200])
    # 3. Every outcome, in every process, then each process's conclusion from them: the same
    # decision everywhere, or (a process that did not answer) Fatal.
    try:
        outcomes = [get(f"{prefix}/outcome/{p.name}", 3) for p in pulls]
    except Fatal as err:
        outcomes = [b"fatal " + str(err).encode()]
    client.key_value_set_bytes(f"{prefix}/decision/{me}", _worst(outcomes))
    decisions = [get(f"{prefix}/decision/{i}", 4) for i in range(jax.process_count())]
    log.debug("round %s: decisions %s", prefix, decisions)
    kind, _, why = _worst(decisions).partition(b" ")
    if kind == b"unavailable":
        raise Unavailable(why.decode())
    if kind == b"failed":
        raise RuntimeError(f"IPC pull: {why.decode()}")
    if kind == b"fatal":
        raise Fatal(why.decode())
    return sum(len(p.chunks) for p in pulls)
