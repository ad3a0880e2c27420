"""pimhbm.adamw (the guarded fused update) and pimhbm.guard, on the CPU backend."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import pimhbm
from conftest import requires_gpu

LR = 1e-3


def random_params(rng, dtype=np.float32, shapes=((300, 77), (77,), (5, 3, 7), (16384,), (16385,))):
    return {f"t{i}": jnp.asarray(rng.standard_normal(s).astype(dtype)) for i, s in enumerate(shapes)}


def random_grads(rng, params):
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(p.dtype)), params)


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def current_view(state):
    return (state.params, state.master, state.mu, state.nu, state.digests)


def make_step(opt):
    return jax.jit(lambda g, s, lr: opt.update(g, s, lr), donate_argnums=1)


# The bias corrections as a compiled step computes them (XLA's pow inside jit can differ from
# eager pow by an ulp; the update itself must not).
_scalars = jax.jit(lambda count: pimhbm.step_scalars.step_scalars(LR, count, 0.9, 0.999))


def numpy_adamw(g, w, m, v, count, lr=LR, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4):
    """optax.adamw's formulas in NumPy float32, one IEEE-rounded operation at a time; the bias
    corrections applied as products with their reciprocals, as the fused update does."""
    f = np.float32
    with np.errstate(all="ignore"):
        m = f(1 - b1) * g + f(b1) * m
        v = f(1 - b2) * (g * g) + f(b2) * v
        _, bc1, bc2 = np.asarray(_scalars(jnp.int32(count)))  # 1 - b^t by XLA, as in a step
        u = (m * (f(1) / bc1)) / (np.sqrt(v * (f(1) / bc2) + f(0)) + f(eps))
        u = u + f(wd) * w
        w = w + f(-lr) * u
    return w, m, v


def test_fault_free_fp32_is_the_optax_formula_bit_for_bit(rng):
    params = random_params(rng)
    opt = pimhbm.update.adamw(LR)
    state = opt.init(params)
    step = make_step(opt)
    ref = {k: (np.asarray(p), np.zeros(p.shape, np.float32), np.zeros(p.shape, np.float32))
           for k, p in params.items()}
    for i in range(40):
        g = random_grads(rng, params)
        state, report = step(g, state, jnp.float32(LR))
        ref = {k: numpy_adamw(np.asarray(g[k]), *ref[k], count=i + 1) for k in ref}
        assert bool(report.committed) and int(report.digest_faults) == 0
    assert int(state.step) == 40
    for k, (w, m, v) in ref.items():
        assert np.asarray(state.params[k]).tobytes() == w.tobytes(), k
        assert np.asarray(state.mu[k]).tobytes() == m.tobytes(), k
        assert np.asarray(state.nu[k]).tobytes() == v.tobytes(), k


def test_fault_free_fp32_agrees_with_optax(rng):
    """optax under XLA may fuse multiply-adds; agreement is to fp32 rounding. The moments are
    running sums of terms that may cancel: a small sum carries its larger inputs' absolute
    rounding (~1 ulp of 1.0 for mu after 60 steps of unit-scale gradients), hence the atol."""
    params = random_params(rng)
    opt, tx = pimhbm.update.adamw(LR), optax.adamw(LR)
    state, ostate, oparams = opt.init(params), tx.init(params), params
    step = make_step(opt)
    ostep = jax.jit(lambda g, s, p: tx.update(g, s, p))
    for _ in range(60):
        g = random_grads(rng, params)
        state, _ = step(g, state, jnp.float32(LR))
        updates, ostate = ostep(g, ostate, oparams)
        oparams = optax.apply_updates(oparams, updates)
    for k in params:
        np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(oparams[k]),
                                   rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.mu[k]), np.asarray(ostate[0].mu[k]),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.nu[k]), np.asarray(ostate[0].nu[k]),
                                   rtol=1e-5, atol=1e-8)


def test_bf16_with_master_weights_is_the_optax_formula_on_the_master(rng):
    params = random_params(rng, ml_dtypes.bfloat16)
    opt = pimhbm.update.adamw(LR, master_weights=True)
    state = opt.init(params)
    step = make_step(opt)
    ref = {k: (np.asarray(p, np.float32), np.zeros(p.shape, np.float32),
               np.zeros(p.shape, np.float32)) for k, p in params.items()}
    for i in range(30):
        g = random_grads(rng, params)  # bf16 gradients, as the model produces them
        state, report = step(g, state, jnp.float32(LR))
        ref = {k: numpy_adamw(np.asarray(g[k], np.float32), *ref[k], count=i + 1) for k in ref}
        assert bool(report.committed)
    for k, (w, m, v) in ref.items():
        assert state.master[k].dtype == jnp.uint16  # stored as the remainder beside p
        assert np.asarray(state.master_weights[k]).tobytes() == w.tobytes(), k
        assert np.asarray(state.params[k]).tobytes() == bf16_ties_away(w).tobytes(), k
        assert np.asarray(state.mu[k]).tobytes() == m.tobytes(), k
        assert np.asarray(state.nu[k]).tobytes() == v.tobytes(), k


def bf16_ties_away(w):
    """float32 -> bfloat16, to nearest with ties away from zero (finite values)."""
    up = w.view(np.uint32) + np.uint32(0x8000)
    return (up >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)


def test_split_master_is_exact_and_rounds_p_to_nearest_ties_away(rng):
    bits_ = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    # exact ties (lower half 0x8000) with even and odd upper halves, and the edges
    hi = rng.integers(0, 2**16, 4096, dtype=np.uint32)
    edges = np.array([0, 0x80000000, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x00008000,
                      0x3F808000, 0x3F818000], np.uint32)
    bits_ = np.concatenate([bits_, (hi << 16) | 0x8000, edges])
    w = bits_.view(np.float32)
    p, r = jax.jit(pimhbm.split_master)(jnp.asarray(w))
    assert p.dtype == jnp.bfloat16 and r.dtype == jnp.uint16
    back = np.asarray(jax.jit(pimhbm.join_master)(p, r))
    nan = np.isnan(w)
    assert np.isnan(back[nan]).all()
    assert (np.asarray(p)[nan].view(np.uint16) == 0x7FC0).all()
    assert (back[~nan].view(np.uint32) == bits_[~nan]).all()
    # p: round to nearest; it differs from ties-to-even exactly on ties with an even upper half
    pv = np.asarray(p)[~nan].view(np.uint16)
    even = w[~nan].astype(ml_dtypes.bfloat16).view(np.uint16)
    lo, up = bits_[~nan] & 0xFFFF, bits_[~nan] >> 16
    differ = (lo == 0x8000) & (up % 2 == 0)
    assert differ.sum() > 1000
    assert (pv[differ] == (up[differ] + 1).astype(np.uint16)).all()
    assert (pv[~differ] == even[~differ]).all()


def test_digests_of_the_new_state_are_the_scan_digests(rng):
    params = random_params(rng, ml_dtypes.bfloat16)
    opt = pimhbm.update.adamw(LR, master_weights=True, chunk_elems=1024)
    state = make_step(opt)(random_grads(rng, params), opt.init(params), jnp.float32(LR))[0]
    for name in ("params", "master", "mu", "nu"):
        key = {"params": "p"}.get(name, name)
        tables = jax.tree.structure(params).flatten_up_to(state.digests)
        for leaf, d in zip(jax.tree.leaves(getattr(state, name)), tables):
            want = pimhbm.scan(leaf, 1024 * leaf.dtype.itemsize).digests
            np.testing.assert_array_equal(np.asarray(d[key]), np.asarray(want))


@pytest.mark.parametrize("kind", ["fp32", "bf16_master"])
def test_nonfinite_gradients_skip_the_step_bit_exactly(rng, kind):
    dtype = np.float32 if kind == "fp32" else ml_dtypes.bfloat16
    params = random_params(rng, dtype)
    opt = pimhbm.update.adamw(LR, master_weights=kind != "fp32", chunk_elems=256)
    step = make_step(opt)
    state = opt.init(params)
    for _ in range(3):
        state, _ = step(random_grads(rng, params), state, jnp.float32(LR))
    before = bits(current_view(state))
    clean = random_grads(rng, params)
    # NaN / Inf at random positions of random leaves.
    g = dict(clean)
    names = sorted(g)
    poisoned = {}
    for k in range(5):
        name = names[int(rng.integers(len(names)))]
        flat = np.asarray(g[name]).reshape(-1).copy()
        i = int(rng.integers(flat.size))
        flat[i] = [np.nan, np.inf, -np.inf][k % 3]
        g[name] = jnp.asarray(flat.reshape(g[name].shape))
        poisoned.setdefault(name, set()).add(i // 256)
    step_before = int(state.step)
    state, report = step(g, state, jnp.float32(LR))
    assert not bool(report.committed)
    assert int(report.grad_nonfinite) == sum(
        int(np.sum(~np.isfinite(np.asarray(v, np.float32)))) for v in g.values())
    assert int(state.step) == step_before
    assert bits(current_view(state)) == before, "a skipped step changed the state"
    for name, chunks in poisoned.items():
        assert set(np.flatnonzero(np.asarray(report.grad_nonfinite_maps[name]))) == chunks
    # The next clean step is the step that would have come: skipping == never having seen it.
    state, report = step(clean, state, jnp.float32(LR))
    assert bool(report.committed) and int(state.step) == step_before + 1


@pytest.mark.parametrize("lr", [np.nan, np.inf, -np.inf])
def test_a_learning_rate_that_is_not_finite_commits_nothing(rng, lr):
    """The update would write NaN or infinite values everywhere: it holds the step instead,
    and the state stays bit for bit. Control: the same step with a finite rate commits."""
    params = random_params(rng, ml_dtypes.bfloat16)
    opt = pimhbm.update.adamw(LR, master_weights=True, chunk_elems=256)
    step = make_step(opt)
    state, _ = step(random_grads(rng, params), opt.init(params), jnp.float32(LR))
    before = bits(current_view(state))
    g = random_grads(rng, params)
    state, report = step(g, state, jnp.float32(lr))
    assert not bool(report.committed) and int(state.step) == 1
    assert bits(current_view(state)) == before
    state, report = step(g, state, jnp.float32(LR))
    assert bool(report.committed) and int(state.step) == 2


@pytest.mark.parametrize("kind", ["fp32", "bf16", "bf16_master"])
@pytest.mark.parametrize("case", ["eps_0_zero_gradients", "huge_gradient"])
def test_new_values_that_are_not_finite_commit_nothing(rng, case, kind):
    """eps 0 where a moment is 0 (every new value 0 / 0), or a finite gradient whose square
    overflows the second moment: the update counts those elements with the non-finite
    gradient values, and the step commits nothing -- in every layout, over ragged leaves (77,
    105 and 16385 elements: a group's lanes past the end must not count). Control: eps 1e-8, a
    gradient of 1."""
    params = random_params(rng, np.float32 if kind == "fp32" else ml_dtypes.bfloat16)
    zero = case == "eps_0_zero_gradients"
    g = jax.tree.map(jnp.zeros_like, params) if zero else random_grads(rng, params)

    def run(eps, value):
        opt = pimhbm.update.adamw(LR, eps=eps, master_weights=kind == "bf16_master",
                                  chunk_elems=256)
        state = opt.init(params)
        before = bits(current_view(state))
        grads = g if zero else {**g, "t3": g["t3"].at[4097].set(value)}
        state, report = make_step(opt)(grads, state, jnp.float32(LR))
        return state, report, before

    state, report, before = run(0.0 if zero else 1e-8, 1e30)
    assert not bool(report.committed) and int(state.step) == 0
    assert bits(current_view(state)) == before
    assert int(report.grad_nonfinite) == (sum(p.size for p in params.values()) if zero else 1)
    assert np.flatnonzero(np.asarray(report.grad_nonfinite_maps["t3"])).tolist() == (
        list(range(64)) if zero else [16])
    state, report, _ = run(1e-8, 1.0)
    assert bool(report.committed) and int(report.grad_nonfinite) == 0 and int(state.step) == 1


@pytest.mark.parametrize("target,bit", [("params", pimhbm.update.FAULT_PARAM),
                                        ("master", pimhbm.update.FAULT_MASTER),
                                        ("mu", pimhbm.update.FAULT_MU),
                                        ("nu", pimhbm.update.FAULT_NU)])
def test_a_flipped_bit_in_the_state_skips_and_reports_its_chunk(rng, target, bit):
    params = random_params(rng, ml_dtypes.bfloat16)
    chunk = 512
    opt = pimhbm.update.adamw(LR, master_weights=True, chunk_elems=chunk)
    step = make_step(opt)
    state = opt.init(params)
    state, _ = step(random_grads(rng, params), state, jnp.float32(LR))
    # Flip one bit of one element of one tensor of the current slot, outside any update.
    name = sorted(params)[int(rng.integers(len(params)))]
    slot = state.slots[state.current]
    tree = getattr(slot, target)
    leaf = tree[name]
    i, b = int(rng.integers(leaf.size)), int(rng.integers(8 * leaf.dtype.itemsize))
    flipped = pimhbm.faults.flip_bit(leaf, i, b)
    slot = slot._replace(**{target: dict(tree, **{name: flipped})})
    slots = list(state.slots)
    slots[state.current] = slot
    state = pimhbm.update.AdamWState(tuple(slots), state.current, state.step_copies)
    before = bits(current_view(state))
    state, report = step(random_grads(rng, params), state, jnp.float32(LR))
    assert not bool(report.committed)
    assert int(report.digest_faults) == 1
    fmap = {k: np.asarray(v) for k, v in report.fault_maps.items()}
    assert np.flatnonzero(fmap[name]).tolist() == [i // chunk]
    assert fmap[name][i // chunk] == bit
    assert all(not v.any() for k, v in fmap.items() if k != name)
    assert bits(current_view(state)) == before


def test_learning_rate_changes_without_recompiling(rng):
    params = random_params(rng)
    opt = pimhbm.update.adamw(LR)
    step = make_step(opt)
    state = opt.init(params)
    for i in range(6):
        state, _ = step(random_grads(rng, params), state, jnp.float32(LR * (i + 1)))
    assert step._cache_size() == 2  # one program per slot parity, never more


@pytest.mark.parametrize("master", [False, True])
def test_xla_aliases_the_update_in_place_no_hidden_copies(rng, master):
    """The update writes its state through results XLA is asked to alias with the operands
    (the write side, the device copy). Where XLA does not, the handler copies the operand in
    first -- correct, but a whole extra pass over the state. On this backend, in a donated
    step, XLA must alias every one of them: no copies counted."""
    dtype = ml_dtypes.bfloat16 if master else np.float32
    params = random_params(rng, dtype)
    opt = pimhbm.update.adamw(LR, master_weights=master, device_copy=True, chunk_elems=1024)
    step = make_step(opt)
    state = opt.init(params)
    state, _ = step(random_grads(rng, params), state, jnp.float32(LR))  # both parities compiled
    before = pimhbm._core.unaliased_copies()
    for _ in range(4):
        state, report = step(random_grads(rng, params), state, jnp.float32(LR))
    assert bool(report.committed)
    assert pimhbm._core.unaliased_copies() == before


def test_an_unaliased_result_is_copied_in_first_and_counted_under_its_op(rng):
    """An in-place op whose result XLA gives a buffer of its own (here: no aliasing asked for)
    means the same: the handler copies the operand in first, and counts the copy under the op's
    name with its bytes."""
    from pimhbm._ffi import ensure_registered
    ensure_registered()
    n = int(rng.integers(1, 5000))
    src = jnp.asarray(rng.standard_normal(n, np.float32))
    dst = jnp.asarray(rng.standard_normal(n, np.float32))
    restore = jax.jit(lambda commit, s, d: jax.ffi.ffi_call(
        "pimhbm_restore", jax.ShapeDtypeStruct(d.shape, d.dtype))(commit, s, d))
    tally = lambda: pimhbm._core.unaliased_copies_by_op().get(
        "pimhbm.restore", {"results": 0, "bytes": 0, "in_command_buffer": 0})
    before, total_before = tally(), pimhbm._core.unaliased_copies()
    kept = restore(jnp.ones(1, jnp.int32), src, dst)  # committed: the destination as it was
    undone = restore(jnp.zeros(1, jnp.int32), src, dst)  # not committed: the source
    assert np.asarray(kept).tobytes() == np.asarray(dst).tobytes()
    assert np.asarray(undone).tobytes() == np.asarray(src).tobytes()
    after = tally()
    assert after["results"] - before["results"] == 2
    assert after["bytes"] - before["bytes"] == 2 * 4 * n
    assert pimhbm._core.unaliased_copies() - total_before == 2


def test_the_compiled_step_has_no_conditional_and_no_host_transfer(rng):
    params = random_params(rng, ml_dtypes.bfloat16)
    opt = pimhbm.update.adamw(LR, master_weights=True)
    state = opt.init(params)
    grads = random_grads(rng, params)

    def train_step(state, grads):  # the update plus a loss-like use of the parameters
        state, report = opt.update(grads, state)
        return state, report, sum(jnp.sum(p.astype(jnp.float32)) for p in jax.tree.leaves(state.params))

    hlo = jax.jit(train_step, donate_argnums=0).lower(state, grads).compile().as_text()
    assert "pimhbm_adamw" in hlo and "pimhbm_restore" in hlo
    forbidden = re.findall(r"\b(conditional|send|recv|outfeed|infeed|host_callback|"
                           r"xla_python_cpu_callback|xla_ffi_python_cpu_callback)\b", hlo)
    assert forbidden == [], forbidden
    # The state is updated in place: no copy of any non-empty buffer.
    copies = [l for l in hlo.splitlines() if re.search(r"= \S+\[[^\]]*\]\S* copy\(", l)
              and not re.search(r"\[0[,\]]", l)]
    assert copies == [], copies


def test_bad_inputs_raise_clear_errors(rng):
    params = random_params(rng)
    opt = pimhbm.update.adamw(LR)
    state = opt.init(params)
    grads = random_grads(rng, params)
    with pytest.raises(ValueError, match="structure of the parameters"):
        opt.update({"t0": grads["t0"]}, state)
    wrong = dict(grads, t1=grads["t1"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"gradient \['t1'\] is bfloat16"):
        opt.update(wrong, state)
    with pytest.raises(ValueError, match="chunk_elems"):
        pimhbm.update.adamw(LR, chunk_elems=100)
    with pytest.raises(TypeError, match="master weights are for bfloat16"):
        pimhbm.update.adamw(LR, master_weights=True).init(params)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        opt.init({"x": jnp.zeros(4, jnp.int32)})
    with pytest.raises(ValueError, match="does not match"):
        pimhbm.restore_unless(jnp.int32(0), [jnp.zeros(3)], [jnp.zeros(4)])


def test_the_kernels_64_bit_counts_become_int32_counts_that_saturate():
    from pimhbm.update import _counts_of
    words = lambda *counts: jnp.asarray([[c & 0xFFFFFFFF, c >> 32] for c in counts], jnp.uint32)
    imax = np.iinfo(np.int32).max
    assert _counts_of(words(5, 7)).tolist() == [5, 7]
    assert _counts_of(words(imax, imax + 1)).tolist() == [imax, imax]
    assert _counts_of(words(2**32 + 3, 2**32)).tolist() == [imax, imax]  # never wraps to 3 or 0
    assert _counts_of(words(0, 2**63)).tolist() == [0, imax]


def test_the_update_call_is_laid_out_by_the_handlers_own_table():
    """The buffers of a leaf are described once, in C++ (csrc/update/adamw_layout.h); the
    Python front builds its calls from that description."""
    layout = pimhbm.update.adamw_layout()
    rows = layout["leaf"]
    operands = sorted(b["operand"] for b in rows if b["operand"] is not None)
    results = sorted(b["result"] for b in rows if b["result"] is not None)
    assert operands == list(range(layout["leaf_operands"])) and len(operands) == 25
    assert results == list(range(layout["leaf_results"])) and len(results) == 18
    keys = [(b["role"], b["tensor"], b["table"]) for b in rows]
    assert len(set(keys)) == len(keys)
    for b in rows:  # read rows are operands only, reports results only, the rest both
        assert (b["operand"] is None) == (b["role"] == "report")
        assert (b["result"] is None) == (b["role"] == "read")


def test_the_handler_rejects_a_wrong_digest_table():
    """Called around the Python checks: a clear error from the handler, no crash."""
    pimhbm.scan(np.zeros(1, np.float32))
    n = 100
    f = lambda k: jnp.zeros((k,), jnp.float32)
    t = lambda k: jnp.zeros((k, 2), jnp.uint32)
    r = lambda k: jnp.zeros((k,), jnp.uint16)  # master weights' remainders
    args = [f(n), r(0), f(n), f(n), f(n), t(7), t(0), t(1), t(1),
            f(n), r(0), f(n), f(n), t(1), t(0), t(1), t(1),
            f(0), r(0), f(0), f(0), t(0), t(0), t(0), t(0), f(3)]
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[9:25]] + [
        jax.ShapeDtypeStruct((1,), jnp.int32)] * 2
    totals = jax.ShapeDtypeStruct((2, 2), jnp.uint32)
    call = jax.ffi.ffi_call("pimhbm_adamw", outs + [totals])
    attrs = dict(chunk_elems=np.int64(16384), b1=np.float32(0.9), b2=np.float32(0.999),
                 one_minus_b1=np.float32(0.1), one_minus_b2=np.float32(0.001),
                 eps=np.float32(1e-8), eps_root=np.float32(0), weight_decay=np.float32(0))
    with pytest.raises(Exception, match=r"digests of the parameters must be a uint32 digest table of shape \(1, 2\)"):
        jax.block_until_ready(call(args[-1], *args[:-1], **attrs))
    # Several leaves in one call: the faulty one is named.
    good = list(args[:-1])
    good[5] = t(1)
    two = jax.ffi.ffi_call("pimhbm_adamw", outs + outs + [totals])
    with pytest.raises(Exception, match=r"pimhbm.adamw: leaf 1: digests of the parameters"):
        jax.block_until_ready(two(args[-1], *good, *args[:-1], **attrs))
    # Master weights in the old form (a float32 tensor) instead of their uint16 remainders.
    b16 = lambda k: jnp.zeros((k,), jnp.bfloat16)
    old = list(good)
    old[0], old[1], old[4], old[9], old[10] = b16(n), f(n), b16(n), b16(n), f(n)
    old[6] = old[14] = t(1)
    outs16 = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in old[9:25]] + outs[16:]
    with pytest.raises(Exception, match=r"pimhbm.adamw: master must be uint16, got float32"):
        jax.block_until_ready(jax.ffi.ffi_call("pimhbm_adamw", outs16 + [totals])(
            args[-1], *old, **attrs))
    # A call whose buffers do not come in whole leaves.
    with pytest.raises(Exception, match=r"expected 25 arguments and 18 results per leaf"):
        jax.block_until_ready(call(args[-1], *good[:-1], **attrs))
    # A call without the totals, or with totals of the wrong shape.
    with pytest.raises(Exception, match=r"and the totals as the last result; got 25 arguments "
                                        r"and 18 results"):
        jax.block_until_ready(jax.ffi.ffi_call("pimhbm_adamw", outs)(args[-1], *good, **attrs))
    with pytest.raises(Exception, match=r"totals must have 4 elements, got shape \(3,\)"):
        jax.block_until_ready(jax.ffi.ffi_call(
            "pimhbm_adamw", outs + [jax.ShapeDtypeStruct((3,), jnp.uint32)])(args[-1], *good, **attrs))
    with pytest.raises(Exception, match=r"totals must be uint32, got int32"):
        jax.block_until_ready(jax.ffi.ffi_call(
            "pimhbm_adamw", outs + [jax.ShapeDtypeStruct((2, 2), jnp.int32)])(args[-1], *good, **attrs))


def test_guard_skips_nonfinite_and_damaged_state_bit_exactly(rng):
    params = random_params(rng)
    params["t1"] = params["t1"].at[0].set(-0.0)  # -0.0 must survive a skipped step
    tx = pimhbm.guard(optax.adamw(LR))
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, random_grads(rng, params))
    assert bool(state.committed)
    p0, s0 = bits(params), bits(state.inner)
    g = random_grads(rng, params)
    g["t2"] = g["t2"].at[1, 1, 1].set(jnp.nan)
    params, state = step(params, state, g)
    assert not bool(state.committed) and int(state.skipped) == 1
    assert bits(params) == p0 and bits(state.inner) == s0
    # Damage the wrapped optimizer's first moment: the next update is refused.
    mu = state.inner[0].mu
    mu = dict(mu, t0=pimhbm.faults.flip_bit(mu["t0"], 123, 30))
    inner = (state.inner[0]._replace(mu=mu),) + tuple(state.inner[1:])
    state = state._replace(inner=inner)
    p1 = bits(params)
    params, state = step(params, state, random_grads(rng, params))
    assert not bool(state.committed) and int(state.skipped) == 2
    assert bits(params) == p1
    # The damage is still there: the next update is refused too, not applied from digests taken
    # of the damaged state at the skip.
    params, state = step(params, state, random_grads(rng, params))
    assert not bool(state.committed) and int(state.skipped) == 3
    assert bits(params) == p1


@requires_gpu
@pytest.mark.parametrize("kind", ["fp32", "bf16", "bf16_master"])
def test_gpu_update_equals_cpu_update(rng, kind):
    """The CUDA kernel against the CPU, bit for bit. (Its launch variants are compared with it
    in bench/adamw_variants_test.cu.)"""
    dtype = np.float32 if kind == "fp32" else ml_dtypes.bfloat16
    params = random_params(rng, dtype)
    opt = pimhbm.update.adamw(LR, master_weights=kind == "bf16_master", chunk_elems=1024)
    results = {}
    for platform in ("cpu", "gpu"):
        dev = jax.devices(platform)[0]
        with jax.default_device(dev):
            state = opt.init(jax.device_put(params, dev))
            step = make_step(opt)
            grng = np.random.default_rng(7)
            for _ in range(5):
                g = jax.device_put(random_grads(grng, params), dev)
                state, report = step(g, state, jnp.float32(LR))
            results[platform] = bits(current_view(state))
    assert results["cpu"] == results["gpu"]


def test_the_verdict_is_global_across_devices(rng):
    """State sharded over 4 devices (each device updates its own shard, with its own digests):
    a NaN in one device's gradient shard makes every device skip."""
    from jax.sharding import Mesh, PartitionSpec as P
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices")
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("dp",))
    opt = pimhbm.update.adamw(LR, chunk_elems=64)
    params = {"w": jnp.asarray(rng.standard_normal((4 * 1000,)).astype(np.float32))}
    spec = P("dp")

    def state_specs(current):
        return pimhbm.update.AdamWState((spec, spec), current, P())

    init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=spec, out_specs=state_specs(0)))
    state = init(params)

    def make(current):
        def local(g, state):
            state, report = opt.update(g, state, jnp.float32(LR), axis_name="dp")
            return state, report.committed[None], report.grad_nonfinite[None]
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, state_specs(current)),
                                     out_specs=(state_specs(1 - current), spec, spec)),
                       donate_argnums=1)

    steps = {0: make(0), 1: make(1)}
    g = {"w": jnp.asarray(rng.standard_normal((4000,)).astype(np.float32))}
    state, committed, bad = steps[state.current](g, state)
    assert np.asarray(committed).all() and int(state.step) == 1
    before = bits(current_view(state))
    g_bad = np.asarray(g["w"]).copy()
    g_bad[3 * 1000 + int(rng.integers(1000))] = np.nan  # only the last device's shard
    state, committed, bad = steps[state.current]({"w": jnp.asarray(g_bad)}, state)
    assert not np.asarray(committed).any(), "every device must skip"
    assert (np.asarray(bad) == 1).all()
    assert bits(current_view(state)) == before and int(state.step) == 1


