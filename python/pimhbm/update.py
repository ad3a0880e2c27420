"""The guarded optimizer update: faulty values never reach the parameters.

``pimhbm.update.adamw`` (two slots; ``pimhbm.adamw`` is the in-place one, ``pimhbm.inplace``) is
AdamW (the mathematics of ``optax.adamw``) fused with integrity checks. The state it manages --
parameters (bf16 or fp32), optional fp32 master weights, fp32 moments, and a digest table per
tensor -- is held twice (two *slots*). Master weights are stored split: the bf16
parameter is their upper half (rounded) and a uint16 tensor holds the rest (``join_master``), so
they cost 2 bytes a parameter beside it, not 4, and the parameters' check is part of theirs. An
update reads the current slot and the gradients in one pass over memory and, in that same pass,

* checks every chunk of the current slot against the digests written by the previous update,
* counts the elements whose gradient or new values are not finite,
* writes the updated state and its new digests into the other slot.

Whether the step commits is decided on the device once every tensor is done (and, with
``axis_name``, across devices): it commits only if every new value is finite (so every gradient
is), no digest mismatched and the step's scalars are usable. If it does not, a predicated copy
puts the current slot back into the other slot, so the state continues bit-identical to its
previous value. Either way the other slot becomes the current one: no ``lax.cond``, no host
transfer, and the same two compiled programs every step (one for each slot parity).

Why two slots: the verdict is known only after every chunk has been read, and in-place writes
could not be undone. Writing aside costs no extra memory traffic (the same 28 bytes per fp32
parameter as optax.adamw; 26 with bf16 parameters and master weights, against optax's 28) and one
extra copy of the optimizer state in memory.

``pimhbm.guard(tx)`` gives the same commit-or-skip semantics to any optax transformation
(unfused, with selects).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import _core
from pimhbm._ffi import ensure_registered
from pimhbm.gradients import check_grads, check_transform, transform_grads
from pimhbm.scan import MAX_CHUNK_SIZE, scan, verify
from pimhbm.step_scalars import for_the_kernel, next_count, step_scalars, unusable

DEFAULT_CHUNK_ELEMS = 16384  # 64 KiB of every fp32 tensor, 32 KiB of every bf16 tensor
DEVICE_COPY_CHUNK_ELEMS = 4096

FAULT_PARAM, FAULT_MASTER, FAULT_MU, FAULT_NU = 1, 2, 4, 8
FAULT_NAMES = {FAULT_PARAM: "param", FAULT_MASTER: "master", FAULT_MU: "mu", FAULT_NU: "nu"}


def split_master(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 master weights -> their stored form: (bf16 parameters, uint16 remainders), with
    ``bits(w) + 0x8000 == p << 16 | r`` (mod 2^32). Exact for every value but NaN (stored as the
    canonical NaN). p is w rounded to nearest with ties away from zero: it differs from
    ``w.astype(bfloat16)`` (ties to even) only on exact ties whose upper half is even, by one bf16
    step. The update kernels do the same (csrc/include/pimhbm/adamw_math.h)."""
    w = jnp.asarray(w, jnp.float32)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
    up = jnp.where(jnp.isnan(w), jnp.uint32(0x7FC00000), bits + jnp.uint32(0x8000))
    p = jax.lax.bitcast_convert_type((up >> 16).astype(jnp.uint16), jnp.bfloat16)
    return p, (up & 0xFFFF).astype(jnp.uint16)


