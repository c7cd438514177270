"""`ember ls` and `ember gc`: what a store holds, and deleting what nothing keeps.

Archives are kept by identity: every GraphArchive of the cluster (and every identity a
ModelDeployment names) when the kept set is read through the kubernetes client, or the identities
of `--keep FILE` / `--keep-identity`. `gc` is a dry run unless `--delete`; it never deletes a blob a
kept archive names (ember/archive/gc.py). Exit codes: 0 done, 1 a problem with the input or the
store's contents, 2 the store or the cluster unreachable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ember import contract
from ember.archive import bundle
from ember.archive.gc import GcPlan, GcRefused, apply_gc, plan_gc
from ember.cli.archives import (
    EndpointOpt,
    JsonOpt,
    StoreArg,
    archive_rows,
    console,
    err_console,
    failed,
    list_table,
    mb,
    open_existing,
)
from ember.store import S3Store, Store, StoreError, StoreUnavailable

_HASH = re.compile(r"^[0-9a-f]{16}$|^[0-9a-f]{64}$")
_MANIFEST = re.compile(r"archives/([0-9a-f]{64})/manifest$")


def ls(store_uri: StoreArg, endpoint: EndpointOpt = None, as_json: JsonOpt = False) -> None:
    """List a store's archives: identity hash, model, engine, graphs, stored size, creation date.

    Exit 0 (also for an empty store), 1 when there is no store at the URI, 2 when it is unreachable.
    """
    try:
        store = open_existing(store_uri, endpoint)
        rows = archive_rows(store)
    except (StoreError, StoreUnavailable) as exc:
        failed(exc)
    if as_json:
        console.print_json(json.dumps({"store": store.uri, "archives": rows}))
    elif rows:
        console.print(list_table(store.uri, rows))
        total = sum(r.get("bytes", 0) for r in rows)
        console.print(f"{len(rows)} archive(s), {mb(total)} named by their manifests (shared blobs counted "
                      "once per archive)")
    else:
        console.print(f"no archives in {store.uri}")


@dataclass
class Kept:
    """Identities to keep (full hashes or 16-hex prefixes), those being saved now, and whence."""

    identities: set[str] = field(default_factory=set)
    saving: set[str] = field(default_factory=set)
    source: str = ""


def keep_from_args(keep_file: Path | None, keep_identity: list[str]) -> Kept:
    """`--keep FILE` (one identity hash, 16-hex prefix or manifest URI a line; # comments) and
    `--keep-identity`. Any line that is none of these is an error: a typo must not delete."""
    entries = [(f"--keep-identity {v}", v) for v in keep_identity]
    if keep_file is not None:
        for n, line in enumerate(keep_file.read_text().splitlines(), 1):
            text = line.split("#", 1)[0].strip()
            if text:
                entries.append((f"{keep_file}:{n}", text))
    sources = [str(keep_file)] if keep_file is not None else []
    kept = Kept(source=", ".join(sources + ["--keep-identity"] * bool(keep_identity)))
    for where, text in entries:
        m = _MANIFEST.search(text)
        value = m.group(1) if m else text.lower()
        if not _HASH.match(value):
            raise typer.BadParameter(f"{where}: {text!r} is not an identity hash (64 hex), a 16-hex prefix "
                                     "or a manifest URI")
        kept.identities.add(value)
    return kept


def keep_from_cluster(store: Store, kubeconfig: str | None, context: str | None) -> Kept:
    """Every identity the cluster's GraphArchives and ModelDeployments name (all namespaces); the
    GraphArchives not Available whose store may be this one are being saved."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
    except (ConfigException, OSError, TypeError):
        if kubeconfig or context:
            raise
        config.load_incluster_config()
        api_client = client.ApiClient()
    api = client.CustomObjectsApi(api_client)
    group, version = contract.GROUP, contract.VERSION
    archives: list[dict[str, Any]] = api.list_cluster_custom_object(  # type: ignore[index]
        group, version, contract.GRAPH_ARCHIVES)["items"]
    deployments: list[dict[str, Any]] = api.list_cluster_custom_object(  # type: ignore[index]
        group, version, contract.MODEL_DEPLOYMENTS)["items"]
    kept = Kept(source=f"the cluster ({len(archives)} GraphArchives, {len(deployments)} ModelDeployments)")
    for ga in archives:
        ident = (ga.get("spec") or {}).get("identityHash") or ""
        kept.identities.add(ident)
        if (ga.get("status") or {}).get("phase") != "Available" and _may_be(store, ga.get("spec") or {}):
            kept.saving.add(ident)
    uses = f"{contract.GROUP}/uses-"
    for md in deployments:
        labels = (md.get("metadata") or {}).get("labels") or {}
        kept.identities |= {v for k, v in labels.items() if k == contract.LABEL_IDENTITY}
        kept.identities |= {k.removeprefix(uses) for k in labels if k.startswith(uses)}
        archive = (md.get("status") or {}).get("archive") or {}
        kept.identities.add(archive.get("identityHash") or "")
    kept.identities = {i for i in kept.identities if _HASH.match(i)}
    kept.saving &= kept.identities
    return kept


def _may_be(store: Store, spec: dict[str, Any]) -> bool:
    """Whether a GraphArchive's store may be `store` (S3: same bucket and prefix; local: always)."""
    s3 = (spec.get("store") or {}).get("s3")
    if not isinstance(store, S3Store) or not s3:
        return True
    return (s3.get("bucket"), (s3.get("prefix") or "").strip("/")) == (store.bucket, store.prefix)


def _plan_table(store: Store, plan: GcPlan) -> Table:
    table = Table(title=f"archives to delete from {store.uri}")
    for col in ("identity hash", "model", "size", "created"):
        table.add_column(col)
    for ident in plan.archives:
        try:
            m, _ = bundle.load_manifest_from(store, ident)
            table.add_row(ident, m.identity.model, mb(m.total_bytes), m.created_at.isoformat()[:19])
        except bundle.ArchiveError as exc:
            table.add_row(ident, f"[red]{exc}[/red]", "", "")
    return table


def _report(store: Store, plan: GcPlan, kept: Kept, dry_run: bool, as_json: bool) -> None:
    if as_json:
        console.print_json(json.dumps({
            "store": store.uri, "dry_run": dry_run, "kept_from": kept.source, "kept": plan.kept,
            "archives": plan.archives, "blobs": [b.digest for b in plan.blobs], "blob_bytes": plan.blob_bytes,
            "young_blobs": plan.young, "held": plan.held}))
        return
    console.print(f"kept: {len(plan.kept)} archive(s) of {store.uri} named by {kept.source}")
    if plan.archives:
        console.print(_plan_table(store, plan))
    young = f"; {plan.young} unreferenced blob(s) younger than --min-age stay" if plan.young else ""
    console.print(f"{len(plan.archives)} archive(s) and {len(plan.blobs)} blob(s) ({mb(plan.blob_bytes)}) "
                  f"{'would be' if dry_run else 'were'} deleted{young}")
    if plan.held:
        console.print(f"[yellow]{plan.held}[/yellow]")
    if dry_run and (plan.archives or plan.blobs):
        console.print("dry run: nothing deleted (pass --delete to delete)")


def gc(
    store_uri: StoreArg,
    keep_file: Annotated[Path | None, typer.Option(
        "--keep", exists=True, dir_okay=False, help="File of identities to keep (one hash, 16-hex prefix or "
        "manifest URI a line; # comments). With --keep or --keep-identity the cluster is not asked.")] = None,
    keep_identity: Annotated[list[str] | None, typer.Option(
        "--keep-identity", help="An identity hash (or 16-hex prefix) to keep; repeat.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run/--delete", help="Only show what would go (the default), or delete it.")] = True,
    min_age: Annotated[float, typer.Option(
        "--min-age", help="Seconds an unreferenced blob must be old to go (a SAVE uploads blobs before its "
        "manifest).")] = 3600.0,
    kubeconfig: Annotated[str | None, typer.Option("--kubeconfig", help="Kubeconfig (default: KUBECONFIG, "
                                                   "~/.kube/config, then in-cluster).")] = None,
    context: Annotated[str | None, typer.Option("--context", help="Kubeconfig context.")] = None,
    endpoint: EndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete archives that nothing keeps, then blobs that no kept archive names.

    Kept: every identity the cluster's GraphArchives and ModelDeployments name (kubernetes client,
    all namespaces), or only those of --keep / --keep-identity. A dry run unless --delete.
    Exit 0 done, 1 bad input or an unreadable kept manifest, 2 store or cluster unreachable.
    """
    try:
        store = open_existing(store_uri, endpoint)
        if keep_file is not None or keep_identity:
            kept = keep_from_args(keep_file, keep_identity or [])
        else:
            kept = _cluster_or_exit(store, kubeconfig, context)
        plan = plan_gc(store, kept.identities, min_age, kept.saving)
        if not dry_run:
            apply_gc(store, plan)
    except (StoreError, StoreUnavailable) as exc:
        failed(exc)
    except GcRefused as exc:
        err_console.print(f"[red]refused:[/red] {exc}")
        raise typer.Exit(1) from None
    _report(store, plan, kept, dry_run, as_json)


def _cluster_or_exit(store: Store, kubeconfig: str | None, context: str | None) -> Kept:
    """The cluster's kept set; any failure to read it ends the command (exit 2): an empty answer
    from a cluster that could not be read must never look like "nothing is kept"."""
    try:
        return keep_from_cluster(store, kubeconfig, context)
    except ImportError:
        err_console.print("[red]no kubernetes client:[/red] install ember[operator] to read the cluster, or "
                          "pass --keep FILE / --keep-identity")
    except Exception as exc:  # config, network, 403, CRDs missing (404): all mean "unknown"
        err_console.print(f"[red]cannot read GraphArchives from the cluster:[/red] {type(exc).__name__}: "
                          f"{str(exc)[:300]}\npass --keep FILE or --keep-identity when there is no cluster")
    raise typer.Exit(2)
