"""The watchdog of a `--ray` job's local cluster (see `ray_cluster.py`): started by path in a
session of its own, it runs `ray start --head --block` in that session and SIGKILLs the whole
process group once the driver's pid is gone. Standard library only: it must not import deepinfer
(torch: about 230 MB and 1.3 s, measured).

    python deepinfer/jobs/ray_watchdog.py DRIVER_PID PORT NUM_CPUS
"""

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5  # how often the driver's pid is checked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie driver (killed, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def watch(driver: int, port: int, num_cpus: str) -> None:
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1",  # a local cluster: not reachable from other hosts
         f"--num-cpus={max(1, round(float(num_cpus)))}", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL,
    )
    while _alive(driver) and head.poll() is None:
        time.sleep(POLL_S)
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the daemons, their workers, and this watchdog


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
