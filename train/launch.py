"""`python -m gpupool.train.launch EXIT_FILE -- COMMAND ...`: run a job's command and write how it ended.

The embedded job runner starts every run of a job through this, in the job's own process group, as the
job's user. It runs the command as its child, passes SIGTERM and SIGINT on (the runner signals the whole
group, so the child has them already; passing them again is harmless), and when the child ends writes its
exit status to EXIT_FILE (`-N` when signal N ended it), atomically, then exits with the same status. The
runner reads that file for a run it re-adopted after a hub restart, whose exit status no `wait()` can give
it. A SIGKILL of the group (the end of a grace period) leaves no file: the runner knows it sent it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def write_status(path: str, status: int) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as out:
        out.write(f"{status}\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m gpupool.train.launch EXIT_FILE -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    exit_file, command = args[0], args[2:]
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        print(f"gpupool: cannot run {command[0]!r}: {error.strerror or error}", file=sys.stderr, flush=True)
        write_status(exit_file, 127)
        return 127

    def forward(signum, frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    status = child.wait()
    write_status(exit_file, status)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
