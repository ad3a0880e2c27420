"""A short run of the main job (`pimhbm demo`), end to end, as a user runs it."""

import json
import os
import subprocess
import sys

from conftest import cached_env


def test_short_demo_run_ends_bit_identical(tmp_path):
    out = tmp_path / "demo"
    env = cached_env()
    env.pop("XLA_FLAGS", None)  # one device, as `make demo` runs
    r = subprocess.run([sys.executable, "-m", "pimhbm_cli", "demo", "--steps", "40", "--faults",
                        "3", "--layers", "1", "--hidden", "32", "--batch", "8", "--seq", "32",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verdict: bit-identical" in r.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["bit_identical"] is True
    assert metrics["compilations_after_prewarm"] == 0
    assert all(row["injected"] == 3 and row["repaired"] == 3 for row in metrics["faults"].values())
    assert len(metrics["faults"]) == 6
    assert (out / "loss.png").stat().st_size > 10_000


def test_a_run_that_cannot_go_on_ends_with_its_reason_not_a_traceback(monkeypatch, capsys):
    """PersistentFault / DeviceFailure from the main job: exit code 3 and the engine's message
    (what happened, what to do) on stderr."""
    import pimhbm_cli as cli
    from pimhbm_cli import demo
    from pimhbm.recovery import PersistentFault

    def fails(args):
        raise PersistentFault("step 7 was skipped 5 times in a row", 7, 5, [])

    monkeypatch.setattr(demo, "run", fails)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds a flag
    assert cli.main(["demo", "--steps", "3"]) == 3
    assert "pimhbm demo: stopped: step 7 was skipped 5 times in a row" in capsys.readouterr().err
