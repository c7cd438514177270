"""`ember inspect` and `ember verify`: archives read and checked without a GPU.

The commands are registered in ember/cli/__init__.py. `verify` checks integrity here; its `--replay` option
(a GPU replay through the runtime) is composed in ember/cli/__init__.py, which passes that check to
`verify_and_report` as `more`: this package never imports the runtime.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from ember.archive import bundle, signing
from ember.archive.collectives import Collectives
from ember.store import LocalStore, Store, StoreError, StoreUnavailable, open_store

console = Console()
err_console = Console(stderr=True)

StoreArg = Annotated[str, typer.Argument(help="Store URI (file:///path, s3://bucket/prefix) or directory.")]
HashArg = Annotated[str | None, typer.Argument(help="Archive identity hash (optional if the store has one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
ExpectIdentityOpt = Annotated[
    str | None, typer.Option("--expect-identity", help="Fail unless the archive has this identity hash.")
]
TrustedKeyOpt = Annotated[list[str] | None, typer.Option(
    "--trusted-key", help="A trusted ed25519 public key (base64, PEM, or @file); repeat for a rotation. "
    "Given: the manifest's signature must verify against one of them.")]
EndpointOpt = Annotated[str | None, typer.Option(
    "--endpoint", envvar="EMBER_S3_ENDPOINT", show_envvar=True,
    help="S3 endpoint URL for s3:// stores (MinIO, on-premises); AWS when unset.")]
MoreChecks = Callable[[str, str], list[str]]  # (store URI, identity hash) -> problems found


def mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 100_000 else f"{n:,} B"


_mb = mb


def open_existing(uri: str, endpoint: str | None = None) -> Store:
    """A store to read: `endpoint` for s3:// URIs; a local store must exist (a mistyped path is
    an error, not an empty store)."""
    store = open_store(uri, **({"endpoint": endpoint} if endpoint and uri.startswith("s3://") else {}))
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise StoreError(f"no store at {uri}: directory {store.root} does not exist")
    return store


def failed(exc: Exception) -> NoReturn:
    """Report a store failure and exit: 2 when unreachable, 1 otherwise."""
    if isinstance(exc, StoreUnavailable):
        err_console.print(f"[red]store unavailable:[/red] {exc}")
        raise typer.Exit(2) from None
    err_console.print(f"[red]cannot read the store:[/red] {exc}")
    raise typer.Exit(1) from None


def _keys_text(keys: list[list[int]], limit: int = 12) -> str:
    text = ", ".join("x".join(map(str, k)) for k in keys[:limit])
    return text + (f", … (+{len(keys) - limit})" if len(keys) > limit else "")


def groups_apart(archive: bundle.Archive) -> list[str]:
    """Per topology group, the first thing that keeps its template out of the group above
    ("" for the first): where to look when an archive has more groups (templates to build at
    LOAD) than expected."""
    from ember.archive.topology import why_apart

    table = archive.graph_table
    index = table.key_index
    templates = [table.graph(index[tuple(g.template)]) for g in archive.manifest.graphs.groups]
    return [""] + [why_apart(a, b, table.function_attrs) for a, b in itertools.pairwise(templates)]


def archive_report(archive: bundle.Archive, with_graphs: bool = True) -> dict[str, Any]:
    """What `ember inspect --json` prints: the manifest plus per-graph facts from the table."""
    m = archive.manifest
    report: dict[str, Any] = {
        "store": archive.store.uri,
        "manifest_uri": archive.manifest_uri,
        "stored_bytes": m.total_bytes,
        "raw_bytes": m.raw_bytes,
        "manifest": m.model_dump(mode="json"),
    }
    if with_graphs:
        table = archive.graph_table
        report["graphs"] = [
            {"key": list(k), "group": table.group_of(i), "nodes": len(table.node_types(i)),
             "edges": len(table.edges(i))}
            for i, k in enumerate(table.keys)
        ]
        report["table"] = {"version": table.version, "rows": len(table.rows), "kernels": len(table.kernels)}
        report["groups_apart"] = groups_apart(archive)
    if "collectives" in m.engine:
        report["collectives"] = Collectives.from_facts(m.engine["collectives"]).summary()
    return report


def archive_rows(store: Store) -> list[dict[str, Any]]:
    """One row per archive of the store: identity, model, engine, graphs, stored bytes, creation."""
    rows: list[dict[str, Any]] = []
    for h in store.list_archives():
        try:
            m, _ = bundle.load_manifest_from(store, h)
            rows.append({"identity_hash": h, "model": m.identity.model, "engine": m.identity.engine,
                         "graphs": m.graphs.count, "bytes": m.total_bytes,
                         "created_at": m.created_at.isoformat()})
        except bundle.ArchiveError as exc:
            rows.append({"identity_hash": h, "error": str(exc)})
    return rows


def list_table(uri: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"archives in {uri}")
    for col in ("identity hash", "model", "engine", "graphs", "size", "created"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["identity_hash"], f"[red]{r['error']}[/red]", "", "", "", "")
        else:
            table.add_row(r["identity_hash"], r["model"], r["engine"], str(r["graphs"]), _mb(r["bytes"]),
                          r["created_at"][:19])
    return table


def _list_archives(store: Store, as_json: bool) -> None:
    rows = archive_rows(store)
    if as_json:
        console.print_json(json.dumps({"store": store.uri, "archives": rows}))
        return
    console.print(list_table(store.uri, rows) if rows else f"no archives in {store.uri}")


def _head_table(archive: bundle.Archive) -> Table:
    """Identity, compat key, engine facts, sizes: one row each."""
    m = archive.manifest
    ident = m.identity
    head = Table(title=f"archive {m.identity_hash}", show_header=False)
    head.add_row("manifest", archive.manifest_uri)
    head.add_row("format", f"{m.format_version} (graph table {m.graphs.table_version}), "
                           f"ember {m.ember_version}")
    head.add_row("created", m.created_at.isoformat())
    head.add_row("model", f"{ident.model} @ {ident.revision}  dtype {ident.dtype}")
    if config := ident.config or m.engine.get("config"):
        head.add_row("model config", f"{config} (digest of its shape; LOAD refuses another)")
    head.add_row("engine", f"{ident.engine} {ident.engine_version}  graph mode {ident.graph_mode}")
    head.add_row("capture sizes", _keys_text([[s] for s in ident.capture_sizes], 20))
    head.add_row("parallelism", f"tensor {ident.parallelism.tensor}, expert {ident.parallelism.expert}, "
                                f"data {ident.parallelism.data}")
    head.add_row("limits", f"max_num_tokens {ident.max_num_tokens}, max_batch {ident.max_batch}")
    if ident.compile:
        head.add_row("compile", ", ".join(f"{k}={v}" for k, v in ident.compile.items()))
    c = m.compat
    head.add_row("compat: gpu", f"{c.gpu_name} (sm {c.compute_capability}) {ident.gpu_product}".strip())
    head.add_row("compat: software", f"driver {c.driver}, CUDA {c.cuda}, torch {c.torch or '-'}, "
                                     f"triton {c.triton or '-'}, engine {c.engine or '-'}")
    if c.env:
        head.add_row("compat: env", ", ".join(f"{k}={v}" for k, v in sorted(c.env.items())))
    for k, v in m.engine.items():
        head.add_row(f"engine: {k}", json.dumps(v) if not isinstance(v, str) else v)
    head.add_row("size", f"{_mb(m.total_bytes)} stored, {_mb(m.raw_bytes)} uncompressed")
    head.add_row("graphs", f"{m.graphs.count} graphs, {m.graphs.nodes:,} nodes, {m.graphs.kernels} kernels, "
                           f"{len(m.graphs.groups)} topology groups, {len(m.graphs.unions)} union templates")
    head.add_row("node types", ", ".join(f"{k} {v:,}" for k, v in m.graphs.node_types.items()))
    return head


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    out = Table(title=title)
    for col in columns:
        out.add_column(col)
    for row in rows:
        out.add_row(*row)
    return out


def _print_archive(archive: bundle.Archive, show_graphs: bool) -> None:
    m = archive.manifest
    console.print(_head_table(archive))
    apart = groups_apart(archive)
    console.print(_table(
        "topology groups", ("#", "signature", "graphs", "template", "nodes", "edges", "keys",
                            "apart from the group above"),
        [(str(i), g.signature[:16], str(len(g.keys)), "x".join(map(str, g.template)), str(g.nodes),
          str(g.edges), _keys_text(g.keys), apart[i]) for i, g in enumerate(m.graphs.groups)],
    ))
    if m.graphs.unions:
        console.print(_table(
            "union templates (one exec for several topologies; a member's missing nodes disabled)",
            ("#", "graphs", "nodes", "optional nodes", "keys"),
            [(str(i), str(len(u.keys)), str(u.nodes), str(u.optional), _keys_text(u.keys))
             for i, u in enumerate(m.graphs.unions)],
        ))
    console.print(_table(
        "blobs", ("name", "sha256", "stored", "uncompressed", "codec"),
        [(b.name, b.sha256[:16], _mb(b.compressed_size), _mb(b.size), b.codec) for b in m.blobs],
    ))
    if "collectives" in m.engine:
        coll = Collectives.from_facts(m.engine["collectives"])
        console.print(_table(
            f"collective placeholders: one archive for a world of {coll.world} (NCCL {coll.nccl_version}); "
            f"{coll.placeholders} nodes in {len(coll.nodes)} graphs, spliced per rank at LOAD",
            ("collective", "calls (as rank 0 issued them)", "nodes"),
            [(str(i), " + ".join(c.describe() for c in calls), str(n))
             for i, (calls, n) in enumerate(zip(coll.table, coll.uses(), strict=True))],
        ))
    if m.kernel_images:
        console.print(_table(
            "kernel images", ("content hash", "kind", "size", "kernels"),
            [(im.content_hash[:16], im.kind, _mb(im.size), str(im.kernels)) for im in m.kernel_images],
        ))
    if show_graphs:
        table = archive.graph_table
        console.print(_table(
            "graphs", ("key", "group", "nodes", "edges"),
            [("x".join(map(str, k)), str(table.group_of(i)), str(len(table.node_types(i))),
              str(len(table.edges(i)))) for i, k in enumerate(table.keys)],
        ))


def inspect(
    store_uri: StoreArg,
    identity_hash: HashArg = None,
    as_json: JsonOpt = False,
    graphs: Annotated[bool, typer.Option("--graphs", help="Also list every graph.")] = False,
    endpoint: EndpointOpt = None,
) -> None:
    """Show an archive without a GPU: identity, compat key, graphs, topology groups, blobs, images.

    With no identity hash, lists the store's archives (or shows the only one). Exit 0, 1 when
    there is no store or archive to read, 2 when the store is unreachable.
    """
    try:
        store = open_existing(store_uri, endpoint)
        if identity_hash is None and len(store.list_archives()) != 1:
            _list_archives(store, as_json)
            return
        archive = bundle.open_archive(store, identity_hash)
        if as_json:
            console.print_json(json.dumps(archive_report(archive, with_graphs=True)))
        else:
            _print_archive(archive, graphs)
    except StoreUnavailable as exc:
        err_console.print(f"[red]store unavailable:[/red] {exc}")
        raise typer.Exit(2) from None
    except (bundle.ArchiveError, StoreError) as exc:
        err_console.print(f"[red]cannot read archive:[/red] {exc}")
        raise typer.Exit(1) from None


def verify_and_report(
    store_uri: str,
    identity_hash: str | None = None,
    expect_identity: str | None = None,
    as_json: bool = False,
    more: MoreChecks | None = None,
    trusted_keys: list[str] | None = None,
    endpoint: str | None = None,
) -> NoReturn:
    """What `ember verify` does: the signature (checked against `trusted_keys` when given, else
    only reported: "unsigned" or who signed), the integrity checks of `bundle.verify_archive`, then
    `more` (the GPU replay of `--replay`) when the archive is intact; prints the problems and
    exits 0 = intact, 1 = problems, 2 = store unreachable."""
    try:
        keys = [signing.TrustedKey(signing.parse_public_key(_key_text(k))) for k in trusted_keys or []]
    except (OSError, signing.SigningKeyError) as exc:
        err_console.print(f"[red]--trusted-key:[/red] {exc}")
        raise typer.Exit(1) from None
    try:
        store = open_existing(store_uri, endpoint)
        if identity_hash is None and len(found := store.list_archives()) > 1:
            _verify_each(store, found, expect_identity, as_json, more, keys)
        if identity_hash is not None:
            identity_hash = bundle.resolve_hash(store, identity_hash)
        signature = _signature_line(store, identity_hash, keys)
        problems = bundle.verify_archive(store, identity_hash, expect_identity, trusted_keys=keys)
        if more is not None and not problems:
            problems += more(store_uri, bundle.open_archive(store, identity_hash).identity_hash)
    except bundle.ArchiveMissing as exc:
        err_console.print(f"[red]cannot read archive:[/red] {exc}")
        raise typer.Exit(1) from None
    except StoreUnavailable as exc:
        err_console.print(f"[red]store unavailable:[/red] {exc}")
        raise typer.Exit(2) from None
    except StoreError as exc:
        err_console.print(f"[red]cannot read archive:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        console.print_json(json.dumps({"store": store_uri, "identity_hash": identity_hash, "ok": not problems,
                                       "signature": signature, "problems": problems}))
        raise typer.Exit(1 if problems else 0)
    if signature:
        console.print(f"signature: {signature}")
    if problems:
        err_console.print(f"[red]archive has {len(problems)} problem(s):[/red]")
        for p in problems:
            err_console.print(f"  - {p}")
    else:
        which = f"{store_uri} {identity_hash}" if identity_hash else store_uri
        console.print(f"[green]archive OK[/green] ({which})")
    raise typer.Exit(1 if problems else 0)


def _verify_each(store: Store, hashes: list[str], expect_identity: str | None, as_json: bool,
                 more: MoreChecks | None, keys: list[signing.TrustedKey]) -> NoReturn:
    """`verify <store>` of a store with several archives: every one, a line each (JSON: a list);
    exit 1 when any has a problem. Store outages propagate (exit 2)."""
    results = []
    for h in hashes:
        problems = bundle.verify_archive(store, h, expect_identity, trusted_keys=keys)
        if more is not None and not problems:
            problems += more(store.uri, h)
        results.append({"identity_hash": h, "ok": not problems, "problems": problems,
                        "signature": _signature_line(store, h, keys)})
        if not as_json:
            line = "[green]OK[/green]" if not problems else f"[red]{len(problems)} problem(s)[/red]: " + \
                "; ".join(problems)
            console.print(f"{h}  {line}", soft_wrap=True)
    bad = sum(not r["ok"] for r in results)
    if as_json:
        console.print_json(json.dumps({"store": store.uri, "ok": not bad, "archives": results}))
    else:
        console.print(f"{len(results) - bad} of {len(results)} archive(s) OK in {store.uri}")
    raise typer.Exit(1 if bad else 0)


def _key_text(arg: str) -> str:
    return open(arg[1:]).read() if arg.startswith("@") else arg


def _signature_line(store: Store, identity_hash: str | None, keys: list[signing.TrustedKey]) -> str:
    """`signing.describe` for the archive verify checks ("" when there is no single manifest)."""
    if identity_hash is None:
        found = store.list_archives()
        identity_hash = found[0] if len(found) == 1 else None
    data = store.get_manifest(identity_hash) if identity_hash else None
    if data is None or identity_hash is None:
        return ""
    return signing.describe(data, store.get_signature(identity_hash), keys)[1]
