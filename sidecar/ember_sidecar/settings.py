"""Typed sidecar settings, read from the environment (CLI flags of `ember-sidecar` override them).

Every field names its variable. In a pod, the operator sets the variables of the pod contract
(`ember.contract`: POD_NAME / POD_NAMESPACE from the downward API, EMBER_RUN_DIR, EMBER_STORE,
EMBER_S3_ENDPOINT, EMBER_SIDECAR_PORT); EMBER_POD_NAME / EMBER_POD_NAMESPACE are accepted too.
The others tune the sidecar and have defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ember import contract


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return None


def _bool(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


class Settings(BaseModel):
    """Everything the sidecar can be told. Defaults suit a serving pod."""

    model_config = ConfigDict(extra="forbid")

    pod_name: str = Field("", description="EMBER_POD_NAME | POD_NAME: this pod (downward API)")
    namespace: str = Field("default", description="EMBER_POD_NAMESPACE | POD_NAMESPACE")
    run_dir: Path = Field(Path(contract.RUN_DIR), description="EMBER_RUN_DIR: the shared emptyDir")
    port: int = Field(
        contract.SIDECAR_PORT, ge=0, le=65535, description="EMBER_SIDECAR_PORT: /readyz /livez /metrics"
    )
    host: str = Field("0.0.0.0", description="EMBER_SIDECAR_HOST: address the HTTP server binds")
    standalone: bool = Field(False, description="EMBER_STANDALONE: no Kubernetes; claim from the flags")
    archive: str = Field("", description="EMBER_ARCHIVE: manifest URI (standalone)")
    store: str = Field("", description="EMBER_STORE: store URI (standalone, with identity)")
    identity: str = Field("", description="EMBER_ARCHIVE_IDENTITY: identity hash (standalone)")
    kubeconfig: str | None = Field(None, description="KUBECONFIG: else the in-cluster config")
    # Store access (boto3 retries with backoff inside; the sidecar retries whole steps on top).
    s3_endpoint: str | None = Field(None, description="EMBER_S3_ENDPOINT")
    s3_max_attempts: int = Field(5, ge=1, description="EMBER_S3_MAX_ATTEMPTS: botocore attempts per call")
    s3_connect_timeout: float = Field(5.0, gt=0, description="EMBER_S3_CONNECT_TIMEOUT (s)")
    s3_read_timeout: float = Field(60.0, gt=0, description="EMBER_S3_READ_TIMEOUT (s)")
    s3_max_concurrency: int = Field(10, ge=1, description="EMBER_S3_MAX_CONCURRENCY: ranged GETs at once")
    s3_chunk_mb: int = Field(8, ge=1, description="EMBER_S3_CHUNK_MB: size of one ranged GET")
    fetch_retry_s: float = Field(
        30.0, ge=0, description="EMBER_FETCH_RETRY_S: keep retrying an unreachable store this long"
    )
    fetch_timeout_s: float = Field(600.0, gt=0, description="EMBER_FETCH_TIMEOUT_S: whole fetch budget")
    engine_timeout_s: float = Field(
        600.0, gt=0, description="EMBER_ENGINE_TIMEOUT_S: handoff → engine's LOAD result, else fallback"
    )
    warm_ready_without_engine: bool = Field(
        False, description="EMBER_WARM_READY_WITHOUT_ENGINE: a warm pod is Ready before the engine's standby"
    )
    log_level: str = Field("INFO", description="EMBER_LOG_LEVEL")
    trusted_keys: str = Field(
        "", description="EMBER_TRUSTED_KEYS: JSON list of trusted ed25519 public keys; set → only "
        "archives signed by one of them are handed over",
    )

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Settings from os.environ; keyword overrides (e.g. CLI flags) win when not None."""
        env: dict[str, Any] = {
            "pod_name": _env("EMBER_POD_NAME", contract.ENV_POD_NAME),
            "namespace": _env("EMBER_POD_NAMESPACE", contract.ENV_POD_NAMESPACE),
            "run_dir": _env(contract.ENV_RUN_DIR),
            "port": _env(contract.ENV_SIDECAR_PORT),
            "host": _env("EMBER_SIDECAR_HOST"),
            "standalone": _bool(_env("EMBER_STANDALONE")),
            "archive": _env("EMBER_ARCHIVE"),
            "store": _env(contract.ENV_STORE),
            "identity": _env("EMBER_ARCHIVE_IDENTITY"),
            "kubeconfig": _env("KUBECONFIG"),
            "s3_endpoint": _env(contract.ENV_S3_ENDPOINT),
            "s3_max_attempts": _env("EMBER_S3_MAX_ATTEMPTS"),
            "s3_connect_timeout": _env("EMBER_S3_CONNECT_TIMEOUT"),
            "s3_read_timeout": _env("EMBER_S3_READ_TIMEOUT"),
            "s3_max_concurrency": _env("EMBER_S3_MAX_CONCURRENCY"),
            "s3_chunk_mb": _env("EMBER_S3_CHUNK_MB"),
            "fetch_retry_s": _env("EMBER_FETCH_RETRY_S"),
            "fetch_timeout_s": _env("EMBER_FETCH_TIMEOUT_S"),
            "engine_timeout_s": _env("EMBER_ENGINE_TIMEOUT_S"),
            "warm_ready_without_engine": _bool(_env("EMBER_WARM_READY_WITHOUT_ENGINE")),
            "log_level": _env("EMBER_LOG_LEVEL"),
            "trusted_keys": _env(contract.ENV_TRUSTED_KEYS),
        }
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate({k: v for k, v in env.items() if v is not None})

    def store_options(self) -> dict[str, Any]:
        """Keyword options for ember.store.open_store on an s3:// URI."""
        opts: dict[str, Any] = {
            "max_attempts": self.s3_max_attempts,
            "connect_timeout": self.s3_connect_timeout,
            "read_timeout": self.s3_read_timeout,
            "max_concurrency": self.s3_max_concurrency,
        }
        if self.s3_endpoint:
            opts["endpoint"] = self.s3_endpoint
        return opts

    def cache_options(self) -> dict[str, Any]:
        """Keyword options for ember_sidecar.fetching.ArchiveCache."""
        return {"store_options": self.store_options(), "retry_s": self.fetch_retry_s,
                "timeout_s": self.fetch_timeout_s, "s3_concurrency": self.s3_max_concurrency,
                "s3_chunk": self.s3_chunk_mb << 20, "trusted_keys": self.trusted_keys}

    def standalone_archive(self) -> str:
        """The manifest URI for standalone mode: EMBER_ARCHIVE, else store + identity."""
        if self.archive:
            return self.archive
        if self.store and self.identity:
            return f"{self.store.rstrip('/')}/archives/{self.identity}/manifest"
        return ""
