"""`gpupool-hub`: JupyterHub with gpupool's rules where JupyterHub has no hook for them (sharing servers).

`gpupool up` runs this instead of `jupyterhub`; configuration, options and behaviour are JupyterHub's, plus
`gpupool.hub.sharing`'s routes in front of JupyterHub's share routes.
"""

from __future__ import annotations

import os

from jupyterhub.app import JupyterHub
from traitlets import Unicode, default

from gpupool.hub.sharing import share_handlers
from gpupool.policies import DEFAULT_POLICY_DIR


class GPUPoolHub(JupyterHub):
    """JupyterHub whose share routes refuse shares outside the team a server runs for."""

    policy_dir = Unicode(
        help="""
        The gpupool policies whose teams decide who may share a server with whom (`teams.TEAM.sharing`).
        Re-read when they change, as the spawner does. Default: `$GPUPOOL_POLICIES`, else the default set.

            c.GPUPoolHub.policy_dir = "/etc/gpupool/policies"
        """,
    ).tag(config=True)

    @default("policy_dir")
    def _default_policy_dir(self):
        return os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR))

    def init_handlers(self):
        super().init_handlers()
        # Tornado takes the first route that matches: these go before JupyterHub's routes of the same paths.
        self.handlers[0:0] = self.add_url_prefix(self.hub_prefix, share_handlers(self.policy_dir))


main = GPUPoolHub.launch_instance
