"""Training a Llama-3 under protection: the model, a byte-level text stream, the guarded update
(one copy of the state updated in place, kept redundant by parity -- or two slots and a device
copy), host snapshots, the asynchronous fault loop and prewarm, in one call.

    trainer = pimhbm.train.llama_trainer(llama3.tiny(), text, steps=300)
    trainer.prewarm()
    stats = trainer.run(300)

Data parallel over every device there is (one included): see pimhbm.recovery.Trainer.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable

import jax
import numpy as np

import pimhbm
from pimhbm import inplace
from pimhbm.models import llama3
from pimhbm.recovery import Trainer
from pimhbm.recovery.trainer import SNAPSHOT_EVERY


class StateKind(enum.StrEnum):
    """How the protected state is held."""

    ONE_COPY = "one-copy"  # pimhbm.inplace: updated in place; parity, or the replicas
    TWO_SLOTS = "two-slots"  # pimhbm.update.adamw: the step writes the other slot; a device copy


def text_batches(data: bytes, batch: int, seq: int, seed: int) -> Callable[[int], dict[str, np.ndarray]]:
    """batch_fn(step) -> {"tokens": int32 [batch, seq + 1]}: windows of the byte stream at
    positions drawn from (seed, step), so that any step's batch can be made again."""
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    if tokens.size < seq + 2:
        raise ValueError(f"the text has {tokens.size} bytes; a window needs {seq + 1}")

    def batch_fn(step: int) -> dict[str, np.ndarray]:
        starts = np.random.default_rng([seed, step]).integers(0, tokens.size - seq - 1, batch)
        return {"tokens": np.stack([tokens[s:s + seq + 1] for s in starts])}

    return batch_fn


def warmup_cosine(peak: float, warmup: int, steps: int, floor: float = 0.1) -> Callable[[int], float]:
    """The learning rate of a step (a host function: passed to the device as a scalar)."""
    def lr(step: int) -> float:
        if step <= warmup:
            return peak * step / max(warmup, 1)
        t = min(1.0, (step - warmup) / max(steps - warmup, 1))
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
    return lr


def gradient_checks_for(state: StateKind, snapshots: bool) -> inplace.GradientChecks:
    """Where the trainer's update finds non-finite gradients by default: by the update itself
    where one copy is backed by host snapshots -- the checks before the writes then read p alone,
    2 bytes a parameter fewer each step, and the rare step with a non-finite gradient under a
    finite loss costs a restore from the snapshot and a replay instead of a skip -- else before
    the writes (without a snapshot nothing could bring back a step applied in part)."""
    if state is StateKind.ONE_COPY and snapshots:
        return inplace.GradientChecks.IN_UPDATE
    return inplace.GradientChecks.BEFORE_WRITES


def llama_trainer(cfg: llama3.Config, data: bytes, *, steps: int, batch: int = 16, seq: int = 64,
                  peak_lr: float = 3e-3, warmup: int = 20, seed: int = 0,
                  chunk_elems: int | None = None, shm_name: str | None = None,
                  snapshot_every: int = SNAPSHOT_EVERY, scrub_every: int | None = None,
                  inject_gradients: bool = False, devices: Any = None,
                  attention_impl: str | None = None, params: Any = None,
                  replica_transport: str = "collective", shard: int = 1,
                  device_copy: bool = True, recheck_every: int | None = None,
                  state: StateKind | str = StateKind.ONE_COPY, in_flight: int = 2,
                  telemetry: Any = "auto", gradient_transform: Any = None,
                  ordered_embedding: bool = False,
                  gradient_checks: inplace.GradientChecks | None = None,
                  parameter_checks: inplace.ParameterChecks = inplace.ParameterChecks.BEFORE_WRITES
                  ) -> Trainer:
    """A protected trainer of the Llama-3 ``cfg`` on byte-level ``data``: bf16 parameters with
    fp32 master weights and moments, and (with ``shm_name``) host snapshots in shared memory.
    ``state``: one copy updated in place (pimhbm.inplace; parity over groups of chunks repairs
    a damaged chunk) or two slots (pimhbm.update.adamw; a device copy repairs it). ``device_copy``:
    each device's own redundancy, parity or the device copy (False: damaged chunks come from
    the other replicas only). ``gradient_transform``: a stateless optax transformation of the
    gradients run first (see pimhbm.adamw). ``ordered_embedding``: the embedding's
    gradient summed in a fixed order (``llama3.embed``; for exact replays). ``in_flight``,
    ``telemetry``: the Trainer's. ``chunk_elems``:
    None for the kind's default (512 in place, 1024
    with two slots). ``recheck_every``: the Trainer's sampled re-execution (None: its
    default). ``gradient_checks``, ``parameter_checks``: one copy's (pimhbm.inplace);
    ``gradient_checks`` None: :func:`gradient_checks_for` the run."""
    if gradient_checks is None:
        gradient_checks = gradient_checks_for(StateKind(state),
                                              shm_name is not None and snapshot_every > 0)
    if params is None:
        params = llama3.init(jax.random.key(seed), cfg)
    master = cfg.dtype == "bfloat16"
    if StateKind(state) is StateKind.ONE_COPY:
        opt = inplace.adamw(peak_lr, weight_decay=0.01, master_weights=master,
                            chunk_elems=chunk_elems or inplace.DEFAULT_CHUNK_ELEMS,
                            group=inplace.DEFAULT_GROUP if device_copy else 0,
                            gradient_transform=gradient_transform,
                            gradient_checks=gradient_checks, parameter_checks=parameter_checks)
    else:
        if (gradient_checks is not inplace.GradientChecks.BEFORE_WRITES or
                parameter_checks is not inplace.ParameterChecks.BEFORE_WRITES):
            raise ValueError(f"gradient_checks={gradient_checks}, parameter_checks="
                             f"{parameter_checks}: two slots check both before the writes only")
        opt = pimhbm.update.adamw(peak_lr, weight_decay=0.01, master_weights=master,
                           device_copy=device_copy, chunk_elems=chunk_elems or 1024,
                           gradient_transform=gradient_transform)
    loss = lambda p, b: llama3.loss(p, b, cfg, attention_impl, ordered_embedding)
    return Trainer(loss, opt, params, text_batches(data, batch, seq, seed),
                   learning_rate=warmup_cosine(peak_lr, warmup, steps), shm_name=shm_name,
                   snapshot_every=snapshot_every, scrub_every=scrub_every,
                   inject_gradients=inject_gradients, devices=devices,
                   replica_transport=replica_transport, shard=shard, recheck_every=recheck_every,
                   in_flight=in_flight, telemetry=telemetry)
