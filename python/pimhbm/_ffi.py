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
