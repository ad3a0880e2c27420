"""pimhbm.inplace: the in-place guarded update, its parity, its stash and its repair (CPU; the
GPU against the CPU where there is one)."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import pimhbm
from conftest import requires_gpu
from pimhbm import inplace, parity
from pimhbm.update import FAULT_PARAM
from test_update import numpy_adamw

LR = 1e-3
KINDS = ["fp32", "bf16", "bf16_master"]


def random_params(rng, dtype, shapes=((300, 77), (77,), (5, 3, 7), (4096,), (4097,), (1,), (513,))):
    return {f"t{i}": jnp.asarray(rng.standard_normal(s).astype(dtype)) for i, s in enumerate(shapes)}


def random_grads(rng, params):
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(p.dtype)), params)


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def make(kind, **kw):
    kw.setdefault("chunk_elems", 128)
    kw.setdefault("group", 4)
    opt = inplace.adamw(LR, master_weights=kind == "bf16_master", **kw)
    return opt, (np.float32 if kind == "fp32" else ml_dtypes.bfloat16)


def random_spot(rng, params, chunk_elems):
    """A random leaf, an element of it, and another element of the same chunk: faults anywhere,
    the ragged last chunks and one-element leaves included."""
    leaf = str(rng.choice(sorted(params)))
    n = int(params[leaf].size)
    at = int(rng.integers(n))
    start = at - at % chunk_elems
    return leaf, at, int(rng.integers(start, min(start + chunk_elems, n)))


def poisoned(grads, leaf, at):
    """The gradients with a NaN at flat element ``at`` of ``leaf``."""
    g = grads[leaf]
    return {**grads, leaf: g.reshape(-1).at[at].set(jnp.nan).reshape(g.shape)}


def steps_of(opt):
    return (jax.jit(opt.update, donate_argnums=1), jax.jit(opt.repair, donate_argnums=0))


FIELD = {"p": "params", "master": "master", "mu": "mu", "nu": "nu"}


def flip(state, tensor, leaf, index, bit):
    """The state with one bit of one element flipped (a copy: the state is donated later)."""
    tree = dict(getattr(state, FIELD[tensor]))
    x = np.asarray(tree[leaf]).copy()
    words = x.view(np.dtype(f"u{x.dtype.itemsize}")).reshape(-1)
    words[index % words.size] ^= np.array(1 << (bit % (8 * x.dtype.itemsize))).astype(words.dtype)
    tree[leaf] = jnp.asarray(x)
    return state._replace(**{FIELD[tensor]: tree})


def flip_row(state, leaf, tensor, row, bit):
    """The state with one bit of a parity row flipped (a copy)."""
    rows = {k: dict(v) for k, v in state.parity.items()}
    x = np.asarray(rows[leaf][tensor]).copy()
    x.reshape(-1)[row * x.shape[1] + bit // 32 % x.shape[1]] ^= np.uint32(1 << (bit % 32))
    rows[leaf][tensor] = jnp.asarray(x)
    return state._replace(parity=rows)


def run(opt, params, grads, damage=None, at=1):
    """The state after one update per gradient tree; ``damage`` (state -> state) before update
    ``at``; left chunks repaired. Returns the state and the reports."""
    update, repair = steps_of(opt)
    state, reports = opt.init(params), []
    for i, g in enumerate(grads):
        if damage is not None and i == at:
            state = damage(state)
        state, report = update(g, state)
        reports.append(report)
        if bool(report.applied) and int(report.digest_faults):
            state, fixed = repair(state, report)
            reports.append(fixed)
    return state, reports


@pytest.mark.parametrize("kind", KINDS)
def test_fault_free_updates_agree_with_the_optax_formula(rng, kind):
    opt, dtype = make(kind)
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    state, reports = run(opt, params, grads)
    assert all(bool(r.committed) and int(r.digest_faults) == 0 for r in reports)
    assert int(state.step) == 3
    w = {k: np.asarray(v, np.float32) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v_ = {k: np.zeros_like(x) for k, x in w.items()}
    for t, g in enumerate(grads, 1):
        for k in w:
            w[k], m[k], v_[k] = numpy_adamw(np.asarray(g[k], np.float32), w[k], m[k], v_[k], t)
    got = state.master_weights if kind == "bf16_master" else state.params
    for k in w:
        if kind == "bf16":  # the update rounds w to bf16 every step; the formula does not
            np.testing.assert_allclose(np.asarray(got[k], np.float32), w[k], rtol=2e-2, atol=2e-3)
        else:
            assert np.asarray(got[k], np.float32).tobytes() == w[k].tobytes(), k
        assert np.asarray(state.mu[k]).tobytes() == m[k].tobytes() or kind == "bf16"


@pytest.mark.parametrize("kind", KINDS)
def test_the_parity_and_digests_the_update_keeps_are_those_made_from_scratch(rng, kind):
    opt, dtype = make(kind, group=int(rng.integers(1, 6)))
    params = random_params(rng, dtype)
    state, _ = run(opt, params, [random_grads(rng, params) for _ in range(2)])
    for k in params:
        for t in inplace.TENSORS:
            x = getattr(state, FIELD[t])
            if x is None:
                continue
            cb = opt.chunk_bytes(t, params[k].dtype)
            assert bits(parity.parity(x[k], cb, opt.group)) == bits(state.parity[k][t]), (k, t)
            assert bits(pimhbm.scan(x[k], cb).digests) == bits(state.digests[k][t]), (k, t)


@pytest.mark.parametrize("chunks,group", [(1, 4), (37, 4), (16 * 3 + 5, 4), (40, 3), (9, 1)])
def test_chunk_groups_is_the_deal_of_the_parity_kernel(chunks, group):
    """A tensor with one chunk set has parity only in that chunk's group row: the row of each
    chunk, as the kernel deals them, is what chunk_groups says; neighbours of a block apart."""
    chunk_bytes = 16
    one_hot = np.zeros((chunks, chunks * chunk_bytes), np.uint8)
    for c in range(chunks):
        one_hot[c, c * chunk_bytes] = 1
    rows = np.asarray(jax.vmap(lambda x: parity.parity(x, chunk_bytes, group))(jnp.asarray(one_hot)))
    kernel = [int(np.flatnonzero(rows[c].any(axis=1))[0]) for c in range(chunks)]
    assert all(np.count_nonzero(rows[c].any(axis=1)) == 1 for c in range(chunks))
    assert kernel == parity.chunk_groups(chunks, group).tolist()
    if chunks > group > 1:
        assert kernel[0] != kernel[1]


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_writes_damaged_parity_rows_anew_unless_their_group_left_a_chunk(rng, kind):
    """Rows of a group whose chunks all commit are the XOR of the new chunks, whatever they held;
    rows of a group with a chunk left keep their damage (they were folded with the changes),
    until the next update that commits all of it."""
    opt, dtype = make(kind, group=2)
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    clean, _ = run(opt, params, grads)
    update, repair = steps_of(opt)
    state, _ = update(grads[0], opt.init(params))
    ce = opt.chunk_elems
    # t0 (300 x 77): group 0's p and nu rows damaged; group 1's nu row too, and a chunk of it
    state = flip_row(flip_row(flip_row(state, "t0", "p", 0, 33), "t0", "nu", 0, 7), "t0", "nu", 1, 100)
    in_group_1 = int(np.flatnonzero(parity.chunk_groups(-(-300 * 77 // ce), opt.group) == 1)[0])
    state = flip(state, "mu", "t0", in_group_1 * ce + 5, 9)
    fresh = lambda st, t: np.asarray(parity.parity(getattr(st, FIELD[t])["t0"],
                                                   opt.chunk_bytes(t, dtype), opt.group))
    assert not np.array_equal(fresh(state, "nu"), np.asarray(state.parity["t0"]["nu"]))
    state, report = update(grads[1], state)
    assert int(report.digest_faults) == 1
    for t in ("p", "nu"):
        rows, want = np.asarray(state.parity["t0"][t]), fresh(state, t)
        assert np.array_equal(rows[0], want[0]), t  # written anew
        assert np.array_equal(rows[2:], want[2:]), t
    assert not np.array_equal(np.asarray(state.parity["t0"]["nu"])[1], fresh(state, "nu")[1])
    state, fixed = repair(state, report)  # mu rebuilds from its row, which was not damaged
    assert bool(fixed.complete)
    state, _ = update(grads[2], state)
    assert bits(state) == bits(clean)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tensor", ["mu", "nu", "master", "p_after_backward"])
def test_a_damaged_chunk_is_rebuilt_from_its_group_and_its_update_redone(rng, kind, tensor,
                                                                        monkeypatch):
    """Damage the update finds (a moment, a master weight, or a parameter damaged after the
    backward pass read it) leaves its chunk; repair rebuilds it from the parity and redoes its
    update from the stash: bit-identical to the run without the fault, no replay."""
    if tensor == "master" and kind != "bf16_master":
        pytest.skip("no master weights")
    opt, dtype = make(kind)
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    clean, _ = run(opt, params, grads)
    leaf = f"t{int(rng.integers(0, len(params)))}"
    index, bit = int(rng.integers(0, 1 << 20)), int(rng.integers(0, 32))
    name = "p" if tensor == "p_after_backward" else tensor
    update, repair = steps_of(opt)
    state = opt.init(params)
    state, _ = update(grads[0], state)
    state = flip(state, name, leaf, index, bit)
    if tensor == "p_after_backward":
        # Damage after the check the update makes before writing (the parameters as the
        # backward pass read them) is what the kernel finds: the check is made to see it intact.
        seeing = inplace.prechecks

        def blind(params, tables, grads, chunk_elems):
            damaged, nonfinite, counts = seeing(params, tables, grads, chunk_elems)
            return inplace.Prechecks([jnp.zeros_like(d) for d in damaged], nonfinite,
                                     counts.at[0].set(0))
        monkeypatch.setattr(inplace, "prechecks", blind)
        update, repair = steps_of(opt)
    state, report = update(grads[1], state)
    assert bool(report.applied) and int(report.digest_faults) == 1
    chunk = (index % params[leaf].size) // opt.chunk_elems
    leaf_i = sorted(params).index(leaf)
    bit_of = {"p": 1, "master": 2, "mu": 4, "nu": 8}[name]
    assert np.asarray(report.stash.index)[0].tolist() == [leaf_i, chunk, bit_of]
    assert int(np.asarray(report.fault_maps[leaf])[chunk]) == bit_of
    state, fixed = repair(state, report)
    assert bool(fixed.complete) and int(fixed.faults) == 0
    state, _ = update(grads[2], state)
    assert bits(state) == bits(clean)


@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_damaged_before_the_update_cancels_the_step_and_is_rebuilt(rng, kind):
    """A parameter chunk that fails its digest when the step starts may have reached the
    gradients: nothing is written; ``repair`` with the step's report rebuilds it from the
    parity, and the step is replayed."""
    opt, dtype = make(kind)
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    clean, _ = run(opt, params, grads)
    update, repair = steps_of(opt)
    state = opt.init(params)
    state, _ = update(grads[0], state)
    leaf, index = "t0", int(rng.integers(0, params["t0"].size))
    damaged = flip(state, "p", leaf, index, int(rng.integers(0, 16)))
    before = bits(damaged)
    state, report = update(grads[1], damaged)
    assert not bool(report.applied) and int(report.digest_faults) == 1
    assert bits(state) == before  # nothing written, the count unchanged
    # The skipped step's fault maps (written by the update call from its checks' map): the
    # damaged chunk's parameter bit, nothing else anywhere.
    chunk = index // opt.chunk_elems
    for k, m in report.fault_maps.items():
        m = np.asarray(m)
        assert m.tolist() == [FAULT_PARAM if (k, c) == (leaf, chunk) else 0 for c in range(m.size)]
    state, fixed = repair(state, report)
    assert bool(fixed.complete)
    status = np.asarray(fixed.params_rebuilt[leaf])
    assert status[0] == pimhbm.REPAIRED and not status[1:].any()  # the one chunk, then none
    assert all(not np.asarray(s).any() for k, s in fixed.params_rebuilt.items() if k != leaf)
    assert bits(state.params[leaf]) == bits(clean_after_one(opt, params, grads)[leaf]), chunk
    for g in grads[1:]:
        state, report = update(g, state)
        assert bool(report.committed)
    assert bits(state) == bits(clean)


def clean_after_one(opt, params, grads):
    """The parameters after the first update of a run without faults."""
    state, _ = jax.jit(opt.update)(grads[0], opt.init(params))
    return state.params


def test_more_damaged_parameters_than_repair_lists_is_not_complete(rng):
    """Parameter chunks past ``stash_capacity`` in one leaf are not rebuilt: ``complete`` says
    so (the next source: a replica or a checkpoint)."""
    opt, _ = make("fp32", group=4, stash_capacity=2)
    ce = opt.chunk_elems
    params = {"w": jnp.asarray(rng.standard_normal(ce * 64).astype(np.float32))}
    update, repair = steps_of(opt)
    state = opt.init(params)
    for c in (0, 1, 2):  # three neighbours: three groups
        state = flip(state, "p", "w", c * ce + 5, 7)
    state, report = update(random_grads(rng, params), state)
    assert not bool(report.applied) and int(report.digest_faults) == 3
    state, fixed = repair(state, report)
    assert not bool(fixed.complete)
    assert np.asarray(fixed.params_rebuilt["w"]).tolist() == [pimhbm.REPAIRED] * 2


def test_two_damaged_chunks_of_one_group_go_to_the_next_source(rng):
    """Two chunks of a group damaged in the same tensor cannot be rebuilt from its parity (the
    repair says so: the next source); in different tensors, or in different groups -- a chunk
    and its neighbour among them -- they are."""
    opt, dtype = make("fp32", group=4)
    ce = opt.chunk_elems
    params = {"w": jnp.asarray(rng.standard_normal(ce * 8).astype(np.float32))}
    grads = [random_grads(rng, params) for _ in range(2)]
    clean, _ = run(opt, params, grads)
    update, repair = steps_of(opt)
    groups = parity.chunk_groups(8, opt.group)
    partner = int(np.flatnonzero(groups == groups[0])[1])  # chunk 0's group's next chunk
    assert groups[1] != groups[0]
    for (t1, t2), second, complete in ((("mu", "mu"), partner * ce + 7, False),
                                       (("mu", "nu"), partner * ce + 7, True),
                                       (("nu", "nu"), ce + 7, True)):
        state = opt.init(params)
        state, _ = update(grads[0], state)
        state = flip(flip(state, t1, "w", 5, 3), t2, "w", second, 30)
        state, report = update(grads[1], state)
        assert bool(report.applied) and int(report.digest_faults) == 2
        state, fixed = repair(state, report)
        assert bool(fixed.complete) == complete, (t1, t2, second)
        if complete:
            assert bits(state) == bits(clean)
        else:
            mu = np.asarray(fixed.rebuilt["w"])[:2, 2]  # the two stash rows
            assert set(mu.tolist()) == {parity.GROUP_CONFLICT}


def test_more_left_chunks_than_the_stash_holds_is_not_complete(rng):
    opt, _ = make("fp32", group=2, stash_capacity=2)
    ce = opt.chunk_elems
    params = {"w": jnp.asarray(rng.standard_normal(ce * 12).astype(np.float32))}
    update, repair = steps_of(opt)
    state = opt.init(params)
    for c in (0, 2, 4):  # three groups
        state = flip(state, "mu", "w", ce * c * 2, 5)
    state, report = update(random_grads(rng, params), state)
    assert int(report.stashed) == 3 and int(report.digest_faults) == 3
    state, fixed = repair(state, report)
    assert not bool(fixed.complete)


def per_chunk(flags, chunk_elems):
    n = flags.size
    padded = np.pad(flags.reshape(-1), (0, -n % chunk_elems))
    return padded.reshape(-1, chunk_elems).sum(axis=1, dtype=np.int32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_the_prechecks_are_verify_and_the_squares_of_the_gradients(rng, dtype):
    """One pass over p and g against its definition: pimhbm.verify of p's chunks, and NumPy's
    float32 g * g counted per chunk where not finite -- on ragged sizes, with bits of p flipped
    and NaN, infinite and huge gradient values (|g| of 2e19: its square overflows; 1e19: not)."""
    chunk = int(rng.choice([128, 256, 512]))
    # (4104,): a short last chunk of whole 16-byte vectors (the kernel's batched path).
    params = random_params(rng, dtype, shapes=((300, 77), (77,), (5, 3, 7), (4097,), (1,), (513,),
                                               (0,), (4104,)))
    state = inplace.adamw(LR, chunk_elems=chunk).init(params)
    grads = random_grads(rng, params)
    ps = {k: np.asarray(v).copy() for k, v in params.items()}
    gs = {k: np.asarray(v).copy() for k, v in grads.items()}
    for k in ps:
        for _ in range(int(rng.integers(1, 3))) if ps[k].size else ():
            words = ps[k].view(np.dtype(f"u{ps[k].itemsize}")).reshape(-1)
            words[rng.integers(words.size)] ^= np.array(1 << int(rng.integers(8 * ps[k].itemsize))).astype(words.dtype)
        flat = gs[k].reshape(-1)
        values = [np.nan, np.inf, -np.inf, 2e19, -2e19, 1e19][:flat.size]
        flat[rng.choice(flat.size, len(values), replace=False)] = values
    keys = sorted(ps)
    tables = [state.digests[k]["p"] for k in keys]
    damaged, nonfinite, counts = jax.jit(lambda p, t, g: inplace.prechecks(p, t, g, chunk))(
        [jnp.asarray(ps[k]) for k in keys], tables, [jnp.asarray(gs[k]) for k in keys])
    for k, table, d, b in zip(keys, tables, damaged, nonfinite):
        want = pimhbm.verify(jnp.asarray(ps[k]), table, chunk * ps[k].itemsize)
        assert np.asarray(d).tolist() == np.asarray(want).astype(np.int32).tolist(), k
        g32 = gs[k].astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite(g32 * g32)
        assert np.asarray(b).tolist() == per_chunk(bad, chunk).tolist(), k
    assert sum(int(np.sum(b)) for b in nonfinite) == sum(min(5, ps[k].size) for k in keys)
    assert sum(int(np.sum(d)) for d in damaged) > 0  # the flips were found
    # The call's totals are the maps' sums (the verdict reads only them).
    assert np.asarray(counts).tolist() == [sum(int(np.sum(d)) for d in damaged),
                                           sum(int(np.sum(b)) for b in nonfinite)]


def test_the_prechecks_refuse_a_table_of_another_chunk_size():
    p = jnp.zeros((1000,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"digest table of p must be uint32 of shape \(8, 2\)"):
        inplace.prechecks([p], [jnp.zeros((4, 2), jnp.uint32)], [p], 128)
    with pytest.raises(ValueError, match="the gradient must have the parameters' dtype"):
        inplace.prechecks([p], [jnp.zeros((8, 2), jnp.uint32)], [p.astype(jnp.float32)], 128)


@pytest.mark.parametrize("case", ["lr_nan", "lr_inf", "schedule_nan", "huge_gradient", "gate"])
def test_a_step_that_would_write_non_finite_values_commits_nothing(rng, case):
    opt, dtype = make("bf16_master")
    if case == "schedule_nan":
        opt = inplace.adamw(lambda count: jnp.where(count > 1, jnp.nan, LR), master_weights=True,
                            chunk_elems=256, group=4)
    params = random_params(rng, dtype)
    state = opt.init(params)
    update = jax.jit(opt.update, donate_argnums=1, static_argnames=())
    state, _ = update(random_grads(rng, params), state)
    before = bits(state)
    grads = random_grads(rng, params)
    lr, gate = None, None
    if case == "lr_nan":
        lr = jnp.float32(np.nan)
    elif case == "lr_inf":
        lr = jnp.float32(np.inf)
    elif case == "huge_gradient":  # finite in bf16, but its square overflows the second moment
        grads = {**grads, "t0": grads["t0"].at[3, 4].set(jnp.bfloat16(1e30))}
    elif case == "gate":
        gate = jnp.bool_(False)
    state, report = jax.jit(lambda g, s: opt.update(g, s, lr, gate=gate), donate_argnums=1)(grads, state)
    assert not bool(report.applied) and not bool(report.committed)
    assert bits(state) == before
    # Nothing ran, so nothing is reported per chunk either (the kernel writes the zeros).
    assert int(report.kept) == 0 and int(report.digest_faults) == 0
    assert not any(np.asarray(m).any() for m in jax.tree.leaves(report.fault_maps))


def test_eps_zero_with_zero_gradients_commits_nothing(rng):
    """0 / (sqrt(0) + 0): every element's update is NaN, so every element keeps its value."""
    opt = inplace.adamw(LR, eps=0.0, chunk_elems=256, group=4)
    params = random_params(rng, np.float32)
    state = opt.init(params)
    before = bits(state)
    zeros = jax.tree.map(jnp.zeros_like, params)
    state, report = jax.jit(opt.update, donate_argnums=1)(zeros, state)
    assert bool(report.applied) and not bool(report.committed)
    assert int(report.kept) == sum(p.size for p in params.values())
    assert bits(state) == before and int(state.step) == 0


