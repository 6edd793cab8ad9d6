"""The hot-reloading policy: the policy of a directory, re-read when its files change.

Every process that serves requests (the hub, its spawners and pages, the accounting service, the MLflow app)
asks here, so an edit of the policy files takes effect everywhere without a restart, and an invalid edit
never replaces a valid policy.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from gpupool.policies.loader import PolicyError, load_policy, policy_file_paths
from gpupool.policies.model import Policy

_policy_cache: dict[str, tuple[float, Policy]] = {}
#: Per directory: the stamp of the files last rejected, and the contents already logged as rejected.
_rejected: dict[str, tuple[float, set[str]]] = {}


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
    stamp = max((f.stat().st_mtime_ns for f in files), default=0) + len(files)
    cached = _policy_cache.get(directory)
    if cached and cached[0] == stamp:
        return cached[1]
    rejected_stamp, logged = _rejected.get(directory, (None, set()))
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
        _rejected[directory] = (stamp, logged)
        return cached[1]
    _policy_cache[directory] = (stamp, policy)
    return policy
