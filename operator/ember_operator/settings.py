"""The operator's one typed settings object, read from `EMBER_OPERATOR_*` environment variables.

`Settings.from_env()` is called once by `main`; everything else receives the object.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, Field, ValidationError

PREFIX = "EMBER_OPERATOR_"


class Settings(BaseModel):
    """Each field is read from EMBER_OPERATOR_<FIELD NAME IN UPPER CASE>."""

    sidecar_image: str = Field(
        "ghcr.io/ember-dev/ember:0.1.0",
        description="Image with ember-sidecar and /opt/ember/lib/libember.so (init + sidecar containers).",
    )
    default_store: str = Field(
        "", description="Store URI for ModelDeployments without spec.store (file:///… or s3://…)."
    )
    default_s3_endpoint: str = Field("", description="S3 endpoint for the default store.")
    local_store_root: str = Field(
        "/var/lib/ember",
        description="ModelDeployments' local stores (spec.store.local.path) must lie under this directory: "
        "the operator reads them itself, and must not read arbitrary paths of its own filesystem.",
    )
    store_endpoints: str = Field(
        "", description="Comma-separated S3 endpoints (scheme://host[:port]; without a port any port of "
        "that host) that ModelDeployments and GraphArchives may name in spec.store.s3.endpoint; '*' allows "
        "any. Empty: only default_s3_endpoint. An unset endpoint (AWS S3) is always allowed. The operator "
        "never connects to another (StoreEndpointNotAllowed).",
    )
    own_credentials_namespaces: str = Field(
        "", description="Comma-separated namespaces whose S3 stores without a credentialsSecret the operator "
        "may check with its own credentials; '*' for all. Empty: none (OperatorCredentialsNotAllowed). The "
        "default store (spec.store unset) always may.",
    )
    signing_secret: str = Field(
        "", description="Signing Secret (PEM ed25519 key under 'signing-key.pem') for ModelDeployments "
        "without spec.archive.signing.secretName; archives are unsigned when both are empty.",
    )
    presave_priority_class: str = Field(
        "", description="priorityClassName of SAVE Jobs that save archives ahead of time for "
        "spec.parallelism.alternatives (the chart's low, non-preempting ember-presave); none when empty.",
    )
    warm_priority_class: str = Field(
        "", description="priorityClassName of warm pods (the chart's low ember-warm, preemptionPolicy "
        "Never): the scheduler preempts them for pods of a higher priority (serving pods); a claimed "
        "warm pod keeps it. The default priority when empty.",
    )
    serving_priority_class: str = Field(
        "", description="priorityClassName of serving pods created cold; the default priority when empty.",
    )
    pod_service_account: str = Field(
        "",
        description="ServiceAccount of serving pods (the sidecar patches its own pod); "
        "the namespace's default when empty.",
    )
    metrics_port: int = Field(8080, description="Prometheus metrics port (0 disables).")
    metrics_host: str = Field("0.0.0.0", description="Address the metrics server binds (127.0.0.1 in tests).")
    liveness_endpoint: str = Field("", description="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz.")
    namespaces: str = Field("", description="Comma-separated namespaces to watch; all when empty.")
    standalone: bool = Field(False, description="Skip leader election: this process always reconciles "
                             "(one replica, development). Never run two standalone operators on one scope.")
    lease_name: str = Field("ember-operator", description="Leader election Lease (coordination.k8s.io) "
                            "the replicas contend for; exactly one holds it and reconciles.")
    lease_namespace: str = Field("", description="Namespace of the Lease; default: POD_NAMESPACE, else the "
                                 "first watched namespace, else default.")
    lease_duration_seconds: float = Field(10.0, ge=1.0, description="How long a Lease is valid without "
                                          "renewal: a SIGKILLed leader is replaced within this plus "
                                          "lease_retry_seconds.")
    lease_retry_seconds: float = Field(2.0, gt=0.0, description="How often candidates try and the leader "
                                       "renews.")
    max_replicas: int = Field(1000, ge=0, description="Most serving replicas one ModelDeployment gets "
                              "(spec.replicas above it: this many, a ReplicasCapped Warning); 0: no cap.")
    max_namespace_replicas: int = Field(0, ge=0, description="Most serving replicas of all ModelDeployments "
                                        "of one namespace together (each is capped to what is left for it, "
                                        "oldest first); 0: no cap.")
    max_warm_gpus: int = Field(64, ge=0, description="Most warm GPUs one ModelDeployment keeps "
                               "(warmPool.size above it: a WarmPoolCapped Warning); 0: no cap.")
    max_namespace_warm_gpus: int = Field(0, ge=0, description="Most warm GPUs of all ModelDeployments of "
                                         "one namespace together (each keeps what is left for it, oldest "
                                         "first; a WarmPoolCapped Warning); 0: no cap.")
    max_gpus_per_pod: int = Field(0, ge=0, le=64, description="Most GPUs one replica (pod) may ask for in "
                                  "any shape; a spec above it is refused (GpusPerPodAboveLimit); 0: the "
                                  "schema's 64.")
    pod_batch: int = Field(500, ge=1, description="Most pods one reconcile pass creates or deletes; the "
                           "rest follow in the next passes (status is written between them, and a stop "
                           "signal is honoured).")
    resync_seconds: float = Field(30.0, description="Timer interval: every object is reconciled this often.")
    save_backoff_seconds: float = Field(10.0, description="First SAVE retry delay; doubles per attempt.")
    save_backoff_max_seconds: float = Field(600.0, description="Largest SAVE retry delay.")
    warm_backoff_seconds: float = Field(
        10.0, ge=0.0, description="A warm pool whose pods keep failing (engine failed, exited or "
        "restarted): its replacement waits this long after the first failure in a row, doubling per "
        "failure (0: no wait).")
    warm_backoff_max_seconds: float = Field(300.0, ge=0.0, description="Largest wait of a failing warm "
                                            "pool's replacements.")
    save_timeout_seconds: int = Field(3600, description="activeDeadlineSeconds of SAVE Jobs.")
    manifest_grace_seconds: float = Field(
        30.0, description="After a SAVE Job succeeds, how long to wait for its manifest to appear."
    )
    store_probe_timeout_seconds: float = Field(3.0, description="Connect/read timeout of store probes.")
    archive_retention_seconds: float = Field(
        86400.0, description="Unreferenced GraphArchives are deleted after this long (0 keeps them)."
    )
    claim_concurrency: int = Field(32, description="Parallel API calls when claiming or creating pods.")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for name in cls.model_fields:
            key = PREFIX + name.upper()
            if key in env:
                raw[name] = env[key]
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise SystemExit(f"invalid {PREFIX}* setting: {exc}") from exc

    def namespace_list(self) -> list[str]:
        return list(_split(self.namespaces))

    def store_endpoint_list(self) -> tuple[str, ...]:
        return _split(self.store_endpoints)

    def credential_namespace_list(self) -> tuple[str, ...]:
        return _split(self.own_credentials_namespaces)

    def lease_home(self) -> str:
        """Where the Lease lives (see `lease_namespace`)."""
        watched = self.namespace_list()
        fallback = watched[0] if watched else "default"
        return self.lease_namespace or os.environ.get("POD_NAMESPACE", "") or fallback


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())
