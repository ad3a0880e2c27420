"""The in-place update's checks one a leaf, each after its parameter's last read: a variant
measured against the library's one pass and lost (bench/NOTES.md, "The checks per leaf timed:
neither way wins"). Kept here with its bench (precheck_order_bench.py).

The in-place update may write only after a check that each parameter leaf was intact when the
forward and backward passes read it, so that check must follow the leaf's last read. Checked
after the whole backward pass (the one pass), it adds its time to the step; checked per leaf as
soon as the leaf's last read is over, it might run while the rest of the backward pass does.

XLA orders work only by data: a check of a leaf that takes nothing from the work reading it may
run before that work (split naively, 15 of the 21 leaves of a Llama step were checked before
their last read). :func:`checks_after` finds, in a traced gradient computation, for each
parameter leaf a gradient leaf computed only after every read of that parameter; the update
then passes that gradient through a barrier with the parameter it checks (:class:`Ordered`).
XLA may also recompute a value from a parameter inside a later kernel (a gather or an
elementwise chain fused into each of its readers), so every value derived from a parameter by
work XLA may duplicate counts as the parameter. What XLA made of it is checked on the compiled
program by :func:`late_reads` -- XLA's CPU pipeline, for one, drops the barrier.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Var

from pimhbm import inplace
from pimhbm.inplace_calls import Prechecks, _saturating_add, prechecks

CHECK = "pimhbm_inplace_precheck"
# Calls that read the parameters after the checks by design: the update and the checks.
_AFTER_THE_CHECKS = ("pimhbm_adamw_inplace", CHECK)


def plan_for(grad_fn: Callable[[Any], Any], params: Any) -> tuple[int | None, ...]:
    """Per leaf of ``params``, the gradient its check follows (None: all of them), for a step
    whose gradients are ``grad_fn(params)``'s last outputs (as ``jax.value_and_grad``'s
    ``(value, grads)``): traced, not run."""
    leaves, treedef = jax.tree.flatten(params)
    closed = jax.make_jaxpr(lambda *ls: grad_fn(jax.tree.unflatten(treedef, ls)))(*leaves)
    return tuple(checks_after(closed, len(leaves)))


@dataclasses.dataclass(frozen=True)
class Ordered(inplace.AdamW):
    """pimhbm.adamw whose checks before the first write run one call per set of leaves that
    follow the same gradient (``after``, from :func:`plan_for`), each after that gradient."""

    after: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, opt: inplace.AdamW, after: Sequence[int | None]) -> "Ordered":
        return cls(**{f.name: getattr(opt, f.name) for f in dataclasses.fields(opt) if f.init},
                   after=tuple(after))

    def _prechecks(self, leaves, tables, grads):
        params, p_tables = [leaf["p"] for leaf in leaves], [t["p"] for t in tables]
        n = len(params)
        if len(self.after) != n or any(j is not None and not 0 <= j < n for j in self.after):
            raise ValueError(f"the plan names {len(self.after)} leaves, each None or a "
                             f"gradient's index; the parameters have {n}: {self.after}")
        grads, damaged, nonfinite = list(grads), [None] * n, [None] * n
        counts = jnp.zeros((2,), jnp.int32)
        groups: dict[int | None, list[int]] = {}
        for i, j in enumerate(self.after):
            groups.setdefault(j, []).append(i)
        # Those checked after every gradient last: their barrier holds every gradient, and no
        # other check may wait for it.
        for j in sorted(groups, key=lambda j: j is None):
            members = groups[j]
            # The update reads the gradient from the barrier too: a barrier output that nothing
            # reads is dropped, and the order with it.
            follows = list(range(n)) if j is None else [j]
            ps = list(jax.lax.optimization_barrier(
                (*(params[i] for i in members), *(grads[k] for k in follows))))
            for k, g in zip(follows, ps[len(members):]):
                grads[k] = g
            d, b, c = prechecks(ps[:len(members)], [p_tables[i] for i in members],
                                [grads[i] for i in members], self.chunk_elems)
            for i, di, bi in zip(members, d, b):
                damaged[i], nonfinite[i] = di, bi
            counts = _saturating_add(counts, c)
        return Prechecks(damaged, nonfinite, counts), grads


# Work XLA computes once and writes (never duplicates into the kernels of its readers): a
# value it produces is no longer the parameter.
_MATERIALIZED = frozenset({
    "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
    "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin", "reduce",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "scatter", "scatter-add",
    "scatter_add", "scatter_mul", "scatter_min", "scatter_max", "sort", "while", "cond",
    "scan", "ffi_call", "custom_call", "top_k", "select_and_scatter_add", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "reduce_window",
})


def checks_after(closed: ClosedJaxpr, leaves: int, first: int = 0) -> list[int | None]:
    """For each of the ``leaves`` inputs of ``closed`` from ``first`` on (the parameters), the
    index among its last ``leaves`` outputs (their gradients) of the earliest gradient that
    every read of that parameter precedes; None where no gradient does (check it after every
    gradient)."""
    jaxpr = closed.jaxpr
    if len(jaxpr.invars) < first + leaves or len(jaxpr.outvars) < leaves:
        raise ValueError(f"the computation has {len(jaxpr.invars)} inputs and "
                         f"{len(jaxpr.outvars)} outputs; expected at least {leaves} of each")
    producer: dict[Var, int] = {}
    ancestors: list[int] = []  # per equation, a bit set of the equations it depends on
    for e, eqn in enumerate(jaxpr.eqns):
        bits = 0
        for v in _vars(eqn.invars):
            if v in producer:
                bits |= ancestors[producer[v]] | (1 << producer[v])
        ancestors.append(bits)
        for v in eqn.outvars:
            producer[v] = e
    grads = jaxpr.outvars[len(jaxpr.outvars) - leaves:]
    upstream = [_upstream(g, producer, ancestors) for g in grads]
    earliest = sorted(range(leaves), key=lambda j: producer.get(grads[j], -1)
                      if isinstance(grads[j], Var) else -1)
    out = []
    for param in jaxpr.invars[first:first + leaves]:
        reads = _reads(jaxpr.eqns, param)
        out.append(next((j for j in earliest if (reads & ~upstream[j]) == 0), None))
    return out


def _vars(atoms: Sequence) -> list[Var]:
    return [a for a in atoms if isinstance(a, Var)]


def _upstream(v, producer: dict, ancestors: list[int]) -> int:
    """The equations that ``v`` depends on (a bit set), its own included."""
    if not isinstance(v, Var) or v not in producer:
        return 0
    return ancestors[producer[v]] | (1 << producer[v])


def _reads(eqns: Sequence, param: Var) -> int:
    """The equations that read ``param`` or a value XLA may recompute from it (a bit set)."""
    derived, bits = {param}, 0
    for e, eqn in enumerate(eqns):
        if not any(v in derived for v in _vars(eqn.invars)):
            continue
        bits |= 1 << e
        if eqn.primitive.name not in _MATERIALIZED:
            derived.update(eqn.outvars)
    return bits


# -- what XLA made of it ------------------------------------------------------------------------

class LateRead(NamedTuple):
    """An instruction of a compiled module that reads a parameter its check does not follow."""

    check: str
    parameter: str
    reader: str


class _Instr(NamedTuple):
    op: str
    operands: list[str]
    after: list[str]  # control predecessors (what an expanded barrier leaves)
    text: str


# Instructions that hand a buffer on without reading it.
_PASS = frozenset({"bitcast", "get-tuple-element", "opt-barrier", "tuple"})
_LINE = re.compile(r"\s*(?:ROOT )?(%[\w.\-]+) = (.*)$")
_OP = re.compile(r"\s([a-z][a-z0-9\-]*)\(")


def reads_after_checks(hlo: str, check: str, exempt: Sequence[str] = ()) -> list[LateRead] | None:
    """In a compiled module's text, the reads of an entry parameter that come after a check
    of it (an instruction of the entry computation calling ``check``) without preceding it
    by data; reads by instructions calling an ``exempt`` target do not count. None where the
    text has no such check in its entry computation (nothing to rely on)."""
    entry, bodies = _entry(hlo), _bodies(hlo)
    calls = lambda i, target: f'"{target}"' in i.text or any(
        f'"{target}"' in bodies.get(c, "") for c in re.findall(r"calls=(%[\w.\-]+)", i.text))
    ancestors: dict[str, set[str]] = {}
    for name, i in entry.items():
        ancestors[name] = set()
        for o in i.operands + i.after:
            if o in entry:
                ancestors[name] |= ancestors[o] | {o}

    @functools.cache
    def parameters(name: str, index: int | None = None) -> frozenset[str]:
        """The entry parameters whose buffer ``name`` (its element ``index``) hands on."""
        i = entry[name]
        ins = [o for o in i.operands if o in entry]
        if i.op == "parameter":
            return frozenset({name})
        if i.op == "bitcast" or (i.op == "opt-barrier" and ins):
            return parameters(ins[0], index)
        if i.op == "get-tuple-element" and ins:
            return parameters(ins[0], int(re.search(r"index=(\d+)", i.text).group(1)))
        if i.op == "tuple":
            picked = ins if index is None or index >= len(ins) else [ins[index]]
            return frozenset().union(*(parameters(o) for o in picked))
        return frozenset()

    reads = {name: frozenset().union(*(parameters(o) for o in i.operands if o in entry))
             for name, i in entry.items() if i.op not in _PASS}
    late, checks = [], 0
    for name, i in entry.items():
        if not calls(i, check):
            continue
        checks += 1
        for param in reads.get(name, frozenset()):
            late += [LateRead(name, param, r) for r in sorted(reads)
                     if param in reads[r] and r != name and r not in ancestors[name]
                     and not any(calls(entry[r], t) for t in (check, *exempt))]
    return late if checks else None


def _entry(hlo: str) -> dict[str, _Instr]:
    start = hlo.index("\nENTRY ")
    body = hlo[start:hlo.index("\n}\n", start)].splitlines()[1:]
    out = {}
    for line in body:
        m = _LINE.match(line)
        op = m and _OP.search(" " + m.group(2))
        if op:
            control = re.search(r"control-predecessors=\{([^}]*)\}", m.group(2))
            out[m.group(1)] = _Instr(op.group(1), _operands(m.group(2)[op.end() - 1:]),
                                     re.findall(r"%[\w.\-]+", control.group(1)) if control else [],
                                     m.group(2))
    return out


def _operands(rest: str) -> list[str]:
    """The instruction names inside the operand list's parentheses."""
    depth = 1
    for k, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%[\w.\-]+", rest[:k])
    return re.findall(r"%[\w.\-]+", rest)


def _bodies(hlo: str) -> dict[str, str]:
    """Each computation's text by its name."""
    out = {}
    for m in re.finditer(r"^(%[\w.\-]+) \(.*?^}$", hlo, re.S | re.M):
        out[m.group(1)] = m.group(0)
    return out


def late_reads(hlo: str) -> list[LateRead] | None:
    """Every read of a parameter in the compiled program ``hlo`` (its text) that its check does
    not precede by data; None where the program has no check in its entry computation."""
    return reads_after_checks(hlo, CHECK, _AFTER_THE_CHECKS)
