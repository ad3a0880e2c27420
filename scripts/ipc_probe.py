"""What kind of memory XLA gives this process's arrays, and whether CUDA IPC can share it:
cuMemGetAddressRange, cuIpcGetMemHandle (cuMemAlloc'd memory), cuMemRetainAllocationHandle and
the requested handle types (virtual-memory-managed memory). Prints one line per question.

usage: python scripts/ipc_probe.py   (on a GPU machine)"""

import ctypes
import os

import jax
import jax.numpy as jnp

print("jax", jax.__version__, jax.devices())
print("env:", {k: v for k, v in os.environ.items() if k.startswith(("XLA", "JAX", "TF_", "CUDA"))})
x = jnp.arange(1 << 20, dtype=jnp.float32) + 1
x.block_until_ready()
ptr = x.unsafe_buffer_pointer()
cu = ctypes.CDLL("libcuda.so.1")
u64, sz = ctypes.c_ulonglong, ctypes.c_size_t


def call(name, *args):
    r = getattr(cu, name)(*args)
    if r:
        s = ctypes.c_char_p()
        cu.cuGetErrorString(r, ctypes.byref(s))
        return f"{name}: CUresult {r} ({s.value.decode() if s.value else '?'})"
    return None


dev = ctypes.c_int()
ctx = ctypes.c_void_p()
print(call("cuInit", 0) or "cuInit ok")
print(call("cuDeviceGet", ctypes.byref(dev), x.devices().pop().local_hardware_id) or "device ok")
print(call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev) or "primary context ok")
print(call("cuCtxSetCurrent", ctx) or "context current")
base, size = u64(), sz()
print(call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), u64(ptr)) or
      f"address range: base {base.value:#x}, size {size.value / 2**30:.2f} GiB, offset {ptr - base.value}")
handle = (ctypes.c_char * 64)()
print(call("cuIpcGetMemHandle", ctypes.byref(handle), u64(base.value)) or "cuIpcGetMemHandle ok")
h = u64()
r = call("cuMemRetainAllocationHandle", ctypes.byref(h), ctypes.c_void_p(ptr))
print(r or "cuMemRetainAllocationHandle ok: virtual-memory-managed allocation")
if not r:
    # CUmemAllocationProp: type (int), requestedHandleTypes (int), location {type, id}, ...
    prop = (ctypes.c_int * 16)()
    print(call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop), h) or
          f"allocation properties: type {prop[0]}, requested handle types {prop[1]:#x} "
          "(1 = POSIX file descriptor, 8 = fabric)")
attr = ctypes.c_int()
# CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 18, MEMPOOL_HANDLE = 17
print(call("cuPointerGetAttribute", ctypes.byref(attr), 18, u64(ptr)) or
      f"legacy CUDA IPC capable: {attr.value}")
pool = ctypes.c_void_p()
print(call("cuPointerGetAttribute", ctypes.byref(pool), 17, u64(ptr)) or
      f"memory pool handle: {pool.value}")
