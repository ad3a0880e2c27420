"""The one-copy Trainer the recovery tests share (mlp, chunks of 128, parity groups of 4), a
run without faults to compare with, and hand-placed faults."""

import jax

from pimhbm import faults, inplace
from pimhbm.models import mlp
from pimhbm.recovery import Trainer

CHUNK, GROUP = 128, 4


def make_trainer(name, *, devices=1, shard=1, group=GROUP, inject=False, resume=False,
                 gradient_checks=inplace.GradientChecks.BEFORE_WRITES,
                 parameter_checks=inplace.ParameterChecks.BEFORE_WRITES, **kw):
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=group,
                        gradient_checks=gradient_checks, parameter_checks=parameter_checks)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=10,
                 scrub_every=5, inject_gradients=inject, resume=resume,
                 devices=jax.devices()[:devices], shard=shard, **kw)
    tr.prewarm()
    return tr


def same_state(a, b):
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


_FAULT_FREE = {}  # (steps, kw) -> the state: several tests compare against the same run


def fault_free(name, steps, **kw):
    """The state after ``steps`` of a run without faults (make_trainer's settings and ``kw``),
    run once a test process for each (steps, kw)."""
    key = (steps, tuple(sorted(kw.items())))
    if key not in _FAULT_FREE:
        tr = make_trainer(name + "_ref", **kw)
        try:
            stats = tr.run(steps)
            assert stats.steps_committed == steps and not stats.incidents
            _FAULT_FREE[key] = tr.current_state()
        finally:
            tr.close(unlink=True)
    return _FAULT_FREE[key]


def incidents(stats, kind=None, action=None):
    return [i for i in stats.incidents
            if (kind is None or i.kind is kind) and (action is None or i.action is action)]


class NoEndlessReplay:
    """A campaign that injects nothing and fails the test once ``step`` is attempted more than
    ``most`` times (so that a run replaying it for ever fails instead of hanging)."""

    def __init__(self, step, most):
        self.step, self.most = step, most

    def before_step(self, trainer, step, attempt):
        assert step != self.step or attempt <= self.most, f"step {step} replayed for ever"
        return None

    def before_scrub(self, trainer, step):
        pass


class Once:
    """A campaign of one hand-placed fault before step ``at``."""

    def __init__(self, at, inject):
        self.at, self.inject = at, inject

    def before_step(self, trainer, step, attempt):
        if step == self.at and attempt == 1:
            self.inject(trainer)
        return None

    def before_scrub(self, trainer, step):
        pass


def flip(trainer, path, tensor, element, bit=3):
    size = next(s for p, t, _, s in trainer.tensor_info() if p == path and t == tensor)
    trainer.inject(path, tensor, faults.spec(faults.FLIP_BIT, offset=element * size, bit=bit))
