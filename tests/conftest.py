import atexit
import os
import random
import shutil
import tempfile
import zlib

# Four virtual CPU devices, for the data-parallel tests; on GPUs, XLA's deterministic ops
# (the tests replay steps and compare bits, as the demo does); set before JAX starts.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_gpu_deterministic_ops" not in _flags:
    _flags += " --xla_gpu_deterministic_ops=true"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import numpy as np
import pytest

# One persistent compilation cache for the session (its workers too, through the environment):
# the many Trainers of the suite compile the same programs, and each takes them from the cache
# after the first. A Trainer counts a program taken from the cache after its prewarm as a
# compilation, so "0 compilations" keeps its meaning.
if "PIMHBM_TEST_JAX_CACHE" not in os.environ:
    os.environ["PIMHBM_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="pimhbm-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["PIMHBM_TEST_JAX_CACHE"], ignore_errors=True)
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


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


requires_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
