#!/usr/bin/env python3
"""Calls the FFI handlers directly with bad input on every platform, each case in a child
process, and reports whether it raised the handler's error (as it must) or crashed.

usage: python scripts/diagnose_ffi_errors.py
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = {
    "verify: digest table of the wrong shape": """
x = jnp.zeros(100, jnp.float32)
call = jax.ffi.ffi_call("pimhbm_verify", jax.ShapeDtypeStruct((25,), jnp.bool_))
jax.block_until_ready(call(x, jnp.zeros(3, jnp.float32), base, chunk_bytes=np.int64(16)))
""",
    "scan: chunk size not a multiple of 16": """
x = jnp.zeros(100, jnp.float32)
call = jax.ffi.ffi_call("pimhbm_scan", (jax.ShapeDtypeStruct((7, 2), jnp.uint32),
    jax.ShapeDtypeStruct((7,), jnp.int32), jax.ShapeDtypeStruct((7,), jnp.float32)))
jax.block_until_ready(call(x, base, chunk_bytes=np.int64(60)))
""",
    "scan: unprotected dtype": """
x = jnp.zeros(7, jnp.complex64)
call = jax.ffi.ffi_call("pimhbm_scan", (jax.ShapeDtypeStruct((4, 2), jnp.uint32),
    jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.float32)))
jax.block_until_ready(call(x, base, chunk_bytes=np.int64(16)))
""",
    "scan: chunk_base of the wrong size": """
x = jnp.zeros(8, jnp.float32)
call = jax.ffi.ffi_call("pimhbm_scan", (jax.ShapeDtypeStruct((2, 2), jnp.uint32),
    jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.float32)))
jax.block_until_ready(call(x, jnp.zeros(2, jnp.int32), chunk_bytes=np.int64(16)))
""",
}

PRELUDE = """
import sys, jax, jax.numpy as jnp, numpy as np
import pimhbm
pimhbm.scan(np.zeros(1, np.float32))  # registers the handlers
platform = sys.argv[1]
base = jnp.zeros(1, jnp.int32)  # the index of the tensor's first chunk (scan.h)
jax.config.update("jax_default_device", jax.devices(platform)[0])
try:
{body}
except Exception as e:
    print("RAISED:", type(e).__name__, str(e).splitlines()[0][:200])
    sys.exit(0)
print("NO ERROR")
sys.exit(3)
"""


def platforms() -> list[str]:
    out = subprocess.run([sys.executable, "-c", "import jax; print(' '.join(sorted({d.platform for d in jax.devices()} | {'cpu'})))"],
                         capture_output=True, text=True)
    return out.stdout.split() or ["cpu"]


def backtrace(code: str, platform: str, env: dict) -> None:
    """Reruns a crashing case under cuda-gdb (gdb where there is one) and prints the stack."""
    import shutil
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger is None:
        print("  (no gdb or cuda-gdb for a native backtrace)")
        return
    path = "/tmp/pimhbm_crash_case.py"
    with open(path, "w") as f:
        f.write(code)
    r = subprocess.run([debugger, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable,
                        path, platform], capture_output=True, text=True, env=env, timeout=600)
    frames = [l for l in r.stdout.splitlines() if l.startswith("#")]
    print("  native backtrace:\n    " + "\n    ".join(frames[:40]))


def main() -> int:
    failures = 0
    for platform in platforms():
        for flags in ("", "--xla_gpu_enable_command_buffer="):
            if flags and platform != "gpu":
                continue
            for name, body in CASES.items():
                code = PRELUDE.format(body="\n".join("    " + l for l in body.strip().splitlines()))
                env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
                r = subprocess.run([sys.executable, "-c", code, platform], capture_output=True,
                                   text=True, env=env, timeout=300)
                verdict = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
                if r.returncode != 0:
                    verdict = f"CRASHED (exit {r.returncode}) {r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else ''}"
                    failures += 1
                    if "--backtrace" in sys.argv and failures == 1:
                        backtrace(code, platform, env)
                print(f"{platform:4} {flags or 'default flags':36} {name:42} {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
