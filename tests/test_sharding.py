"""The FFI ops under plain jax.jit with parameters sharded on their first dimension (4 virtual CPU
devices): each device works on its own shards -- the compiled program holds no all-gather --
the outputs keep the inputs' sharding, and every result equals the unsharded one bit for bit;
a leaf whose shards do not fall on chunk (or parity-block) boundaries is computed whole,
correctly. Positive controls: without the chunk base a shard's digests are not the whole's, and
a layout that cannot be cut per shard does gather."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pimhbm
from conftest import needs_devices
from pimhbm import inplace, parity
from pimhbm.repair import NOT_LISTED

CHUNK, GROUP = 128, 4


@pytest.fixture
def mesh():
    needs_devices(4)
    return jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])


def on(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def gathers(compiled_text: str) -> list[str]:
    return re.findall(r"\b(all-gather|all-to-all|collective-permute)\b", compiled_text)


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_a_scan_runs_per_shard_and_equals_the_whole(mesh, rng):
    x = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))  # 16 rows a shard
    whole = pimhbm.scan(x, 1024)
    f = jax.jit(lambda x: pimhbm.scan(x, 1024))
    got = f(on(mesh, x, "x", None))
    assert got.digests.sharding.spec[0] == "x" and got.nonfinite.sharding.spec[0] == "x"
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, whole))
    assert gathers(f.lower(on(mesh, x, "x", None)).compile().as_text()) == []
    verify = jax.jit(lambda x, t: pimhbm.verify(x, t, 1024))
    flags = verify(on(mesh, x, "x", None), got.digests)
    assert flags.sharding.spec[0] == "x" and not bool(flags.any())
    # A flipped bit in the last shard is found in its chunk of the whole tensor, and only there.
    damaged = np.asarray(x).copy()
    damaged.reshape(-1).view(np.uint32)[60 * 96 + 7] ^= np.uint32(1 << 3)
    flags = np.asarray(verify(on(mesh, jnp.asarray(damaged), "x", None), got.digests))
    assert np.flatnonzero(flags).tolist() == [(60 * 96 + 7) * 4 // 1024]
    # The control: each shard scanned as a tensor of its own has other digests -- the chunk
    # base is what made them the whole tensor's.
    own = pimhbm.scan(np.asarray(x)[16:32], 1024).digests
    assert not np.array_equal(np.asarray(own), np.asarray(whole.digests)[6:12])


@pytest.mark.parametrize("rows", [60, 64 * 3 + 4], ids=["shards-not-on-chunks", "ragged"])
def test_a_shard_off_the_chunk_boundaries_is_scanned_whole(mesh, rng, rows):
    x = jnp.asarray(rng.standard_normal((rows, 24)).astype(np.float32))
    f = jax.jit(lambda x: pimhbm.scan(x, 1024).digests)
    got = f(on(mesh, x, "x", None))
    assert np.array_equal(np.asarray(got), np.asarray(pimhbm.scan(x, 1024).digests))
    assert gathers(f.lower(on(mesh, x, "x", None)).compile().as_text())  # gathered: computed whole


def test_parity_rows_run_per_shard(mesh, rng):
    x = jnp.asarray(rng.standard_normal((64, 128)).astype(np.float32))  # a block a shard
    f = jax.jit(lambda x: parity.parity(x, 512, GROUP))
    got = f(on(mesh, x, "x", None))
    assert got.sharding.spec[0] == "x"
    assert np.array_equal(np.asarray(got), np.asarray(parity.parity(x, 512, GROUP)))
    assert gathers(f.lower(on(mesh, x, "x", None)).compile().as_text()) == []


def sharded_params(rng, mesh, dtype):
    """A matrix in whole parity blocks a shard, a vector too small to shard (replicated), and a
    matrix sharded off the block boundaries (computed whole)."""
    params = {"w": rng.standard_normal((256, 64)), "b": rng.standard_normal((64,)),
              "odd": rng.standard_normal((8, 100))}
    params = {k: jnp.asarray(v.astype(dtype)) for k, v in params.items()}
    shardings = {"w": P("x", None), "b": P(), "odd": P("x", None)}
    return params, {k: on(mesh, v, *shardings[k]) for k, v in params.items()}


def steps(opt):
    return jax.jit(opt.update, donate_argnums=1), jax.jit(opt.repair, donate_argnums=0)


@pytest.mark.parametrize("kind", ["fp32", "bf16_master"])
def test_the_in_place_update_runs_per_shard_and_equals_the_whole(mesh, rng, kind):
    dtype = np.float32 if kind == "fp32" else ml_dtypes.bfloat16
    opt = inplace.adamw(1e-3, master_weights=kind != "fp32", chunk_elems=CHUNK, group=GROUP)
    params, placed = sharded_params(rng, mesh, dtype)
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape).astype(dtype)) for k, v in params.items()}
             for _ in range(3)]
    update, _ = steps(opt)
    whole, state = opt.init(params), opt.init(placed)
    assert state.params["w"].sharding.spec[0] == "x"
    assert state.mu["w"].sharding.spec[0] == "x" and state.digests["w"]["mu"].sharding.spec[0] == "x"
    assert state.parity["w"]["nu"].sharding.spec[0] == "x"
    assert bits(state) == bits(whole)
    for g in grads:
        g_placed = jax.tree.map(lambda a, p: jax.device_put(a, p.sharding), g, placed)
        state, report = update(g_placed, state)
        whole, want = update(g, whole)
        assert bool(report.committed) and int(report.digest_faults) == 0
        assert bits(state) == bits(whole)
    for field in (state.params, state.mu, state.nu):
        assert field["w"].sharding.spec[0] == "x"
    hlo = update.lower(g_placed, state).compile().as_text()
    # The one leaf off the block boundaries ("odd") is gathered; none of the others is.
    gathered = [line for line in hlo.splitlines() if re.search(r"\ball-gather\b", line)]
    assert gathered and all("8,100" in line or "[800]" in line or "8, 100" in line
                            for line in gathered), gathered[:3]


def test_without_an_odd_leaf_the_update_holds_no_all_gather(mesh, rng):
    opt = inplace.adamw(1e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    params = {"w": jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16),
              "v": jnp.asarray(rng.standard_normal((512, 32)), jnp.bfloat16)}
    placed = {k: on(mesh, v, "x", None) for k, v in params.items()}
    state = opt.init(placed)
    grads = {k: on(mesh, jnp.ones(v.shape, v.dtype), "x", None) for k, v in params.items()}
    update = jax.jit(opt.update, donate_argnums=1)
    assert gathers(update.lower(grads, state).compile().as_text()) == []
    state, report = update(grads, state)
    assert bool(report.committed) and state.params["v"].sharding.spec[0] == "x"


def test_a_chunk_damaged_in_a_shard_is_stashed_with_its_whole_index_and_repaired(mesh, rng):
    """A flipped bit in the third device's shard of mu: the update leaves its chunk; the merged
    stash names it by its index in the whole tensor; repair rebuilds and redoes it -- the same
    state as the unsharded run with the same flip."""
    opt = inplace.adamw(1e-3, chunk_elems=CHUNK, group=GROUP)
    params, placed = sharded_params(rng, mesh, np.float32)
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape).astype(np.float32))
              for k, v in params.items()} for _ in range(3)]
    update, repair = steps(opt)
    element = 2 * 64 * 64 + 5 * CHUNK + 17  # in the third device's shard of w: chunk 69

    def run(state, place):
        for i, g in enumerate(grads):
            if i == 1:
                mu = np.asarray(state.mu["w"]).copy()
                mu.reshape(-1).view(np.uint32)[element] ^= np.uint32(1 << 9)
                state = state._replace(mu=dict(state.mu, w=place(jnp.asarray(mu), "w")))
            state, report = update({k: place(v, k) for k, v in g.items()}, state)
            if i == 1:
                assert bool(report.applied) and int(report.digest_faults) == 1
                assert np.asarray(report.stash.index)[0].tolist() == [2, element // CHUNK, 4]
                assert int(report.stashed) == 1
                state, fixed = repair(state, report)
                assert bool(fixed.complete)
        return state

    shardings = {k: v.sharding for k, v in placed.items()}
    sharded = run(opt.init(placed), lambda a, k: jax.device_put(a, shardings[k]))
    whole = run(opt.init(params), lambda a, k: a)
    assert bits(sharded) == bits(whole)


@pytest.mark.parametrize("kind", ["fp32", "bf16_master"])
def test_a_shard_updated_with_its_chunk_base_is_the_wholes_shard(rng, kind):
    """The kernels themselves (on this machine's default device, the GPU where there is one):
    the prechecks and the update of rows [128, 192) of a leaf, called with its first chunk's
    index, give exactly those rows of the whole update -- tensors, digest tables, parity rows --
    and without it, the shard's digests do not verify."""
    from pimhbm import inplace_calls
    from pimhbm.step_scalars import step_scalars

    dtype = np.float32 if kind == "fp32" else ml_dtypes.bfloat16
    opt = inplace.adamw(1e-3, master_weights=kind != "fp32", chunk_elems=CHUNK, group=GROUP)
    params = {"w": jnp.asarray(rng.standard_normal((256, 64)).astype(dtype))}
    g = jnp.asarray(rng.standard_normal((256, 64)).astype(dtype))
    state = opt.init(params)
    rows, chunks = slice(128, 192), slice(128 * 64 // CHUNK, 192 * 64 // CHUNK)
    block = GROUP * GROUP  # a run of whole blocks holds the run of whole groups below
    assert chunks.start % block == 0 and chunks.stop % block == 0
    groups = slice(chunks.start // GROUP, chunks.stop // GROUP)
    base = jnp.asarray([chunks.start], jnp.int32)
    tables = state.digests["w"]
    damaged, nonfinite, counts = inplace_calls._precheck_ffi(
        [params["w"][rows]], [tables["p"][chunks]], [g[rows]], [base], CHUNK)
    assert not np.asarray(damaged).any() and not np.asarray(nonfinite).any()
    assert not np.asarray(counts).any()
    unbased, _, counts = inplace_calls._precheck_ffi(
        [params["w"][rows]], [tables["p"][chunks]], [g[rows]], [jnp.zeros(1, jnp.int32)], CHUNK)
    assert np.asarray(unbased).all()  # the control: keyed by the shard's own chunk numbers
    assert np.asarray(counts).tolist() == [[unbased.size, 0], [0, 0]]

    leaf = {k: getattr(state, f)["w"][rows] for k, f in
            (("p", "params"), ("mu", "mu"), ("nu", "nu"), ("master", "master"))
            if getattr(state, f) is not None}
    ops = inplace_calls.leaf_operands(leaf, {k: t[chunks] for k, t in tables.items()},
                                      {k: r[groups] for k, r in state.parity["w"].items()}, g[rows],
                                      damaged)
    ops["chunk_base"] = base
    scalars = step_scalars(jnp.float32(1e-3), state.step + 1, opt.b1, opt.b2)
    results, _, totals = jax.jit(lambda s, o: inplace_calls.update_call(
        s, jnp.ones((1,), jnp.int32), [o], opt.attributes(), opt.stash_capacity))(scalars, ops)
    whole, report = jax.jit(opt.update)({"w": g}, state)
    assert bool(report.committed) and not np.asarray(totals).any()
    for name, field in (("p", "params"), ("mu", "mu"), ("nu", "nu"), ("master", "master")):
        if name in leaf:
            assert bits(results[0][name]) == bits(getattr(whole, field)["w"][rows]), name
            assert bits(results[0]["d_" + name]) == bits(whole.digests["w"][name][chunks]), name
            assert bits(results[0]["q_" + name]) == bits(whole.parity["w"][name][groups]), name


def test_a_mesh_of_explicit_axes_gets_the_same_per_shard_update(rng):
    """jax.make_mesh's default axes are explicit (sharding in the types): the same update, per
    shard, bit-identical to the whole one, with no all-gather."""
    needs_devices(4)
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:4])
    opt = inplace.adamw(1e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    params = {"w": jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)}
    grads = {"w": jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)}
    placed = {"w": on(mesh, params["w"], "x", None)}
    g_placed = {"w": on(mesh, grads["w"], "x", None)}
    state = opt.init(placed)
    assert state.mu["w"].sharding.spec[0] == "x"
    update = jax.jit(opt.update)
    assert gathers(update.lower(g_placed, state).compile().as_text()) == []
    state, report = update(g_placed, state)
    whole, _ = update(grads, opt.init(params))
    assert bool(report.committed) and bits(state) == bits(whole)


