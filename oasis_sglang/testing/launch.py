"""Start and stop real SGLang servers for the main job, the tests and the benchmarks.

Uses SGLang's own ``sglang.test.test_utils.popen_launch_server`` (health polling, timeouts)
and ``kill_process_tree``; adds the CPU-engine environment and the OasisKV flags.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


EXTRA_E2E = "OASIS_E2E_EXTRA"


def extra_e2e() -> bool:
    """Whether the opt-in end-to-end tests run: ``OASIS_E2E_EXTRA=1`` (or its earlier name
    ``OASIS_EAGLE_EXTRA=1``). Today one: the EAGLE-3 PD deployment of
    tests/e2e/test_e2e_pd_oasis.py, a second PD pair with a draft model on both nodes."""
    return "1" in (os.environ.get(EXTRA_E2E), os.environ.get("OASIS_EAGLE_EXTRA"))


def has_cuda() -> bool:
    """True when torch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def base_args(device: Optional[str] = None, max_total_tokens: int = 65536, max_running_requests: int = 4) -> list[str]:
    """Server flags shared by dense and oasis runs: CPU engine (fp32, torch_native) without CUDA.

    ``OASIS_ATTENTION_BACKEND`` overrides the GPU attention backend (default ``triton``); the GPU
    smoke run uses ``torch_native`` so dense and oasis issue the same SDPA calls.
    """
    device = device or ("cuda" if has_cuda() else "cpu")
    # --sleep-on-idle: an idle SGLang scheduler otherwise spins a core, starving the other
    # servers of a test run on a 2-core machine
    args = ["--max-total-tokens", str(max_total_tokens), "--max-running-requests", str(max_running_requests),
            "--log-level", "info", "--sleep-on-idle"]
    if device == "cpu":
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32"]
    else:
        backend = os.environ.get("OASIS_ATTENTION_BACKEND", "triton")
        args += ["--attention-backend", backend, "--sampling-backend", "pytorch", "--disable-cuda-graph"]
    return args


def oasis_args(**cfg) -> list[str]:
    """``--kv-sparse oasis --kv-sparse-config <json of cfg>`` as a flag list."""
    return ["--kv-sparse", "oasis", "--kv-sparse-config", json.dumps(cfg)] if cfg is not None else []


@dataclass
class Server:
    """A running server: ``url``, its process and the file holding its log."""

    url: str
    proc: object
    log_path: Path
    _log: object = field(repr=False, default=None)

    def log(self) -> str:
        """The server's whole log so far."""
        return self.log_path.read_text(errors="replace")

    def residency_lines(self) -> list[str]:
        """The ``OasisKV decode:`` lines of the log, oldest first."""
        return [l for l in self.log().splitlines() if "OasisKV decode:" in l]

    def stop(self) -> None:
        """Kill the server's process tree and close its log."""
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(self.proc.pid)
        if self._log:
            self._log.close()


_HANDED_OUT: set[int] = set()      # ports this process already gave to a server (no reuse)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), never one this
    process handed out before: servers started in parallel get distinct ports even when the OS
    offers a just-released port twice."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1")


def check_port_free(port: int) -> None:
    """Raise ``OSError`` naming ``port`` when something already listens there.

    SGLang's launcher only polls the URL, so a server already on the port would be taken for
    the new one (whose own bind then fails in its log).
    """
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise OSError(f"port {port} on 127.0.0.1 is already in use ({e.strerror}); stop that server "
                          f"or choose another port") from None


def wait_port_free(port: int, timeout: float = 120.0) -> None:
    """Wait (polling every 2 s, at most ``timeout`` seconds) until nothing listens on ``port``:
    a stopped server's port, before a new one starts there. Raises ``OSError``
    (:func:`check_port_free`'s) when it is still taken then."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            check_port_free(port)
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(2)


def launch(model: str, port: int, args: list[str], log_path: Path, timeout: float = 600,
           echo: bool = True) -> Server:
    """Start an SGLang server (``sglang serve``) and wait until it serves.

    The server's output goes to ``log_path``; with ``echo`` (default) also to this process's
    stdout/stderr, as SGLang's launcher does. ``port`` 0 picks a free port; a server on a picked
    port that exits while starting (e.g. one of its internal ports was taken by a server starting
    beside it) is started once more on another port (the first log kept as ``<log>.1``).

    Raises:
        OSError: ``port`` is already in use.
        RuntimeError: the server did not come up in ``timeout`` s or exited; the message holds
            the last lines of its log (all of it is in ``log_path``).
    """
    import time

    t0 = time.monotonic()
    try:
        return _launch_once(model, port, args, log_path, timeout, echo)
    except OSError:
        raise
    except Exception as first:  # noqa: BLE001 - SGLang's launcher raises plain Exception
        left = timeout - (time.monotonic() - t0)
        if port or left < 60:
            raise _launch_error(first, log_path) from first
        Path(log_path).replace(str(log_path) + ".1")
    try:
        return _launch_once(model, 0, args, log_path, left, echo)
    except Exception as second:  # noqa: BLE001
        raise _launch_error(second, log_path) from second


def _launch_error(e: Exception, log_path: Path, lines: int = 30) -> RuntimeError:
    """``e`` with the last ``lines`` lines of the server's log (CI output shows why it failed)."""
    try:
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        tail = "(no log)"
    return RuntimeError(f"SGLang server did not come up: {e}\nlast lines of {log_path}:\n{tail}")


def _launch_once(model: str, port: int, args: list[str], log_path: Path, timeout: float, echo: bool) -> Server:
    from sglang.test.test_utils import popen_launch_server

    import sys

    if port:
        check_port_free(port)
    else:      # a free port may be taken (e.g. by another server's internal ports) before we check
        for attempt in range(10):
            port = free_port()
            try:
                check_port_free(port)
                break
            except OSError:
                if attempt == 9:
                    raise
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)     # set for the kernel tests on CPU; servers run compiled Triton
    # popen_launch_server runs the `sglang` console script: use this interpreter's
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    import shutil

    if shutil.which("sglang", path=env["PATH"]) is None:   # sglang unpacked without its scripts
        bindir = log_path.parent / ".bin"
        bindir.mkdir(parents=True, exist_ok=True)
        (bindir / "sglang").write_text(
            f"#!/bin/sh\nexec {sys.executable} -c 'import sys; from sglang.cli.main import main; "
            f"sys.exit(main())' \"$@\"\n")
        (bindir / "sglang").chmod(0o755)
        env["PATH"] = str(bindir) + os.pathsep + env["PATH"]
    if "--device" in args and args[args.index("--device") + 1] == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    f = open(log_path, "w")
    url = f"http://127.0.0.1:{port}"
    import contextlib

    quiet = open(os.devnull, "w") if not echo else None
    try:
        # popen_launch_server tees the server's output to sys.stdout/stderr as they are now
        with (contextlib.redirect_stdout(quiet) if quiet else contextlib.nullcontext()), \
                (contextlib.redirect_stderr(quiet) if quiet else contextlib.nullcontext()):
            proc = popen_launch_server(model, url, timeout=timeout, other_args=args, env=env,
                                       return_stdout_stderr=(f, f),
                                       device="cpu" if env.get("SGLANG_USE_CPU_ENGINE") else "auto")
    except Exception:
        f.close()
        raise
    return Server(url=url, proc=proc, log_path=log_path, _log=f)