def test_prechecks_without_gradients_read_p_alone(rng):
    """grads None: the same damaged maps as with the gradients, every nonfinite count 0 (the
    gradients hold NaN and infinities, which a check of them would count)."""
    chunk = int(rng.choice([128, 256, 512]))
    params = random_params(rng, ml_dtypes.bfloat16, shapes=((300, 77), (4097,), (1,), (0,)))
    state = inplace.adamw(LR, chunk_elems=chunk).init(params)
    keys = sorted(params)
    ps = [np.asarray(params[k]).copy() for k in keys]
    ps[0].view(np.uint16).reshape(-1)[int(rng.integers(ps[0].size))] ^= np.uint16(1 << 3)
    gs = [np.full(p.shape, np.nan, p.dtype) for p in ps]
    tables = [state.digests[k]["p"] for k in keys]
    call = jax.jit(lambda p, t, g: inplace.prechecks(p, t, g, chunk))
    with_g = call([jnp.asarray(p) for p in ps], tables, [jnp.asarray(g) for g in gs])
    alone = jax.jit(lambda p, t: inplace.prechecks(p, t, None, chunk))(
        [jnp.asarray(p) for p in ps], tables)
    assert [np.asarray(d).tolist() for d in alone.damaged] == \
        [np.asarray(d).tolist() for d in with_g.damaged]
    assert int(with_g.counts[0]) == 1 and int(with_g.counts[1]) == sum(p.size for p in ps)
    assert np.asarray(alone.counts).tolist() == [1, 0]
    assert not any(np.asarray(b).any() for b in alone.nonfinite)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_checked_in_the_update_apply_the_step_in_part(rng, kind):
    """GradientChecks.IN_UPDATE: a NaN gradient value does not cancel the step before its
    writes; the update keeps that element (and only it), reports it where the checks would
    have, and the step does not commit. The control, BEFORE_WRITES, writes nothing."""
    params = random_params(rng, make(kind)[1])
    grads = random_grads(rng, params)
    leaf, at = "t0", (int(rng.integers(300)), int(rng.integers(77)))
    grads = {**grads, leaf: grads[leaf].at[at].set(jnp.nan)}
    for checks in inplace.GradientChecks:
        opt, _ = make(kind, gradient_checks=checks)
        state = opt.init(params)
        before = {k: np.asarray(v).copy() for k, v in state.mu.items()}
        state, report = jax.jit(opt.update, donate_argnums=1)(grads, state)
        assert not bool(report.committed) and int(report.grad_nonfinite) == 1, checks
        nonfinite = np.asarray(report.grad_nonfinite_maps[leaf])
        assert nonfinite.sum() == 1 and nonfinite[(at[0] * 77 + at[1]) // opt.chunk_elems] == 1
        after = {k: np.asarray(v) for k, v in state.mu.items()}
        if checks is inplace.GradientChecks.BEFORE_WRITES:
            assert not bool(report.applied)
            assert all(after[k].tobytes() == before[k].tobytes() for k in before)
            continue
        assert bool(report.applied) and int(report.kept) == 1
        changed = after[leaf] != before[leaf]
        assert not changed[at] and changed.sum() > changed.size // 2
        # What was written verifies: the state is whole, a step behind in one element.
        for k in after:
            for name, x in (("p", state.params[k]), ("mu", state.mu[k])):
                bad = pimhbm.verify(x, state.digests[k][name], opt.chunk_bytes(name, x.dtype))
                assert not np.asarray(bad).any(), (k, name)


def test_a_redo_from_a_non_finite_stashed_gradient_is_not_complete(rng):
    """IN_UPDATE: a chunk whose moment is damaged is left for the redo with its gradient, which
    nothing checked; a NaN there makes the redo keep that element, so the repair is not complete
    (the next source takes the chunk). The control: the same chunk with a finite gradient."""
    opt, dtype = make("bf16_master", gradient_checks=inplace.GradientChecks.IN_UPDATE)
    params = random_params(rng, dtype)
    update, repair = steps_of(opt)
    leaf, at, nan_at = random_spot(rng, params, opt.chunk_elems)
    for nan in (True, False):
        state = flip(opt.init(params), "mu", leaf, at, int(rng.integers(32)))
        grads = random_grads(rng, params)
        if nan:
            grads = poisoned(grads, leaf, nan_at)
        state, report = update(grads, state)
        assert bool(report.applied) and int(report.digest_faults) == 1 and int(report.stashed) == 1
        state, fixed = repair(state, report)
        assert bool(fixed.complete) is not nan, (leaf, at, nan_at)


def test_gradient_checks_must_be_the_enum():
    with pytest.raises(TypeError, match="GradientChecks"):
        inplace.adamw(LR, gradient_checks="in the update")


BF16_MAX = 0x7F7F  # the largest finite bf16, as bits
GROW = 2.0 ** 119  # takes a master weight of BF16_MAX's value up 0x8000 ulps: to bits 0x7F7F8000


def near_limit(rng, shape=(9, 300)):
    """bf16 parameters, some of them +-BF16_MAX, and gradients of magnitude one: each extreme
    element in row 0 grows (its gradient against its sign), in row 1 shrinks."""
    p = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    g = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    sign = rng.choice([-1, 1], size=(2, shape[1]))
    p.view(np.uint16)[:2] = np.where(sign > 0, BF16_MAX, 0x8000 | BF16_MAX)
    g[:2] = np.where(np.array([[-1], [1]]) * sign > 0, 1.0, -1.0).astype(ml_dtypes.bfloat16)
    return {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}


@pytest.mark.parametrize("ulps_short", [0, 1])
def test_a_master_weight_is_kept_exactly_where_its_new_parameter_would_overflow(rng, ulps_short):
    """An update that takes |w| from the largest bf16 up by 2^119 lands on bits 0x7F7F8000, whose
    split parameter is the infinity: those elements keep their values; by 2^104 less it lands on
    0x7F7F7FFF (parameter BF16_MAX, remainder 0xFFFF) and is written. Everything else updates."""
    params, grads = near_limit(rng)
    opt = inplace.adamw(GROW - ulps_short * 2.0 ** 104, weight_decay=0.0, master_weights=True,
                        chunk_elems=256, group=4)
    state = opt.init(params)
    old_p, old_r = np.asarray(state.params["w"]).view(np.uint16), np.asarray(state.master["w"])
    state, report = jax.jit(opt.update, donate_argnums=1)(grads, state)
    p, r = np.asarray(state.params["w"]).view(np.uint16), np.asarray(state.master["w"])
    grown = p[0] & 0x7FFF, r[0]
    if ulps_short == 0:
        assert int(report.kept) == p.shape[1] and not bool(report.committed)
        assert (p[0] == old_p[0]).all() and (r[0] == old_r[0]).all()
    else:
        assert int(report.kept) == 0 and bool(report.committed)
        assert (grown[0] == BF16_MAX).all() and (grown[1] == 0xFFFF).all()
    assert (p[2:] != old_p[2:]).all() and (r[1] != old_r[1]).all()
    assert np.isfinite(np.asarray(state.master_weights["w"], np.float32)).all()


@requires_gpu
@pytest.mark.parametrize("eps,eps_root,lr", [(1e-8, 0.0, GROW), (1e-8, 1e-12, GROW),
                                             (0.0, 0.0, LR)])
def test_gpu_equals_cpu_bit_for_bit_where_elements_keep_their_values(rng, eps, eps_root, lr):
    """The kernel's rare path (an element keeps its values) beside its common one, with and
    without eps_root (the main launch leaves out its addition where it is zero): elements at the
    bf16 limit, or with eps 0 the elements whose gradient is zero (0 / 0)."""
    params, g = near_limit(rng, (9, 1000))
    if eps == 0.0:
        g = {"w": jnp.where(jnp.asarray(rng.random(g["w"].shape) < 0.1), 0, g["w"])}
    opt = inplace.adamw(lr, eps=eps, eps_root=eps_root, weight_decay=0.0, master_weights=True,
                        chunk_elems=256, group=4)
    with jax.default_device(jax.devices("cpu")[0]):
        _, reports = run(opt, params, [g, g], None)
    assert int(reports[0].kept) > 0  # the control: the rare path runs
    assert_gpu_equals_cpu(opt, params, [g, g], None)


@pytest.mark.parametrize("bad", [dict(b1=np.nan), dict(b2=1.0), dict(b2=0.99999999),
                                 dict(b1=1 - 1e-9), dict(eps=-1.0), dict(eps=np.inf),
                                 dict(learning_rate=np.nan), dict(weight_decay=np.nan),
                                 dict(chunk_elems=1024), dict(group=-1), dict(group=(1 << 15) + 1),
                                 dict(chunk_elems=100)])
def test_bad_hyperparameters_are_refused_when_the_optimizer_is_made(bad):
    kw = dict(learning_rate=LR) | bad
    with pytest.raises(ValueError):
        inplace.adamw(**kw)


def test_a_b_near_1_is_taken_while_float32_tells_it_from_1():
    assert inplace.adamw(LR, b2=0.9999999).b2 == 0.9999999  # 1 - 1.2e-7 in float32
    with pytest.raises(ValueError, match=r"b2=0.99999999 is 1 in float32"):
        inplace.adamw(LR, b2=0.99999999)


def test_lax_scan_over_updates_equals_the_updates_one_by_one(rng):
    opt, dtype = make("bf16_master")
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
    scanned = jax.jit(lambda s, gs: jax.lax.scan(
        lambda s, g: (opt.update(g, s)[0], None), s, gs)[0])(opt.init(params), stacked)
    one_by_one, _ = run(opt, params, grads)
    assert bits(scanned) == bits(one_by_one)


def test_the_state_is_held_once_at_most_optax_bytes(rng):
    """bf16 parameters with fp32 master weights, at the defaults: no larger than optax.adamw's
    state with its fp32 master copy (14 bytes a parameter)."""
    params = {"w": jnp.zeros((1024, 4096), jnp.bfloat16), "b": jnp.zeros((4096,), jnp.bfloat16),
              "e": jnp.zeros((32000, 512), jnp.bfloat16)}
    opt = inplace.adamw(LR, master_weights=True)
    shapes = jax.eval_shape(opt.init, params)
    ours = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    theirs = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        (params, master, jax.eval_shape(optax.adamw(LR).init, master))))
    n = sum(p.size for p in params.values())
    assert ours <= theirs, (ours / n, theirs / n)
    assert ours / n < 12.9  # 12 bytes of state, 0.75 of parity, the digests


