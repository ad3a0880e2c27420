"""Every program a run can need, compiled ahead of time from shapes (no device memory is
touched), and the count of compilations after that (there should be none)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pimhbm
from pimhbm.recovery.placement import AXES, Transport
from pimhbm.recovery.one_copy import OneCopy
from pimhbm.recovery.traced import Traced, TrainState

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations while entered (a context manager, re-entrant by
    counting), listening to jax.monitoring only for as long as it is in use. A program taken
    from the persistent compilation cache counts too (JAX reports its load as a backend
    compilation): "0 compilations after prewarm" holds with a cache as without one."""

    def __init__(self):
        self.count = 0
        self._depth = 0

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        if self._depth == 0:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            jax.monitoring.unregister_event_duration_listener(self._on_event)


@dataclasses.dataclass
class Programs:
    """Compiled programs by what they are for; ``current`` (0 or 1) is the parity of the slot a
    program's input state reads (the step's output is the other parity's)."""

    step: dict[int, Any] = dataclasses.field(default_factory=dict)
    sampled: dict[int, Any] = dataclasses.field(default_factory=dict)  # the step, with digests
    recheck: dict[int, Any] = dataclasses.field(default_factory=dict)  # by its input's parity
    repair: dict[tuple[int, bool], Any] = dataclasses.field(default_factory=dict)  # into_copy
    redo: dict[int, Any] = dataclasses.field(default_factory=dict)  # one copy: the left chunks
    replica: dict[int, Any] = dataclasses.field(default_factory=dict)
    rebuild: dict[int, Any] = dataclasses.field(default_factory=dict)
    vote: dict[int, Any] = dataclasses.field(default_factory=dict)
    recopy: dict[int, Any] = dataclasses.field(default_factory=dict)
    scrub: dict[int, Any] = dataclasses.field(default_factory=dict)
    scheduled_scrub: dict[int, Any] = dataclasses.field(default_factory=dict)  # one copy's
    snapshot: dict[tuple[int, int, int], Any] = dataclasses.field(default_factory=dict)  # slot, part
    inject: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    clone: Any = None

    def __len__(self) -> int:
        tables = (self.step, self.sampled, self.recheck, self.repair, self.redo, self.replica,
                  self.rebuild, self.vote, self.recopy, self.scrub, self.scheduled_scrub,
                  self.snapshot, self.inject)
        return sum(map(len, tables)) + (self.clone is not None)


