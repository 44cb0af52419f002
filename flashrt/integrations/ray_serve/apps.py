"""The apps flashrt deploys on Ray Serve and their scale: `StageScale` (one deployment), `SpeechApp`
(an Orpheus-style voice as lm -> vocoder -> ingress), `PolicyApp`; the ``--replicas`` syntax and the
check that a cluster can hold them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashrt.errors import ConfigError

STAGES = ("lm", "vocoder", "ingress")  # the deployments of a SpeechApp, as --replicas names them

@dataclass(frozen=True)
class StageScale:
    """One deployment's scale: replicas, resources per replica, requests a replica holds at once and
    requests the deployment queues beyond them (then Serve refuses with a 503). With ``max_replicas``
    above ``replicas`` the deployment autoscales between them (Serve's ``autoscaling_config``: it
    starts at ``replicas`` and adds replicas while they hold more than ``target_ongoing_requests``
    each)."""

    replicas: int = 1
    max_replicas: int | None = None  # None: always ``replicas``
    target_ongoing_requests: float = 2.0  # what autoscaling aims a replica holds (Serve's default)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 8
    max_queued_requests: int = 16
    threads: int | None = None  # torch's intra-op threads in a replica (None: num_cpus, at least 1)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_ongoing_requests < 1 or self.max_queued_requests < 0:
            raise ConfigError(f"{self}: replicas and max_ongoing_requests must be >= 1, "
                              "max_queued_requests >= 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"{self}: threads must be >= 1")
        if self.max_replicas is not None and self.max_replicas < self.replicas or \
                not self.target_ongoing_requests > 0:
            raise ConfigError(f"{self}: max_replicas must be >= replicas, target_ongoing_requests > 0")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError(f"{self}: resources must not be negative")

    @property
    def torch_threads(self) -> int:
        """Set in each replica before it loads: a float reduction's result depends on the thread count,
        so a replica matches (bit for bit) a process run with the same count."""
        return self.threads if self.threads is not None else max(1, int(self.num_cpus))

    @property
    def autoscales(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.autoscales else self.replicas

    def deployment_options(self) -> dict[str, Any]:
        """Serve's options of the deployment (``serve.deployment(**options)``, and a Serve config's
        deployment entry): a fixed ``num_replicas``, or an ``autoscaling_config``."""
        count: dict[str, Any] = {"num_replicas": self.replicas}
        if self.autoscales:
            count = {"autoscaling_config": {"min_replicas": self.replicas, "initial_replicas": self.replicas,
                                            "max_replicas": self.max_replicas,
                                            "target_ongoing_requests": self.target_ongoing_requests}}
        return {**count, "max_ongoing_requests": self.max_ongoing_requests,
                "max_queued_requests": self.max_queued_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}


@dataclass(frozen=True)
class SpeechApp:
    """An Orpheus-style voice served on Ray: its folder, the voice's name, `load_orpheus` options
    (device, precision, max_new_tokens, sampling, ...), the scale of each stage, the server's limits
    (`flashrt.serve.app.ServerLimits`; None: its defaults) and the API key the ingress checks (None:
    none; never in the repr)."""

    folder: str
    name: str = "orpheus"
    options: dict[str, Any] = field(default_factory=dict)
    lm: StageScale = StageScale()
    vocoder: StageScale = StageScale(num_cpus=0.5)
    ingress: StageScale = StageScale(num_cpus=0.25, max_ongoing_requests=64, max_queued_requests=64)
    limits: Any = None
    api_key: str | None = field(default=None, repr=False)  # the ingress wants `Bearer <key>` on /v1/

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is blank: give a non-empty key, or none")

    def args(self) -> dict[str, Any]:
        """This app as the plain ``args`` of a Serve config (`speech_builder` rebuilds it); never with
        an API key (a config file would hold it in plain text)."""
        from dataclasses import asdict

        from flashrt.serve.app import ServerLimits

        if self.api_key is not None:
            raise ConfigError("a Serve config would hold the API key in plain text: deploy with "
                              "`flashrt serve --ray --api-key` (or `deploy_speech`), or put an "
                              "authenticating gateway in front of Serve's port")
        return {"folder": str(self.folder), "name": self.name, "options": dict(self.options),
                **{stage: asdict(getattr(self, stage)) for stage in STAGES},
                "limits": asdict(self.limits or ServerLimits())}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> SpeechApp:
        from flashrt.serve.app import ServerLimits

        unknown = sorted(set(args) - {"folder", "name", "options", "limits", *STAGES})
        if unknown or "folder" not in args:
            raise ConfigError(f"speech app args: unknown {unknown} or no 'folder' (args: {sorted(args)})")
        scales = {stage: StageScale(**args[stage]) for stage in STAGES if stage in args}
        limits = ServerLimits(**args["limits"]) if "limits" in args else None
        return cls(str(args["folder"]), args.get("name", "orpheus"), dict(args.get("options", {})),
                   limits=limits, **scales)


@dataclass(frozen=True)
class PolicyApp:
    """A policy served on Ray: its checkpoint folder, `load_policy` options, the deployment's scale."""

    folder: str
    options: dict[str, Any] = field(default_factory=dict)
    scale: StageScale = StageScale()

    def args(self) -> dict[str, Any]:
        """This app as the plain ``args`` of a Serve config (`policy_builder` rebuilds it)."""
        from dataclasses import asdict

        return {"folder": str(self.folder), "options": dict(self.options), "scale": asdict(self.scale)}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> PolicyApp:
        unknown = sorted(set(args) - {"folder", "options", "scale"})
        if unknown or "folder" not in args:
            raise ConfigError(f"policy app args: unknown {unknown} or no 'folder' (args: {sorted(args)})")
        scale = StageScale(**args["scale"]) if "scale" in args else StageScale()
        return cls(str(args["folder"]), dict(args.get("options", {})), scale)


