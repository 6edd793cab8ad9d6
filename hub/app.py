"""`gpupool-hub`: JupyterHub with gpupool's rules where JupyterHub has no hook for them (sharing servers), and
the embedded mode's job runner.

`gpupool up` runs this instead of `jupyterhub`; configuration, options and behaviour are JupyterHub's, plus
`gpupool.hub.sharing`'s routes in front of JupyterHub's share routes, the profiles' availability
(`gpupool.hub.availability`) and, when the spawner is the embedded
`LocalGPUSpawner`, the training jobs' runner (`gpupool.spawner.jobs`) in the hub process: one scheduler
authority per machine for servers and jobs.
"""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

from jupyterhub import orm
from jupyterhub.app import JupyterHub
from traitlets import Unicode, default

from gpupool.hub.availability import availability_handlers
from gpupool.hub.config import TEMPLATES
from gpupool.hub.sharing import share_handlers
from gpupool.hub.spawn_api import spawn_api_handlers
from gpupool.hub.spawn_page import spawn_page_handlers
from gpupool.policies import DEFAULT_POLICY_DIR
from gpupool.spawner.wiring import JOB_TOKEN_SCOPES

#: How long a run's hub token stays valid at most (it is removed when the run ends).
JOB_TOKEN_DAYS = 30

#: The job backend (`gpupool.spawner.jobs`) each spawner's hub runs its training jobs on, by the spawner class's
#: import path (a name, not the class: the Kubernetes client is 34 MiB of the embedded hub's memory at rest).
#: A spawner class may name its own instead (a `job_backend` class attribute).
JOB_BACKENDS = {"gpupool.spawner.local.LocalGPUSpawner": "local", "gpupool.spawner.kube.GPUKubeSpawner": "volcano"}


