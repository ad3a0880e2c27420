"""How chunks travel from a healthy replica into the devices whose copy of them is damaged.

One protocol, three implementations:

* :class:`ProgramTransport` -- a pre-compiled program pulls every listed chunk at once, through
  an XLA psum ("collective": any devices, any number of processes) or by our kernel reading the
  source device's memory ("peer": the devices of one process); which one is decided when the
  programs are traced;
* :class:`IpcTransport` -- another process's GPU memory mapped over CUDA IPC and read by the
  repair kernel of the process that holds the target (pimhbm.ipc); where IPC cannot serve the
  run it says so once and uses the collective programs from then on.

Every received chunk is checked against the source's digest before it is written and the
target after.
"""

from __future__ import annotations

import collections
from typing import NamedTuple, Protocol

import jax

import pimhbm
from pimhbm import ipc
from pimhbm.recovery.layout import StateLayout
from pimhbm.recovery.placement import Placement, Transport
from pimhbm.recovery.planner import RebuildPlan, ReplicaPull, rebuild_pulls, replica_batches
from pimhbm.recovery.programs import Programs
from pimhbm.recovery.one_copy import OneCopy
from pimhbm.recovery.traced import Traced, TrainState, slot_of


class TransportFailed(RuntimeError):
    """A replica transfer failed (a peer that did not answer within the peer ops' bounded wait,
    a collective error, a pulled chunk that did not verify): the state it was given may be gone
    (donated), so the next source is the host snapshot."""


class Pulled(NamedTuple):
    state: TrainState
    verified: bool  # every chunk verified on every device that received it
    repairs: int = 0  # chunks counted as repairs
    ipc_pulls: int = 0  # chunks pulled over CUDA IPC
    notice: str = ""  # why the transport changed (IPC given up), said once


class ReplicaTransport(Protocol):
    def pull(self, state: TrainState, pulls: list[ReplicaPull]) -> Pulled:
        """The listed chunks from their source replicas into every other replica."""

    def rebuild(self, state: TrainState, plan: RebuildPlan) -> Pulled:
        """Whole device states from a clean replica of their shard column."""


def _failed(err: Exception) -> TransportFailed:
    return TransportFailed(f"failed ({str(err).splitlines()[0][:200]})")


class ProgramTransport:
    """Chunks pulled by the compiled replica and rebuild programs."""

    def __init__(self, programs: Programs, placement: Placement, layout: StateLayout,
                 capacity: int):
        self.programs, self.placement, self.layout = programs, placement, layout
        self.capacity = capacity

    def pull(self, state: TrainState, pulls: list[ReplicaPull]) -> Pulled:
        p, layout, repairs = self.placement, self.layout, 0
        for batch in replica_batches(pulls, layout, self.capacity):
            program = self.programs.replica[slot_of(state.opt)]
            try:
                state, status = program(state, p.put(batch.lists, p.by_column),
                                        p.put(batch.sources, p.by_column))
                status = p.fetch(status)  # [devices, leaves, tensors, capacity]
            except jax.errors.JaxRuntimeError as err:
                raise _failed(err) from err
            for pull, slot in batch.slots:
                at = layout.leaf_index(pull.leaf), layout.tensor_index(pull.tensor), slot
                others = [layout.device_at(r, pull.column) for r in range(p.replicas)
                          if r != pull.source]
                if any(status[(d, *at)] != pimhbm.REPAIRED for d in others):
                    return Pulled(state, False, repairs)
                repairs += 1
        return Pulled(state, True, repairs)

    def rebuild(self, state: TrainState, plan: RebuildPlan) -> Pulled:
        p = self.placement
        program = self.programs.rebuild[slot_of(state.opt)]
        try:
            state, bad = program(state, p.put(plan.sources, p.by_column),
                                 p.put(plan.targets, p.grid))
            bad = p.fetch(bad)
        except jax.errors.JaxRuntimeError as err:
            raise _failed(err) from err
        return Pulled(state, not bad.any())