def parse_count(text: str, flag: str = "--replicas") -> dict[str, int | None]:
    """``N`` or ``MIN-MAX`` (autoscaling between them) -> `StageScale` fields (replicas, max_replicas)."""
    low, sep, high = text.strip().partition("-")
    if not low.isdigit() or int(low) < 1 or sep and (not high.isdigit() or int(high) < int(low)):
        raise ConfigError(f"{flag} {text!r}: give a count N >= 1, or MIN-MAX (autoscaling) with "
                          "1 <= MIN <= MAX")
    return {"replicas": int(low), "max_replicas": int(high) if sep else None}


def parse_replicas(spec: str) -> dict[str, dict[str, int | None]]:
    """``lm=1-3,vocoder=1`` -> {"lm": {"replicas": 1, "max_replicas": 3}, "vocoder": {"replicas": 1,
    "max_replicas": None}}: stages of `STAGES` (each once), each a count or a MIN-MAX range
    (`parse_count`)."""
    counts: dict[str, dict[str, int | None]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, count = part.partition("=")
        if not sep or stage not in STAGES or stage in counts:
            raise ConfigError(f"--replicas {spec!r}: give STAGE=COUNT[,...] with STAGE one of {STAGES} "
                              "(each once) and COUNT a count >= 1 or MIN-MAX")
        counts[stage] = parse_count(count, f"--replicas {stage}=")
    return counts


def check_fits(scales: list[StageScale], available: dict[str, float]) -> None:
    """ConfigError when the replicas of `scales` together (an autoscaling one at its most) need more
    CPUs or GPUs than `available` (``ray.cluster_resources()``, the cluster's total): Serve would wait
    for them forever."""
    for key, need in (("CPU", sum(s.most_replicas * s.num_cpus for s in scales)),
                      ("GPU", sum(s.most_replicas * s.num_gpus for s in scales))):
        have = available.get(key, 0.0)
        if need > have + 1e-9:
            raise ConfigError(f"the deployments need {need:g} {key}s ({', '.join(_needs(scales, key))}); "
                              f"the Ray cluster has {have:g}: fewer replicas or smaller shares")


def _needs(scales: list[StageScale], key: str) -> list[str]:
    return [f"{s.most_replicas} x {s.num_cpus if key == 'CPU' else s.num_gpus:g}" for s in scales]


def set_threads(threads: int) -> None:
    """torch's intra-op threads of a replica (`StageScale.torch_threads`), set before it loads."""
    import torch

    torch.set_num_threads(threads)