def join_master(p: jax.Array, r: jax.Array) -> jax.Array:
    """The fp32 master weights from their stored form (see ``split_master``)."""
    hi = jax.lax.bitcast_convert_type(p, jnp.uint16).astype(jnp.uint32)
    bits = ((hi << 16) | r.astype(jnp.uint32)) - jnp.uint32(0x8000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def tensor_dtype(name: str, param_dtype: Any) -> Any:
    """The dtype of a state tensor ("p", "master", "mu", "nu") of a parameter of this dtype."""
    return {"p": param_dtype, "master": jnp.uint16}.get(name, jnp.float32)


class Slot(NamedTuple):
    """One copy of the protected state. Pytrees of the parameters' structure."""

    params: Any  # bf16 or fp32
    master: Any  # the fp32 master weights' uint16 remainders (join_master(params, master)), or None
    mu: Any  # fp32
    nu: Any  # fp32
    digests: Any  # per leaf: dict of uint32 (nchunks, 2) tables: p, mu, nu (and master)


@jax.tree_util.register_pytree_node_class
class AdamWState:
    """Both slots, which one is current (static: part of the tree structure), the number of
    committed steps (``step_copies``: int32 (3,), the count three times -- see ``step``), and
    the device copy (``device_copy``: a third slot that holds the current state, or None)."""

    def __init__(self, slots: tuple[Slot, Slot], current: int, step_copies: jax.Array,
                 device_copy: Slot | None = None):
        self.slots = slots
        self.current = current
        self.step_copies = step_copies
        self.device_copy = device_copy

    @property
    def step(self) -> jax.Array:
        """The number of committed steps: the bitwise majority of the three copies, so that a
        flipped bit in one copy changes nothing (each update writes all three again)."""
        return step_majority(self.step_copies)

    @property
    def params(self) -> Any:
        """The parameters to use now."""
        return self.slots[self.current].params

    @property
    def master(self) -> Any:
        """The stored remainders of the master weights (uint16; see ``master_weights``)."""
        return self.slots[self.current].master

    @property
    def master_weights(self) -> Any:
        """The fp32 master weights, joined from the parameters and their remainders (None
        without master weights)."""
        slot = self.slots[self.current]
        if slot.master is None:
            return None
        return jax.tree.map(join_master, slot.params, slot.master)

    @property
    def mu(self) -> Any:
        return self.slots[self.current].mu

    @property
    def nu(self) -> Any:
        return self.slots[self.current].nu

    @property
    def digests(self) -> Any:
        return self.slots[self.current].digests

    def replace_current(self, slot: Slot) -> "AdamWState":
        slots = (slot, self.slots[1]) if self.current == 0 else (self.slots[0], slot)
        return AdamWState(slots, self.current, self.step_copies, self.device_copy)

    def with_current(self, current: int) -> "AdamWState":
        """The same arrays, with slot ``current`` the current one."""
        return AdamWState(self.slots, current, self.step_copies, self.device_copy)

    def tree_flatten(self):
        return (self.slots, self.step_copies, self.device_copy), self.current

    @classmethod
    def tree_unflatten(cls, current, children):
        slots, step_copies, device_copy = children
        return cls(tuple(slots), current, step_copies, device_copy)


def _check_learning_rate(learning_rate: Any) -> None:
    """A learning rate is a number or a scalar. Anything else is most likely the parameters, passed
    by an API that takes this optimizer for an optax GradientTransformation
    (``update(updates, state, params)``): say so, and what to use."""
    if learning_rate is None or isinstance(learning_rate, (int, float, np.number)):
        return
    shape = getattr(learning_rate, "shape", None)
    if shape == ():
        return
    raise TypeError(
        f"pimhbm.adamw: update's third argument is the learning rate, got "
        f"{type(learning_rate).__name__}{'' if shape is None else tuple(shape)}. If an optax or "
        "flax API called it as update(updates, state, params): pimhbm.adamw is not an optax "
        "GradientTransformation -- it updates the parameters its state holds and returns "
        "(state, report), not updates to apply. Call it in your step (state, report = "
        "opt.update(grads, state)), or wrap an optax transformation with pimhbm.guard(tx) for "
        "commit-or-skip in optax's form.")


def step_majority(copies: jax.Array) -> jax.Array:
    """The bitwise majority of three int32 copies (a bit is set where two of them set it)."""
    a, b, c = copies[0], copies[1], copies[2]
    return (a & b) | (b & c) | (a & c)


def step_copies_of(step: Any) -> jax.Array:
    """A step count as the three copies an AdamWState holds."""
    return jnp.full((3,), step, jnp.int32)


class UpdateReport(NamedTuple):
    """What an update saw, as device values (fetch them asynchronously; never in the step)."""

    committed: jax.Array  # bool: the step was applied
    # Summed over devices (each device's count saturates at INT32_MAX; their sum could wrap --
    # the commit decision never reads it: it sums a flag per device).
    # int32: elements with a NaN/Inf gradient or new value (all leaves, all devices)
    grad_nonfinite: jax.Array
    digest_faults: jax.Array  # int32: state chunks whose digest mismatched
    fault_maps: Any  # per leaf: int32 (nchunks,) bitmask of FAULT_* per chunk
    grad_nonfinite_maps: Any  # per leaf: int32 (nchunks,) those elements, per chunk
    local_counts: jax.Array  # int32 (2,): this device's faulty chunks, those elements
    scalars: jax.Array  # float32 (3,): lr, 1 - b1^t, 1 - b2^t of this step


_INT32_MAX = np.iinfo(np.int32).max


def _counts_of(totals: jax.Array) -> jax.Array:
    """int32 (2,) from a call's totals (uint32 (2, 2): two 64-bit counters as low and high
    words), each saturating at INT32_MAX."""
    lo, hi = totals[:, 0], totals[:, 1]
    return jnp.where((hi != 0) | (lo > _INT32_MAX), _INT32_MAX, lo.astype(jnp.int32))


def check_chunk_elems(chunk_elems: int) -> None:
    """Raises ValueError unless a digest can cover a chunk of every state tensor (fp32: widest)."""
    if chunk_elems <= 0 or chunk_elems % 16:
        raise ValueError(f"chunk_elems must be a positive multiple of 16, got {chunk_elems}")
    if chunk_elems * 4 > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_elems must be at most {MAX_CHUNK_SIZE // 4} (an fp32 chunk of "
                         f"at most {MAX_CHUNK_SIZE} bytes), got {chunk_elems}")


def _num_chunks(n: int, chunk_elems: int) -> int:
    return -(-n // chunk_elems)


def _leaf_digests(p, master, mu, nu, chunk_elems) -> dict[str, jax.Array]:
    tables = {"p": scan(p, chunk_elems * p.dtype.itemsize).digests,
              "mu": scan(mu, chunk_elems * 4).digests,
              "nu": scan(nu, chunk_elems * 4).digests}
    if master is not None:
        tables["master"] = scan(master, chunk_elems * master.dtype.itemsize).digests
    return tables


def slot_tensors(slot: Slot, treedef) -> list[dict[str, tuple[jax.Array, jax.Array]]]:
    """Per leaf, {name: (tensor, digest table)} for p, mu, nu (and master)."""
    flat = treedef.flatten_up_to
    masters = flat(slot.master) if slot.master is not None else [None] * treedef.num_leaves
    out = []
    for p, m, mu, nu, d in zip(flat(slot.params), masters, flat(slot.mu), flat(slot.nu),
                               flat(slot.digests)):
        leaf = {"p": (p, d["p"]), "mu": (mu, d["mu"]), "nu": (nu, d["nu"])}
        if m is not None:
            leaf["master"] = (m, d["master"])
        out.append(leaf)
    return out


def slot_from_tensors(leaves: list[dict[str, tuple[jax.Array, jax.Array]]], treedef) -> Slot:
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    has_master = "master" in leaves[0] if leaves else False
    return Slot(unflat([l["p"][0] for l in leaves]),
                unflat([l["master"][0] for l in leaves]) if has_master else None,
                unflat([l["mu"][0] for l in leaves]), unflat([l["nu"][0] for l in leaves]),
                unflat([{k: v[1] for k, v in l.items()} for l in leaves]))


@dataclasses.dataclass(frozen=True)
class AdamW:
    """Guarded, fused AdamW. Build it with :func:`adamw`."""

    learning_rate: float | Callable[[jax.Array], jax.Array]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4
    master_weights: bool = False
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    device_copy: bool = False
    # A stateless optax transformation of the gradients, run first in the same step.
    gradient_transform: Any = None

    def __post_init__(self):
        check_chunk_elems(self.chunk_elems)
        check_transform(self.gradient_transform)

    def chunk_bytes(self, dtype: Any) -> int:
        """Digest chunk of a state tensor of this dtype: chunk_elems elements."""
        return self.chunk_elems * jnp.dtype(dtype).itemsize

    # -- setting up --------------------------------------------------------------------------

    def init(self, params: Any) -> AdamWState:
        """Both slots from the parameters (and the device copy, with ``device_copy``): moments
        at zero, master weights (if any) from the parameters, digests of everything."""
        ensure_registered()
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            dtype = jnp.asarray(p).dtype
            if dtype not in (jnp.float32, jnp.bfloat16):
                raise TypeError(f"parameter {jax.tree_util.keystr(path)} is {dtype}: pimhbm.update.adamw "
                                "updates float32 or bfloat16 parameters")
            if self.master_weights and dtype != jnp.bfloat16:
                raise TypeError(f"parameter {jax.tree_util.keystr(path)} is {dtype}: master "
                                "weights are for bfloat16 parameters")
        check_transform(self.gradient_transform, params)

        def one_slot(p_tree):
            # A copy: every slot needs its own buffers (they are donated and written in place),
            # and none may be the caller's.
            params = jax.tree.map(lambda p: jnp.copy(jnp.asarray(p)), p_tree)
            # A bf16 parameter taken as its fp32 master: p itself, remainder 0x8000.
            master = (jax.tree.map(lambda p: jnp.full(p.shape, 0x8000, jnp.uint16), params)
                      if self.master_weights else None)
            mu = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            nu = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            masters = master if master is not None else jax.tree.map(lambda _: None, params)
            digests = jax.tree.map(
                lambda p, m, a, b: _leaf_digests(p, m, a, b, self.chunk_elems),
                params, masters, mu, nu, is_leaf=lambda x: x is None)
            return Slot(params, master, mu, nu, digests)

        copies = 3 if self.device_copy else 2
        slots = jax.jit(lambda p: tuple(one_slot(p) for _ in range(copies)))(params)
        return AdamWState((slots[0], slots[1]), 0, step_copies_of(0),
                          slots[2] if self.device_copy else None)

    # -- one step ------------------------------------------------------------------------------

    def update(self, grads: Any, state: AdamWState, learning_rate: Any = None, *,
               axis_name: str | None = None, gate: Any = None) -> tuple[AdamWState, UpdateReport]:
        """One guarded step. Call it inside ``jax.jit`` with the state donated. Returns the new
        state (the other slot is now current) and the report. ``learning_rate`` (a device
        scalar, or None for the configured one) can change every step without recompiling.
        Inside ``shard_map``, pass the data-parallel ``axis_name``: the verdict is global.
        ``gate`` (a device bool): when false on any device the step does not commit either (the
        recovery engine holds steps back this way until a skipped one has been replayed)."""
        ensure_registered()
        _check_learning_rate(learning_rate)
        if (state.device_copy is not None) != self.device_copy:
            raise ValueError("the state was made with device_copy="
                             f"{state.device_copy is not None}, this optimizer has {self.device_copy}")
        cur, nxt = state.current, 1 - state.current
        read, write = state.slots[cur], state.slots[nxt]
        check_grads(grads, read.params)
        grads = transform_grads(self.gradient_transform, grads, read.params)
        treedef = jax.tree.structure(read.params)

        count = next_count(state.step)
        if learning_rate is None:
            learning_rate = (self.learning_rate(count) if callable(self.learning_rate)
                             else self.learning_rate)
        scalars = step_scalars(learning_rate, count, self.b1, self.b2)

        reads = slot_tensors(read, treedef)
        writes = slot_tensors(write, treedef)
        copies = slot_tensors(state.device_copy, treedef) if state.device_copy is not None else [None] * len(reads)
        outs, totals = self._update_call(reads, treedef.flatten_up_to(grads), writes, copies,
                                         for_the_kernel(scalars))
        local = _counts_of(totals)

        faults = [o["faults"] for o in outs]
        bad = [o["grad_nonfinite"] for o in outs]
        # The kernels counted this device's faulty chunks and non-finite elements as they went
        # (no reduction over the maps here). Across devices, the verdict sums a flag per device
        # (a sum of counts could wrap); the counts are summed for the report.
        # A closed gate on any device holds the step back on every device (the flag is summed
        # with the others), so that the replicas never part.
        hold = (local != 0).any() | unusable(scalars)  # (a NaN learning rate, say)
        if gate is not None:
            hold |= ~jnp.asarray(gate, jnp.bool_)
        counts = jnp.concatenate([local, hold.astype(jnp.int32)[None]])
        if axis_name is not None:
            counts = jax.lax.psum(counts, axis_name)
        n_faults, n_bad = counts[0], counts[1]
        commit = (counts[2] == 0).astype(jnp.int32)

        # Commit or skip: when skipping, the read slot goes back into the written slot, and
        # into the device copy where the read side verified (elsewhere the copy was not written).
        names = list(reads[0]) if reads else []
        sources = [r[k][i] for r in reads for k in names for i in (0, 1)]
        dests = [o["write"][k][i] for o in outs for k in names for i in (0, 1)]
        restored = iter(restore_unless(commit, sources, dests))
        new_write = [{k: (next(restored), next(restored)) for k in names} for _ in outs]
        new_slot = slot_from_tensors(new_write, treedef)
        new_copy = None
        if state.device_copy is not None:
            cleaned = iter(restore_clean(
                commit, [(o["faults"], r[k], o["device_copy"][k], self.chunk_bytes(r[k][0].dtype))
                         for r, o in zip(reads, outs) for k in names]))
            new_copy = slot_from_tensors([{k: next(cleaned) for k in names} for _ in outs],
                                           treedef)
        slots = (read, new_slot) if cur == 0 else (new_slot, read)
        done = count - 1 + commit
        new_state = AdamWState(slots, nxt, step_copies_of(done), new_copy)
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        report = UpdateReport(commit.astype(bool), n_bad, n_faults, unflat(faults), unflat(bad),
                              local, scalars)
        return new_state, report

    def _update_call(self, reads, grads, writes, copies, scalars):
        """One pimhbm_adamw call for the given leaves (the kernel runs over the chunks of all of
        them), laid out by the handler's own description of a leaf (adamw_layout). reads/writes/
        copies: per leaf {name: (tensor, table)} (device copy None: absent). Returns, per leaf,
        {"write": {...}, "faults", "grad_nonfinite"[, "device_copy": {...}]}, and the call's
        totals: faulty chunks and non-finite elements as uint32 (2, 2), each a 64-bit
        count's low and high words."""
        layout = adamw_layout()
        operands = sorted((b for b in layout["leaf"] if b["operand"] is not None),
                          key=lambda b: b["operand"])
        results = sorted((b for b in layout["leaf"] if b["result"] is not None),
                         key=lambda b: b["result"])
        args, out_types, aliases = [], [], {}
        for read, g, write, copy in zip(reads, grads, writes, copies):
            sides = {"read": read, "write": write, "copy": copy}
            p = read["p"][0]
            leaf = {_key(b): _leaf_operand(b, sides, g, p.dtype) for b in operands}
            arg0, ret0 = 1 + len(args), len(out_types)  # the step scalars come first
            args += [leaf[_key(b)][0] for b in operands]
            for b in results:
                if b["operand"] is None:  # a report: one value per chunk
                    out_types.append(jax.ShapeDtypeStruct(
                        (_num_chunks(p.size, self.chunk_elems),), _dtype_of(b, p.dtype)))
                    continue
                value, present = leaf[_key(b)]
                out_types.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
                if present:  # updated in place: the result is the operand's buffer
                    aliases[arg0 + b["operand"]] = ret0 + b["result"]
        if not args:
            return [], jnp.zeros((2, 2), jnp.uint32)
        out_types.append(jax.ShapeDtypeStruct((2, 2), jnp.uint32))  # the totals
        outs = jax.ffi.ffi_call("pimhbm_adamw", out_types, input_output_aliases=aliases)(
            scalars, *args, chunk_elems=np.int64(self.chunk_elems), b1=np.float32(self.b1),
            b2=np.float32(self.b2), one_minus_b1=np.float32(1 - self.b1),
            one_minus_b2=np.float32(1 - self.b2), eps=np.float32(self.eps),
            eps_root=np.float32(self.eps_root), weight_decay=np.float32(self.weight_decay))
        per_leaf = layout["leaf_results"]
        leaves = []
        for i, (read, copy) in enumerate(zip(reads, copies)):
            got = {_key(b): outs[per_leaf * i + b["result"]] for b in results}
            side = lambda role: {k: (got[role, k, False], got[role, k, True]) for k in read}
            leaf = {"write": side("write"), "faults": got["report", "faults", False],
                    "grad_nonfinite": got["report", "grad_nonfinite", False]}
            if copy is not None:
                leaf["device_copy"] = side("copy")
            leaves.append(leaf)
        return leaves, outs[-1]


@functools.cache
def adamw_layout() -> dict:
    """The buffers of one leaf of a pimhbm_adamw call, as the handler describes them
    (csrc/update/adamw_layout.h): {"leaf": rows, "leaf_operands": n, "leaf_results": m}, each
    row {"name", "role" (read, write, copy, report), "tensor" (p, master, mu, nu, g, faults,
    grad_nonfinite), "table" (the tensor's digest table), "dtype", "count", "operand",
    "result" (its positions in the leaf's group, or None)}."""
    return _core.adamw_layout()


def _key(b: dict) -> tuple[str, str, bool]:
    return b["role"], b["tensor"], b["table"]


def _dtype_of(b: dict, param_dtype: Any) -> Any:
    return param_dtype if b["dtype"] == "param" else jnp.dtype(b["dtype"])


def _leaf_operand(b: dict, sides: dict, g: jax.Array, param_dtype: Any) -> tuple[jax.Array, bool]:
    """The operand of layout row ``b`` for one leaf, and whether it is there: without master
    weights or a device copy their rows get empty placeholders of the row's dtype."""
    if b["tensor"] == "g":
        return g, True
    tensors = sides[b["role"]]
    if tensors is not None and b["tensor"] in tensors:
        return tensors[b["tensor"]][1 if b["table"] else 0], True
    return jnp.zeros((0, 2) if b["table"] else (0,), _dtype_of(b, param_dtype)), False


def adamw(learning_rate: float | Callable[[jax.Array], jax.Array], b1: float = 0.9,
          b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          weight_decay: float = 1e-4, *, master_weights: bool = False,
          chunk_elems: int | None = None, device_copy: bool = False,
          gradient_transform: Any = None) -> AdamW:
    """Guarded fused AdamW; arguments as ``optax.adamw`` (``learning_rate`` may be a schedule
    of the step count). ``master_weights``: keep fp32 master weights for bf16 parameters (stored
    as the parameters and a uint16 remainder each: ``AdamWState.master_weights`` joins them).
    ``device_copy``: keep a current copy of the state on the device, written in the same pass,
    for chunk-level repair. ``chunk_elems``: elements per digest chunk (default 16384, or 4096
    with a device copy: the update then reads each chunk twice and the second read must come
    from L2). ``gradient_transform``: a stateless optax transformation of the gradients run
    first, in the same compiled step (``optax.clip_by_global_norm(1.0)`` makes this
    ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))``); it sees the gradients
    alone, so inside ``shard_map`` a global norm is each device's."""
    if chunk_elems is None:
        chunk_elems = DEVICE_COPY_CHUNK_ELEMS if device_copy else DEFAULT_CHUNK_ELEMS
    return AdamW(learning_rate, b1, b2, eps, eps_root, weight_decay, master_weights, chunk_elems,
                 device_copy, gradient_transform)





def restore_unless(commit: jax.Array, sources: list[jax.Array],
                   dests: list[jax.Array]) -> list[jax.Array]:
    """``dests`` (updated in place), overwritten by ``sources`` when ``commit`` is 0. One
    predicated copy on the device; no conditional, no host transfer."""
    ensure_registered()
    if len(sources) != len(dests):
        raise ValueError(f"{len(sources)} sources for {len(dests)} destinations")
    for i, (s, t) in enumerate(zip(sources, dests)):
        if s.shape != t.shape or s.dtype != t.dtype:
            raise ValueError(f"pair {i}: source {s.dtype}{tuple(s.shape)} does not match "
                             f"destination {t.dtype}{tuple(t.shape)}")
    if not dests:
        return []
    k = len(dests)
    outs = jax.ffi.ffi_call(
        "pimhbm_restore", [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in dests],
        input_output_aliases={1 + k + i: i for i in range(k)})(
            jnp.asarray(commit, jnp.int32).reshape(1), *sources, *dests)
    return list(outs)


def restore_clean(commit: jax.Array, tensors: list[tuple[jax.Array, tuple[jax.Array, jax.Array],
                                                        tuple[jax.Array, jax.Array], int]]
                  ) -> list[tuple[jax.Array, jax.Array]]:
    """For each (faults, src, dst, chunk_bytes) of ``tensors`` -- src and dst (tensor, table)
    pairs -- ``dst`` where ``commit`` is 0 overwritten chunk by chunk from ``src`` for the chunks
    whose ``faults`` entry is 0 (in place). One call (one launch) for all of them."""
    ensure_registered()
    if not tensors:
        return []
    args, out_types, aliases, sizes = [], [], {}, []
    for i, (faults, src, dst, chunk_bytes) in enumerate(tensors):
        args += [faults, src[0], src[1], dst[0], dst[1]]
        out_types += [jax.ShapeDtypeStruct(dst[0].shape, dst[0].dtype),
                      jax.ShapeDtypeStruct(dst[1].shape, dst[1].dtype)]
        aliases[1 + 5 * i + 3] = 2 * i
        aliases[1 + 5 * i + 4] = 2 * i + 1
        sizes.append(chunk_bytes)
    outs = jax.ffi.ffi_call("pimhbm_restore_clean", out_types, input_output_aliases=aliases)(
        jnp.asarray(commit, jnp.int32).reshape(1), *args,
        chunk_bytes=np.asarray(sizes, np.int64))
    return [(outs[2 * i], outs[2 * i + 1]) for i in range(len(tensors))]


# -- guard: commit-or-skip around any optax transformation ---------------------------------------

class GuardState(NamedTuple):
    inner: Any  # the wrapped transformation's state
    digests: Any  # digest tables of the inner state's float leaves (None when not verified)
    committed: jax.Array  # bool: the last update was applied
    skipped: jax.Array  # int32: updates skipped so far


def _float_leaves(tree: Any) -> Any:
    return jax.tree.map(lambda x: x if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else None,
                        tree)


def guard(tx: Any, *, verify_state: bool = True, chunk_bytes: int = 65536) -> Any:
    """Wraps an optax ``GradientTransformation`` with commit-or-skip: the update applies only if
    every gradient (and every update) is finite and, with ``verify_state``, the wrapped state
    still matches the digests taken when it was last written. Otherwise the updates are -0.0
    (so ``optax.apply_updates`` leaves every parameter bit-identical, -0.0 included) and the
    state is kept with its digests: damaged state keeps every later update skipped (the guard
    holds no copy to repair it from). Select-based: no conditional, no host transfer."""
    import optax

    def digests_of(inner):
        if not verify_state:
            return None
        return jax.tree.map(lambda x: None if x is None else scan(x, chunk_bytes).digests,
                            _float_leaves(inner), is_leaf=lambda x: x is None)

    def init_fn(params):
        inner = tx.init(params)
        return GuardState(inner, digests_of(inner), jnp.array(True), jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        ok = jnp.array(True)
        for g in jax.tree.leaves(updates):
            ok &= jnp.all(jnp.isfinite(g))
        if verify_state:
            maps = jax.tree.map(lambda x, d: None if x is None else verify(x, d, chunk_bytes),
                                _float_leaves(state.inner), state.digests,
                                is_leaf=lambda x: x is None)
            for m in jax.tree.leaves(maps):
                ok &= ~jnp.any(m)
        new_updates, new_inner = tx.update(updates, state.inner, params)
        for u in jax.tree.leaves(new_updates):
            ok &= jnp.all(jnp.isfinite(u))
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.array(-0.0, u.dtype)),
                                   new_updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_inner, state.inner)
        # A skip keeps the old digests too: state skipped as damaged must stay flagged, not be
        # blessed by digests taken of it.
        new_digests = digests_of(new_inner)
        if verify_state:
            new_digests = jax.tree.map(lambda n, o: None if n is None else jnp.where(ok, n, o),
                                       new_digests, state.digests, is_leaf=lambda x: x is None)
        return new_updates, GuardState(new_inner, new_digests, ok,
                                       state.skipped + (~ok).astype(jnp.int32))

    return optax.GradientTransformation(init_fn, update_fn)
