"""A protected training run for the crash test: fresh or resumed from shared memory.

usage: python crash_worker.py SHM_NAME STEPS OUT.npz [--resume] [--pace SECONDS]
Prints "step N" after every committed step; saves the final state to OUT.npz.
"""

import sys
import time

import numpy as np

from pimhbm import inplace
from pimhbm.models import mlp
from pimhbm.recovery import Trainer


def main() -> int:
    name, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = "--resume" in sys.argv
    pace = float(sys.argv[sys.argv.index("--pace") + 1]) if "--pace" in sys.argv else 0.0
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=256, group=4)
    trainer = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name,
                      snapshot_every=10, scrub_every=5, resume=resume)
    if resume:
        print(f"resumed from step {trainer.next_step - 1}", flush=True)
    trainer.prewarm()

    def progress(step, stats):
        print(f"step {step}", flush=True)
        if pace:
            time.sleep(pace)

    t0 = time.perf_counter()
    stats = trainer.run(steps, progress=progress)
    np.savez(out, **trainer.current_state())
    print(f"done {stats.steps_committed} committed, {stats.compiles_after_prewarm} compiles, "
          f"{time.perf_counter() - t0:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
