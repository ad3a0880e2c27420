"""The agreement of a CUDA IPC round (pimhbm.ipc.run_round) without GPUs: two threads stand in
for two processes, sharing a key-value store that behaves like jax.distributed's (blocking gets
with a deadline). Whatever goes wrong in one process -- an export that raises, a pull that does
not verify, a process that never answers -- every process must come to the same decision within
the round's bound, never one left waiting for the other."""

import threading
import time
from dataclasses import dataclass

import pytest

from pimhbm import _core, ipc


class Store:
    def __init__(self):
        self.kv, self.cv = {}, threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.cv:
            assert key not in self.kv, f"{key} set twice"
            self.kv[key] = bytes(value)
            self.cv.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.kv[key]


@dataclass(frozen=True)
class Dev:
    process_index: int
    platform: str = "gpu"
    local_hardware_id: int = 0


def run_two(monkeypatch, export, pull, timeout_ms=400, silent=()):
    """Runs one round in two 'processes' (a pull from process 0's device into process 1's);
    returns what each raised or returned, and the seconds the slower one took."""
    store, me = Store(), threading.local()
    monkeypatch.setattr(ipc, "_client", lambda: store)
    monkeypatch.setattr(ipc.jax, "process_index", lambda: me.i)
    monkeypatch.setattr(ipc.jax, "process_count", lambda: 2)
    monkeypatch.setattr(ipc, "_export", export)
    monkeypatch.setattr(ipc, "_pull", pull)
    pulls = [ipc.Pull("w.nu", Dev(0), Dev(1), [3, 7], (None, None), (None, None), 1024)]
    out = [None, None]

    def process(i):
        me.i = i
        if i in silent:
            return
        try:
            out[i] = ipc.run_round("t", 1, pulls, timeout_ms)
        except Exception as err:  # noqa: BLE001
            out[i] = err

    t0 = time.monotonic()
    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10 * timeout_ms / 1000)
    assert not any(t.is_alive() for t in threads), "a process was left waiting"
    return out, time.monotonic() - t0


def ok_export(p):
    return b"handles"


def ok_pull(p, blob, timeout_ms):
    assert blob == b"handles"
    return b"ok"


def test_a_round_that_works_repairs_its_chunks_in_both_processes(monkeypatch):
    out, _ = run_two(monkeypatch, ok_export, ok_pull)
    assert out == [2, 2]


@pytest.mark.parametrize("error", [_core.IpcUnavailable("no IPC handle for this memory"),
                                   RuntimeError("cuMemGetAddressRange: no IPC handle"),
                                   ipc.Unavailable("no IPC handle for the devices")])
def test_an_export_that_raises_makes_the_round_unavailable_everywhere(monkeypatch, error):
    def export(p):
        raise error

    out, took = run_two(monkeypatch, export, ok_pull)
    assert all(isinstance(o, ipc.Unavailable) for o in out), out
    assert all("no IPC handle" in str(o) for o in out), out
    assert took < 1.0  # decided at once, not at the deadline


def test_a_chunk_that_does_not_verify_fails_the_round_in_both_processes(monkeypatch):
    def pull(p, blob, timeout_ms):
        return b"failed chunks [7] did not verify"

    out, _ = run_two(monkeypatch, ok_export, pull)
    assert all(type(o) is RuntimeError and "[7] did not verify" in str(o) for o in out), out


def test_a_process_that_never_answers_is_fatal_within_the_bound(monkeypatch):
    out, took = run_two(monkeypatch, ok_export, ok_pull, timeout_ms=300, silent=(0,))
    assert isinstance(out[1], ipc.Fatal) and "no answer" in str(out[1]), out
    assert took < 4 * 0.3 + 0.5


def test_an_unforeseen_error_in_a_pull_is_fatal_in_both_processes(monkeypatch):
    def pull(p, blob, timeout_ms):
        raise TypeError("something nobody planned for")

    out, took = run_two(monkeypatch, ok_export, pull)
    assert all(isinstance(o, ipc.Fatal) and "nobody planned" in str(o) for o in out), out
    assert took < 1.0


def run_pull_that_raises(monkeypatch, error):
    """A round whose pull goes through ipc._pull, with a _core.ipc_pull that raises ``error``;
    returns what each process raised, the seconds taken and the pulls that ran."""
    real_pull = ipc.__dict__["_pull"]

    class Core:
        IpcUnavailable = _core.IpcUnavailable

        @staticmethod
        def ipc_pull(*args):
            raise error

    monkeypatch.setattr(ipc, "_core", Core)
    monkeypatch.setattr(ipc, "_on", lambda x, device: FakeBuffer())
    pulls_seen = []

    def pull(p, blob, timeout_ms):
        pulls_seen.append(p.name)
        return real_pull(p, blob, timeout_ms)

    out, took = run_two(monkeypatch, ok_export, pull)
    return out, took, pulls_seen


def test_a_pull_that_raises_is_fatal_in_both_processes(monkeypatch):
    out, _, pulls_seen = run_pull_that_raises(
        monkeypatch, RuntimeError("pimhbm IPC pull: the pull did not finish within 400 ms"))
    assert pulls_seen == ["w.nu"]
    assert all(isinstance(o, ipc.Fatal) and "did not finish" in str(o) for o in out), out


class FakeBuffer:
    nbytes = 4096

    def unsafe_buffer_pointer(self):
        return 0x1000


def test_an_unforeseen_error_inside_the_pull_call_is_fatal_in_both_processes(monkeypatch):
    """The same through ipc._pull itself: an error of any type from the pull is its outcome."""
    out, took, _ = run_pull_that_raises(
        monkeypatch, TypeError("ipc_pull(): incompatible function arguments"))
    assert all(isinstance(o, ipc.Fatal) and "incompatible function" in str(o) for o in out), out
    assert took < 1.0


def nonces(monkeypatch, silent=(), timeout_ms=300):
    """Each 'process's run_nonce (or what it raised), with one store for both."""
    store, me = Store(), threading.local()
    monkeypatch.setattr(ipc, "_client", lambda: store)
    monkeypatch.setattr(ipc.jax, "process_index", lambda: me.i)
    out = [None, None]

    def process(i):
        me.i = i
        if i not in silent:
            try:
                out[i] = ipc.run_nonce("t", timeout_ms)
            except Exception as err:  # noqa: BLE001
                out[i] = err

    threads = [threading.Thread(target=process, args=(i,)) for i in (1, 0)]  # 1 asks first
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    return out


def test_every_process_of_a_run_gets_the_same_fresh_nonce(monkeypatch):
    first, again = nonces(monkeypatch), nonces(monkeypatch)
    assert first[0] == first[1] and len(first[0]) == 32 and int(first[0], 16) >= 0
    assert again[0] == again[1] and again[0] != first[0]  # drawn anew for each run


def test_without_process_0_the_nonce_is_a_clear_error(monkeypatch):
    out = nonces(monkeypatch, silent=(0,))
    assert isinstance(out[1], ipc.Fatal) and "no run nonce from process 0" in str(out[1])
