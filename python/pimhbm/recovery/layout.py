"""Where each protected chunk lives: which leaf, which tensor of it, which chunk of which
device's shard -- and the bits that say which tensors of a chunk are damaged.

A device's chunks are numbered across its leaves in tree order (the *global* chunk index of the
engine's fault lists): leaf i's chunks start at ``chunk_base[i]``. Devices are positions in the
mesh ('dp', 'shard'), row-major: device d is replica d // shard, shard column d % shard.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import update

TENSORS = ("p", "master", "mu", "nu")  # the state tensors of a leaf, in this order everywhere


STATE_BITS = 0xF  # Damage's bits of the current slot (the device copy's: shifted by 4)


class Damage(enum.IntFlag):
    """Damaged tensors of one chunk: the update's fault-map bits for the current slot, and the
    same bits shifted by 4 for the device copy (the scrub's map)."""

    P = update.FAULT_PARAM
    MASTER = update.FAULT_MASTER
    MU = update.FAULT_MU
    NU = update.FAULT_NU
    COPY_P = P << 4
    COPY_MASTER = MASTER << 4
    COPY_MU = MU << 4
    COPY_NU = NU << 4

    @classmethod
    def of(cls, tensor: str, *, in_copy: bool = False) -> "Damage":
        return cls(_BIT[tensor] << (4 if in_copy else 0))

    def tensors(self, *, in_copy: bool = False) -> list[str]:
        """The damaged tensors of the current slot (or of the device copy), in TENSORS order."""
        bits = int(self) >> (4 if in_copy else 0)
        return [k for k in TENSORS if bits & _BIT[k]]

    @property
    def in_state(self) -> bool:
        return bool(int(self) & STATE_BITS)

    @property
    def in_copy(self) -> bool:
        return bool(int(self) >> 4)


_BIT = {"p": update.FAULT_PARAM, "master": update.FAULT_MASTER, "mu": update.FAULT_MU,
        "nu": update.FAULT_NU}


class Vote(enum.IntEnum):
    """A replica's chunk in the vote program: how its digest stands among the replicas'."""

    UNLISTED = 0
    MAJORITY = 1
    MINORITY = 2
    NONE = -1  # no digest is held by more than half the replicas


class ChunkRef(NamedTuple):
    """One chunk of one tensor on one device."""

    device: int  # position in the mesh, row-major
    leaf: str  # the leaf's path ("blocks/0/wq")
    tensor: str  # "p", "master", "mu", "nu", or "gradient"
    chunk: int  # within the leaf, within the device's shard


class ChunkDamage(NamedTuple):
    """A fault-list entry: a device's global chunk index and the damage there."""

    device: int
    index: int
    damage: Damage


def keystr(path: Any) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The protected state's geometry on one device: leaves, their tensors, chunks."""

    paths: tuple[str, ...]  # leaf paths, tree order
    names: tuple[str, ...]  # tensors of every leaf (TENSORS, without "master" when absent)
    dtypes: tuple[Any, ...]  # the parameters' dtypes
    sizes: tuple[int, ...]  # elements of each leaf on one device (a sharded leaf: its shard)
    sharded: tuple[bool, ...]  # split over the 'shard' axis (else replicated)
    chunk_elems: int
    shard: int  # devices per replica

    @classmethod
    def of(cls, params: Any, opt: Any, sharded: list[bool], shard: int) -> "StateLayout":
        leaves = jax.tree_util.tree_leaves_with_path(params)
        sizes = [int(np.prod(np.shape(p))) // (shard if sh else 1)
                 for (_, p), sh in zip(leaves, sharded)]
        names = TENSORS if opt.master_weights else tuple(k for k in TENSORS if k != "master")
        return cls(tuple(keystr(path) for path, _ in leaves), names,
                   tuple(jnp.asarray(p).dtype for _, p in leaves), tuple(sizes), tuple(sharded),
                   opt.chunk_elems, shard)

    @property
    def nchunks(self) -> list[int]:
        return [-(-n // self.chunk_elems) for n in self.sizes]

    @property
    def chunk_base(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.nchunks)]).astype(np.int64)

    def leaf_index(self, path: str) -> int:
        return self.paths.index(path)

    def tensor_index(self, name: str) -> int:
        return self.names.index(name)

    def leaf_of(self, index: int) -> tuple[int, int]:
        """(leaf, chunk within the leaf) of a global chunk index."""
        base = self.chunk_base
        leaf = int(np.searchsorted(base, index, side="right") - 1)
        return leaf, index - int(base[leaf])

    def locate(self, entry: ChunkDamage, *, in_copy: bool = False) -> list[ChunkRef]:
        """The damaged chunks of a fault-list entry, one per damaged tensor."""
        leaf, chunk = self.leaf_of(entry.index)
        return [ChunkRef(entry.device, self.paths[leaf], k, chunk)
                for k in entry.damage.tensors(in_copy=in_copy) if k in self.names]

    def gradient_chunk(self, device: int, index: int) -> ChunkRef:
        leaf, chunk = self.leaf_of(index)
        return ChunkRef(device, self.paths[leaf], "gradient", chunk)

    def tensor_info(self) -> list[tuple[str, str, int, int]]:
        """(leaf path, tensor, elements on one device, bytes per element) of every protected
        tensor (a sharded tensor: the elements of one shard)."""
        return [(path, k, n, jnp.dtype(update.tensor_dtype(k, dtype)).itemsize)
                for path, dtype, n in zip(self.paths, self.dtypes, self.sizes)
                for k in self.names]

    def chunk_bytes(self, tensor: str, leaf: int) -> int:
        return self.chunk_elems * jnp.dtype(update.tensor_dtype(tensor, self.dtypes[leaf])).itemsize

    # -- the mesh ----------------------------------------------------------------------------

    def replica_of(self, device: int) -> int:
        return device // self.shard

    def column_of(self, device: int) -> int:
        return device % self.shard

    def device_at(self, replica: int, column: int) -> int:
        return replica * self.shard + column
