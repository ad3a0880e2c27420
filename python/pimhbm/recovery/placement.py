"""Where the engine's arrays live: the mesh ('dp', 'shard'), the shardings of the state and of
the per-device reports, and moving values between the host and the devices -- in one process or
one process per GPU (jax.distributed), where each process fills and reads its own devices."""

from __future__ import annotations

import enum
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("dp", "shard")


class Transport(enum.StrEnum):
    """How a chunk travels from a healthy replica into the devices that need it."""

    COLLECTIVE = "collective"  # an XLA psum inside a compiled program: any devices, processes
    PEER = "peer"  # our kernel reads the source device's memory: the devices of one process
    IPC = "ipc"  # another process's GPU over CUDA IPC (the collective programs as fallback)

    @property
    def in_programs(self) -> "Transport":
        """What the compiled repair programs use (IPC pulls outside them)."""
        return Transport.PEER if self is Transport.PEER else Transport.COLLECTIVE


def xla_deterministic_flag() -> bool:
    """Whether XLA's deterministic-ops flag is on in this process's XLA_FLAGS."""
    return "xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", "")


def repeatable(devices: list[Any]) -> bool:
    """Whether any step on these devices gives the same bits every time it runs: on CPUs always;
    on GPUs with XLA's deterministic ops (without, cuDNN's attention backward and scatter-adds
    vary). A step built from repeatable ops alone (pimhbm.attention, an ordered embedding) is
    repeatable without the flag, which only its author knows: they say so by recheck_every."""
    if devices[0].platform == "cpu":
        return True
    return xla_deterministic_flag()


def fsdp_spec(shape: tuple[int, ...], shard: int) -> P:
    """How the engine places a parameter of ``shape`` over a 'shard' axis of ``shard`` devices:
    split along its first dimension when that divides evenly, else replicated."""
    return P("shard") if shard > 1 and len(shape) > 0 and shape[0] % shard == 0 else P()


class Placement:
    """The mesh of ``devices`` as len(devices) / shard replicas x ``shard`` shard columns."""

    def __init__(self, devices: list[Any], shard: int):
        if shard < 1 or len(devices) % shard:
            raise ValueError(f"shard={shard} must divide the {len(devices)} devices")
        self.devices, self.shard = devices, shard
        self.mesh = Mesh(np.array(devices).reshape(len(devices) // shard, shard), AXES)
        # One process per GPU: what the host decides on (fault summaries, statuses) is gathered
        # inside the programs so that every process sees every device's rows and decides alike.
        self.multiprocess = jax.process_count() > 1
        self.replicated = self.sharding(P())
        self.by_device = self.sharding(P(AXES))  # a row per device
        self.by_column = self.sharding(P("shard"))  # a row per shard column
        self.grid = self.sharding(P("dp", "shard"))  # (replica, column)
        # Per-device reports, stacked in mesh order (with several processes: gathered).
        self.report_spec = P() if self.multiprocess else P(AXES)
        # Who writes this process's host snapshot: per shard column, its first device here.
        me = jax.process_index()
        self.writers: dict[int, Any] = {}
        for col in range(shard):
            local = [d for d in self.mesh.devices[:, col] if d.process_index == me]
            if local:
                self.writers[col] = local[0]

    @property
    def replicas(self) -> int:
        return len(self.devices) // self.shard

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def manual(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``fn`` per device over the mesh. check_vma=False: the copies of the state are equal
        on every replica by construction (the verdict is global), which the checker cannot see
        through the custom calls."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def put(self, x: Any, sharding: Any = None, copy: bool = False) -> jax.Array:
        """From the host, each process filling only its own devices' parts. ``copy``: through a
        fresh host copy per part on the CPU, where a put may share the source's buffer (a
        region view), and every copy of the state must own its buffers (they are donated); a
        GPU put makes device buffers anyway."""
        x = np.asarray(x)
        copy = copy and self.devices[0].platform == "cpu"
        part = (lambda idx: np.array(x[idx])) if copy else (lambda idx: x[idx])
        return jax.make_array_from_callback(x.shape, sharding or self.replicated, part)

    def put_tree(self, tree: Any, specs: Any) -> Any:
        return jax.tree.map(lambda x, spec: self.put(x, self.sharding(spec)), tree, specs,
                            is_leaf=lambda x: isinstance(x, P))

    def per_device(self, tree: Any) -> Any:
        """Inside the programs: a report (a pytree of int32 arrays, this device's row each)
        stacked over devices (each process its own rows) or, with several processes, gathered
        to every device so that every process reads all rows -- in one collective."""
        tree = jax.tree.map(lambda x: x[None], tree)
        if not self.multiprocess:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        sizes = [leaf[0].size for leaf in leaves]
        flat = jax.numpy.concatenate([leaf.reshape(1, -1) for leaf in leaves], axis=1)
        flat = jax.lax.all_gather(flat, AXES, tiled=True)
        parts = np.cumsum([0] + sizes)
        return jax.tree.unflatten(treedef, [
            flat[:, a:b].reshape(flat.shape[0], *leaf.shape[1:])
            for a, b, leaf in zip(parts[:-1], parts[1:], leaves)])

    def fetch(self, x: Any) -> Any:
        """A report on the host (with several processes: the local copy of the gathered one)."""
        one = ((lambda a: np.asarray(a.addressable_shards[0].data)) if self.multiprocess
               else np.asarray)
        return jax.tree.map(one, x)

    def on_device(self, tree: Any, device: Any) -> Any:
        """``device``'s part of ``tree``, as single-device arrays (no copy)."""
        return jax.tree.map(lambda a: next(s.data for s in a.addressable_shards
                                           if s.device == device), tree)

    @property
    def serialize(self) -> bool:
        # The host platform's virtual devices share one thread pool: programs with collectives
        # queued back to back can each hold threads the other's rendezvous waits for, and hang
        # (seen with 4 virtual devices on 2 cores). There each program is waited for before
        # the next is queued. GPUs run each device's programs on their own streams: no wait.
        return self.devices[0].platform == "cpu" and len(self.devices) > 1

    def settle(self, *values: Any) -> None:
        if self.serialize:
            jax.block_until_ready(values)