@pytest.mark.parametrize("speculative", [False, True], ids=["checks-first", "speculative"])
def test_the_compiled_update_is_in_place_with_no_conditional_and_no_host_transfer(rng,
                                                                                  speculative):
    """Both ways of checking; the speculative update holds no pass before its writes (the
    default's holds one: the control)."""
    where = "IN_UPDATE" if speculative else "BEFORE_WRITES"
    opt, dtype = make("bf16_master", gradient_checks=inplace.GradientChecks[where],
                      parameter_checks=inplace.ParameterChecks[where])
    params = random_params(rng, dtype)
    state = opt.init(params)
    grads = random_grads(rng, params)
    step = jax.jit(opt.update, donate_argnums=1)
    hlo = step.lower(grads, state).compile().as_text()
    assert "pimhbm_adamw_inplace" in hlo
    assert ("pimhbm_inplace_precheck" in hlo) is not speculative
    forbidden = re.findall(r"\b(conditional|send|recv|outfeed|infeed|host_callback|"
                           r"xla_python_cpu_callback|xla_ffi_python_cpu_callback)\b", hlo)
    assert forbidden == [], forbidden
    # No copy of any non-empty buffer: the state and the step count's three copies are written
    # in place (a fusion that read the copies while writing them would need one on the GPU).
    # One int32 scalar of the report is copied, 4 bytes: speculative, one returned twice (the
    # kept count, as the gradients' count too); checks first, the suspect count's constant 0
    # (on the GPU XLA copies it out of a fusion's tuple, on the CPU from the constant).
    copies = [l for l in hlo.splitlines() if re.search(r"= \S+\[[^\]]*\]\S* copy\(", l)
              and not re.search(r"\[0[,\]]", l)]
    assert len(copies) <= 1 and all(re.search(r"= s32\[\] copy\(", l) for l in copies), copies
    state, _ = step(grads, state)
    before = pimhbm._core.unaliased_copies()
    for _ in range(3):
        state, report = step(random_grads(rng, params), state)
    assert bool(report.committed) and pimhbm._core.unaliased_copies() == before


