"""Benchmark: `gpupool replay` of the Philly trace, against a plain heap-based event loop of the same events.

    .venv/bin/python bench/replay.py                 # the whole trace (82,247 jobs), pooled and dedicated
    .venv/bin/python bench/replay.py --limit 20000

Times, in the same run, (a) the replay through the platform's admission, queue pass and placement
(`gpupool.hub.replay.replay`) and (b) a loop that pops and pushes exactly the events the replay processed
(each arrival, then each job's end at the time the replay started it plus its duration) with no policy at
all. Prints events per second of both and the ratio (b) / (a): what the platform's decisions cost per event.
Reads the trace from ../shared/data/traces/philly/ relative to the repository root. The target (issue 38) is the
whole trace in under 5 s of CPU per policy set; `--repeat N` times each replay N times and reports the fastest
(the machine is shared: the least disturbed run is the closest to the code's own cost).
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import time
from pathlib import Path

from gpupool.hub import replay as R

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "philly"


def plain_loop(run: R.Replay, teams: set[str]) -> int:
    """The same events, with nothing decided: arrivals, and ends where the replay put them."""
    heap = [(r.job.arrival, 1, n, r) for n, r in enumerate(run.results.values()) if r.job.team in teams]
    heapq.heapify(heap)
    events = 0
    while heap:
        now, kind, n, result = heapq.heappop(heap)
        events += 1
        if kind == 1 and result.started is not None:
            heapq.heappush(heap, (result.started + result.job.duration, 0, n, result))
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, help="only the first N jobs")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="time each replay N times, keep the fastest")
    args = parser.parse_args()
    began = time.process_time()
    work = R.read_philly(TRACES / "philly.csv", limit=args.limit)
    read_s = time.process_time() - began
    vcs = R.read_philly_vcs(TRACES / "philly_vc.csv")
    print(f"{len(work.jobs)} jobs (read in {read_s:.2f} s), load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"{'policies':<10} {'events':>8} {'replay s':>9} {'wall s':>7} {'events/s':>10} {'plain s':>8} "
          f"{'events/s':>10} {'ratio':>6}")
    for name, dedicated in (("pooled", False), ("dedicated", True)):
        policy = R.philly_policy(vcs, dedicated=dedicated)
        replay_s = wall_s = math.inf
        for _ in range(max(1, args.repeat)):
            began, began_wall = time.process_time(), time.perf_counter()
            run = R.replay(work, policy, node_cards=8)
            replay_s = min(replay_s, time.process_time() - began)
            wall_s = min(wall_s, time.perf_counter() - began_wall)
        plain_s = math.inf
        for _ in range(max(1, args.repeat)):
            began = time.process_time()
            events = plain_loop(run, set(policy.teams))
            plain_s = min(plain_s, time.process_time() - began)
        assert events == run.events, (events, run.events)
        print(f"{name:<10} {events:>8} {replay_s:>9.2f} {wall_s:>7.2f} {events / replay_s:>10.0f} {plain_s:>8.3f} "
              f"{events / plain_s:>10.0f} {plain_s / replay_s:>6.3f}")
    print("replay s and plain s are CPU seconds of this process (time.process_time), so other load on the machine "
          "counts less; wall s is the clock's")


if __name__ == "__main__":
    main()
