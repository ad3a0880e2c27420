"""The guarded optimizer update in place: one copy of the state, kept redundant by parity.

``adamw`` is AdamW (the mathematics of ``optax.adamw``) fused with integrity checks, on a state
that is held once -- parameters (bf16 or fp32), optional fp32 master weights (stored split: the
bf16 parameter is their upper half, a uint16 tensor the rest, see ``pimhbm.update``), fp32
moments, a digest table per tensor -- plus, unless the redundancy comes from data-parallel
replicas, the parity of every group of up to ``group`` chunks of every tensor (about 1/group of
the state; neighbouring chunks in different groups: pimhbm.parity).

A step may be cancelled only by what is known before the first write. So ``update`` first checks,
in passes that read only the gradients and the parameters (4 bytes a bf16 parameter): every
gradient finite (and its square), every parameter chunk intact after the backward pass read it,
the step's scalars (learning rate, bias corrections) finite, and the caller's gate open -- across
devices with ``axis_name``. (Options move the first two into the update itself:
``GradientChecks.IN_UPDATE`` and, speculatively, ``ParameterChecks.IN_UPDATE``; a step that they
find wanting is then applied but not committed, and its state must come from elsewhere.) Only
then does the update run (else it writes nothing), reading and writing every chunk once, in
place. What it finds from there is local to one chunk (csrc/update/inplace.h): a chunk whose
master weights or moments (or parameters, damaged after the backward pass) fail their digests
does not commit -- its digests keep their old values, its change stays out of the parity, its
gradient goes into a small stash -- and ``repair`` then rebuilds its old state from the parity
and redoes its update from the stash, in place: the step is complete without a replay. An
element whose new values would not be finite keeps its old ones (``UpdateReport.kept``): the
update never writes NaN or Inf into the state.

The state is a NamedTuple of fixed structure (no slot to flip): ``lax.scan`` over steps and
checkpoints restored into ``jax.eval_shape(opt.init, params)`` see the same tree every step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import parity
from pimhbm._ffi import ensure_registered
from pimhbm.inplace_calls import (PRECHECK_TOTALS, Prechecks, Stash, leaf_operands, prechecks,
                                  UpdateTotals, redo_call, saturating_psum, update_call)
from pimhbm.inplace_calls import layout as inplace_layout
from pimhbm.repair import NOT_LISTED, REPAIRED
from pimhbm.scan import scan
from pimhbm.gradients import check_grads, check_transform, transform_grads
from pimhbm.update import (FAULT_MASTER, FAULT_MU, FAULT_NU, FAULT_PARAM, _check_learning_rate,
                           join_master, step_copies_of, step_majority)
from pimhbm.step_scalars import next_count, step_scalars, unusable

# A warp holds a chunk in registers, 16 elements a lane: what is paid once a chunk (set-up,
# digest finalisations, parity, reports) is shared by twice the elements of a chunk of 256 (86
# SASS instructions an element against 102; 127 registers, 4 blocks an SM, no spills). On an
# H100 the 8B-layer row cost +1.14 % and +0.95 % against 256's +1.36 % and +1.02 % (one machine,
# ABBA; runs 179-181), and the held state is 12.81 B a parameter against 12.88 (bench/NOTES.md).
DEFAULT_CHUNK_ELEMS = 512
DEFAULT_GROUP = 16  # chunks a parity row covers: 1/16 of the state's bytes
DEFAULT_STASH = 16  # gradients of chunks a step can leave for a redo
TENSORS = ("p", "master", "mu", "nu")
FAULT_BIT = {"p": FAULT_PARAM, "master": FAULT_MASTER, "mu": FAULT_MU, "nu": FAULT_NU}
# |g| beyond this overflows g * g in float32 (the second moment): such a step does not commit.
GRAD_LIMIT = float(np.sqrt(np.finfo(np.float32).max))


class AdamWState(NamedTuple):
    """The protected state, once. Pytrees of the parameters' structure, but ``digests`` and
    ``parity``: per leaf a dict by tensor name (p, master, mu, nu) of uint32 tables
    (chunks, 2) and parity rows (groups, chunk_bytes // 4)."""

    params: Any  # bf16 or fp32
    master: Any  # uint16 remainders of the fp32 master weights, or None
    mu: Any
    nu: Any
    digests: Any
    parity: Any  # None without parity
    step_copies: jax.Array  # int32 (3,): the committed steps three times (see step)

    @property
    def step(self) -> jax.Array:
        """Committed steps: the bitwise majority of the three copies (one flipped bit in one
        copy changes nothing; every update writes all three)."""
        return step_majority(self.step_copies)

    @property
    def master_weights(self) -> Any:
        if self.master is None:
            return None
        return jax.tree.map(join_master, self.params, self.master)


class LeftChunks(NamedTuple):
    """What ``repair`` needs of an update that left chunks: this device's stash, how many
    chunks were offered to it (more than its capacity: not all fit), and the step's scalars."""

    stash: Stash
    stashed: jax.Array  # int32
    scalars: jax.Array  # float32 (3,): lr, 1 - b1^t, 1 - b2^t


class GradientChecks(enum.Enum):
    """Where the update learns that a gradient value (or its square) is not finite."""

    # A pass over the gradients before the first write (2 bytes a bf16 parameter): such a step
    # is cancelled and writes nothing. pimhbm.adamw's default: safe without a host snapshot.
    BEFORE_WRITES = "before the writes"
    # The update itself finds them, as elements it keeps (UpdateReport.kept): such a step is
    # applied in part and does not commit (its state must come from elsewhere: the Trainer
    # restores the host snapshot and replays). The checks before the writes read p alone. The
    # Trainer also closes the update's gate where the loss is not finite (the usual way such
    # gradients come), so that step is skipped before any write -- even where its gradients
    # are finite, which commit with BEFORE_WRITES; in a loop of your own, pass
    # ``gate=jnp.isfinite(loss)``. pimhbm.train.llama_trainer's default where host snapshots
    # are on (pimhbm.train.gradient_checks_for).
    IN_UPDATE = "in the update"


class ParameterChecks(enum.Enum):
    """Where the update learns that a parameter chunk no longer matches its digest table."""

    # A pass over p before the first write (2 bytes a bf16 parameter): a chunk damaged before
    # the backward pass read it cancels the step, which writes nothing; the chunk is rebuilt
    # from its parity and the step runs again.
    BEFORE_WRITES = "before the writes"
    # Speculative: the update verifies each chunk as it reads it, and no pass runs before the
    # writes (GradientChecks.IN_UPDATE too). It cannot tell damage that came before the
    # gradients were computed from that which came after, so a step where it finds a damaged
    # parameter chunk is applied (but for that chunk) and does not commit, even once the chunk
    # is redone: its state must come from elsewhere (the Trainer restores the host snapshot
    # and replays; a replica's chunk would not do: the gradients were summed over replicas).
    IN_UPDATE = "in the update"


class UpdateReport(NamedTuple):
    """What an update saw, as device values (fetch them asynchronously, never in the step)."""

    applied: jax.Array  # bool: the update ran (every check before it passed, on every device)
    # bool: applied with no element kept (and, speculative checks, no damaged parameter chunk
    # found), so the step counts; chunks it left (digest_faults) are completed by ``repair``
    # with this step's scalars
    committed: jax.Array
    grad_nonfinite: jax.Array  # int32: NaN/Inf (or overflowing) gradient values, all devices
    digest_faults: jax.Array  # int32: damaged chunks found (before the update, and by it)
    kept: jax.Array  # int32: elements whose new values were not finite (kept as they were)
    fault_maps: Any  # per leaf int32 (chunks,): FAULT_* bits of the chunks found damaged
    grad_nonfinite_maps: Any  # per leaf int32 (chunks,)
    stash: Stash  # this device's gradients of the chunks the update left for a redo
    stashed: jax.Array  # int32: chunks offered to this device's stash (> capacity: not all fit)
    scalars: jax.Array  # float32 (3,): lr, 1 - b1^t, 1 - b2^t of this step (a redo needs them)
    # int32: speculative checks, the parameter chunks the update found damaged, all devices
    # (their damage may have reached the gradients: the step is not whole); else 0
    suspect: jax.Array

    @property
    def left(self) -> LeftChunks:
        return LeftChunks(self.stash, self.stashed, self.scalars)


class RepairReport(NamedTuple):
    """What ``repair`` did with an update's left chunks (this device's), and with the parameter
    chunks the checks before a refused update found damaged."""

    rebuilt: Any  # per leaf int32 (capacity, 4): rebuild status per stash row and tensor
    faults: jax.Array  # int32: redone chunks that still do not verify (to the next source)
    # bool: every left chunk rebuilt and redone, every damaged parameter rebuilt (speculative
    # checks: and no left chunk a damaged parameter's, which leaves its step suspect)
    complete: jax.Array
    # per leaf int32 (capacity,): rebuild status of each damaged parameter chunk the checks
    # found before a refused update (NOT_LISTED: none; always so for a LeftChunks argument)
    params_rebuilt: Any


def _tensors(state: AdamWState, treedef) -> list[dict[str, jax.Array]]:
    flat = treedef.flatten_up_to
    masters = flat(state.master) if state.master is not None else [None] * treedef.num_leaves
    out = []
    for p, m, mu, nu in zip(flat(state.params), masters, flat(state.mu), flat(state.nu)):
        leaf = {"p": p, "mu": mu, "nu": nu}
        if m is not None:
            leaf["master"] = m
        out.append(leaf)
    return out


@dataclasses.dataclass(frozen=True)
class AdamW:
    """Guarded, fused, in-place AdamW. Build it with :func:`adamw`."""

    learning_rate: float | Callable[[jax.Array], jax.Array]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4
    master_weights: bool = False
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    group: int = DEFAULT_GROUP  # 0: no parity
    stash_capacity: int = DEFAULT_STASH
    gradient_checks: GradientChecks = GradientChecks.BEFORE_WRITES
    parameter_checks: ParameterChecks = ParameterChecks.BEFORE_WRITES
    # An optax transformation of the gradients alone, run first in the same step (clipping by
    # global norm, masks, scaling). Stateless only: a state of its own would be unprotected.
    gradient_transform: Any = None

    def __post_init__(self):
        _check_hyper(self)
        check_transform(self.gradient_transform)
        if not isinstance(self.gradient_checks, GradientChecks):
            raise TypeError(f"gradient_checks={self.gradient_checks!r}: a pimhbm.inplace."
                            f"GradientChecks ({', '.join(c.name for c in GradientChecks)})")
        if not isinstance(self.parameter_checks, ParameterChecks):
            raise TypeError(f"parameter_checks={self.parameter_checks!r}: a pimhbm.inplace."
                            f"ParameterChecks ({', '.join(c.name for c in ParameterChecks)})")
        if self.speculative and self.gradient_checks is not GradientChecks.IN_UPDATE:
            raise ValueError("parameter_checks=ParameterChecks.IN_UPDATE takes no pass before "
                             "the update's writes, so the gradients must be checked there too: "
                             "pass gradient_checks=GradientChecks.IN_UPDATE")

    @property
    def speculative(self) -> bool:
        """No checks before the writes: a step where the update finds a damaged parameter chunk
        does not commit (ParameterChecks.IN_UPDATE)."""
        return self.parameter_checks is ParameterChecks.IN_UPDATE

    def chunk_bytes(self, name: str, param_dtype: Any) -> int:
        size = jnp.dtype(param_dtype).itemsize if name == "p" else (2 if name == "master" else 4)
        return self.chunk_elems * size

    # -- setting up --------------------------------------------------------------------------

    def init(self, params: Any) -> AdamWState:
        """The state from the parameters (copies: the state's buffers are donated and written
        in place): moments zero, master weights (if any) from the parameters, digests and
        parity of everything."""
        ensure_registered()
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            dtype = jnp.asarray(p).dtype
            if dtype not in (jnp.float32, jnp.bfloat16):
                raise TypeError(f"parameter {jax.tree_util.keystr(path)} is {dtype}: pimhbm.adamw "
                                "updates float32 or bfloat16 parameters")
            if self.master_weights and dtype != jnp.bfloat16:
                raise TypeError(f"parameter {jax.tree_util.keystr(path)} is {dtype}: master "
                                "weights are for bfloat16 parameters")
        check_transform(self.gradient_transform, params)
        # The moments and master weights are laid out as their parameters are (sharded ones too).
        layouts = [getattr(p, "sharding", None) for p in jax.tree.leaves(params)]
        return jax.jit(lambda p: self._init(p, layouts))(params)

    def _init(self, params: Any, layouts: list) -> AdamWState:
        params = jax.tree.map(lambda p: jnp.copy(jnp.asarray(p)), params)
        treedef = jax.tree.structure(params)

        def like(make):
            return jax.tree.unflatten(treedef, [_laid_out(make(p), sh) for p, sh in
                                                zip(jax.tree.leaves(params), layouts)])
        # A bf16 parameter taken as its fp32 master: p itself, remainder 0x8000.
        master = (like(lambda p: jnp.full(p.shape, 0x8000, jnp.uint16))
                  if self.master_weights else None)
        mu = like(lambda p: jnp.zeros(p.shape, jnp.float32))
        nu = like(lambda p: jnp.zeros(p.shape, jnp.float32))
        state = AdamWState(params, master, mu, nu, None, None, step_copies_of(0))
        leaves = _tensors(state, treedef)
        dtypes = [leaf["p"].dtype for leaf in leaves]
        digests = [{k: scan(x, self.chunk_bytes(k, dt)).digests for k, x in leaf.items()}
                   for leaf, dt in zip(leaves, dtypes)]
        rows = None
        if self.group > 0:
            rows = jax.tree.unflatten(treedef, [
                {k: parity.parity(x, self.chunk_bytes(k, dt), self.group) for k, x in leaf.items()}
                for leaf, dt in zip(leaves, dtypes)])
        return state._replace(digests=jax.tree.unflatten(treedef, digests), parity=rows)

    # -- one step ------------------------------------------------------------------------------

    def update(self, grads: Any, state: AdamWState, learning_rate: Any = None, *,
               axis_name: str | None = None, gate: Any = None,
               before_writes: Callable[[Any], Any] | None = None
               ) -> tuple[AdamWState, UpdateReport]:
        """One guarded step, in place: call it inside ``jax.jit`` with the state donated.
        ``learning_rate``: a device scalar (or None for the configured one). ``axis_name``: the
        data-parallel axis inside ``shard_map`` (the verdict is global). ``gate`` (a device
        bool): false on any device, the step does not run on any. ``before_writes``: applied to
        the checks' counts, from which the verdict the update reads is drawn (what must follow
        the checks and precede the update's writes, as a snapshot's fence)."""
        ensure_registered()
        _check_learning_rate(learning_rate)
        treedef = jax.tree.structure(state.params)
        check_grads(grads, state.params)
        grads = transform_grads(self.gradient_transform, grads, state.params)
        count = next_count(state.step)
        if learning_rate is None:
            learning_rate = (self.learning_rate(count) if callable(self.learning_rate)
                             else self.learning_rate)
        scalars = step_scalars(learning_rate, count, self.b1, self.b2)
        leaves = _tensors(state, treedef)
        tables = treedef.flatten_up_to(state.digests)
        flat_grads = treedef.flatten_up_to(grads)

        # Before any write: the parameters as the backward pass read them, the gradients.
        checked, flat_grads = self._prechecks(leaves, tables, flat_grads)
        p_faults, g_bad, local = checked
        if before_writes is not None:
            # The update reads the verdict drawn from these counts: whatever passes them through
            # runs after the checks and before the first write. Not the gradients: XLA copies
            # those it cannot alias through an in-place op (on the GPU, 4 of 8 MiB a step at the
            # 8B layers).
            local = before_writes(local)
        hold = (local != 0).any() | unusable(scalars)
        if gate is not None:
            hold |= ~jnp.asarray(gate, jnp.bool_)
        counts = jnp.concatenate([local, hold.astype(jnp.int32)[None]])
        if axis_name is not None:
            counts = saturating_psum(counts, axis_name)
        go = counts[2] == 0

        outs, stash, totals = self._call(go, scalars, leaves, tables, state.parity, treedef,
                                         flat_grads, checked=p_faults)
        kept, faulty = totals.kept, totals.faulty
        suspect = self._suspect(totals)
        if axis_name is not None:
            summed = saturating_psum(jnp.stack([faulty, kept, suspect]), axis_name)
            faulty, kept, suspect = summed[0], summed[1], summed[2]
        committed = go & (kept == 0) & (suspect == 0)
        done = count - 1 + committed.astype(jnp.int32)
        new_state = self._state_from(outs, treedef, state.master is not None, state.parity is not None,
                                     step_copies_of(done))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        # A skipped step's maps are the checks' (FAULT_PARAM where p was damaged): the kernel
        # writes them, so no XLA op a leaf merges the two.
        fault_maps = [o["faults"] for o in outs]
        grad_nonfinite, g_maps = counts[1], g_bad
        if self.gradient_checks is GradientChecks.IN_UPDATE:  # the kept elements say it
            grad_nonfinite, g_maps = kept, [o["kept"] for o in outs]
        report = UpdateReport(go, committed, grad_nonfinite, counts[0] + faulty, kept,
                              unflat(fault_maps), unflat(g_maps), stash, totals.stashed,
                              scalars, suspect)
        return new_state, report

    def _prechecks(self, leaves: list[dict], tables: list[dict], grads: list[jax.Array]
                   ) -> tuple[Prechecks, list[jax.Array]]:
        """Per leaf, p's damaged chunks and the gradient's nonfinite counts, with their totals;
        and the gradients the update reads (the same here; a variant that orders its checks by
        barriers hands on the barriers' outputs: bench/check_order.py). Speculative: no pass,
        no maps, totals 0 -- drawn after every gradient, so that what the caller puts between
        them and the update (a snapshot's fence) still waits for the backward pass."""
        if self.speculative:
            zeros, grads = jax.lax.optimization_barrier(
                (jnp.zeros((PRECHECK_TOTALS,), jnp.int32), grads))
            return Prechecks(None, None, zeros), grads
        params, p_tables = [leaf["p"] for leaf in leaves], [t["p"] for t in tables]
        if self.gradient_checks is GradientChecks.BEFORE_WRITES:  # the pass reads the gradients
            return prechecks(params, p_tables, grads, self.chunk_elems), grads
        # p's checks alone: through a barrier with the gradients, so that they run after the
        # backward pass's last read of p (XLA orders by data only: without it they may run
        # first, and damage between them and that read would reach the gradients unseen).
        params, grads = jax.lax.optimization_barrier((params, grads))
        return prechecks(params, p_tables, None, self.chunk_elems), grads

    def _suspect(self, totals: UpdateTotals) -> jax.Array:
        """Speculative: the parameter chunks the update found damaged (int32, the kernel's
        count), whose damage may have come before the gradients were computed from them; else
        0 (the checks before the writes found any such damage)."""
        return totals.suspect if self.speculative else jnp.int32(0)

    def _suspect_left(self, index: jax.Array) -> jax.Array:
        """Speculative: whether a stash (its index) holds a parameter chunk the update found
        damaged -- the step's gradients may have read the damage, so its redo does not make the
        step whole."""
        return self.speculative & jnp.any(index[:, 2] & FAULT_PARAM != 0)

    def _state_from(self, outs: list[dict], treedef, has_master: bool, has_parity: bool,
                    step_copies: jax.Array) -> AdamWState:
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        names = [k for k in TENSORS if has_master or k != "master"]
        return AdamWState(
            unflat([o["p"] for o in outs]),
            unflat([o["master"] for o in outs]) if has_master else None,
            unflat([o["mu"] for o in outs]), unflat([o["nu"] for o in outs]),
            unflat([{k: o["d_" + k] for k in names} for o in outs]),
            unflat([{k: o["q_" + k] for k in names} for o in outs]) if has_parity else None,
            step_copies)

    def attributes(self) -> dict:
        """The FFI attributes of the update and redo calls."""
        return dict(chunk_elems=np.int64(self.chunk_elems), group=np.int64(self.group),
                    b1=np.float32(self.b1), b2=np.float32(self.b2),
                    one_minus_b1=np.float32(1 - self.b1), one_minus_b2=np.float32(1 - self.b2),
                    eps=np.float32(self.eps), eps_root=np.float32(self.eps_root),
                    weight_decay=np.float32(self.weight_decay))

    def _call(self, go, scalars, leaves, tables, rows, treedef, grads=None, stash=None,
              checked=None):
        """One pimhbm_adamw_inplace call (grads and the checks' maps of p given) or
        pimhbm_adamw_redo call (stash given) over every leaf (pimhbm.inplace_calls): per leaf its
        results by name, the new stash (None for a redo), the totals."""
        flat_rows = treedef.flatten_up_to(rows) if rows is not None else [None] * len(leaves)
        pick = lambda xs, i: xs[i] if xs is not None else None
        ops = [leaf_operands(leaf, table, r, pick(grads, i), pick(checked, i))
               for i, (leaf, table, r) in enumerate(zip(leaves, tables, flat_rows))]
        attrs = self.attributes()
        if stash is not None:
            results, totals = redo_call(scalars, stash, ops, attrs)
            return results, None, totals
        return update_call(scalars, go.astype(jnp.int32).reshape(1), ops, attrs,
                           self.stash_capacity)

    # -- after an update that left chunks -------------------------------------------------------

    def repair(self, state: AdamWState,
               report: UpdateReport | LeftChunks) -> tuple[AdamWState, RepairReport]:
        """This device's chunks the update left (``report.left``, or the LeftChunks kept from
        it): the damaged tensors of each rebuilt from the parity, then the chunk updated with its
        stashed gradient and the step's scalars -- in place, under ``jax.jit`` with the state
        donated. Given the whole UpdateReport of a refused step, also the parameter chunks its
        checks found damaged (up to ``stash_capacity`` a leaf) are rebuilt from the parity: that
        step is not done (its gradients read the damaged parameters), the next one runs on the
        rebuilt parameters -- recompute the refused step's gradients to replay it. Does nothing
        where nothing was found. Needs parity (with replicas, copy the chunks from a healthy
        replica instead -- but not for a step the speculative checks left suspect, whose
        gradients every replica summed: restore a snapshot)."""
        ensure_registered()
        if state.parity is None:
            raise ValueError("repair rebuilds from parity; this state has none (group=0)")
        treedef = jax.tree.structure(state.params)
        if isinstance(report, UpdateReport):
            state, params_rebuilt, params_whole = self._rebuild_params(state, report, treedef)
            report = report.left
        else:
            params_rebuilt = jax.tree.unflatten(treedef, [
                jnp.full((self.stash_capacity,), NOT_LISTED, jnp.int32)] * treedef.num_leaves)
            params_whole = jnp.bool_(True)
        leaves = _tensors(state, treedef)
        tables = treedef.flatten_up_to(state.digests)
        rows = treedef.flatten_up_to(state.parity)
        index = report.stash.index
        statuses, rebuilt, unrepaired = [], [], jnp.bool_(False)
        for i, (leaf, table, r) in enumerate(zip(leaves, tables, rows)):
            new, st = {}, []
            for k in TENSORS:
                chunks = jnp.where((index[:, 0] == i) & (index[:, 2] & FAULT_BIT[k] != 0),
                                   index[:, 1], -1)
                if k not in leaf:
                    st.append(jnp.zeros(chunks.shape, jnp.int32))
                    continue
                new[k], s = parity.rebuild(chunks, leaf[k], table[k], r[k],
                                           self.chunk_bytes(k, leaf["p"].dtype), self.group)
                unrepaired |= jnp.any((chunks >= 0) & (s != REPAIRED))
                st.append(s)
            rebuilt.append(new)
            statuses.append(jnp.stack(st, axis=1))
        outs, _, totals = self._call(None, report.scalars, rebuilt, tables, state.parity, treedef,
                                     stash=report.stash)
        faults = totals.faulty
        # A stashed gradient that was not checked before the writes may be non-finite: the
        # redo then kept elements, and the chunk is not whole (the next source takes it).
        kept_whole = (totals.kept == 0
                      if self.gradient_checks is GradientChecks.IN_UPDATE else True)
        # The redo commits a chunk's step: the count stays (the step was counted when applied).
        new_state = self._state_from(outs, treedef, state.master is not None, True,
                                     state.step_copies)
        complete = ((faults == 0) & (report.stashed <= self.stash_capacity) & ~unrepaired
                    & params_whole & kept_whole & ~self._suspect_left(index))
        return new_state, RepairReport(jax.tree.unflatten(treedef, statuses), faults, complete,
                                       params_rebuilt)

    def _rebuild_params(self, state: AdamWState, report: UpdateReport, treedef
                        ) -> tuple[AdamWState, Any, jax.Array]:
        """The parameter chunks the checks before a refused update found damaged, rebuilt from
        the parity (``stash_capacity`` of them a leaf at most). Returns the state, the statuses
        per leaf, and whether every damaged chunk was listed and rebuilt."""
        params = treedef.flatten_up_to(state.params)
        tables = treedef.flatten_up_to(state.digests)
        rows = treedef.flatten_up_to(state.parity)
        maps = treedef.flatten_up_to(report.fault_maps)
        new, statuses, whole = [], [], jnp.bool_(True)
        for p, table, r, m in zip(params, tables, rows, maps):
            damaged = ~report.applied & (m & FAULT_PARAM != 0)
            chunks = _first_marked(damaged, self.stash_capacity)
            p, status = parity.rebuild(chunks, p, table["p"], r["p"],
                                       self.chunk_bytes("p", p.dtype), self.group)
            whole &= (jnp.sum(damaged) <= self.stash_capacity) & ~jnp.any(
                (chunks >= 0) & (status != REPAIRED))
            new.append(p)
            statuses.append(status)
        return (state._replace(params=jax.tree.unflatten(treedef, new)),
                jax.tree.unflatten(treedef, statuses), whole)


def _first_marked(marked: jax.Array, k: int) -> jax.Array:
    """int32[k]: the indices of the first k true entries of ``marked``, -1 past the last. By k
    minimum reductions: on a map sharded as its leaf each is a reduction across the devices,
    where ``jnp.nonzero`` would gather the map (k is small; this runs only in a repair)."""
    n = marked.shape[0]
    left = jnp.where(marked, jnp.arange(n, dtype=jnp.int32), n)
    found = []
    for _ in range(k):
        first = jnp.min(left, initial=n)
        found.append(first)
        left = jnp.where(left == first, n, left)
    listed = jnp.stack(found) if found else jnp.zeros((0,), jnp.int32)
    return jnp.where(listed < n, listed, -1).astype(jnp.int32)


def _laid_out(x: jax.Array, sharding: Any) -> jax.Array:
    """``x`` constrained to its parameter's sharding, where that is a mesh's."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    if all(t == jax.sharding.AxisType.Auto for t in sharding.mesh.axis_types):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.sharding.reshard(x, sharding)  # a mesh of explicit axes: the type's sharding


def _check_hyper(o: AdamW) -> None:
    def real(name, v, lo=-math.inf, hi=math.inf, lo_open=False, hi_open=False):
        ok = isinstance(v, (int, float, np.floating, np.integer)) and math.isfinite(float(v))
        ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            raise ValueError(f"pimhbm.adamw: {name} must be a finite number in "
                             f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {v!r}")
    real("b1", o.b1, 0.0, 1.0, hi_open=True)
    real("b2", o.b2, 0.0, 1.0, hi_open=True)
    for name, b in (("b1", o.b1), ("b2", o.b2)):
        if np.float32(b) == 1:  # 1 - b^t would be 0: every step would be held
            raise ValueError(f"pimhbm.adamw: {name}={b!r} is 1 in float32, so its bias "
                             f"correction 1 - {name}^t would be 0; take a value further from 1")
    real("eps", o.eps, 0.0)
    real("eps_root", o.eps_root, 0.0)
    real("weight_decay", o.weight_decay)
    if not callable(o.learning_rate):
        real("learning_rate", o.learning_rate)
    sizes = tuple(inplace_layout()["chunk_elems"])
    if o.chunk_elems not in sizes:
        raise ValueError(f"chunk_elems must be one of {sizes} (a warp holds a chunk), got "
                         f"{o.chunk_elems}")
    if not 0 <= o.group <= parity.MAX_GROUP:
        raise ValueError(f"group must be 0 (no parity: replicas are the redundancy) to "
                         f"{parity.MAX_GROUP}, got {o.group}")
    if o.stash_capacity < 0:
        raise ValueError(f"stash_capacity must be 0 or more, got {o.stash_capacity}")


def adamw(learning_rate: float | Callable[[jax.Array], jax.Array], b1: float = 0.9,
          b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          weight_decay: float = 1e-4, *, master_weights: bool = False,
          chunk_elems: int = DEFAULT_CHUNK_ELEMS, group: int = DEFAULT_GROUP,
          stash_capacity: int = DEFAULT_STASH, gradient_transform: Any = None,
          gradient_checks: GradientChecks = GradientChecks.BEFORE_WRITES,
          parameter_checks: ParameterChecks = ParameterChecks.BEFORE_WRITES) -> AdamW:
    """Guarded, fused, in-place AdamW; arguments as ``optax.adamw``. ``master_weights``: fp32
    master weights for bf16 parameters. ``group``: chunks a parity row covers (0: no parity,
    for data-parallel replicas that are each other's redundancy). ``stash_capacity``: chunks a
    step can leave for ``repair`` (more: the next source, a replica or a snapshot).
    ``gradient_transform``: a stateless optax transformation of the gradients run first, in the
    same compiled step -- ``optax.clip_by_global_norm(1.0)`` makes this
    ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))``. It sees the gradients
    alone (no parameters); under FSDP each device's shards (a global norm would be a shard's),
    so the Trainer refuses it there. ``gradient_checks``: where non-finite gradients are found
    (GradientChecks: before the writes, cancelling the step; or by the update itself, 2 bytes a
    parameter fewer read, the step then applied in part). ``parameter_checks``: where damaged
    parameter chunks are found (ParameterChecks: before the writes, cancelling the step; or,
    speculatively, by the update itself -- with the gradients checked there too, no pass before
    the writes at all -- the step then not committed where it finds one)."""
    return AdamW(learning_rate, b1, b2, eps, eps_root, weight_decay, master_weights, chunk_elems,
                 group, stash_capacity, gradient_checks=gradient_checks,
                 parameter_checks=parameter_checks, gradient_transform=gradient_transform)
