"""Peer-pointer collectives and the one-sided chunk pull, against JAX's own collectives, on the
devices of this process (4 virtual CPU devices in CI; the GPUs under scripts/gpu-check)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import pimhbm
from pull_chain import pull_chain

DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.uint16, np.float64]


def devices_or_skip(n):
    devs = jax.devices()
    if len(devs) < n:
        pytest.skip(f"needs {n} devices of one platform, has {len(devs)}")
    return devs[:n]


def meshes():
    out = []
    n = len(jax.devices())
    if n >= 4:
        out.append(((2, 2), ("dp", "sh")))
        out.append(((4, 1), ("dp", "sh")))
    if n >= 2:
        out.append(((1, 2), ("dp", "sh")))
    return out or pytest.skip("needs 2 or more devices")


def random_array(rng, shape, dtype):
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def spmd(mesh, fn):
    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("axis", ["dp", "sh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_equals_jax_all_gather(rng, axis, dtype):
    for shape, names in meshes():
        mesh = Mesh(np.array(jax.devices()[:shape[0] * shape[1]]).reshape(shape), names)
        n = mesh.devices.size
        # Ragged per-device sizes (not multiples of 16 bytes), a fresh one each run.
        rows = int(rng.integers(1, 40))
        cols = int(rng.integers(1, 9))
        x = jnp.asarray(random_array(rng, (n * rows, cols), dtype))
        ours = spmd(mesh, lambda v: pimhbm.peer.all_gather(v, axis, mesh))(x)
        theirs = spmd(mesh, lambda v: jax.lax.all_gather(v, axis))(x)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint8),
                                      np.asarray(theirs).view(np.uint8))


@pytest.mark.parametrize("axis", ["dp", "sh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_equals_jax_all_to_all(rng, axis, dtype):
    for shape, names in meshes():
        mesh = Mesh(np.array(jax.devices()[:shape[0] * shape[1]]).reshape(shape), names)
        size = mesh.shape[axis]
        n = mesh.devices.size
        block = (int(rng.integers(1, 7)), int(rng.integers(1, 5)))
        x = jnp.asarray(random_array(rng, (n * size, *block), dtype))
        ours = spmd(mesh, lambda v: pimhbm.peer.all_to_all(v, axis, mesh))(x)
        theirs = spmd(mesh, lambda v: jax.lax.all_to_all(v, axis, 0, 0))(x)
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint8),
                                      np.asarray(theirs).view(np.uint8))


def test_repeated_calls_and_two_call_sites_in_one_program(rng):
    devs = devices_or_skip(2)
    mesh = Mesh(np.array(devs), ("dp",))

    def body(v):
        a = pimhbm.peer.all_gather(v, "dp", mesh)
        b = pimhbm.peer.all_gather(v * 2, "dp", mesh, after=a)  # one order on every device
        return a + b

    f = spmd(mesh, body)
    for _ in range(5):
        x = jnp.asarray(rng.standard_normal((len(devs) * 3, 5)).astype(np.float32))
        want = spmd(mesh, lambda v: jax.lax.all_gather(v, "dp") * 3)(x)
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(want))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_pull_repairs_each_devices_chunks_from_the_named_peer(rng, dtype):
    devs = devices_or_skip(2)
    mesh = Mesh(np.array(devs[:4]), ("dp",))
    n = mesh.devices.size
    size = int(rng.integers(1000, 5000))  # a ragged last chunk
    chunk_elems = 256
    cb = chunk_elems * np.dtype(dtype).itemsize
    clean = random_array(rng, (size,), dtype)
    nch = -(-size // chunk_elems)
    table = np.asarray(pimhbm.scan(jnp.asarray(clean), cb).digests)
    # Every device holds the same tensor. Device 1 has damage in its first and last chunks
    # (pulled from device 0), device 0 in chunk 1 (pulled from device 1), device 3 (if any) in
    # the middle chunk; every other device re-pulls the listed chunks (the same bytes again).
    copies = np.stack([clean] * n).copy()
    bad = {1: [0, nch - 1], 0: [1], **({3: [nch // 2]} if n > 3 else {})}
    raw = copies.view({2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize])
    for d, chunks in bad.items():
        for c in chunks:
            i = c * chunk_elems + int(rng.integers(0, min(chunk_elems, size - c * chunk_elems)))
            raw[d, i] ^= 1 << int(rng.integers(0, 8 * np.dtype(dtype).itemsize))
    cap = 6
    lists = np.full((cap,), -1, np.int32)
    srcs = np.zeros((cap,), np.int32)
    listed = [(0, 0), (nch - 1, 0), (1, 1)] + ([(nch // 2, 0)] if n > 3 else [])
    for k, (c, src) in enumerate(listed):
        lists[k], srcs[k] = c, src

    sharded = jax.sharding.NamedSharding(mesh, P("dp"))
    xs = jax.device_put(copies.reshape(n * size), sharded)
    tables = jax.device_put(np.tile(table, (n, 1)), sharded)

    def body(x, t, lists, srcs):
        (x, t), status = pimhbm.peer.pull(lists, srcs, (x, t), cb, "dp", mesh)
        return x, t, status[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp"), P(), P()),
                              out_specs=(P("dp"), P("dp"), P("dp")), check_vma=False))
    x, t, status = f(xs, tables, jnp.asarray(lists), jnp.asarray(srcs))
    status = np.asarray(status)
    x = np.asarray(x).reshape(n, size)
    for d in range(n):
        for k in range(len(listed)):
            want = pimhbm.NOT_LISTED if srcs[k] == d else pimhbm.REPAIRED
            assert status[d, k] == want, (d, k, status)
        assert (status[d, len(listed):] == pimhbm.NOT_LISTED).all()
        np.testing.assert_array_equal(x[d].view(np.uint8), clean.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(t).reshape(n, nch, 2), np.stack([table] * n))

    # A damaged source is never copied: device 0's chunk 1 damaged and named as the source;
    # the last device's own damage there stays as it was.
    raw = np.asarray(x).copy().view(raw.dtype)
    raw[0, chunk_elems + 3] ^= 4
    raw[n - 1, chunk_elems + 3] ^= 8
    xs = jax.device_put(raw.view(dtype).reshape(n * size), sharded)
    lists[:] = -1
    lists[0] = 1
    srcs[:] = 0
    x, t, status = f(xs, t, jnp.asarray(lists), jnp.asarray(srcs))
    status = np.asarray(status)
    assert status[0, 0] == pimhbm.NOT_LISTED
    assert list(status[1:, 0]) == [pimhbm.SOURCE_DAMAGED] * (n - 1)
    assert np.array_equal(np.asarray(x).reshape(n, size)[n - 1].view(raw.dtype), raw[n - 1])


def test_chained_pulls_each_read_the_status_of_the_one_before(rng):
    """A program's pulls run in one order on every device only where each reads a buffer the one
    before it wrote (XLA's CPU runtime orders ops by their buffers alone): `after` makes it so.
    Control: the same chain through an optimization barrier, which orders nothing once
    compiled (the pulls then all read one buffer), is no chain."""
    devs = devices_or_skip(2)
    mesh = Mesh(np.array(devs[:4]), ("dp",))
    n, count = mesh.devices.size, 4
    x = random_array(rng, (count, n * 256), np.float32)
    table = np.stack([np.tile(np.asarray(pimhbm.scan(jnp.asarray(x[k, :256]), 1024).digests), (n, 1))
                      for k in range(count)])

    def body(x, t, ordered):
        after, outs = None, []
        for k in range(count):
            chunks = jnp.zeros((1,), jnp.int32)  # every device re-pulls chunk 0 from device 0
            if ordered:
                (y, _), after = pimhbm.peer.pull(chunks, jnp.zeros(1, jnp.int32), (x[k], t[k]),
                                                 1024, "dp", mesh, after=after)
            else:
                if after is not None:
                    chunks = jax.lax.optimization_barrier((chunks, after))[0]
                (y, _), after = pimhbm.peer.pull(chunks, jnp.zeros(1, jnp.int32), (x[k], t[k]),
                                                 1024, "dp", mesh)
            outs.append(y)
        return jnp.stack(outs)

    spec = P(None, "dp")
    for ordered in (True, False):
        f = jax.jit(jax.shard_map(lambda x, t: body(x, t, ordered), mesh=mesh,
                                  in_specs=(spec, spec), out_specs=spec, check_vma=False))
        hlo = f.lower(x, table).compile().as_text()
        if ordered:
            assert len(pull_chain(hlo)) == count
            same = np.tile(x[:, :256], (1, n))  # device 0's chunk everywhere
            np.testing.assert_array_equal(np.asarray(f(x, table)), same)
        else:
            with pytest.raises(AssertionError, match="follow no other pull"):
                pull_chain(hlo)
    with pytest.raises(Exception, match="at most one `after` operand"):
        f = jax.jit(jax.shard_map(
            lambda x, t: jax.ffi.ffi_call("pimhbm_peer_pull", [
                jax.ShapeDtypeStruct(x[0].shape, x.dtype), jax.ShapeDtypeStruct(t[0].shape, t.dtype),
                jax.ShapeDtypeStruct((1,), jnp.int32)])(
                    jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), x[0], t[0],
                    jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), chunk_bytes=np.int64(1024),
                    **pimhbm.peer._attrs(mesh, "dp", 1000))[0][None],
            mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False))
        jax.block_until_ready(f(x, table))


def test_bad_inputs_raise_clear_errors():
    devs = devices_or_skip(2)
    mesh = Mesh(np.array(devs), ("dp",))
    with pytest.raises(ValueError, match="not one of the mesh's axes"):
        pimhbm.peer.all_gather(jnp.zeros(4), "tp", mesh)
    with pytest.raises(ValueError, match="one block per peer"):
        spmd(mesh, lambda v: pimhbm.peer.all_to_all(v, "dp", mesh))(jnp.zeros((len(devs) * 3, 2)))
    with pytest.raises(ValueError, match="timeout_ms"):
        pimhbm.peer.all_gather(jnp.zeros(4), "dp", mesh, timeout_ms=0)
    with pytest.raises(ValueError, match="differ"):
        pimhbm.peer.pull(jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32),
                         (jnp.zeros(8), jnp.zeros((1, 2), jnp.uint32)), 64, "dp", mesh)
    # A digest table of the wrong length: the handler's error reaches the user.
    f = jax.jit(jax.shard_map(
        lambda x, t: pimhbm.peer.pull(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), (x, t), 64,
                                      "dp", mesh)[1][None],
        mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp"), check_vma=False))
    with pytest.raises(Exception, match="digest table of shape"):
        jax.block_until_ready(f(jnp.zeros(len(devs) * 40), jnp.zeros((len(devs) * 5, 2), jnp.uint32)))
