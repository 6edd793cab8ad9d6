"""The policy schema: GPU models, profiles, teams, prices; every other part of gpupool reads these objects.

The models are strict (no coercion of strings to numbers, no unknown keys) and immutable after loading.
Checks that span several sections (a profile naming a team, a queue's parent) live in `references.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)

from gpupool.images import BASE_IMAGE, image_names

# --- scalar types -------------------------------------------------------------------------------

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: Kubernetes resource quantities, e.g. ``4``, ``500m``, ``32Gi``, ``1.5``.
QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
#: A Kubernetes resource name, e.g. ``cpu``, ``nvidia.com/gpu``, ``volcano.sh/vgpu-memory``.
RESOURCE_NAME = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
MIG_PROFILE = re.compile(r"(\d)g\.(\d+)gb")

_QUANTITY_FACTORS = {
    None: 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def parse_quantity(text: str | int) -> Fraction:
    """The value of a Kubernetes quantity (``32Gi`` → 34359738368, ``500m`` → 1/2)."""
    match = QUANTITY.fullmatch(str(text))
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (accepted: e.g. 4, 500m, 1.5, 32Gi)")
    return Fraction(match.group(1)) * _QUANTITY_FACTORS[match.group(3)]


def _quantity(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a Kubernetes quantity: a number or a string such as 500m or 32Gi")
    text = str(value)
    parse_quantity(text)
    return text


def _decimal(value: Any) -> Decimal:
    """Money and GPU-hours: numbers (or numeric strings) made exact through their decimal text."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise ValueError("expected a decimal number such as 3.20")
    try:
        result = Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a decimal number (accepted: e.g. 3.20)") from None
    if not result.is_finite():
        raise ValueError("expected a finite decimal number")
    if result < 0:
        raise ValueError("must not be negative")
    return result


def _share(value: Any) -> Fraction:
    """A share of one card: 0.25, 1/3 written as the string "1/3", or 2 for two cards."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Fraction)):
        raise ValueError('expected a share such as 0.25, "1/3" or 2')
    try:
        result = Fraction(str(value)) if not isinstance(value, Fraction) else value
    except (ValueError, ZeroDivisionError):
        raise ValueError(f'{value!r} is not a share (accepted: e.g. 0.25, "1/3", 2)') from None
    if result <= 0:
        raise ValueError("a share must be greater than 0")
    return result


Quantity = Annotated[str, BeforeValidator(_quantity)]
NonNegativeDecimal = Annotated[Decimal, BeforeValidator(_decimal), PlainSerializer(str, return_type=str)]
Share = Annotated[Fraction, BeforeValidator(_share), PlainSerializer(str, return_type=str)]
ResourceList = dict[str, Quantity]

Backend = Literal["hami", "volcano-vgpu", "mig", "timeslice", "whole"]
FRACTIONAL_BACKENDS: tuple[str, ...] = ("hami", "volcano-vgpu", "timeslice")
#: Vendors whose cards gpupool can request; non-NVIDIA cards are shared through HAMi.
Vendor = Literal["nvidia", "hygon", "metax"]

#: MIG profiles each card model supports (NVIDIA's MIG user guide); the compute slices of a
#: profile are its leading digit, out of `MIG_SLICES`.
KNOWN_MIG_PROFILES: dict[str, tuple[str, ...]] = {
    "H200": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    "H100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "A100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "A100-40GB": ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A30": ("1g.6gb", "2g.12gb", "4g.24gb"),
}
MIG_SLICES: dict[str, int] = {"A30": 4}
DEFAULT_MIG_SLICES = 7

RESERVED_TEAM_NAMES = frozenset(
    {
        "default", "kube-system", "kube-public", "kube-node-lease", "volcano-system", "root",
        "admin", "admins", "jupyterhub", "hub", "gpupool", "all", "none", "system",
        "deprioritized",  # gpupool-deprioritized is the PriorityClass of over-budget work
    }
)


class Strict(BaseModel):
    """Base of every policy object: no unknown keys, no type coercion, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --- GPU models -----------------------------------------------------------------------------------