def test_the_verdicts_counts_come_from_the_checks_call_whatever_the_leaves(rng, monkeypatch):
    """The verdict's counts are the checks' own totals (summed by their kernel): the compiled
    update holds as many reductions for 9 leaves as for 3, inside shard_map and under plain jit
    (XLA would run a reduction of per-leaf maps as one launch a leaf, every step). Control: the
    counts summed from the maps, leaf by leaf, grow with the leaves."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("dp",))
    opt, dtype = make("fp32")

    def reductions(leaves: int, in_shard_map: bool) -> int:
        params = random_params(rng, dtype, shapes=[(300 + 7 * i,) for i in range(leaves)])
        state, grads = opt.init(params), random_grads(rng, params)
        update = opt.update
        if in_shard_map:
            update = jax.shard_map(lambda g, s: opt.update(g, s, axis_name="dp"), mesh=mesh,
                                   in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
        hlo = jax.jit(update).lower(grads, state).compile().as_text()
        return len(re.findall(r"\breduce\(", hlo))

    for in_shard_map in (True, False):
        assert reductions(3, in_shard_map) == reductions(9, in_shard_map), in_shard_map
    seeing = inplace.prechecks

    def summed_per_leaf(params, tables, grads, chunk_elems):
        damaged, nonfinite, _ = seeing(params, tables, grads, chunk_elems)
        total = lambda maps: sum((jnp.sum(m, dtype=jnp.int32) for m in maps), jnp.int32(0))
        return inplace.Prechecks(damaged, nonfinite, jnp.stack([total(damaged), total(nonfinite)]))
    monkeypatch.setattr(inplace, "prechecks", summed_per_leaf)
    assert reductions(9, False) >= reductions(3, False) + 6


def test_a_skipped_steps_fault_maps_come_from_the_kernel_whatever_the_leaves(rng):
    """The report's fault maps are the update call's results as they are: a skipped step's are
    the checks' (the kernel writes them), so the compiled update holds as many OR operations
    for 9 leaves as for 3 (XLA runs an op on each leaf's map as one launch a leaf, every step).
    Control: the maps merged with the checks' in XLA, leaf by leaf, grow with the leaves."""
    opt, dtype = make("fp32")

    def ors(leaves: int, merged_in_xla: bool) -> int:
        params = random_params(rng, dtype, shapes=[(300 + 7 * i,) for i in range(leaves)])
        state, grads = opt.init(params), random_grads(rng, params)

        def update(g, s):
            new, report = opt.update(g, s)
            if merged_in_xla:
                maps = jax.tree.map(lambda m: m | jnp.where(report.applied, 0, 1), report.fault_maps)
                report = report._replace(fault_maps=maps)
            return new, report
        hlo = jax.jit(update).lower(grads, state).compile().as_text()
        return len(re.findall(r"\bor\(", hlo))

    assert ors(3, False) == ors(9, False)
    assert ors(9, True) >= ors(3, True) + 6


def test_the_verdict_is_global_across_devices(rng):
    """Four devices in shard_map: a parameter damaged on one cancels the step on all; a moment
    damaged on one leaves that device's chunk (its repair is local) and the others commit."""
    from jax.sharding import Mesh, PartitionSpec as P
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices), ("dp",))
    opt, dtype = make("fp32")
    params = random_params(rng, dtype, shapes=((600,), (300,)))
    state = opt.init(params)
    grads = random_grads(rng, params)
    replicate = lambda x: jnp.stack([x] * 4)
    many = jax.tree.map(replicate, state)
    g4 = jax.tree.map(replicate, grads)
    step = jax.jit(jax.shard_map(
        lambda s, g: (lambda out: (jax.tree.map(lambda x: x[None], out[0]),
                                   jax.tree.map(lambda x: x[None], out[1])))(
            opt.update(jax.tree.map(lambda g: g[0], g), jax.tree.map(lambda x: x[0], s),
                       axis_name="dp")),
        mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P("dp"), P("dp"))))
    for tensor, applied in (("params", False), ("mu", True)):
        damaged = jax.tree.map(jnp.copy, many)
        x = np.asarray(getattr(damaged, tensor)["t0"]).copy()
        x.view(np.uint32)[2, 17] ^= 1 << 9
        damaged = damaged._replace(**{tensor: {**getattr(damaged, tensor), "t0": jnp.asarray(x)}})
        _, report = step(damaged, g4)
        assert np.asarray(report.applied).tolist() == [applied] * 4, tensor
        assert np.asarray(report.digest_faults).tolist() == [1] * 4, tensor


