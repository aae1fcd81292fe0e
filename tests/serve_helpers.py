"""``superfluid serve`` as a subprocess on a free port, for tests that need a real
server: its own process, a supervised worker, signals, resident memory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running ``superfluid serve``; its output goes to a temporary file (``log()``)."""

    def __init__(self, *args: str, runtime: str = "toy", env: dict[str, str] | None = None, ready_timeout: float = 120.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("superfluid")
        self._state = None
        if "--state-dir" not in args:  # stored responses: a directory of its own, not the user's
            self._state = tempfile.mkdtemp(prefix="superfluid-state-")
            args = (*args, "--state-dir", self._state)
        self.cmd = [str(exe), "serve", "--runtime", runtime, "--port", str(self.port), "--log-level", "warning", *args]
        self._log = tempfile.NamedTemporaryFile(prefix="superfluid-serve-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.pop("SUPERFLUID_FAIL_RUNTIME", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"superfluid serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"superfluid serve did not come up in {ready_timeout:.0f} s:\n{self.log()}")
            time.sleep(0.2)

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def rss_kib(self) -> int:
        """Resident memory of the server and its model worker (VmRSS, KiB)."""
        pids = [self.proc.pid, self.health()["pid"]]
        return sum(vm_rss_kib(p) for p in set(pids))

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        if self._state is not None:
            shutil.rmtree(self._state, ignore_errors=True)
        if os.environ.get("SUPERFLUID_KEEP_SERVER_LOG"):
            print(f"server log kept: {self._log.name}")
            return
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for {pid}")