class MIGConfig(Strict):
    """How MIG slices of this model are configured and exposed."""

    strategy: Literal["mixed", "single"] = Field(
        "mixed",
        description="How the NVIDIA device plugin exposes MIG slices: `mixed` (one resource per profile, "
        "`nvidia.com/mig-1g.18gb`) or `single` (`nvidia.com/gpu` on nodes labelled with the profile).",
    )
    profiles: list[str] = Field(description="The MIG profiles configured on these cards, e.g. `1g.18gb`.")
    slices: int | None = Field(
        None, ge=1, description="Compute slices of a whole card; default 7 (4 for the A30)."
    )


class TimesliceConfig(Strict):
    """NVIDIA device plugin time-slicing (no memory isolation between replicas)."""

    replicas: int = Field(ge=2, le=64, description="How many time-sliced replicas each card is advertised as.")


class GPUModel(Strict):
    """A kind of card and how the pool may share it."""

    vendor: Vendor = Field(description="Who makes the card; selects HAMi's resource names for that vendor.")
    memory_gib: int = Field(gt=0, description="Device memory of one card in GiB.")
    product: str | None = Field(
        None,
        description="The node label value `nvidia.com/gpu.product` (GPU feature discovery) that selects "
        "this model in a heterogeneous cluster, e.g. `NVIDIA-H200`. Default: `NVIDIA-<model>`.",
    )
    backends: list[Backend] = Field(min_length=1, description="Sharing backends offered for this model.")
    mig: MIGConfig | None = Field(None, description="MIG set-up; required when `mig` is a backend.")
    timeslice: TimesliceConfig | None = Field(None, description="Required when `timeslice` is a backend.")
    tolerations: list[dict[str, str]] | None = Field(
        None,
        description="Tolerations user pods of this model need. Default for NVIDIA: tolerate the "
        "`nvidia.com/gpu` NoSchedule taint; none for other vendors.",
    )

    @model_validator(mode="after")
    def _backend_settings(self) -> GPUModel:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError("backends are listed more than once")
        if "mig" in self.backends and self.mig is None:
            raise ValueError("backend `mig` needs a `mig:` section listing the MIG profiles")
        if "timeslice" in self.backends and self.timeslice is None:
            raise ValueError("backend `timeslice` needs a `timeslice:` section with `replicas`")
        if {"mig", "volcano-vgpu", "timeslice"} & set(self.backends) and self.vendor != "nvidia":
            raise ValueError("backends mig, volcano-vgpu and timeslice exist for NVIDIA cards only; use hami")
        return self


class DeclaredGPU(Strict):
    """Cards a machine without NVML has (laptops, CI) or that the operator wants to pin."""

    model: str = Field(description="A model from `models`.")
    count: int = Field(ge=1, le=1024, description="How many such cards.")
    uuids: list[str] | None = Field(None, description="Optional card UUIDs, one per card.")

    @model_validator(mode="after")
    def _uuid_count(self) -> DeclaredGPU:
        if self.uuids is not None and len(self.uuids) != self.count:
            raise ValueError(f"{len(self.uuids)} uuids given for count {self.count}")
        return self


# --- profiles ---------------------------------------------------------------------------------------