def test_restore_clean_puts_back_only_clean_chunks_of_every_tensor_when_not_committed(rng):
    """The device copy's commit-or-skip for several tensors in one call: with commit 0, each tensor's
    chunks whose fault entry is 0 become the source's (data and digest row), the others stay;
    with commit 1 nothing changes."""
    from pimhbm.update import restore_clean
    tensors, expect = [], {0: [], 1: []}
    for dtype, chunk_elems in ((np.float32, 16), (ml_dtypes.bfloat16, 32), (np.float32, 64)):
        n = int(rng.integers(1, 700))
        nchunks = -(-n // chunk_elems)
        src = rng.standard_normal(n).astype(dtype)
        dst = rng.standard_normal(n).astype(dtype)
        src_t = rng.integers(0, 2**32, (nchunks, 2), dtype=np.uint32)
        dst_t = rng.integers(0, 2**32, (nchunks, 2), dtype=np.uint32)
        faults = (rng.random(nchunks) < 0.4).astype(np.int32)
        tensors.append((faults, (src, src_t), (dst, dst_t), chunk_elems * np.dtype(dtype).itemsize))
        want, want_t = dst.copy(), dst_t.copy()
        for c in np.flatnonzero(faults == 0):
            want[c * chunk_elems:(c + 1) * chunk_elems] = src[c * chunk_elems:(c + 1) * chunk_elems]
            want_t[c] = src_t[c]
        expect[0].append((want, want_t))
        expect[1].append((dst, dst_t))
    for commit in (1, 0):
        call = jax.jit(lambda c, ts: restore_clean(c, [(f, s, d, cb) for (f, s, d), cb in
                                                       zip(ts, [t[3] for t in tensors])]))
        got = call(jnp.int32(commit), [(jnp.asarray(f), tuple(map(jnp.asarray, s)),
                                        tuple(map(jnp.asarray, d))) for f, s, d, _ in tensors])
        for (x, xt), (w, wt) in zip(got, expect[commit]):
            assert np.array_equal(np.asarray(x).view(np.uint8), w.view(np.uint8))
            assert np.array_equal(np.asarray(xt), wt)
    # A wrong table in the second tensor is named.
    f, s, d, cb = tensors[1]
    bad = tensors[:1] + [(f, s, (d[0], d[1][:-1]) if len(d[1]) > 1 else (d[0], np.zeros((5, 2), np.uint32)), cb)]
    with pytest.raises(Exception, match=r"pimhbm.restore_clean: tensor 1: "):
        jax.block_until_ready(restore_clean(jnp.int32(0), [
            (jnp.asarray(f), tuple(map(jnp.asarray, s)), tuple(map(jnp.asarray, d)), cb)
            for f, s, d, cb in bad]))


# -- the step counter -------------------------------------------------------------------------------

def _with_step_copies(state, copies):
    return pimhbm.update.AdamWState(state.slots, state.current, jnp.asarray(copies, jnp.int32),
                             state.device_copy)


@pytest.mark.parametrize("copy,bit", [(0, 12), (1, 0), (2, 30), (1, 31)])
def test_a_flipped_bit_of_the_step_counter_changes_nothing(rng, copy, bit):
    """Bit 12 of the counter flipped: the bias corrections would use step 4096 + t. The three
    copies outvote it, and the next update writes all three again."""
    params = random_params(rng, shapes=((33, 7), (129,)))
    grads = [random_grads(rng, params) for _ in range(6)]
    opt = pimhbm.update.adamw(LR)
    step = make_step(opt)

    def run(flip, must_commit=True):
        state = opt.init(params)
        for i, g in enumerate(grads):
            if i == 3 and flip is not None:
                copies = np.asarray(state.step_copies).copy()
                for c in flip:
                    copies[c] ^= np.int32(np.uint32(1 << bit).view(np.int32))
                state = _with_step_copies(state, copies)
            state, report = step(g, state, jnp.float32(LR))
            assert bool(report.committed) or not must_commit
        return state

    clean, flipped = run(None), run([copy])
    assert int(flipped.step) == 6 and np.asarray(flipped.step_copies).tolist() == [6, 6, 6]
    assert bits(current_view(flipped)) == bits(current_view(clean))
    # Positive control: the same bit flipped in two copies is believed, and the run differs
    # (bit 31 makes the step negative: its bias corrections are not finite, and every later
    # step is held).
    twice = run([copy, (copy + 1) % 3], must_commit=False)
    assert int(twice.step) != 6 and bits(current_view(twice)) != bits(current_view(clean))


@pytest.mark.parametrize("api", ["optax.chain", "as_transformation"])
def test_used_as_an_optax_transformation_it_says_what_to_use_instead(rng, api):
    params = random_params(rng)
    opt = pimhbm.update.adamw(LR)
    tx = optax.chain(optax.clip_by_global_norm(1.0), opt) if api == "optax.chain" else opt
    state = tx.init(params)  # construction and init cannot tell
    with pytest.raises(TypeError, match="not an optax GradientTransformation.*pimhbm.guard"):
        tx.update(random_grads(rng, params), state, params)


def test_a_gradient_transformation_runs_first_in_the_same_step(rng):
    """adamw(gradient_transform=optax.clip_by_global_norm(c)) is optax.chain(clip, adamw): the
    same state as the update fed the clipped gradients (to float tolerance: the norm's
    reduction runs in another program), and not the unclipped ones (the clip bites)."""
    clip = optax.clip_by_global_norm(0.5)
    params = random_params(rng)
    grads = [random_grads(rng, params) for _ in range(3)]
    clipped = [jax.jit(lambda g: clip.update(g, clip.init(g), None)[0])(g) for g in grads]

    def run(opt, gs):
        state, step = opt.init(params), make_step(opt)
        for g in gs:
            state, report = step(g, state, jnp.float32(LR))
            assert bool(report.committed)
        return state

    state = run(pimhbm.update.adamw(LR, gradient_transform=clip), grads)
    want = run(pimhbm.update.adamw(LR), clipped)
    unclipped = run(pimhbm.update.adamw(LR), grads)
    for k in params:
        np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(want.params[k]),
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(state.mu[k]), np.asarray(want.mu[k]), rtol=1e-5,
                                   atol=1e-8)
        assert np.abs(np.asarray(state.mu[k])).sum() < 0.9 * np.abs(np.asarray(unclipped.mu[k])).sum()
    with pytest.raises(ValueError, match="state of its own"):
        pimhbm.update.adamw(LR, gradient_transform=optax.scale_by_adam()).init(params)
    with pytest.raises(TypeError, match="GradientTransformation"):
        pimhbm.update.adamw(LR, gradient_transform=lambda g: g)
