"""A local Ray cluster that cannot outlive the job that started it.

`ray.init()` without an address starts the cluster's daemons as children of the driver, and a
SIGKILL to the driver leaves its DashboardAgent, RuntimeEnvAgent and worker processes running
(measured on this machine: still alive 60 s later, re-parented to init). So a `--ray` job without an
address starts the cluster here instead: `ray start --head --block` inside a watchdog process in a
session (process group) of its own. The watchdog polls the driver's pid; when the driver is gone, by
any signal, it SIGKILLs the whole group (the daemons, the workers and itself). A driver that ends
normally tears the group down itself (`LocalCluster.stop`).

To attach to a running cluster instead, pass its address (`--ray auto` or `--ray HOST:PORT`); that
cluster is then the operator's, and only the job's own tasks and actors end with the driver (Ray's
fate sharing of a job's workers with its driver).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time


from deepinfer.errors import DeepInferError

WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_watchdog.py")


class ClusterStartError(DeepInferError):
    """The local Ray cluster of a `--ray` job did not come up."""


def _free_port() -> int:
    with socket.socket() as s:  # other users' clusters may hold Ray's default 6379
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """A cluster started by `start_local`: its address and process group."""

    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc, self.address, self.pgid = proc, address, proc.pid

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL what is left after `grace_s`."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.pgid, 0)
                except ProcessLookupError:
                    self.proc.wait(5)
                    return
                time.sleep(0.1)


def use_own_token() -> None:
    """Token auth with a token of this job's own, for this process and the cluster it starts.

    Ray 2.60 turns token auth on for a `ray start` when ~/.ray/auth_token exists (any earlier local
    `ray.init` writes one) but not for a driver that imported ray with RAY_AUTH_MODE unset: attaching
    by address then failed every call with InvalidAuthToken (measured: ray.init retried for 2.5 min).
    Ray caches the mode when it is imported, so an imported Ray is told to read it again."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    if "ray._raylet" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def start_local(num_cpus: float, timeout_s: float = 180.0) -> LocalCluster:
    """Start the watchdog + head node; returns once `ray.init(address)` can attach (the caller attaches)."""
    port = _free_port()
    use_own_token()
    proc = subprocess.Popen(
        # run by path, not `-m`: the watchdog needs only the standard library, not deepinfer's torch
        [sys.executable, WATCHDOG, str(os.getpid()), str(port), str(num_cpus)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    cluster = LocalCluster(proc, f"127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise ClusterStartError(f"the local Ray cluster did not start (exit {proc.returncode}): {err}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return cluster
        except OSError:
            time.sleep(0.2)
    cluster.stop()
    raise ClusterStartError(f"the local Ray cluster did not come up in {timeout_s:.0f}s")