def test_a_parameter_damaged_in_a_shard_cancels_the_step_on_every_device(mesh, rng):
    """The checks before the update, per shard: a flipped bit in the second device's shard of p
    cancels the whole step (nothing written anywhere) and is reported in its chunk of the whole
    tensor."""
    opt = inplace.adamw(1e-3, chunk_elems=CHUNK, group=GROUP)
    params, placed = sharded_params(rng, mesh, np.float32)
    grads = {k: on(mesh, jnp.ones(v.shape, v.dtype), *v.sharding.spec) for k, v in placed.items()}
    state = opt.init(placed)
    element = 64 * 64 + 3 * CHUNK + 5  # the second device's shard of w
    w = np.asarray(state.params["w"]).copy()
    w.reshape(-1).view(np.uint32)[element] ^= np.uint32(1 << 20)
    damaged = state._replace(params=dict(state.params, w=on(mesh, jnp.asarray(w), "x", None)))
    before = bits(damaged)
    new, report = jax.jit(opt.update)(grads, damaged)
    assert not bool(report.applied) and int(report.digest_faults) == 1
    assert np.flatnonzero(np.asarray(report.fault_maps["w"])).tolist() == [element // CHUNK]
    assert bits(new) == before


def test_a_damaged_parameter_is_rebuilt_per_shard_by_repair(mesh, rng):
    """A parameter bit flipped on the last device's shard: the update is refused, repair with
    its report rebuilds the chunk on that device (no all-gather), and the state is the whole
    run's bit for bit."""
    opt = inplace.adamw(1e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    params = {"v": jnp.asarray(rng.standard_normal((512, 32)), jnp.bfloat16)}
    grads = {"v": jnp.asarray(rng.standard_normal((512, 32)), jnp.bfloat16)}
    update, repair = steps(opt)
    element = 3 * 128 * 32 + 5 * CHUNK + 1

    def refused(place):
        state = opt.init({k: place(v) for k, v in params.items()})
        p = np.asarray(state.params["v"]).copy()
        p.reshape(-1).view(np.uint16)[element] ^= np.uint16(1 << 6)
        state = state._replace(params={"v": place(jnp.asarray(p))})
        return update({k: place(g) for k, g in grads.items()}, state)

    sharded, report = refused(lambda a: on(mesh, a, "x", None))
    assert not bool(report.applied) and int(report.digest_faults) == 1
    assert gathers(repair.lower(sharded, report).compile().as_text()) == []
    sharded, fixed = repair(sharded, report)
    whole, _ = repair(*refused(lambda a: a))
    assert bool(fixed.complete)
    assert np.asarray(fixed.params_rebuilt["v"]).tolist()[:2] == [pimhbm.REPAIRED, NOT_LISTED]
    assert sharded.params["v"].sharding.spec[0] == "x" and bits(sharded) == bits(whole)
    assert bits(sharded.params) == bits(opt.init(params).params)


def test_the_repair_runs_per_shard_with_no_all_gather(mesh, rng):
    """repair of a chunk left by the update, on sharded leaves: each device rebuilds and redoes
    the stash's rows of its own chunks (the program holds no all-gather) and the state equals
    the unsharded run's repair bit for bit."""
    opt = inplace.adamw(1e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    params = {"w": jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16),
              "v": jnp.asarray(rng.standard_normal((512, 32)), jnp.bfloat16)}
    grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.bfloat16) for k, v in params.items()}
    update, repair = steps(opt)
    element = 3 * 128 * 32 + 2 * CHUNK + 9  # the last device's shard of v

    def damaged_report(state, place):
        nu = np.asarray(state.nu["v"]).copy()
        nu.reshape(-1).view(np.uint32)[element] ^= np.uint32(1 << 30)
        state = state._replace(nu=dict(state.nu, v=place(jnp.asarray(nu))))
        return update({k: place(g) for k, g in grads.items()}, state)

    sharded, report = damaged_report(opt.init({k: on(mesh, v, "x", None) for k, v in params.items()}),
                                     lambda a: on(mesh, a, "x", None))
    assert int(report.digest_faults) == 1
    assert np.asarray(report.stash.index)[0].tolist() == [0, element // CHUNK, 8]
    assert gathers(repair.lower(sharded, report).compile().as_text()) == []
    sharded, fixed = repair(sharded, report)
    whole, whole_report = damaged_report(opt.init(params), lambda a: a)
    whole, _ = repair(whole, whole_report)
    assert bool(fixed.complete) and int(fixed.faults) == 0
    assert sharded.nu["v"].sharding.spec[0] == "x" and bits(sharded) == bits(whole)


def test_a_chunk_of_a_shard_is_rebuilt_with_its_chunk_base(rng):
    """The rebuild kernel itself (on this machine's default device): a damaged chunk in rows
    [128, 192) of a tensor, rebuilt from the shard's parity rows with the shard's first chunk
    index, verifies against the whole tensor's digests; with chunk base 0 it does not."""
    from pimhbm.repair import REPAIRED, STILL_DAMAGED
    chunk_bytes = CHUNK * 4
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    table, rows = pimhbm.scan(x, chunk_bytes).digests, parity.parity(x, chunk_bytes, GROUP)
    first = 128 * 64 // CHUNK
    assert first % (GROUP * GROUP) == 0 and 32 % (GROUP * GROUP) == 0  # whole blocks: whole groups
    shard = np.asarray(x[128:192]).copy()
    shard.reshape(-1).view(np.uint32)[5 * CHUNK + 3] ^= np.uint32(1 << 11)

    def rebuild(base):
        call = jax.ffi.ffi_call("pimhbm_parity_rebuild",
                                (jax.ShapeDtypeStruct(shard.shape, shard.dtype),
                                 jax.ShapeDtypeStruct((1,), jnp.int32)),
                                input_output_aliases={1: 0})
        return call(jnp.asarray([5], jnp.int32), jnp.asarray(shard), table[first:first + 32],
                    rows[first // GROUP:(first + 32) // GROUP], jnp.asarray([base], jnp.int32),
                    chunk_bytes=np.int64(chunk_bytes), group=np.int64(GROUP))

    fixed, status = rebuild(first)
    assert int(status[0]) == REPAIRED and bits(fixed) == bits(x[128:192])
    assert int(rebuild(0)[1][0]) == STILL_DAMAGED  # the control: the shard's own numbering