def test_counts_summed_over_devices_saturate_rather_than_wrap(rng):
    """The verdict's counts summed over four devices never wrap: each device's count is capped
    at INT32_MAX / 4 first, so the sum is zero (the verdict that commits) only where every count
    is, whatever their sizes. Control: a plain psum of four large counts wraps to 0."""
    from jax.sharding import Mesh, PartitionSpec as P
    from pimhbm.inplace_calls import saturating_psum
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("dp",))
    top, cap = np.iinfo(np.int32).max, np.iinfo(np.int32).max // 4
    big = top // 2 + 1  # four of them pass 2^32: a wrapped sum is 0 exactly
    uneven = rng.integers(0, top, size=(4, 1), dtype=np.int64)  # sizes of every magnitude
    devices = rng.permutation(4)
    uneven[devices[:2]] = 0  # two devices found nothing
    uneven[devices[2]] = top  # one found as many as an int32 holds
    small = rng.integers(0, 3, size=(4, 1))  # counts at the bottom, zero on some devices
    small[rng.integers(4)] = 1
    counts = jnp.asarray(np.concatenate([np.full((4, 1), big), uneven, small, np.zeros((4, 1))],
                                        axis=1), jnp.int32)

    def summed(psum):
        return np.asarray(jax.jit(jax.shard_map(lambda c: psum(c, "dp"), mesh=mesh,
                                                in_specs=P("dp"), out_specs=P("dp")))(counts))

    saturated, expected = summed(saturating_psum), np.minimum(np.asarray(counts), cap).sum(axis=0)
    assert (saturated == expected).all() and (saturated >= 0).all()
    assert (saturated[0, :3] > 0).all() and saturated[0, 3] == 0
    assert saturated[0, 2] == int(np.asarray(counts)[:, 2].sum())  # small counts are exact
    assert summed(jax.lax.psum)[:, 0].tolist() == [0] * 4