def job_backend_of(spawner_class) -> str | None:
    """The job backend a hub of `spawner_class` runs: the class's own `job_backend`, else `JOB_BACKENDS`' entry of
    the class or of the nearest class it derives from; None: that hub runs no training jobs."""
    if not isinstance(spawner_class, type):
        return None
    declared = getattr(spawner_class, "job_backend", None)
    if declared:
        return declared
    for cls in spawner_class.__mro__:
        backend = JOB_BACKENDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if backend is not None:
            return backend
    return None


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
        self.handlers[0:0] = self.add_url_prefix(self.hub_prefix, [*share_handlers(self.policy_dir),
                                                                   *availability_handlers()])
        # Opening a spawn page makes no server (JupyterHub's made one that counted against the named-server limit).
        self.handlers = spawn_page_handlers(self.handlers)
        # A spawn POSTed to the REST API is answered 202 as soon as it waits in the queue, not after 10 s.
        self.handlers = spawn_api_handlers(self.handlers)

    def init_tornado_settings(self):
        # gpupool's pages (the spawn page, the progress page's Stop, the home page) in every mode that runs this
        # hub, however its configuration came: after the configured paths, before JupyterHub's own, the first
        # folder that has a page serving it. Unconfigured (z2jh), `template_paths` is JupyterHub's folder alone.
        ours = str(TEMPLATES)
        if ours not in self.template_paths:
            paths = list(self.template_paths)
            jupyterhubs = self._template_paths_default()[0]
            at = paths.index(jupyterhubs) if jupyterhubs in paths else len(paths)
            self.template_paths = [*paths[:at], ours, *paths[at:]]
        super().init_tornado_settings()

    job_runner = None

    async def start(self):
        await super().start()
        backend = job_backend_of(self.spawner_class)
        make = {"local": self._local_job_backend, "volcano": self._volcano_job_backend}.get(backend)
        if backend is not None and make is None:
            self.log.error("gpupool: the spawner names the job backend %r (known: local, volcano): training jobs "
                           "are not run", backend)
        made = await make() if make is not None else None
        if made is None:
            return
        from gpupool.hub.accounting.jobs import JobStore
        from gpupool.spawner.jobs.runner import JobRunner

        ledger, policy_of, job_backend, where = made
        runner = JobRunner(JobStore(ledger.engine), ledger, policy_of, job_backend, self.log)
        await runner.start()
        self.job_runner = runner
        self.log.info("gpupool: job runner started (%s backend: %s)", backend, where)

    async def _local_job_backend(self):
        """The embedded mode's training jobs: processes through the spawners' pool (`gpupool.spawner.jobs.local`)."""
        from gpupool.spawner.jobs.local import LocalBackend

        settings = self._job_spawner(None)
        pool = settings.pool  # the spawners' own (and the requeue of what waited before a restart)
        backend = LocalBackend(pool, settings.state_dir, self._job_spawner_async, self._job_token,
                               self._revoke_job_token, self.hub.api_url)
        return (settings.ledger, lambda: settings.policy, backend,
                f"jobs in {settings.ledger_url.split('@')[-1]}")

    async def _volcano_job_backend(self):
        """The Kubernetes mode's training jobs as Volcano Jobs (`gpupool.spawner.jobs.volcano`), in the namespace,
        with the API client and the default image of the hub's GPUKubeSpawner configuration."""
        from kubespawner.clients import shared_client

        from gpupool.spawner.jobs.volcano import VolcanoBackend
        from gpupool.spawner.volcano import RELEASE_ENV, Release

        # A spawner of the hub's configuration (for no one: KubeSpawner expands its names from a user's name and
        # id) loads the Kubernetes client configuration and holds the namespace, image and ledger settings.
        settings = self.spawner_class(config=self.config, user=SimpleNamespace(name="gpupool-jobs", id=0, groups=[]),
                                      hub=self.hub)
        if not settings.ledger_url:
            self.log.warning("gpupool: no GPUPOOL_LEDGER_URL: training jobs are not run")
            return None
        backend = VolcanoBackend(shared_client("CustomObjectsApi"), shared_client("CoreV1Api"), settings.namespace,
                                 Release(os.environ.get(RELEASE_ENV, Release.name), settings.namespace),
                                 settings.image, storage_of=self._job_storage)
        return settings.ledger, lambda: settings.policy, backend, f"Volcano Jobs in namespace {settings.namespace}"

    async def _job_storage(self, job) -> dict:
        """The user's storage as GPUKubeSpawner mounts it in their servers (z2jh's `singleuser.storage`: the home
        claim), expanded for the job's user, and the pod's user and groups: a job sees its notebooks' files."""
        orm_user = orm.User.find(self.db, job.user)
        user = SimpleNamespace(name=job.user, id=orm_user.id if orm_user is not None else 0, groups=[])
        return await self.spawner_class(config=self.config, user=user, hub=self.hub).user_storage()

    def _job_spawner(self, job):
        """A spawner of the hub's configuration for `job`'s user (None: the settings only): every setting a
        server of theirs would get, configured in one place."""
        user = SimpleNamespace(name="", groups=[])
        if job is not None:
            orm_user = orm.User.find(self.db, job.user)
            groups = [SimpleNamespace(name=g.name) for g in orm_user.groups] if orm_user is not None else []
            user = SimpleNamespace(name=job.user, groups=groups)
        return self.spawner_class(config=self.config, user=user, hub=self.hub)

    async def _job_spawner_async(self, job):
        return self._job_spawner(job)

    def _note(self, job, attempt: int) -> str:
        return f"gpupool job {job.id} run {attempt}"

    async def _job_token(self, job, attempt: int) -> str | None:
        """The run's own hub token: its user's, allowed only to call the MLflow and jobs services."""
        orm_user = orm.User.find(self.db, job.user)
        if orm_user is None:
            return None
        user = self.users[orm_user]
        return user.new_api_token(note=self._note(job, attempt), scopes=list(JOB_TOKEN_SCOPES),
                                  expires_in=int(timedelta(days=JOB_TOKEN_DAYS).total_seconds()))

    async def _revoke_job_token(self, job, attempt: int) -> None:
        orm_user = orm.User.find(self.db, job.user)
        if orm_user is None:
            return
        for token in list(orm_user.api_tokens):
            if token.note == self._note(job, attempt):
                self.db.delete(token)
        self.db.commit()

    async def cleanup(self):
        if self.job_runner is not None:
            await self.job_runner.stop()  # the runs go on: the next hub re-adopts them
        await super().cleanup()


main = GPUPoolHub.launch_instance
