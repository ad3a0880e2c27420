"""Registration of the compiled FFI handlers with JAX (once, on first use)."""

from __future__ import annotations

import functools

import jax

from pimhbm import _core


def _jax_has_cuda() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False


@functools.cache
def ensure_registered() -> tuple[str, ...]:
    """Registers every handler for every platform this process can run; returns the platforms."""
    platforms = []
    for platform, targets in _core.registrations().items():
        if platform == "CUDA" and not _jax_has_cuda():
            continue
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        platforms.append(platform)
    return tuple(platforms)


def built_with_cuda() -> bool:
    return bool(_core.with_cuda)


def unbatched_call(target: str, out_types, why: str, **options):
    """``jax.ffi.ffi_call(target, out_types, **options)`` for an op that has no meaning under
    ``jax.vmap``: a vmap of it raises a ValueError that says ``why``, where JAX would name only
    its own vmap_method setting."""
    call = jax.ffi.ffi_call(target, out_types, **options)

    def run(*args, **attrs):
        @jax.custom_batching.custom_vmap
        def op(*arrays):
            return call(*arrays, **attrs)

        @op.def_vmap
        def refuse(axis_size, in_batched, *arrays):
            raise ValueError(f"{target} cannot be vmapped: {why}")

        return op(*args)

    return run