def canonical(report):
    """A report with its stash rows in (leaf, chunk) order (a repair's statuses sorted): the GPU's
    chunks take their rows in the order they finish, the CPU's in chunk order."""
    if isinstance(report, inplace.RepairReport):  # its statuses are by stash row: as a multiset
        return report._replace(rebuilt=jax.tree.map(
            lambda st: np.asarray(st)[np.lexsort(np.asarray(st).T[::-1])], report.rebuilt))
    index, rows = np.asarray(report.stash.index), np.asarray(report.stash.rows)
    order = np.lexsort((index[:, 1], index[:, 0], index[:, 0] < 0))
    return report._replace(stash=inplace.Stash(rows[order], index[order]))


def assert_gpu_equals_cpu(opt, params, grads, damage):
    results = {}
    for platform in ("cpu", "gpu"):
        dev = jax.devices(platform)[0]
        with jax.default_device(dev):
            state, reports = run(opt, jax.device_put(params, dev), jax.device_put(grads, dev), damage)
            results[platform] = (bits(state), [bits(canonical(r)) for r in reports])
    assert results["cpu"][0] == results["gpu"][0]
    assert results["cpu"][1] == results["gpu"][1]


@requires_gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_equals_cpu_bit_for_bit_with_damage_and_repair(rng, kind):
    """The CUDA kernels (update, parity, rebuild, redo) against the CPU reference."""
    opt, dtype = make(kind, chunk_elems=int(rng.choice([128, 256, 512])), group=int(rng.integers(1, 9)))
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(4)]
    damage = lambda s: flip_row(flip(flip(s, "mu", "t0", 999, 7), "nu", "t4", 4096, 31),
                                "t3", "mu", 0, 77)
    assert_gpu_equals_cpu(opt, params, grads, damage)


