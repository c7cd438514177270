"""Which stores a namespace may make the operator use (pure; `store_refusal` is the one check).

The operator probes every deployment's store itself. In a cluster shared by tenants that reach
must be bounded by the admin, not by the tenant's spec:

- **Endpoints**: an S3 `endpoint` must be on the admin's allow-list (setting `store_endpoints`;
  empty: the default store's endpoint only). An unset endpoint is AWS S3 (public), allowed. The
  operator never opens a connection to anything else (its own metrics port, etcd, a cloud
  metadata address), and creates no SAVE Job or pod that would.
- **Credentials**: an S3 store without `credentialsSecret` would be read with the operator's own
  credentials (its environment). Only namespaces the admin lists (setting
  `own_credentials_namespaces`, `*` for all) may do that; the operator's default store
  (spec.store unset) is the admin's own and always may.
- **Local paths** lie under `local_store_root` (the operator reads them itself).

A refusal is (reason, message): the deployment's status says it (`Progressing=False`, phase
`Invalid`), the archive's `Saved` condition too.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from ember_operator.api import StoreSpec, under_root

NO_STORE = "StoreNotConfigured"
OUTSIDE_ROOT = "LocalStoreOutsideRoot"
ENDPOINT_NOT_ALLOWED = "StoreEndpointNotAllowed"
CREDENTIALS_NOT_ALLOWED = "OperatorCredentialsNotAllowed"
REASONS = (NO_STORE, OUTSIDE_ROOT, ENDPOINT_NOT_ALLOWED, CREDENTIALS_NOT_ALLOWED)


@dataclass(frozen=True)
class Tenancy:
    """The admin's settings (from Settings)."""

    default_store: str = ""
    default_s3_endpoint: str = ""
    local_store_root: str = "/var/lib/ember"
    store_endpoints: tuple[str, ...] = ()  # allow-list; () → the default endpoint only; "*" → any
    credential_namespaces: tuple[str, ...] = ()  # may use the operator's credentials; "*" → all

    def default(self) -> StoreSpec:
        if not self.default_store:
            raise Refused(NO_STORE, "spec.store is unset and the operator has no default store "
                               "(setting default_store, chart value store.uri): set spec.store")
        return StoreSpec.from_uri(self.default_store, self.default_s3_endpoint)


class Refused(ValueError):
    """The operator refuses the spec (a store this namespace may not use, a limit): `reason` is
    the condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1  # never matches
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def endpoint_allowed(endpoint: str, allowed: Sequence[str]) -> bool:
    """`endpoint` is one of `allowed` (scheme://host[:port]; an entry without a port allows any
    port of its host; `*` allows everything). Paths are ignored."""
    if "*" in allowed:
        return True
    scheme, host, port = _origin(endpoint)
    for entry in allowed:
        e_scheme, e_host, e_port = _origin(entry)
        if (e_scheme, e_host) == (scheme, host) and e_port in (None, port):
            return True
    return False


def store_refusal(store: StoreSpec, namespace: str, tenancy: Tenancy) -> tuple[str, str] | None:
    """Why `namespace` may not use `store` ((reason, message)), or None when it may."""
    default = tenancy.default_store and _same(store, tenancy.default())
    if store.local is not None and not default and not under_root(store.local.path, tenancy.local_store_root):
        return OUTSIDE_ROOT, (f"store.local.path {store.local.path} is outside the operator's local store "
                              f"root {tenancy.local_store_root} (setting local_store_root): not read")
    if store.s3 is None or default:
        return None
    endpoint = store.s3.endpoint or ""
    allowed = tenancy.store_endpoints or tuple(e for e in (tenancy.default_s3_endpoint,) if e)
    if endpoint and not endpoint_allowed(endpoint, allowed):
        listed = ", ".join(allowed) or "none"
        return ENDPOINT_NOT_ALLOWED, (
            f"store.s3.endpoint {endpoint} is not on the operator's allow-list ({listed}; setting "
            "store_endpoints, chart value store.allowedEndpoints): the operator does not connect to it")
    names = tenancy.credential_namespaces
    if not store.s3.credentials_secret and "*" not in names and namespace not in names:
        return CREDENTIALS_NOT_ALLOWED, (
            "store.s3.credentialsSecret is unset: the operator does not lend its own store credentials "
            f"to namespace {namespace} (setting own_credentials_namespaces, chart value "
            "store.operatorCredentialsNamespaces); name a Secret with AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in this namespace")
    return None


def _same(store: StoreSpec, default: StoreSpec) -> bool:
    return store.uri() == default.uri() and (store.s3.endpoint if store.s3 else None) == (
        default.s3.endpoint if default.s3 else None)
