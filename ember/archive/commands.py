"""`ember inspect` and `ember verify`: archives read without a GPU.

Registered in ember/cli.py. `verify --replay` first re-executes the process under libember in
load mode (`ember.runtime.session.reexec_under_libember`), checks integrity, then calls the
runtime's GPU check `ember.engines.decode.commands.replay_verify(store_uri, identity_hash) -> dict`
({"ok", "graphs", "identical", "differ"} or {"ok": False, "refused": reason}) through
`replay_problems`, which turns the result into sentences and says so plainly when the runtime
part is not installed.
"""

from __future__ import annotations

import importlib
import itertools
import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ember.archive import bundle
from ember.store import Store, StoreError, StoreUnavailable, open_store

console = Console()
err_console = Console(stderr=True)

REPLAY_MODULE = "ember.engines.decode.commands"

StoreArg = Annotated[str, typer.Argument(help="Store URI (file:///path, s3://bucket/prefix) or directory.")]
HashArg = Annotated[str | None, typer.Argument(help="Archive identity hash (optional if the store has one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 100_000 else f"{n:,} B"


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
    return report


def _list_archives(store: Store, as_json: bool) -> None:
    rows = []
    for h in store.list_archives():
        try:
            m, _ = bundle.load_manifest_from(store, h)
            rows.append({"identity_hash": h, "model": m.identity.model, "engine": m.identity.engine,
                         "graphs": m.graphs.count, "bytes": m.total_bytes,
                         "created_at": m.created_at.isoformat()})
        except bundle.ArchiveError as exc:
            rows.append({"identity_hash": h, "error": str(exc)})
    if as_json:
        console.print_json(json.dumps({"store": store.uri, "archives": rows}))
        return
    table = Table(title=f"archives in {store.uri}")
    for col in ("identity hash", "model", "engine", "graphs", "size", "created"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["identity_hash"], f"[red]{r['error']}[/red]", "", "", "", "")
        else:
            table.add_row(r["identity_hash"], r["model"], r["engine"], str(r["graphs"]), _mb(r["bytes"]),
                          r["created_at"][:19])
    console.print(table if rows else f"no archives in {store.uri}")


def _print_archive(archive: bundle.Archive, show_graphs: bool) -> None:
    m = archive.manifest
    ident = m.identity
    head = Table(title=f"archive {m.identity_hash}", show_header=False)
    head.add_row("manifest", archive.manifest_uri)
    head.add_row("format", f"{m.format_version} (graph table {m.graphs.table_version}), "
                           f"ember {m.ember_version}")
    head.add_row("created", m.created_at.isoformat())
    head.add_row("model", f"{ident.model} @ {ident.revision}  dtype {ident.dtype}")
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
                           f"{len(m.graphs.groups)} topology groups")
    head.add_row("node types", ", ".join(f"{k} {v:,}" for k, v in m.graphs.node_types.items()))
    console.print(head)

    groups = Table(title="topology groups")
    cols = ("#", "signature", "graphs", "template", "nodes", "edges", "keys", "apart from the group above")
    for col in cols:
        groups.add_column(col)
    apart = groups_apart(archive)
    for i, g in enumerate(m.graphs.groups):
        groups.add_row(str(i), g.signature[:16], str(len(g.keys)), "x".join(map(str, g.template)),
                       str(g.nodes), str(g.edges), _keys_text(g.keys), apart[i])
    console.print(groups)

    blobs = Table(title="blobs")
    for col in ("name", "sha256", "stored", "uncompressed", "codec"):
        blobs.add_column(col)
    for b in m.blobs:
        blobs.add_row(b.name, b.sha256[:16], _mb(b.compressed_size), _mb(b.size), b.codec)
    console.print(blobs)

    if m.kernel_images:
        images = Table(title="kernel images")
        for col in ("content hash", "kind", "size", "kernels"):
            images.add_column(col)
        for im in m.kernel_images:
            images.add_row(im.content_hash[:16], im.kind, _mb(im.size), str(im.kernels))
        console.print(images)

    if show_graphs:
        table = archive.graph_table
        gt = Table(title="graphs")
        for col in ("key", "group", "nodes", "edges"):
            gt.add_column(col)
        for i, k in enumerate(table.keys):
            gt.add_row("x".join(map(str, k)), str(table.group_of(i)), str(len(table.node_types(i))),
                       str(len(table.edges(i))))
        console.print(gt)


def inspect(
    store_uri: StoreArg,
    identity_hash: HashArg = None,
    as_json: JsonOpt = False,
    graphs: Annotated[bool, typer.Option("--graphs", help="Also list every graph.")] = False,
) -> None:
    """Show an archive without a GPU: identity, compat key, graphs, topology groups, blobs, images.

    With no identity hash, lists the store's archives (or shows the only one).
    """
    try:
        store = open_store(store_uri)
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


def replay_problems(store_uri: str, identity_hash: str) -> list[str]:
    """GPU replay of every graph, compared bitwise with SAVE's outputs (the runtime's part)."""
    try:
        mod = importlib.import_module(REPLAY_MODULE)
        replay_verify = mod.replay_verify
    except (ImportError, AttributeError) as exc:
        return [f"GPU replay is not available in this build ({REPLAY_MODULE}: {exc})"]
    try:
        res = replay_verify(store_uri, identity_hash)
    except Exception as exc:  # no GPU, no libember, driver errors: a problem to report, not a crash
        return [f"GPU replay failed: {type(exc).__name__}: {exc}"]
    if res.get("ok"):
        return []
    if "refused" in res:
        return [f"LOAD refused the archive on this machine: {res['refused']}"]
    differ = res.get("differ", [])
    return [f"{len(differ)} of {res.get('graphs', 0)} graph(s) replayed differently from SAVE "
            f"(first keys: {differ[:5]})" if differ else f"replay checked no graph: {res}"]


def _reexec_for_replay() -> None:
    try:
        from ember.runtime.session import reexec_under_libember

        reexec_under_libember("load")
    except Exception as exc:  # replay_problems then reports why replay cannot run here
        err_console.print(f"[yellow]cannot run under libember here:[/yellow] {exc}")


def verify(
    store_uri: StoreArg,
    identity_hash: HashArg = None,
    expect_identity: Annotated[
        str | None, typer.Option("--expect-identity", help="Fail unless the archive has this identity hash.")
    ] = None,
    replay: Annotated[bool, typer.Option("--replay", help="Also replay every graph on this GPU vs native.")]
    = False,
    as_json: JsonOpt = False,
) -> None:
    """Check an archive's integrity without a GPU: manifest, identity, every blob's size and digest,
    decompression, the graph table's structure. Exit 0 = intact, 1 = problems, 2 = store unreachable.
    """
    if replay:
        _reexec_for_replay()  # LOAD must run under libember: this process is replaced once
    try:
        store = open_store(store_uri)
        problems = bundle.verify_archive(store, identity_hash, expect_identity)
        if replay and not problems:
            problems += replay_problems(store_uri, bundle.open_archive(store, identity_hash).identity_hash)
    except StoreUnavailable as exc:
        err_console.print(f"[red]store unavailable:[/red] {exc}")
        raise typer.Exit(2) from None
    except StoreError as exc:
        err_console.print(f"[red]cannot read archive:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        console.print_json(json.dumps({"store": store_uri, "identity_hash": identity_hash, "ok": not problems,
                                       "problems": problems}))
    elif problems:
        err_console.print(f"[red]archive has {len(problems)} problem(s):[/red]")
        for p in problems:
            err_console.print(f"  - {p}")
    else:
        which = f"{store_uri} {identity_hash}" if identity_hash else store_uri
        console.print(f"[green]archive OK[/green] ({which})")
    raise typer.Exit(1 if problems else 0)