@requires_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_elems,group", [(128, 0), (256, 0), (512, 0), (256, 1), (256, 16),
                                               (512, 3)])
def test_gpu_equals_cpu_bit_for_bit_at_every_chunk_size_and_group(rng, kind, chunk_elems, group):
    """Every shape of the main launch: no parity (replicas are the redundancy), groups of one
    chunk and of the default 16, chunks of 128 to 512 -- beside the ragged tails of the shapes.
    Damage (where parity can repair it) in a whole group's chunk."""
    opt, dtype = make(kind, chunk_elems=chunk_elems, group=group)
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    damage = None if group == 0 else (
        lambda s: flip_row(flip_row(flip(s, "mu", "t0", 300, 5), "t0", "nu", 0, 3), "t5", "p", 0, 8))
    assert_gpu_equals_cpu(opt, params, grads, damage)


@requires_gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_equals_cpu_bit_for_bit_speculative(rng, kind):
    """The speculative update (no checks before the writes) finding damaged parameters in
    several chunks and a moment in another: its maps, its count of suspect chunks (the
    kernel's total), the redo and the state against the CPU reference."""
    opt, dtype = make(kind, chunk_elems=int(rng.choice([128, 256, 512])),
                      group=int(rng.integers(1, 9)),
                      gradient_checks=inplace.GradientChecks.IN_UPDATE,
                      parameter_checks=inplace.ParameterChecks.IN_UPDATE)
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    damage = lambda s: flip(flip(flip(flip(s, "p", "t0", 10, 3), "p", "t0", 5000, 9),
                                 "p", "t3", 700, 1), "mu", "t1", 2000, 20)
    with jax.default_device(jax.devices("cpu")[0]):
        _, reports = run(opt, params, grads, damage)
    assert int(reports[1].suspect) == 3  # the count compared is not 0
    assert_gpu_equals_cpu(opt, params, grads, damage)


