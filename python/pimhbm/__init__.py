"""pim-hbm-bypass: keeps JAX training correct when GPU memory or arithmetic silently goes wrong.

Integrity scan (per-chunk digests, NaN/Inf counts, max |x|), guarded AdamW with commit-or-skip
on the device, chunk repair from a backup, host snapshots in shared memory; the recovery engine
is ``pimhbm.recovery.Trainer``. Every op is an XLA FFI call on CPU and GPU.
"""

__version__ = "0.1.0"

from pimhbm.scan import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_SIZE,
    ScanResult,
    num_chunks,
    scan,
    scan_tree,
    verify,
    verify_tree,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_SIZE",
    "ScanResult",
    "num_chunks",
    "scan",
    "scan_tree",
    "verify",
    "verify_tree",
]

from pimhbm.update import (  # noqa: E402
    GuardState,
    Slot,
    guard,
    join_master,
    restore_unless,
    split_master,
)

__all__ += ["GuardState", "Slot", "guard", "join_master", "restore_unless", "split_master"]

from pimhbm import faults  # noqa: E402,F401

from pimhbm.gate import healthy_mean, insulate, insulate_tree, probe  # noqa: E402

__all__ += ["healthy_mean", "insulate", "insulate_tree", "probe"]

from pimhbm.repair import (  # noqa: E402
    NOT_LISTED,
    OUT_OF_RANGE,
    REPAIRED,
    SOURCE_DAMAGED,
    STILL_DAMAGED,
    backup_snapshot,
    repair,
)

__all__ += ["NOT_LISTED", "OUT_OF_RANGE", "REPAIRED", "SOURCE_DAMAGED", "STILL_DAMAGED",
            "backup_snapshot", "repair"]
from pimhbm import telemetry  # noqa: E402,F401
from pimhbm.telemetry import Health, DeviceHealth, Monitor, health  # noqa: E402

__all__ += ["Health", "DeviceHealth", "Monitor", "health"]
from pimhbm import peer  # noqa: E402,F401
from pimhbm import report  # noqa: E402,F401

# The modules users reach as pimhbm.<module>.<name> (pimhbm.update.adamw,
# pimhbm.recovery.Trainer, pimhbm.train.llama_trainer), loaded by a plain `import pimhbm`. Last,
# because each of them imports pimhbm and uses the names above.
from pimhbm import backup, campaign, inplace, recovery, train  # noqa: E402,F401

# The guarded optimizer: AdamW updated in place on one copy of the state (pimhbm.inplace). The
# two-slot one is pimhbm.update.adamw.
from pimhbm.inplace import AdamW, AdamWState, UpdateReport, adamw  # noqa: E402

__all__ += ["AdamW", "AdamWState", "UpdateReport", "adamw"]

# Attention whose replays are bit-identical without XLA's deterministic flag (pimhbm.attention).
from pimhbm.attention import attention  # noqa: E402

__all__ += ["attention"]
