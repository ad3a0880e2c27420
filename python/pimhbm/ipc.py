"""Repair from a replica in another process by a one-sided pull over CUDA IPC.

After a fault every process of a run decides the same repairs (each sees every device's
summary). For each (source device, target device, tensor) pair of those repairs:

1. the process that holds the source exports the source tensor's and digest table's memory
   (``pimhbm._core.ipc_export``: the CUDA IPC handle of the allocation, the offset in it) and
   publishes them in jax.distributed's key-value store;
2. the process that holds the target reads them (bounded wait), maps the peer's memory once
   (cached) and runs the chunk-repair kernel on its own stream, reading the peer GPU directly
   (``pimhbm._core.ipc_pull``: each chunk checked against the source's digest before it is
   written, the target checked after) -- no NCCL call, no work on the healthy GPU;
3. it publishes the outcome; every process reads every outcome (bounded) and so decides alike.

The source's process waits for the outcomes before it goes on, so nothing rewrites memory a
peer is reading. Memory that cannot be exported (a build without CUDA, an allocator whose
memory has no IPC handle, two devices of one process) makes the round "unavailable": the
caller then uses the collective transport. A pull that fails or times out makes it "failed".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import pimhbm
from pimhbm import _core

PREFIX = "pimhbm/ipc"


class Unavailable(RuntimeError):
    """This run's memory cannot be pulled over CUDA IPC (the reason is the message)."""


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


def run_round(round_id: int, pulls: list[Pull], timeout_ms: int) -> int:
    """Runs every pull of a round (each process its own part); returns the chunks repaired.
    Raises Unavailable (every process alike) when IPC cannot serve this run, RuntimeError
    when a pull failed or an outcome did not come in time."""
    client = _client()
    me = jax.process_index()
    key = lambda kind, p: f"{PREFIX}/{round_id}/{kind}/{p.name}"
    # 1. Exports of what this process holds (an error is published in place of the handles).
    for p in pulls:
        if p.source.process_index != me:
            continue
        try:
            if p.source.process_index == p.target.process_index:
                raise Unavailable("source and target are devices of one process")
            blob = b"".join(_core.ipc_export(_on(a, p.source).unsafe_buffer_pointer(),
                                             p.source.local_hardware_id) for a in p.src)
        except (RuntimeError, Unavailable) as err:
            blob = b"!" + str(err).encode()
        client.key_value_set_bytes(key("export", p), blob)
    # 2. Pulls into this process's devices.
    for p in pulls:
        if p.target.process_index != me:
            continue
        blob = client.blocking_key_value_get_bytes(key("export", p), timeout_ms)
        if blob.startswith(b"!"):
            outcome = b"unavailable: " + blob[1:]
        else:
            half = len(blob) // 2
            t, table = (_on(a, p.target) for a in p.dst)
            try:
                status = _core.ipc_pull(p.target.local_hardware_id, p.chunks,
                                        t.unsafe_buffer_pointer(), table.unsafe_buffer_pointer(),
                                        t.nbytes, p.chunk_bytes, blob[:half], blob[half:],
                                        timeout_ms)
                bad = [c for c, s in zip(p.chunks, status) if s != pimhbm.REPAIRED]
                outcome = b"ok" if not bad else f"failed: chunks {bad} did not verify".encode()
            except RuntimeError as err:
                outcome = f"failed: {err}".encode()
        client.key_value_set_bytes(key("outcome", p), outcome)
    # 3. Every outcome, in every process: the same decision everywhere.
    outcomes = [client.blocking_key_value_get_bytes(key("outcome", p), timeout_ms)
                for p in pulls]
    for p, o in zip(pulls, outcomes):
        if o.startswith(b"unavailable: "):
            raise Unavailable(o[len(b"unavailable: "):].decode())
    for p, o in zip(pulls, outcomes):
        if o != b"ok":
            raise RuntimeError(f"IPC pull {p.name}: {o.decode()}")
    return sum(len(p.chunks) for p in pulls)
