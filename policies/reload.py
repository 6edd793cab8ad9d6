"""The hot-reloading policy: the policy of a directory, re-read when its files change.

Every process that serves requests (the hub, its spawners and pages, the accounting service, the MLflow app)
asks here, so an edit of the policy files takes effect everywhere without a restart, and an invalid edit
never replaces a valid policy; `refused_change` says why one was refused (the hub's pages show it to admins).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from gpupool.policies.loader import PolicyError, load_policy, policy_file_paths
from gpupool.policies.model import Policy

_policy_cache: dict[str, tuple[float, Policy]] = {}
#: Per directory: the stamp of the files last rejected, the contents already logged as rejected, and why.
_rejected: dict[str, tuple[float, set[str], PolicyError]] = {}


def _contents_digest(files) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path).encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            pass
        digest.update(b"\0")
    return digest.hexdigest()


def current_policy(directory: str | Path, log=None) -> Policy:
    """The policy in `directory`, re-read when a file changes; an invalid edit keeps the last valid policy.

    A rejected edit is logged once per distinct content (not on every read while it stays on disk).
    """
    directory = str(directory)
    files = policy_file_paths(directory)
    stamp = _stamp(files)
    cached = _policy_cache.get(directory)
    if cached and cached[0] == stamp:
        return cached[1]
    rejected_stamp, logged, _ = _rejected.get(directory, (None, set(), None))
    if cached and rejected_stamp == stamp:
        return cached[1]
    try:
        policy = load_policy(directory)
    except PolicyError as error:
        if cached is None:
            raise
        digest = _contents_digest(files)
        if log and digest not in logged:
            log.error("Policy change in %s rejected, keeping the previous policy:\n%s", directory, error)
        logged.add(digest)
        _rejected[directory] = (stamp, logged, error)
        return cached[1]
    _policy_cache[directory] = (stamp, policy)
    return policy


def _stamp(files) -> int:
    return max((f.stat().st_mtime_ns for f in files), default=0) + len(files)


def refused_change(directory: str | Path) -> PolicyError | None:
    """Why the policy files in `directory` as they are now were refused (the last valid policy stays in force), or
    None when they are in force. Reads them again when they changed, as `current_policy` does."""
    try:
        current_policy(directory)
    except PolicyError as error:  # never valid in this process: nothing of them is in force
        return error
    rejected = _rejected.get(str(directory))
    return rejected[2] if rejected and rejected[0] == _stamp(policy_file_paths(directory)) else None
