"""Two NIXL agents over UCX loopback: the CPU their progress threads use while idle, and the time
of a READ of scattered 4 KiB pieces, with NIXL's progress thread pausing ``--delay-us``
microseconds between polls (``disagg.transport.set_progress_delay``; 0 = nixl's own busy polling).

    python scripts/probe_nixl_progress.py --delay-us 0      # 5.94 CPU s per 3 s on the dev box
    python scripts/probe_nixl_progress.py --delay-us 100    # 0.11 (docs/benchmarks/2026-12-04_nixl-progress-delay-cpu.md)

Needs the ``[disagg]`` extra (nixl). Prints one line per measurement.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-us", type=int, default=100, help="progress-thread pause, 0..1000000 (0: nixl's spinning)")
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle to measure the CPU over")
    ap.add_argument("--reads", type=int, default=20, help="READs to time")
    a = ap.parse_args()
    if not 0 <= a.delay_us <= 1_000_000:
        ap.error(f"--delay-us must be 0..1000000 microseconds, got {a.delay_us}")
    if not 0 < a.idle_s <= 600:
        ap.error(f"--idle-s must be in (0, 600] seconds, got {a.idle_s}")
    if not 1 <= a.reads <= 100_000:
        ap.error(f"--reads must be 1..100000, got {a.reads}")
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        print("probe_nixl_progress: nixl is not installed (pip install '.[disagg]')", file=sys.stderr)
        return 2
    from oasis_sglang.disagg.transport import set_progress_delay

    set_progress_delay(a.delay_us)

    def cfg():
        return nixl_agent_config(backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)

    src = torch.arange(1 << 20, dtype=torch.uint8).reshape(256, 4096).clone()
    dst = torch.zeros_like(src)
    pf, dc = nixl_agent("probe-src", cfg()), nixl_agent("probe-dst", cfg())
    try:
        t0 = time.process_time()
        time.sleep(a.idle_s)
        print(f"two idle agents, pause {a.delay_us} us: {time.process_time() - t0:.2f} CPU s in {a.idle_s:g} s")
        reg = [pf.register_memory(src), dc.register_memory(dst)]
        dc.add_remote_agent(pf.get_agent_metadata())
        pf.add_remote_agent(dc.get_agent_metadata())
        idx = list(range(0, 256, 3))
        remote = pf.get_xfer_descs([(src.data_ptr() + i * 4096, 4096, 0) for i in idx], "DRAM")
        local = dc.get_xfer_descs([(dst.data_ptr() + i * 4096, 4096, 0) for i in idx], "DRAM")
        times = []
        for r in range(a.reads):
            h = dc.initialize_xfer("READ", local, remote, "probe-src", b"n%d" % r)
            t0 = time.perf_counter()
            dc.transfer(h)
            while (st := dc.check_xfer_state(h)) not in ("DONE", "ERR"):
                pass
            times.append(time.perf_counter() - t0)
            dc.release_xfer_handle(h)
            if st == "ERR":
                print("probe_nixl_progress: a READ failed", file=sys.stderr)
                return 1
        ok = torch.equal(dst[idx], src[idx])
        print(f"READ of {len(idx)} x 4 KiB pieces: median {1e3 * statistics.median(times):.3f} ms, "
              f"max {1e3 * max(times):.3f} ms over {a.reads}; bytes equal: {ok}")
        pf.deregister_memory(reg[0])
        dc.deregister_memory(reg[1])
        return 0 if ok else 1
    finally:
        del pf, dc


if __name__ == "__main__":
    sys.exit(main())