def test_used_as_an_optax_transformation_it_says_what_to_use_instead(rng):
    opt, dtype = make("fp32")
    params = random_params(rng, dtype)
    tx = optax.chain(optax.clip_by_global_norm(1.0), opt)
    state = tx.init(params)
    with pytest.raises(TypeError, match="not an optax GradientTransformation"):
        tx.update(random_grads(rng, params), state, params)


def test_a_gradient_transformation_runs_first_in_the_same_step(rng):
    """inplace.adamw(gradient_transform=optax.clip_by_global_norm(c)) is optax.chain(clip,
    adamw): the same states as the update fed the clipped gradients (to float tolerance: the
    norm's reduction runs in another program), and not the unclipped ones (the clip bites)."""
    clip = optax.clip_by_global_norm(0.5)
    opt, dtype = make("fp32", gradient_transform=clip)
    plain, _ = make("fp32")
    params = random_params(rng, dtype)
    grads = [random_grads(rng, params) for _ in range(3)]
    clipped = [jax.jit(lambda g: clip.update(g, clip.init(g), None)[0])(g) for g in grads]
    state, reports = run(opt, params, grads)
    want, _ = run(plain, params, clipped)
    unclipped, _ = run(plain, params, grads)
    assert all(bool(r.committed) for r in reports)
    for k in params:
        np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(want.params[k]),
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(state.mu[k]), np.asarray(want.mu[k]), rtol=1e-5,
                                   atol=1e-8)
    # Adam's step hardly sees a uniform scale; its moments do.
    assert all(np.abs(np.asarray(state.mu[k])).sum() < 0.9 * np.abs(np.asarray(unclipped.mu[k])).sum()
               for k in params)


def test_a_stateful_or_unknown_gradient_transformation_is_refused():
    with pytest.raises(ValueError, match="state of its own"):
        inplace.adamw(LR, gradient_transform=optax.scale_by_adam()).init({"w": jnp.zeros(3)})
    masked = optax.masked(optax.clip(1.0), {"w": True, "b": False})  # its mask is the tree's
    inplace.adamw(LR, gradient_transform=masked).init({"w": jnp.zeros(3), "b": jnp.zeros(2)})
    with pytest.raises(TypeError, match="GradientTransformation"):
        inplace.adamw(LR, gradient_transform=lambda g: g)


def test_vmap_of_the_update_says_why_it_cannot_be(rng):
    opt = inplace.adamw(1e-3)
    params = {"w": jnp.asarray(rng.standard_normal(1000), jnp.float32)}
    state = opt.init(params)
    grads = jnp.asarray(rng.standard_normal((3, 1000)), jnp.float32)
    with pytest.raises(ValueError, match="cannot be vmapped: the update writes one optimizer"):
        jax.vmap(lambda g: opt.update({"w": g}, state)[0].params)(grads)
    # Without vmap the same call runs (the refusal is vmap's alone).
    new, report = jax.jit(lambda g: opt.update({"w": g}, state))(grads[0])
    assert bool(report.committed)
