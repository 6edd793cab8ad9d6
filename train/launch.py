"""`python -m gpupool.train.launch EXIT_FILE -- COMMAND ...`: run a job's command and write how it ended.

The embedded job runner starts every run of a job through this, in the job's own process group, as the
job's user. It runs the command as its child and when the child ends writes its exit status to EXIT_FILE (`-N`
when signal N ended it), atomically, then exits with the same status. The runner reads that file for a run it
re-adopted after a hub restart, whose exit status no `wait()` can give it. A SIGKILL of the group (the end of a
grace period) leaves no file: the runner knows it sent it.

The runner stops a run by signalling its whole process group, as a terminal does its foreground job: the command
and its own children hear SIGTERM (or SIGINT) once, from there. The launcher outlives it to write the status and
does not pass it on: a second delivery is not harmless (a handler running again inside itself, a second
KeyboardInterrupt in the middle of the first one's clean-up). Stop a job with `gpupool jobs cancel|suspend`, or
signal its group (`kill -TERM -PGID`).
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


def _outlive(signum, frame) -> None:
    """SIGTERM or SIGINT to the run's group: the command has it too; the launcher waits for its end."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m gpupool.train.launch EXIT_FILE -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    exit_file, command = args[0], args[2:]
    # Caught here (the launcher stays), and so back to their defaults in the command after its exec, whatever the
    # process that started the launcher had.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _outlive)
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        print(f"gpupool: cannot run {command[0]!r}: {error.strerror or error}", file=sys.stderr, flush=True)
        write_status(exit_file, 127)
        return 127
    status = child.wait()
    write_status(exit_file, status)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