class IpcTransport:
    """Chunks pulled over CUDA IPC from another process's GPU, straight into the current slot's
    buffers; the collective programs where IPC cannot serve this run. A round that did not
    finish raises ipc.Fatal (a pull may still be writing the state: the run stops)."""

    def __init__(self, fallback: ProgramTransport, traced: Traced, run_id: str,
                 timeout_s: float = 30.0):
        self.fallback, self.traced, self.run_id = fallback, traced, run_id
        self.timeout_s = timeout_s  # the bound on every wait of a round
        self.rounds = 0  # numbered alike in every process
        self.nonce: str | None = None  # drawn at the first round (ipc.run_nonce)
        self.off: str | None = None  # why IPC was given up
        if isinstance(traced, OneCopy) and traced.has_parity:
            # A pull outside the programs would leave the chunks' parity groups stale; the
            # programs make it anew.
            self.off = "one copy of the state with parity: pulls go through the programs"

    def pull(self, state: TrainState, pulls: list[ReplicaPull]) -> Pulled:
        notice = ""
        if self.off is None:
            pulled, notice = self._try_round(state, pulls, "repair from a replica")
            if pulled is not None:
                return Pulled(state, True, repairs=pulled, ipc_pulls=pulled)
        return self.fallback.pull(state, pulls)._replace(notice=notice)

    def rebuild(self, state: TrainState, plan: RebuildPlan) -> Pulled:
        programs, p = self.fallback.programs, self.fallback.placement
        recopy = programs.recopy.get(slot_of(state.opt))
        notice = ""
        if self.off is None and (recopy is not None or not self.traced.device_copy):
            pulled, notice = self._try_round(state, rebuild_pulls(plan, self.fallback.layout),
                                             "rebuild from a replica")
            if pulled is not None:
                if recopy is not None:  # the device copy made anew from the pulled state
                    try:
                        state = recopy(state, p.put(plan.targets, p.grid))
                    except jax.errors.JaxRuntimeError as err:
                        raise _failed(err) from err
                return Pulled(state, True, ipc_pulls=pulled)
        return self.fallback.rebuild(state, plan)._replace(notice=notice)

    def _try_round(self, state: TrainState, pulls: list[ReplicaPull],
                   what: str) -> tuple[int | None, str]:
        """(chunks pulled, "") -- or (None, why) when IPC cannot serve this run: it is then
        given up for good (the reason is said once)."""
        try:
            return self._run_round(state, pulls), ""
        except ipc.Unavailable as err:
            self.off = str(err)
            return None, f"CUDA IPC unavailable ({err})"
        except ipc.Fatal as err:
            raise ipc.Fatal(f"{what} over CUDA IPC: {err}") from err
        except RuntimeError as err:  # a pulled chunk did not verify: the host snapshot
            raise _failed(err) from err

    def _run_round(self, state: TrainState, pulls: list[ReplicaPull]) -> int:
        # Nothing of the state is still written (its last writers) or read (the steps' and
        # scrubs' results were waited for before the fault was handled; snapshots too).
        jax.block_until_ready(state)
        self.rounds += 1
        layout, mesh = self.fallback.layout, self.fallback.placement.mesh
        cur = self.traced.tensors(state.opt)
        by_pair: dict[tuple, list[int]] = collections.defaultdict(list)
        for p in pulls:
            for target in p.targets:
                by_pair[p.source, target, p.column, p.leaf, p.tensor].append(p.chunk)
        work = []
        for (row, target, col, leaf, tensor), chunks in sorted(by_pair.items()):
            li = layout.leaf_index(leaf)
            t = cur[li][tensor]
            work.append(ipc.Pull(f"{row}.{target}.{col}.{leaf}.{tensor}", mesh.devices[row, col],
                                 mesh.devices[target, col], chunks, t, t,
                                 layout.chunk_bytes(tensor, li)))
        timeout_ms = int(self.timeout_s * 1000)
        if self.nonce is None:
            self.nonce = ipc.run_nonce(self.run_id, timeout_ms)
        return ipc.run_round(f"{self.run_id}/{self.nonce}", self.rounds, work, timeout_ms)


def transport_for(kind: Transport, programs: Programs, placement: Placement, layout: StateLayout,
                  capacity: int, traced: Traced, run_id: str) -> ReplicaTransport:
    in_programs = ProgramTransport(programs, placement, layout, capacity)
    return IpcTransport(in_programs, traced, run_id) if kind is Transport.IPC else in_programs

