"""Faults written into the live state, in place, with the run's compiled programs (campaigns
and tests): one tensor of the current state or of the device copy, on one device or on all."""

from __future__ import annotations

import numpy as np

from pimhbm.recovery.programs import Compiler
from pimhbm.recovery.traced import TrainState
from pimhbm.update import AdamWState, slot_from_tensors, slot_tensors


def inject(state: TrainState, compiler: Compiler, path: str, tensor: str, fault: np.ndarray, *,
           into_copy: bool, device: int | None, rehash: bool) -> TrainState:
    """``state`` with ``fault`` (pimhbm.faults.spec) applied to ``tensor`` of leaf ``path``
    (see Trainer.inject); its buffers are donated."""
    t_, placement, layout = compiler.t, compiler.placement, compiler.t.layout
    opt = state.opt
    if into_copy and not t_.device_copy:
        raise ValueError("this run keeps no device copy (pimhbm.update.adamw(device_copy=False), or "
                         "one copy of the state: pimhbm.inplace)")
    leaves = slot_tensors(opt.device_copy, t_.treedef) if into_copy else t_.tensors(opt)
    i = layout.leaf_index(path)
    t, table = leaves[i][tensor]
    rows = np.zeros((len(placement.devices), 8), np.int32)
    rows[slice(None) if device is None else device] = fault
    rows = placement.put(rows, placement.by_device)
    spec = t_.leaf_specs[i]
    if rehash:
        t, table = compiler.inject_rehashed(t, table, spec, layout.chunk_bytes(tensor, i))(
            t, table, rows)
    else:
        t = compiler.inject(t.shape, t.dtype, spec)(t, rows)
    placement.settle(t, table)
    leaves[i][tensor] = (t, table)
    if into_copy:
        opt = AdamWState(opt.slots, opt.current, opt.step_copies,
                         slot_from_tensors(leaves, t_.treedef))
    else:
        opt = t_.with_tensors(opt, leaves)
    return state._replace(opt=opt)
