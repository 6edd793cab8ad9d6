"""Seconds from POST to ready: LocalGPUSpawner (0.25 × H200) vs JupyterHub's SimpleLocalProcessSpawner.

Two real hubs run side by side (`gpupool up`, the second with `spawner_class = "simple"`); spawns alternate
between them so both see the same machine load. Prints a table and the ratio (target ≤ 1.15).

    .venv/bin/python bench/spawn.py [--spawns 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness, tests/harness.py
from harness import Hub  # noqa: E402

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {quota: {gpus: 100, per_user_gpus: 100}}
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision], default: true}
billing: {prices: {H200: '3.20'}}
""",
}
SELF = 'c.LocalGPUSpawner.run_as = "self"\n'
# The stock spawner runs `jupyterhub-singleuser` from PATH: name the one beside this Python, so that the bench runs
# the same without an activated virtual environment.
SIMPLE = ('c.JupyterHub.spawner_class = "simple"\nc.Spawner.args = ["--allow-root"]\n'
          f'c.Spawner.cmd = [{str(Path(sys.executable).parent / "jupyterhub-singleuser")!r}]\n')


def time_spawn(hub: Hub, user: str, options: dict) -> float:
    start = time.perf_counter()
    reply = hub.api("POST", f"/users/{user}/server", json=options)
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready(user)
    elapsed = time.perf_counter() - start
    hub.stop_server(user)
    return elapsed


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawns", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gpu = Hub(Path(tmp) / "gpupool", POLICY, SELF, mlflow=False)
        plain = Hub(Path(tmp) / "simple", POLICY, SIMPLE, mlflow=False)
        try:
            gpu.start()
            plain.start()
            gpu.add_user("bench", "vision")
            plain.add_user("bench", "vision")
            time_spawn(gpu, "bench", {"profile": "h200-quarter"})  # warm-up: imports, caches
            time_spawn(plain, "bench", {})
            times: dict[str, list[float]] = {"LocalGPUSpawner": [], "SimpleLocalProcessSpawner": []}
            for _ in range(args.spawns):
                times["LocalGPUSpawner"].append(time_spawn(gpu, "bench", {"profile": "h200-quarter"}))
                times["SimpleLocalProcessSpawner"].append(time_spawn(plain, "bench", {}))
        finally:
            gpu.stop()
            plain.stop()
    print(f"{'spawner':<28}{'spawns':>8}{'median s':>11}{'p95 s':>9}")
    for name, values in times.items():
        print(f"{name:<28}{len(values):>8}{statistics.median(values):>11.3f}{p95(values):>9.3f}")
    ratio = statistics.median(times["LocalGPUSpawner"]) / statistics.median(times["SimpleLocalProcessSpawner"])
    ratio95 = p95(times["LocalGPUSpawner"]) / p95(times["SimpleLocalProcessSpawner"])
    print(f"ratio LocalGPUSpawner / SimpleLocalProcessSpawner: median {ratio:.3f}, p95 {ratio95:.3f} (target ≤ 1.15)")


if __name__ == "__main__":
    main()
