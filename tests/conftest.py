import atexit
import os
import random
import shutil
import tempfile
import uuid
import zlib

# Four virtual CPU devices, for the data-parallel tests; on GPUs, XLA's deterministic ops
# (the tests replay steps and compare bits, as the demo does); set before JAX starts.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_gpu_deterministic_ops" not in _flags:
    _flags += " --xla_gpu_deterministic_ops=true"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()

# Several processes of the suite share one GPU (a test's child processes, pytest-xdist's
# workers): each takes the memory it needs, not JAX's default of 75 % of the card, which left a
# child started after the parent's tests unable to open cuBLAS ("BlasLt is unavailable").
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One persistent compilation cache for the session and its workers (pytest-xdist; they inherit
# the environment): the many Trainers of the suite compile the same programs, and each takes them
# from the cache after the first. JAX reports a load from the cache as a compilation, so "0
# compilations after prewarm" keeps its meaning. A test's single child process takes it through
# cached_env(). Not the processes of a multi-process run: only process 0 writes to the cache
# (JAX's rule) and process 1 finds none of its programs there (on the CPU it had no hit at all),
# so process 0 would load what process 1 compiles, and the first collective's 30 s rendezvous
# on the CPU times out.
if "PIMHBM_TEST_JAX_CACHE" not in os.environ:
    os.environ["PIMHBM_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="pimhbm-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["PIMHBM_TEST_JAX_CACHE"], ignore_errors=True)

import jax  # noqa: E402
import numpy as np
import pytest

jax.config.update("jax_compilation_cache_dir", os.environ["PIMHBM_TEST_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_report_header(config):
    return [f"jax {jax.__version__}, devices: {jax.devices()}",
            f"PIMHBM_SEED={_SEED} (set it to replay a run)"]


_SEED = int(os.environ.get("PIMHBM_SEED", random.SystemRandom().randrange(2**32)))
# Parallel workers (pytest-xdist, started after this file is loaded) inherit the environment:
# every worker then draws from the seed in the report header.
os.environ["PIMHBM_SEED"] = str(_SEED)


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is in the report header and in failures."""
    seed = (_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**32
    return np.random.default_rng(seed)


def cached_env(env=None) -> dict:
    """``env`` (this process's environment where None) with the session's compilation cache, for
    a test's single child process: JAX reads these variables as it starts, and the child loads
    what the session (or an earlier child) compiled. Not for a multi-process run (see above)."""
    env = dict(os.environ if env is None else env)
    env.update(JAX_COMPILATION_CACHE_DIR=os.environ["PIMHBM_TEST_JAX_CACHE"],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


requires_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")


def needs_devices(n: int) -> None:
    """Skips the calling test where JAX has fewer than ``n`` devices (a one-GPU machine; on the
    CPU, tests run on 4 virtual devices)."""
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, this machine has {len(jax.devices())}")


def nan_at_step(batches, step: int):
    """``batches`` (step -> batch) with a NaN in step ``step``'s inputs: the same non-finite
    gradient on every replay of that step (not a transient fault)."""
    def batch_fn(s):
        b = batches(s)
        if s == step:
            b["x"][3, 5] = np.nan
        return b
    return batch_fn


def new_shm_name() -> str:
    """A fresh shared-memory region name for one test."""
    return f"pimhbm_test_{uuid.uuid4().hex[:12]}"


def uninterrupted_state(make_trainer, steps: int) -> dict:
    """The state after ``steps`` of a run without faults (its region removed afterwards); the run
    must report nothing and compile nothing after its prewarm."""
    from pimhbm.backup import HostBackup
    name = new_shm_name()
    try:
        tr = make_trainer(name)
        stats = tr.run(steps)
        assert stats.incidents == [] and tr.compiles == 0
        return tr.current_state()
    finally:
        HostBackup.unlink(name)


@pytest.fixture
def shm_name():
    """A region name for the test; the region (and its "_ref" twin) removed afterwards."""
    from pimhbm.backup import HostBackup
    name = new_shm_name()
    yield name
    HostBackup.unlink(name)
    HostBackup.unlink(name + "_ref")