class Compiler:
    """Lowers and compiles the traced functions for the shapes of one run."""

    def __init__(self, traced: Traced, init: Callable, params_sds: Any, batch_specs: list,
                 repair_capacity: int, recheck: bool):
        self.t, self.init, self.params_sds = traced, init, params_sds
        self.batch_specs, self.repair_capacity = batch_specs, repair_capacity
        self.with_recheck = recheck  # sampled re-execution: the sampled step and the recheck
        self.programs = Programs()
        # Progress: compile_all first lists the programs (a pass that compiles nothing), then
        # compiles them, telling `progress(done, total, what)` after each.
        self._listing, self._done, self._total = False, 0, 0
        self.progress: Callable[[int, int, str], None] | None = None

    def _built(self, what: str, build: Callable[[], Any]) -> Any:
        if self._listing:
            return what
        program = build()
        self._done += 1
        if self.progress is not None:
            self.progress(self._done, self._total, what)
        return program

    @property
    def placement(self):
        return self.t.placement

    def _sds(self, shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self.placement.replicated)

    def abstract_state(self, current: int) -> TrainState:
        """The state's global shapes with their shardings."""
        shapes = jax.eval_shape(self.init, self.params_sds)
        opt = shapes if isinstance(self.t, OneCopy) else shapes.with_current(current)
        put = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                   sharding=self.placement.sharding(spec))
        state = TrainState(opt, jax.ShapeDtypeStruct((), jnp.int32), self.t.pending_shapes())
        return jax.tree.map(put, state, self.t.state_specs(current))

    def local_state(self, current: int, device: Any) -> TrainState:
        """One device's part of the state (its shards), placed on ``device``."""
        where = jax.sharding.SingleDeviceSharding(device)
        shard = self.t.layout.shard
        put = lambda x, spec: jax.ShapeDtypeStruct(
            (x.shape[0] // shard, *x.shape[1:]) if "shard" in tuple(spec) else x.shape,
            x.dtype, sharding=where)
        return jax.tree.map(put, self.abstract_state(current), self.t.state_specs(current))

    def _compile(self, fn: Callable, in_specs: Any, out_specs: Any, *args: Any,
                 donate: bool = True, what: str = "program") -> Any:
        def build():
            program = self.placement.manual(fn, in_specs, out_specs)
            return jax.jit(program, donate_argnums=0 if donate else ()).lower(*args).compile()
        return self._built(what, build)

    def compile_all(self, backup: Any,
                    progress: Callable[[int, int, str], None] | None = None) -> Programs:
        """Every program the run can need; ``progress(done, total, what)`` after each. (The
        programs go into the same Programs the trainer's parts hold.)"""
        kept, self.programs = self.programs, Programs()
        self._listing = True
        try:
            self._compile_all(backup)  # lists them: compiles nothing
        finally:
            self._total, self._done, self._listing = len(self.programs), 0, False
            self.programs = kept
        self.progress = progress
        try:
            return self._compile_all(backup)
        finally:
            self.progress = None

    def _compile_all(self, backup: Any) -> Programs:
        for current in self.t.slots:
            self._step(current)
            self._repairs(current)
            if len(self.placement.devices) > self.t.layout.shard:
                self._replicas(current)
            self.scrub(current)
            self.scheduled_scrub(current)
            if backup is not None:
                self._snapshots(current, backup)
        # Fault injection on every state tensor shape (campaigns).
        tensors = self.t.tensors(self.abstract_state(0).opt)
        for leaf, spec in zip(tensors, self.t.leaf_specs):
            for x, _ in leaf.values():
                self.inject(x.shape, x.dtype, spec)
        if self.placement.replicas > 1:  # wrong values only other replicas can tell
            for i, leaf in enumerate(tensors):
                for k, (x, table) in leaf.items():
                    self.inject_rehashed(x, table, self.t.leaf_specs[i],
                                         self.t.layout.chunk_bytes(k, i))
        if backup is not None:
            self.clone()
        return self.programs

    def _batch(self) -> dict:
        return {s.name: self._sds(s.shape, s.dtype, self.placement.by_device)
                for s in self.batch_specs}

    def _step(self, current: int) -> None:
        p, each = self.placement, self.placement.report_spec
        # The step hands over to the other slot: its output is the other parity's state. The
        # batch is split over every device in every process layout; only the reports are
        # gathered whole where processes must all read them (report_spec).
        ins = (self.t.state_specs(current), p.by_device.spec, P(), P())
        outs = (self.t.state_specs(self.t.after_step(current)), P(), each)
        args = (self.abstract_state(current), self._batch(), self._sds((), jnp.float32),
                self._sds((10,), jnp.int32))
        self.programs.step[current] = self._compile(self.t.step, ins, outs, *args, what="the step")
        if not self.with_recheck:
            return
        sampled = lambda *a: self.t.step(*a, digests=True)
        # Two slots: the step's own digests, for the re-execution after it; one copy: the
        # re-execution's verdict per device (it ran inside the step).
        extra = each if self.t.recheck_in_step else P(AXES)
        self.programs.sampled[current] = self._compile(sampled, ins, (*outs, extra), *args,
                                                       what="the sampled step")
        if self.t.recheck_in_step:
            return
        # The recheck reads the step's output: the other parity's state.
        st, ss = self.abstract_state(1 - current), self.t.state_specs(1 - current)
        n, leaves = len(p.devices), len(self.t.layout.paths)
        self.programs.recheck[1 - current] = self._compile(
            self.t.recheck, (ss, p.by_device.spec, each, P(AXES)), (ss, each), st, self._batch(),
            self._sds((n,), jnp.int32, p.sharding(each)),
            self._sds((n, leaves + 1, 2), jnp.uint32, p.by_device), what="the re-execution")

    def _repairs(self, current: int) -> None:
        ss, st = self.t.state_specs(current), self.abstract_state(current)
        lists = self._sds((len(self.t.layout.paths), len(self.t.layout.names),
                           self.repair_capacity), jnp.int32)
        for into_copy in ((False, True) if self.t.local_source else ()):
            fn = lambda s, l, c=into_copy: self.t.repair(s, l, into_copy=c)
            self.programs.repair[current, into_copy] = self._compile(
                fn, (ss, P()), (ss, self.placement.report_spec), st, lists, what="a repair")
        if isinstance(self.t, OneCopy) and self.t.has_parity:
            self.programs.redo[current] = self._compile(
                self.t.redo, (ss,), (ss, self.placement.report_spec), st, what="a redo")

    def _replicas(self, current: int) -> None:
        """Repairs from another replica, whole devices rebuilt from one, the vote where the
        replicas disagree, and (CUDA IPC) the device copy made anew after a rebuild."""
        p, each, shard = self.placement, self.placement.report_spec, self.t.layout.shard
        ss, st = self.t.state_specs(current), self.abstract_state(current)
        lists = self._sds((shard, len(self.t.layout.paths), len(self.t.layout.names),
                           self.repair_capacity), jnp.int32, p.by_column)
        grid = self._sds(p.mesh.devices.shape, jnp.int32, p.grid)
        self.programs.replica[current] = self._compile(
            self.t.replica, (ss, P("shard"), P("shard")), (ss, each), st, lists, lists,
            what="a repair from a replica")
        self.programs.rebuild[current] = self._compile(
            self.t.rebuild, (ss, P("shard"), P("dp", "shard")), (ss, each), st,
            self._sds((shard,), jnp.int32, p.by_column), grid, what="a device rebuilt")
        self.programs.vote[current] = self._compile(self.t.vote, (ss, P("shard")), each, st,
                                                    lists, donate=False, what="the vote")
        if self.t.transport is Transport.IPC and self.t.device_copy:
            self.programs.recopy[current] = self._compile(
                self.t.recopy, (ss, P("dp", "shard")), ss, st, grid, what="the device copy anew")

    def scrub(self, current: int) -> Any:
        if current not in self.programs.scrub:
            self.programs.scrub[current] = self._compile(
                self.t.scrub, (self.t.state_specs(current),), self.placement.report_spec,
                self.abstract_state(current), donate=False, what="the scrub")
        return self.programs.scrub[current]

    def scheduled_scrub(self, current: int) -> Any:
        """The scrub between steps: the scrub itself where the kind's are the same."""
        if type(self.t).scheduled_scrub is Traced.scheduled_scrub:
            return self.scrub(current)
        if current not in self.programs.scheduled_scrub:
            self.programs.scheduled_scrub[current] = self._compile(
                self.t.scheduled_scrub, (self.t.state_specs(current),),
                self.placement.report_spec, self.abstract_state(current), donate=False,
                what="the scrub between steps")
        return self.programs.scheduled_scrub[current]

    def _snapshots(self, current: int, backup: Any) -> None:
        for part, device in self.placement.writers.items():
            one = self.local_state(current, device).opt
            for slot in (0, 1):
                fn = lambda s, slot=slot, part=part: self.t.snapshot(s, backup=backup, slot=slot,
                                                                     part=part)
                self.programs.snapshot[current, slot, part] = self._built(
                    "a snapshot", lambda fn=fn, one=one: jax.jit(fn).lower(one).compile())

    def inject(self, shape, dtype, spec=P()) -> Any:
        """Fault injection into some devices' copies (or shards) of a tensor, in place: one
        program for all devices, a spec row per device."""
        key = (tuple(shape), jnp.dtype(dtype), tuple(spec))
        if key not in self.programs.inject:
            p = self.placement
            self.programs.inject[key] = self._compile(
                Traced.inject, (spec, P(AXES)), spec,
                jax.ShapeDtypeStruct(shape, dtype, sharding=p.sharding(spec)),
                jax.ShapeDtypeStruct((len(p.devices), 8), jnp.int32, sharding=p.by_device),
                what="fault injection")
        return self.programs.inject[key]

    def inject_rehashed(self, x: Any, table: Any, spec: P, chunk_bytes: int) -> Any:
        """Fault injection that makes the damaged copies' digest tables anew (Traced)."""
        key = ("rehashed", tuple(x.shape), jnp.dtype(x.dtype), tuple(spec), chunk_bytes)
        if key not in self.programs.inject:
            p = self.placement
            fn = lambda x, t, f: Traced.inject_rehashed(x, t, f, chunk_bytes)
            self.programs.inject[key] = self._built("fault injection", lambda: jax.jit(
                p.manual(fn, (spec, spec, P(AXES)), (spec, spec)), donate_argnums=(0, 1)).lower(
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding(spec)),
                jax.ShapeDtypeStruct(table.shape, table.dtype, sharding=p.sharding(spec)),
                jax.ShapeDtypeStruct((len(p.devices), 8), jnp.int32,
                                     sharding=p.by_device)).compile())
        return self.programs.inject[key]

    def clone(self) -> Any:
        """Two more copies of a slot, on the devices (a restore puts the snapshot on the
        devices once and makes the other slot and the device copy from it there); with one
        copy, the parity of the state put back."""
        if self.programs.clone is None:
            self.programs.clone = self._built("the restore's copies", self._clone)
        return self.programs.clone

    def _clone(self) -> Any:
        opt = self.abstract_state(0).opt
        if not isinstance(self.t, OneCopy):
            return jax.jit(self.t.clone).lower(opt.slots[0]).compile()
        # One copy: the parity of each device's own shards, from the tensors put back.
        specs = self.t.state_specs().opt
        bare = lambda o: o._replace(parity=None)
        program = self.placement.manual(self.t.clone, (bare(specs),), specs)
        return jax.jit(program, donate_argnums=0).lower(bare(opt)).compile()


def use_compilation_cache(cache_dir: str) -> None:
    """A persistent compilation cache, keyed by this library's version (a sub-folder each)."""
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(cache_dir, f"pimhbm-{pimhbm.__version__}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def prewarm(compiler: Compiler, backup: Any, cache_dir: str | None,
            progress: Callable[[int, int, str], None] | None = None) -> tuple[Programs, float]:
    """Every program, and the seconds it took."""
    if cache_dir is not None:
        use_compilation_cache(cache_dir)
    t0 = time.perf_counter()
    programs = compiler.compile_all(backup, progress)
    return programs, time.perf_counter() - t0