class GPURequest(Strict):
    """What GPU a profile holds: a share of one card, a MIG slice, or whole cards."""

    model: str = Field(description="A model from `models`.")
    share: Share | None = Field(None, description='A fraction of one card: 0.25, 0.5, "1/3".')
    mig: str | None = Field(None, description="A MIG profile of the model, e.g. `1g.18gb`.")
    count: int | None = Field(None, ge=1, le=64, description="Whole cards.")
    backend: Backend | None = Field(
        None,
        description="How the share is delivered; may be left out when the model offers only one fitting "
        "backend (`count` → `whole`, `mig` → `mig`).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> GPURequest:
        given = [name for name in ("share", "mig", "count") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of share, mig, count (got {', '.join(given) or 'none'})")
        if self.share is not None and self.share >= 1:
            raise ValueError("share must be below 1; ask for whole cards with `count`")
        if self.mig is not None and not MIG_PROFILE.fullmatch(self.mig):
            raise ValueError(f"{self.mig!r} is not a MIG profile name (accepted: e.g. 1g.18gb)")
        return self


    def backend_for(self, model: GPUModel) -> str:
        """The backend that delivers this request on `model`; ValueError saying why none does."""
        if self.mig is not None:
            wanted = ["mig"]
        elif self.count is not None:
            wanted = ["whole", "hami"]
        else:
            wanted = list(FRACTIONAL_BACKENDS)
        if self.backend is not None:
            if self.backend not in wanted:
                raise ValueError(
                    f"backend {self.backend!r} cannot deliver this request (accepted: {', '.join(wanted)})"
                )
            if self.backend not in model.backends:
                raise ValueError(
                    f"backend {self.backend!r} is not offered for {self.model} "
                    f"(offered: {', '.join(model.backends)})"
                )
            return self.backend
        offered = [b for b in wanted if b in model.backends]
        if not offered:
            raise ValueError(
                f"{self.model} offers no backend for this request: it needs one of {', '.join(wanted)}, "
                f"the model offers {', '.join(model.backends)}"
            )
        if self.count is not None:
            return offered[0]
        if len(offered) > 1:
            raise ValueError(f"several backends fit ({', '.join(offered)}); choose one with `backend:`")
        return offered[0]


class Image(Strict):
    """One image choice of a profile."""

    display_name: str = Field(description="What users see.")
    image: str = Field(description="Container image (kubernetes mode); ignored by the embedded mode.")
    environment: str = Field(
        BASE_IMAGE, description="The gpupool image (`images/NAME`: `gpupool images list`) whose Python environment "
        "the embedded mode runs this choice's servers and jobs from, built on the machine from the same lock file "
        "as the container image (`gpupool images build NAME`); `base` is the servers' environment.")
    default: bool = Field(False, description="Preselected (at most one per profile).")

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, name: str) -> str:
        if name not in image_names():
            raise ValueError(f"no gpupool image {name!r}: the images are {', '.join(image_names())}")
        return name


class Resources(Strict):
    """A request (`guarantee`) and a limit, as Kubernetes quantities."""

    guarantee: Quantity | None = Field(None, description="Reserved for the server (Kubernetes request).")
    limit: Quantity | None = Field(None, description="Hard limit.")

    @model_validator(mode="after")
    def _order(self) -> Resources:
        if self.guarantee is not None and self.limit is not None:
            if parse_quantity(self.guarantee) > parse_quantity(self.limit):
                raise ValueError(f"guarantee {self.guarantee} exceeds limit {self.limit}")
        return self


# --- idle culling --------------------------------------------------------------------------------------


def _positive(value: Any) -> Decimal:
    result = _decimal(value)
    if result <= 0:
        raise ValueError("must be greater than 0")
    return result


PositiveDecimal = Annotated[Decimal, BeforeValidator(_positive), PlainSerializer(str, return_type=str)]


#: The longest times an idle rule may name: a year.
IDLE_MOST_MINUTES = 525_600
IDLE_MOST_HOURS = 8_760


class Idle(Strict):
    """When the idle culler stops a server that holds a GPU share and does nothing with it.

    A server is idle while every signal is under its threshold: the GPU use of its own processes (not the card's),
    their CPU use, and Jupyter's own activity (no kernel busy, no kernel or terminal activity). Idle for
    `after_minutes`, it is stopped; its user is warned `warn_minutes` before (the hub's home page, the culler's
    page, the alert webhook) and may keep it for up to `keep_max_hours` in all.
    """

    enabled: bool = Field(True, description="Off: servers under this rule are never culled.")
    after_minutes: PositiveDecimal = Field(
        Decimal(60), description="Minutes a server may stay idle before it is stopped (e.g. 60).")
    gpu_below_percent: NonNegativeDecimal = Field(
        Decimal(1), description="The server's processes' GPU utilisation (SM %, the highest sample since the "
        "culler's last look) under which the GPU counts as idle.")
    cpu_below_percent: NonNegativeDecimal = Field(
        Decimal(5), description="The server's processes' CPU use in % of one core, averaged since the culler's "
        "last look, under which the CPU counts as idle.")
    warn_minutes: NonNegativeDecimal = Field(
        Decimal(10), description="Minutes before the stop at which the user is warned (0: no warning time; "
        "the warning still comes first).")
    max_age_hours: PositiveDecimal | None = Field(
        None, description="Stop a server this many hours after it started, busy or not (warned the same way). "
        "Leave out for no limit.")
    keep_max_hours: NonNegativeDecimal = Field(
        Decimal(8), description="How many hours in all a user may postpone the stop of one server with "
        "\"keep it\" (0: no postponing).")

    @model_validator(mode="after")
    def _bounds(self) -> Idle:
        for name in ("gpu_below_percent", "cpu_below_percent"):
            if getattr(self, name) > 100:
                raise ValueError(f"{name} must be at most 100")
        for name, most in (("after_minutes", IDLE_MOST_MINUTES), ("warn_minutes", IDLE_MOST_MINUTES),
                           ("max_age_hours", IDLE_MOST_HOURS), ("keep_max_hours", IDLE_MOST_HOURS)):
            value = getattr(self, name)
            if value is not None and value > most:
                raise ValueError(f"{name} must be at most {most} (a year)")
        if self.warn_minutes >= self.after_minutes:
            raise ValueError(f"warn_minutes ({self.warn_minutes}) must be less than after_minutes "
                             f"({self.after_minutes})")
        return self


class Profile(Strict):
    """A choice on the spawn page."""

    display_name: str = Field(min_length=1, description="What users see, e.g. `0.25 × H200`.")
    description: str = Field("", description="Shown under the name on the spawn page.")
    gpu: GPURequest | None = Field(None, description="Leave out for a CPU-only profile.")
    cpu: Resources = Field(Resources(), description="CPU cores: `guarantee` (request) and `limit`.")
    memory: Resources = Field(Resources(), description="Memory in bytes (`8Gi`): `guarantee` and `limit`.")
    images: dict[str, Image] = Field(default_factory=dict, description="Image choices, by slug.")
    teams: list[str] = Field(min_length=1, description="Teams whose members may pick this profile.")
    preemptible: bool = Field(False, description="Work under this profile may be preempted by Volcano.")
    default: bool = Field(False, description="Preselected on the spawn page (at most one profile).")
    idle: Idle | None = Field(
        None, description="When idle servers of this profile are culled; before the team's `idle` and the "
        "pool's `settings.idle`.")


# --- teams ---------------------------------------------------------------------------------------------


class QueueSettings(Strict):
    """The team's Volcano queue (`scheduling.volcano.sh/v1beta1` Queue)."""

    weight: int = Field(1, ge=1, le=65535, description="Share of spare capacity relative to other queues.")
    capability: ResourceList | None = Field(None, description="Upper bound of the queue, by resource name.")
    deserved: ResourceList | None = Field(
        None, description="What the queue deserves; above it its pods may be reclaimed."
    )
    guarantee: ResourceList | None = Field(None, description="Reserved for this queue whatever others do.")
    reclaimable: bool = Field(True, description="Whether other queues may reclaim this queue's excess.")
    parent: str | None = Field(None, description="Another team whose queue is this queue's parent.")
    timeout_seconds: int | None = Field(
        None, ge=1, description="How long a request may wait in the queue; default from `settings`."
    )

    @field_validator("capability", "deserved", "guarantee")
    @classmethod
    def _resource_names(cls, value: ResourceList | None) -> ResourceList | None:
        for name in value or {}:
            if not RESOURCE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a Kubernetes resource name (e.g. cpu, nvidia.com/gpu)")
        return value


class Quota(Strict):
    """Concurrent quota, in cards (shares held at the same time). Beyond it requests wait."""

    gpus: Share | None = Field(None, description="Shares the team may hold at once, all models.")
    per_user_gpus: Share | None = Field(None, description="Shares one member may hold at once.")
    per_model: dict[str, Share] = Field(default_factory=dict, description="Shares at once, per model.")


class Budget(Strict):
    """Period budget in GPU-hours. Beyond it, `on_exhausted` applies."""

    gpu_hours: NonNegativeDecimal | None = Field(None, description="GPU-hours per period, all models.")
    per_model: dict[str, NonNegativeDecimal] = Field(default_factory=dict, description="GPU-hours per period, per model.")
    on_exhausted: Literal["alert", "deprioritize", "deny"] = Field(
        "alert",
        description="Beyond 100%: `alert` admits and notifies, `deprioritize` admits as lowest-priority "
        "preemptible work, `deny` refuses saying budget, usage and when it resets.",
    )
    alert_thresholds: list[NonNegativeDecimal] = Field(
        default_factory=lambda: [Decimal("0.8"), Decimal("1.0")],
        description="Fractions of the budget at which an alert is sent, once per period each.",
    )

    @field_validator("alert_thresholds")
    @classmethod
    def _thresholds(cls, value: list[Decimal]) -> list[Decimal]:
        if any(t <= 0 or t > 10 for t in value):
            raise ValueError("alert thresholds are fractions of the budget, above 0 and at most 10")
        if value != sorted(set(value)):
            raise ValueError("alert thresholds must be increasing and distinct")
        return value


#: An S3 bucket name (AWS rules: 3–63 characters, lower-case letters, digits, '.' and '-').
S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: One segment of a key prefix or folder path below a team's root; `.` and `..` are refused separately.
PATH_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


def _relative_segments(value: str) -> list[str]:
    """`a/b` below a root; refuses anything that could leave it (absolute, `..`, URLs, empty segments)."""
    segments = value.split("/")
    if value.startswith("/") or "://" in value or any(
        s in ("", ".", "..") or not PATH_SEGMENT.fullmatch(s) for s in segments
    ):
        raise ValueError(
            f"{value!r} is outside the team's root or not a plain path (accepted: folders below the root "
            "such as `dvc` or `data/dvc`; letters, digits, '.', '_', '-'; no `..`, no absolute path, no URL)"
        )
    return segments


def s3_root_parts(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` → (bucket, prefix without slashes); ValueError naming what is accepted."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r} is not an S3 URL (accepted: s3://bucket or s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://"):].rstrip("/").partition("/")
    if not S3_BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"{bucket!r} is not an S3 bucket name (accepted: 3–63 lower-case letters, digits, '.', '-')")
    if prefix:
        _relative_segments(prefix)
    return bucket, prefix


#: A job's priority within its team (`gpupool jobs submit --priority`), lowest first.
JOB_PRIORITIES: tuple[str, ...] = ("low", "normal", "high")
JobPriority = Literal["low", "normal", "high"]


class TeamDatasets(Strict):
    """Where one team's datasets live: its root (a folder or an S3 bucket/prefix) and the DVC remote in it."""

    root: str | None = Field(
        None,
        description="With `datasets.storage: s3`: the team's bucket or prefix, `s3://bucket` or "
        "`s3://bucket/prefix`, reachable with the team's own credentials only; default `s3://gpupool-<team>`. "
        "With `folder` storage the root is always the team's group-private folder.",
    )
    remote: str = Field(
        "dvc",
        description="The team's DVC remote, relative to its root (e.g. `dvc`); a path leaving the root "
        "(`..`, absolute paths, URLs) is refused.",
    )

    @field_validator("root")
    @classmethod
    def _root(cls, value: str | None) -> str | None:
        if value is not None:
            s3_root_parts(value)
        return value

    @field_validator("remote")
    @classmethod
    def _remote(cls, value: str) -> str:
        _relative_segments(value)
        return value


#: Named servers a member of a team may have besides the default one, unless the team says otherwise.
DEFAULT_NAMED_SERVERS = 2
MAX_NAMED_SERVERS = 100


class Team(Strict):
    """A tenant: a JupyterHub group with a Volcano queue, a concurrent quota and a period budget."""

    display_name: str | None = Field(None, description="Shown on the hub pages.")
    group_source: Literal["policy", "authenticator"] = Field(
        "policy",
        description="`policy`: members are listed here; `authenticator`: members come from the login "
        "provider's groups claim (OAuthenticator `manage_groups`).",
    )
    members: list[str] = Field(
        default_factory=list, description="Hub user names (with `group_source: policy`); the team's hub group "
        "adds more (`gpupool team add-member`, the admin page's groups, the login provider's groups).")
    leads: list[str] = Field(
        default_factory=list, description="See their team's usage and bills. A lead is a member by `members` or "
        "by the team's hub group; a name in neither has no lead's rights until added.")
    reviewers: list[str] = Field(
        default_factory=list, description="May move the team's models to `production` in MLflow (members only, "
        "like `leads`)."
    )
    priority: int = Field(0, ge=0, le=1_000_000, description="Higher first, in the queue and in Volcano.")
    queue: QueueSettings = Field(QueueSettings(), description="The team's Volcano queue.")
    quota: Quota = Field(Quota(), description="Concurrent quota: beyond it requests wait.")
    budget: Budget = Field(Budget(), description="Period budget: beyond it `on_exhausted` applies.")
    datasets: TeamDatasets = Field(TeamDatasets(), description="Where the team's datasets live (DVC remote).")
    named_servers: int = Field(
        DEFAULT_NAMED_SERVERS, ge=0, le=MAX_NAMED_SERVERS,
        description="Named servers (`/user/NAME/SERVER`, each with its own profile) a member may have besides "
        "their default server; a member of several teams gets the largest of their teams' numbers. `0`: the "
        "default server only. All of a member's servers count against the same concurrent quotas.",
    )
    sharing: bool = Field(
        False,
        description="Members may share a running server with teammates (JupyterHub's shares, "
        "`POST /hub/api/shares/USER/SERVER`): with members of the team the server runs for, or with that "
        "team's group, never with anyone else; share codes are refused. Off: nobody of the team may share.",
    )

    idle: Idle | None = Field(
        None, description="When the team's idle servers are culled (a profile's own `idle` comes first); "
        "leave out for the pool's `settings.idle`.")

    job_priorities: list[JobPriority] = Field(
        default_factory=lambda: ["low", "normal"], min_length=1,
        description="The priorities members may give their training jobs (`gpupool jobs submit --priority`). "
        "A job without one gets `normal` when it is allowed, else the highest allowed.",
    )

    @model_validator(mode="after")
    def _membership(self) -> Team:
        if self.group_source == "authenticator" and self.members:
            raise ValueError("members come from the authenticator (group_source); leave `members` out")
        return self


# --- training jobs ------------------------------------------------------------------------------------

#: What may end a job's run; the ones that are never the job's fault never count as a retry.
RESTART_CAUSES: tuple[str, ...] = ("failed", "preempted", "node-lost", "platform-restart", "suspended")


class Restarts(Strict):
    """When a job whose run failed is started again (runs ended by preemption, a lost node, a restart of the
    platform or a suspend are always resumed and never count)."""

    max_restarts: int = Field(3, ge=0, le=1000, description="Failed runs restarted before the job is `failed`; "
                              "`gpupool jobs submit --max-restarts` may ask for fewer.")
    backoff_seconds: int = Field(10, ge=0, le=3600,
                                 description="Wait before the first restart after a failure; doubled each time.")
    max_backoff_seconds: int = Field(600, ge=0, le=86400, description="The longest wait between restarts.")
    never_retry_exit_codes: list[int] = Field(
        default_factory=list, description="Exit codes that fail the job at once (e.g. `2`, a usage error).")
    always_retry_exit_codes: list[int] = Field(
        default_factory=list, description="Exit codes restarted without counting against `max_restarts`.")

    @model_validator(mode="after")
    def _codes(self) -> Restarts:
        both = sorted(set(self.never_retry_exit_codes) & set(self.always_retry_exit_codes))
        if both:
            raise ValueError(f"exit codes {both} are both never-retry and always-retry: keep each in one list")
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError("max_backoff_seconds is below backoff_seconds")
        return self


class Preemption(Strict):
    """Who may preempt whom: a request that cannot fit may stop preemptible jobs of lower priority."""

    enabled: bool = Field(True, description="Off: requests wait for room; no job is ever preempted.")
    by: list[Literal["server", "job"]] = Field(
        default_factory=lambda: ["server", "job"],
        description="Which requests may preempt: notebook servers, jobs, or both. Notebook servers are never "
        "preempted.",
    )
    min_priority_gap: int = Field(
        1, ge=1, le=2_000_000,
        description="How much higher the request's priority must be than a job's (team priority plus the job's "
        "`priorities` offset; over-budget work is the lowest) for that job to be preempted.",
    )


class Jobs(Strict):
    """Training jobs (`gpupool jobs submit`): their priorities, preemption, restarts and checkpoints."""

    priorities: dict[JobPriority, Annotated[int, Field(ge=0, le=1_000_000)]] = Field(
        default_factory=lambda: {"low": 0, "normal": 10, "high": 20},
        description="Added to the team's `priority` for a job of each priority; servers have `normal`'s.",
    )
    grace_seconds: int = Field(
        60, ge=1, le=3600,
        description="A preempted or cancelled job gets SIGTERM, then SIGKILL after this long (Kubernetes: "
        "`terminationGracePeriodSeconds`): time to save a checkpoint (`gpupool.train.should_stop()`).",
    )
    restarts: Restarts = Field(Restarts(), description="Restarts of failed runs, with back-off.")
    preemption: Preemption = Field(Preemption(), description="Who may preempt whom.")
    checkpoint_claim: str | None = Field(
        None, pattern=DNS_LABEL.pattern,
        description="Kubernetes mode: the PersistentVolumeClaim jobs keep their checkpoints on (each job mounts "
        "its own `USER/JOB` folder of it and finds it in `GPUPOOL_CHECKPOINT_DIR`); without it a job's pod has "
        "no checkpoint folder.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Jobs:
        missing = [p for p in JOB_PRIORITIES if p not in self.priorities]
        if missing:
            raise ValueError(f"priorities needs an offset for each of {', '.join(JOB_PRIORITIES)} "
                             f"(missing: {', '.join(missing)})")
        values = [self.priorities[p] for p in JOB_PRIORITIES]
        if values != sorted(values):
            raise ValueError("priorities must not decrease from low to normal to high")
        return self


# --- billing and settings -----------------------------------------------------------------------------


class Billing(Strict):
    """Prices per GPU-hour; bills are per team and calendar month."""

    currency: str = Field("EUR", pattern=r"[A-Z]{3}", description="ISO 4217 code.")
    period: Literal["month"] = Field("month", description="Budgets and bills run per calendar month, UTC.")
    prices: dict[str, NonNegativeDecimal] = Field(
        default_factory=dict, description="Price of one GPU-hour of each model."
    )


class S3Storage(Strict):
    """The S3-compatible object store holding the teams' buckets (with `storage: s3`)."""

    endpoint_url: str | None = Field(
        None, pattern=r"https?://[^\s]+",
        description="For a store other than AWS (SeaweedFS, MinIO, Ceph), e.g. `https://s3.example.org`.",
    )
    region: str | None = Field(None, description="The region of the buckets, when the store needs one.")


class Datasets(Strict):
    """Where teams keep datasets: one DVC remote per team, known to every server of the team."""

    storage: Literal["folder", "s3"] = Field(
        "folder",
        description="`folder`: each team's group-private folder under the spawner's `team_root` (embedded "
        "mode); `s3`: each team's bucket or prefix (`teams.<team>.datasets.root`) with its own credentials.",
    )
    s3: S3Storage = Field(S3Storage(), description="The object store, with `storage: s3`.")


#: How the pool chooses cards for a share (`policies/placement.py`).
PLACEMENTS: tuple[str, ...] = ("best-fit", "fragmentation-aware")
DEFAULT_PLACEMENT = "fragmentation-aware"


class Settings(Strict):
    """Pool-wide settings."""

    queue_timeout_seconds: int = Field(
        3600, ge=1, description="Default for how long a request waits in its team's queue."
    )
    mps: Literal["auto", "off"] = Field(
        "auto", description="Embedded mode: enforce shares with the NVIDIA MPS daemon when it runs."
    )
    alert_webhook: str | None = Field(
        None,
        pattern=r"https?://[^\s]+",
        description="Budget alerts are also POSTed here as JSON (team, period, scope, threshold, message).",
    )
    placement: Literal["best-fit", "fragmentation-aware"] = Field(
        DEFAULT_PLACEMENT,
        description="Embedded mode: which card a share goes on. `best-fit`: the fullest card with room. "
        "`fragmentation-aware`: where the free share left on cards stays most usable by the profiles' "
        "shares (the FGD measure, USENIX ATC'23). `gpupool replay openb` compares both.",
    )
    idle: Idle = Field(Idle(), description="When idle servers are culled, unless their profile or team says "
                       "otherwise (60 idle minutes, GPU under 1%, CPU under 5%, warned 10 minutes before).")
    engine: Literal["volcano", "yunikorn"] = Field(
        "volcano",
        description="Kubernetes mode: the batch scheduler that places servers and jobs in the team queues. "
        "`volcano`: Volcano Queues (`gpupool render` writes them); `yunikorn`: Apache YuniKorn, whose "
        "`yunikorn-configs` ConfigMap `gpupool render` writes instead. Naming it declares the policy for the "
        "Kubernetes mode: `gpupool render` and `gpupool policy check` then refuse a share backend the engine "
        "cannot place (docs/kubernetes.md, \"Choosing an engine\"). The embedded mode has no engine.",
    )


class Policy(Strict):
    """Everything in a policy directory, merged."""

    models: dict[str, GPUModel] = Field(default_factory=dict, description="GPU models, by name (`H200`).")
    inventory: list[DeclaredGPU] = Field(
        default_factory=list, description="Cards of the embedded pool when NVML finds none (laptops, CI)."
    )
    profiles: dict[str, Profile] = Field(default_factory=dict, description="What users pick, by DNS-safe slug.")
    teams: dict[str, Team] = Field(default_factory=dict, description="Teams, by DNS-safe name (≤ 32 chars).")
    billing: Billing = Field(Billing(), description="Currency, period and prices.")
    datasets: Datasets = Field(Datasets(), description="Where the teams' datasets live (DVC remotes).")
    settings: Settings = Field(Settings(), description="Pool-wide settings.")
    jobs: Jobs = Field(Jobs(), description="Training jobs: priorities, preemption, restarts, checkpoints.")

    # ---- conveniences the rest of gpupool uses ----

    def profiles_for_teams(self, teams: set[str] | frozenset[str]) -> dict[str, Profile]:
        """Profiles any of `teams` may pick, in policy order."""
        return {slug: p for slug, p in self.profiles.items() if set(p.teams) & set(teams)}

    def teams_of(self, user: str, groups: Iterable[str] = ()) -> list[str]:
        """`user`'s teams in policy order: the hub `groups` that are teams, plus the teams whose member list
        names `user` (the one membership rule; without `groups` only the policy's member lists count)."""
        groups = set(groups)
        return [name for name, team in self.teams.items() if name in groups or user in team.members]

    def leads_of(self, user: str, groups: Iterable[str] = ()) -> list[str]:
        """The teams `user` leads: named in their `leads` and a member (by `teams_of`'s one rule, so a lead in the
        team by its hub group alone is a lead; the policy files cannot know the groups, so they do not ask)."""
        return [name for name in self.teams_of(user, groups) if user in self.teams[name].leads]

    def named_server_limit(self, teams) -> int:
        """How many named servers a member of `teams` may have: the largest of their teams' (0 in no team)."""
        return max((self.teams[t].named_servers for t in teams if t in self.teams), default=0)

    def default_job_priority(self, team: str) -> str:
        """The priority of a job of `team` submitted without one: `normal` if the team may use it."""
        allowed = self.teams[team].job_priorities
        return "normal" if "normal" in allowed else max(allowed, key=JOB_PRIORITIES.index)

    def job_priority(self, team: str, priority: str = "normal") -> int:
        """The queue priority of work of `team` at job priority `priority` (servers are `normal`): the team's
        priority plus the policy's offset for it."""
        return self.teams[team].priority + self.jobs.priorities[priority]

    def idle_rule(self, team: str, profile: str) -> Idle:
        """The culling rule of a server of `team` under `profile`: the profile's, else the team's, else the pool's
        (a name no longer in the policies falls through to the next)."""
        chosen = self.profiles.get(profile)
        if chosen is not None and chosen.idle is not None:
            return chosen.idle
        owner = self.teams.get(team)
        return owner.idle if owner is not None and owner.idle is not None else self.settings.idle

    def queue_timeout(self, team: str) -> int:
        return self.teams[team].queue.timeout_seconds or self.settings.queue_timeout_seconds

    def dataset_s3_root(self, team: str) -> str:
        """The team's bucket or prefix with `s3` storage, as `s3://bucket[/prefix]` without a trailing slash."""
        return (self.teams[team].datasets.root or f"s3://gpupool-{team}").rstrip("/")

    def summary(self) -> str:
        return f"{len(self.models)} GPU models, {len(self.profiles)} profiles, {len(self.teams)} teams"


def mig_slices(model_name: str, model: GPUModel) -> int:
    if model.mig is not None and model.mig.slices is not None:
        return model.mig.slices
    return MIG_SLICES.get(model_name, DEFAULT_MIG_SLICES)


def product_label(model_name: str, model: GPUModel) -> str:
    return model.product or f"NVIDIA-{model_name}"
