"""pimhbm.scan / verify (and the tree forms) on the CPU backend, against the NumPy definition."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pimhbm
from conftest import requires_gpu
from digest_ref import chunk_digests, chunk_health

FLOAT_DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16,
                ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
INT_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64]
# Shapes with element counts that are no multiple of anything, 0-d and empty included.
SHAPES = [(), (0,), (1,), (3,), (7, 5), (17,), (33, 3), (1000,), (4097,), (129, 257)]


def random_array(rng, dtype, shape, bad_fraction=0.05):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.integers(0, 2, size=shape)).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True))
    if dtype.itemsize == 1:  # fp8: every bit pattern is fair game
        return np.asarray(rng.integers(0, 256, size=shape, dtype=np.uint8)).view(dtype)
    x = rng.standard_normal(size=shape) * np.exp2(rng.integers(-8, 8, size=shape))
    x = np.array(x, dtype=dtype)
    bad = rng.random(size=shape) < bad_fraction
    specials = np.array([np.nan, np.inf, -np.inf]).astype(dtype)
    x[bad] = specials[rng.integers(0, 3, size=int(bad.sum()))]
    return x


def cpu_device():
    return jax.devices("cpu")[0]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_scan_matches_the_definition(rng, dtype):
    # 64-bit dtypes exist in JAX only in x64 mode; the other dtypes run in the default mode.
    with jax.enable_x64(np.dtype(dtype).itemsize == 8):
        _check_scan_matches_the_definition(rng, dtype)


def _check_scan_matches_the_definition(rng, dtype):
    scan = jax.jit(pimhbm.scan, static_argnames="chunk_bytes")
    for shape in SHAPES:
        x = random_array(rng, dtype, shape)
        for chunk in (16, 48, 4096, pimhbm.DEFAULT_CHUNK_BYTES, 16 * int(rng.integers(1, 300))):
            r = scan(jax.device_put(x, cpu_device()), chunk_bytes=chunk)
            n = pimhbm.num_chunks(x, chunk)
            assert r.digests.shape == (n, 2) and r.digests.dtype == jnp.uint32
            np.testing.assert_array_equal(np.asarray(r.digests), chunk_digests(x.tobytes(), chunk),
                                          err_msg=f"shape {shape} chunk {chunk}")
            if np.dtype(dtype) in map(np.dtype, FLOAT_DTYPES):
                counts, maxima = chunk_health(x, chunk)
                np.testing.assert_array_equal(np.asarray(r.nonfinite), counts)
                np.testing.assert_array_equal(np.asarray(r.max_abs), maxima)
            else:
                assert r.max_abs is None
                assert not np.asarray(r.nonfinite).any()


def test_every_single_bit_flip_is_found_in_its_chunk(rng):
    x = rng.standard_normal(50_001).astype(np.float32)
    chunk = 4096
    table = pimhbm.scan(x, chunk).digests
    raw = x.view(np.uint32).copy()
    for _ in range(40):
        i, bit = int(rng.integers(raw.size)), int(rng.integers(32))
        raw[i] ^= np.uint32(1 << bit)
        mismatch = np.asarray(pimhbm.verify(raw.view(np.float32), table, chunk))
        assert mismatch.nonzero()[0].tolist() == [i * 4 // chunk], (i, bit)
        raw[i] ^= np.uint32(1 << bit)
    assert not np.asarray(pimhbm.verify(raw.view(np.float32), table, chunk)).any()


def test_scan_and_verify_trees_inside_jit(rng):
    tree = {
        "embed": rng.standard_normal((300, 64)).astype(ml_dtypes.bfloat16),
        "layers": [{"w": rng.standard_normal((64, 129)).astype(np.float32),
                    "b": np.zeros(129, np.float32)} for _ in range(3)],
        "step": np.int32(7),
    }
    scans = jax.jit(pimhbm.scan_tree, static_argnames="chunk_bytes")(tree, chunk_bytes=1024)
    assert isinstance(scans["embed"], pimhbm.ScanResult)
    assert jax.tree.structure(jax.tree.map(lambda x: 0, tree)) == jax.tree.structure(
        jax.tree.map(lambda s: 0, scans, is_leaf=lambda s: isinstance(s, pimhbm.ScanResult)))
    clean = jax.jit(pimhbm.verify_tree, static_argnames="chunk_bytes")(tree, scans, chunk_bytes=1024)
    assert not any(np.asarray(m).any() for m in jax.tree.leaves(clean))
    # Damage one element of one leaf: exactly its chunk is flagged, nothing else.
    w = tree["layers"][1]["w"].copy()
    w.reshape(-1)[5000] = np.nextafter(w.reshape(-1)[5000], np.float32(np.inf))
    damaged = dict(tree, layers=[tree["layers"][0], dict(tree["layers"][1], w=w), tree["layers"][2]])
    maps = pimhbm.verify_tree(damaged, scans, chunk_bytes=1024)
    flagged = {path: np.asarray(m).nonzero()[0].tolist()
               for path, m in jax.tree_util.tree_leaves_with_path(maps) if np.asarray(m).any()}
    assert list(flagged.values()) == [[5000 * 4 // 1024]]
    assert "layers" in str(next(iter(flagged)))


def test_verify_tree_accepts_plain_digest_tables(rng):
    tree = [rng.standard_normal(100).astype(np.float32), rng.integers(0, 9, 10).astype(np.int8)]
    tables = [s.digests for s in pimhbm.scan_tree(tree)]
    assert not any(np.asarray(m).any() for m in pimhbm.verify_tree(tree, tables))


@pytest.mark.parametrize("bad", [0, -16, 8, 17, 100])
def test_bad_chunk_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="multiple of 16"):
        pimhbm.scan(np.zeros(4, np.float32), chunk_bytes=bad)


def test_chunks_past_the_digests_word_range_are_refused():
    too_big = pimhbm.MAX_CHUNK_SIZE + 16
    with pytest.raises(ValueError, match=f"at most {too_big - 16}"):
        pimhbm.scan(np.zeros(4, np.float32), chunk_bytes=too_big)
    with pytest.raises(ValueError, match="chunk_elems must be at most"):
        pimhbm.update.adamw(1e-3, chunk_elems=too_big)
    # The moments' fp32 chunks are the widest: 4 bytes an element.
    widest = pimhbm.MAX_CHUNK_SIZE // 4
    assert pimhbm.update.adamw(1e-3, chunk_elems=widest).chunk_bytes(np.float32) == widest * 4
    with pytest.raises(ValueError, match=f"chunk_elems must be at most {widest} "):
        pimhbm.update.adamw(1e-3, chunk_elems=widest + 16)


def test_non_integer_chunk_size_is_refused():
    with pytest.raises(TypeError, match="chunk_bytes must be an int"):
        pimhbm.scan(np.zeros(4, np.float32), chunk_bytes=16.0)


@pytest.mark.parametrize("dtype", [np.complex64, ml_dtypes.int4, ml_dtypes.float8_e4m3fnuz])
def test_unprotected_dtypes_are_refused_at_trace_time(dtype):
    x = jax.ShapeDtypeStruct((8,), dtype)
    with pytest.raises(TypeError, match="does not protect"):
        jax.jit(pimhbm.scan).trace(x)


def test_wrong_digest_tables_are_refused(rng):
    x = rng.standard_normal(10_000).astype(np.float32)
    table = pimhbm.scan(x, 1024).digests
    with pytest.raises(ValueError, match=r"shape \(40, 2\)"):
        pimhbm.verify(x, table[:-1], 1024)
    with pytest.raises(ValueError, match="uint32"):
        pimhbm.verify(x, table.astype(jnp.int32), 1024)
    with pytest.raises(ValueError, match="another chunk_bytes"):
        pimhbm.verify(x, table, 2048)
    with pytest.raises(ValueError, match="structure"):
        pimhbm.verify_tree([x, x], [table], 1024)


def test_the_handler_itself_rejects_bad_input_without_crashing():
    """Bypassing the Python checks must give the handler's error, never a crash: each case
    runs in a child process, on every platform this machine has."""
    script = pathlib.Path(__file__).parents[1] / "scripts" / "diagnose_ffi_errors.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(lines) >= 3 and all("RAISED" in l for l in lines), r.stdout
    assert any("digest table of shape (25, 2)" in l for l in lines)
    assert any("positive multiple of 16, got 60" in l for l in lines)
    assert any("complex64 is not protected" in l for l in lines)
    assert any("chunk_base" in l for l in lines)


@requires_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [np.int8, np.int32], ids=lambda d: np.dtype(d).name)
def test_gpu_digests_equal_cpu_digests(rng, dtype):
    gpu, cpu = jax.devices("gpu")[0], cpu_device()
    scan = jax.jit(pimhbm.scan, static_argnames="chunk_bytes")
    for n, bad in [(0, 0), (1, 0), (5, 0.5), (31, 0), (1000, 0.01), (65_537, 0),
                   (1_000_003, 1e-5), (4_000_037, 0), (4_000_037, 0.05)]:
        x = random_array(rng, dtype, (n,), bad_fraction=bad)
        for chunk in (16, 4096, pimhbm.DEFAULT_CHUNK_BYTES):
            if pimhbm.num_chunks(x, chunk) > 300_000:
                continue
            on_gpu = scan(jax.device_put(x, gpu), chunk_bytes=chunk)
            on_cpu = scan(jax.device_put(x, cpu), chunk_bytes=chunk)
            for a, b in zip(on_gpu, on_cpu):
                if a is not None:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"n={n}")
            mismatch = jax.jit(pimhbm.verify, static_argnames="chunk_bytes")(
                jax.device_put(x, gpu), on_gpu.digests, chunk_bytes=chunk)
            assert not np.asarray(mismatch).any()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_vmap_scans_and_verifies_each_tensor_of_the_batch_on_its_own(rng, dtype):
    chunk = 64
    xs = np.stack([random_array(rng, dtype, (1001,)) for _ in range(3)])
    batched = jax.jit(jax.vmap(lambda x: pimhbm.scan(x, chunk)))(jnp.asarray(xs))
    for b in range(3):
        assert np.array_equal(np.asarray(batched.digests[b]), chunk_digests(xs[b].tobytes(), chunk))
    # One flipped bit in the second tensor: verify of the batch flags that chunk of it alone.
    damaged = np.asarray(pimhbm.faults.flip_bit(jnp.asarray(xs), 1 * 1001 + 500, 3))
    bad = np.asarray(jax.jit(jax.vmap(lambda x, d: pimhbm.verify(x, d, chunk)))(
        jnp.asarray(damaged), batched.digests))
    expected = np.zeros_like(bad)
    expected[1, 500 * np.dtype(dtype).itemsize // chunk] = True
    assert np.array_equal(bad, expected)
