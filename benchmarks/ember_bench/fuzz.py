"""`ember bench fuzz`: coverage-guided fuzzing of the archive's parsers with atheris (libFuzzer).

Targets (every input is untrusted bytes from a store or a pod):

    graph_table  `ember.archive.graph_table.decode` and a walk of the table (keys, groups, node
                 types, edges, chunks, graphs, changed nodes, validate); documented error: FormatError
    graph_index  the same decoder and walk past zstd: the input is a raw (decompressed) index that
                 the harness compresses and puts in a valid table before a real chunk area (a
                 mutated zstd frame rarely decompresses, so `graph_table` alone stays shallow)
    graph_chunk  likewise for one graph's param chunk (the first graph's, a group template): the
                 input is the raw chunk, compressed and indexed by the harness
    manifest     `ember.archive.manifest.loads` and `referenced_digests`; documented: ManifestError
    image_size   libember's kernel-image sizer (`Interposer.image_size`, native/src/images.cpp) on
                 bytes that end exactly at a PROT_NONE page, so an over-read faults; documented:
                 EmberError, and a reported size must fit the bytes given. Coverage guidance sees
                 the Python side only (libember is not built with -fsanitize=fuzzer here).

Anything else (another exception, a hang past `--timeout`, a fault) is a finding: libFuzzer stops
and writes the input as `crash-*` / `timeout-*` under the output folder. Each target runs in its
own process (`python -m ember_bench.fuzz TARGET <libFuzzer args>`), from the seed corpus in
tests/fuzz_corpus/<target>/ plus a work corpus where new inputs land.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

TARGETS = ("graph_table", "graph_index", "graph_chunk", "manifest", "image_size")
SEED_CORPUS = Path(__file__).resolve().parents[2] / "tests" / "fuzz_corpus"
console = Console()

# ---- the targets (run inside the child process, after atheris instruments ember.archive) ---------


def graph_table_target() -> Callable[[bytes], None]:
    from ember.archive.graph_table import FormatError, decode

    def one(data: bytes) -> None:
        try:
            t = decode(data)
            _walk_table(t)
        except FormatError:
            pass

    return one


def _walk_table(t: Any) -> None:
    """What LOAD, `ember inspect` and `ember verify` touch, bounded so one input stays fast."""
    _ = t.version, t.keys, t.key_index, t.kernels, t.function_attrs, t.node_type_counts()
    n = min(t.count, 8)
    for i in range(n):
        t.node_types(i)
        t.edges(i)
        t.group_of(i)
        t.chunk(i)
        t.graph(i)
    for g in t.groups[:4]:
        members = list(g.members)[:4]
        for j in members[1:]:
            t.changed_nodes(members[0], j)
    t.validate()


def graph_index_target() -> Callable[[bytes], None]:
    import zstandard as zstd

    from ember.archive.graph_table import MAGIC, MAJOR, OUTER, FormatError, decode, read_header

    base = (SEED_CORPUS / "graph_table" / INDEX_BASE).read_bytes()
    minor, flags, _ioff, _ilen, _iraw, coff = read_header(base)
    chunks = base[coff:]
    comp = zstd.ZstdCompressor(level=1)

    def one(data: bytes) -> None:
        frame = comp.compress(data)
        header = OUTER.pack(MAGIC, MAJOR, minor, OUTER.size, flags, OUTER.size, len(frame), len(data),
                            OUTER.size + len(frame))
        with contextlib.suppress(FormatError):
            _walk_table(decode(header + frame + chunks))

    return one


INDEX_BASE = "synthetic-1.bin"  # graph_index: the table whose chunk area every input is put before


def graph_chunk_target() -> Callable[[bytes], None]:
    import numpy as np
    import zstandard as zstd

    from ember.archive import graph_table

    base = (SEED_CORPUS / "graph_table" / INDEX_BASE).read_bytes()
    minor, flags, ioff, ilen, iraw, coff = graph_table.read_header(base)
    raw_index = zstd.ZstdDecompressor().decompress(base[ioff:ioff + ilen], max_output_size=iraw)
    sections = {k: np.array(v) for k, v in graph_table.unpack_container(
        raw_index, graph_table.INDEX_SECTIONS, "index", graph_table.OPTIONAL_INDEX_SECTIONS).items()}
    row = int(sections[b"ROOT"][0])  # graph 0: a template, its chunk compressed without a dictionary
    chunks = base[coff:]
    comp = zstd.ZstdCompressor(level=1)

    def one(data: bytes) -> None:
        frame = comp.compress(data)
        rows = sections[b"GRPH"].copy()
        rows[row]["chunk_off"], rows[row]["chunk_len"] = len(chunks), len(frame)
        rows[row]["chunk_raw"] = len(data)
        raw_index = graph_table.pack_container({**sections, b"GRPH": rows})
        index = comp.compress(raw_index)
        size = graph_table.OUTER.size
        header = graph_table.OUTER.pack(graph_table.MAGIC, graph_table.MAJOR, minor, size, flags, size,
                                        len(index), len(raw_index), size + len(index))
        with contextlib.suppress(graph_table.FormatError):
            _walk_table(graph_table.decode(header + index + chunks + frame))

    return one


def manifest_target() -> Callable[[bytes], None]:
    from ember.archive.manifest import ManifestError, loads, referenced_digests

    def one(data: bytes) -> None:
        referenced_digests(data)
        try:
            m = loads(data)
        except ManifestError:
            return
        for entry in m.blobs[:8]:
            m.blob(entry.name)

    return one


def image_size_target() -> Callable[[bytes], None]:
    import ctypes
    import mmap

    from ember.native import EmberError, Interposer, find_library

    lib = find_library()
    if lib is None:
        raise SystemExit("libember.so not found (build native/ or set EMBER_LIB)")
    ip = Interposer.attach(lib)
    pages = 16
    area = mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    guard = base + pages * mmap.PAGESIZE
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(guard, mmap.PAGESIZE, 0) != 0:  # PROT_NONE: one byte too far faults
        raise SystemExit("mprotect failed")

    def one(data: bytes, _keep: Any = area) -> None:  # the mapping lives as long as the target
        data = data[: pages * mmap.PAGESIZE]
        addr = guard - len(data)
        ctypes.memmove(addr, data, len(data))
        for limit in (0, len(data)):
            try:
                _kind, size = ip.image_size(addr, limit)
            except EmberError:
                continue
            if size > len(data):
                raise AssertionError(f"image_size reported {size} bytes for {len(data)} (limit {limit})")

    return one


TARGET_FUNCTIONS: dict[str, Callable[[], Callable[[bytes], None]]] = {
    "graph_table": graph_table_target, "graph_index": graph_index_target, "graph_chunk": graph_chunk_target,
    "manifest": manifest_target,
    "image_size": image_size_target,
}
INSTRUMENTED = ("ember.archive", "ember.native", "ember.identity", "ember.contract")


def _instrument(atheris: Any, prefixes: tuple[str, ...]) -> int:
    """Coverage instrumentation for every function and method defined in modules under `prefixes`."""
    import inspect

    done = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefixes) or module is None:
            continue
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            members = [obj] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                members = list(vars(obj).values())
            for m in members:
                for f in (m, getattr(m, "__func__", None), getattr(m, "fget", None)):
                    if inspect.isfunction(f):
                        atheris.instrument_func(f)
                        done += 1
    return done


def _child(target: str, args: list[str]) -> None:
    import atheris

    one = TARGET_FUNCTIONS[target]()
    # Instrument ember's own modules after the imports: atheris' import hook misses modules loaded
    # through the editable install's loader, and instrument_all() takes ~20 s (every library).
    _instrument(atheris, INSTRUMENTED)
    atheris.Setup([sys.argv[0], *args], one)
    atheris.Fuzz()


# ---- the driver ---------------------------------------------------------------------------------

_STAT = re.compile(r"#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/\S+.*?exec/s: (\d+)")


def run_target(target: str, runs: int, out: Path, timeout: int = 10, seed: int = 0,
               max_len: int = 65536, rss_limit_mb: int = 2048) -> dict[str, Any]:
    """Fuzz one target for `runs` executions in a child process; its figures and findings."""
    work = out / f"corpus-{target}"
    work.mkdir(parents=True, exist_ok=True)
    seeds = SEED_CORPUS / target
    cmd = [sys.executable, "-m", "ember_bench.fuzz", target, f"-runs={runs}", f"-timeout={timeout}",
           f"-seed={seed}", f"-max_len={max_len}", f"-rss_limit_mb={rss_limit_mb}",
           f"-artifact_prefix={out}/{target}-", "-print_final_stats=1", str(work), str(seeds)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    wall = time.perf_counter() - t0
    (out / f"{target}.log").write_text(proc.stdout[-100_000:] + proc.stderr[-200_000:])  # atheris: stdout
    stats = [m.groups() for m in _STAT.finditer(proc.stderr)]
    last = stats[-1] if stats else ("0", "", "0", "0", "0", "0")
    executed = re.findall(r"stat::number_of_executed_units:\s*(\d+)", proc.stderr)
    findings = sorted(p.name for p in out.glob(f"{target}-*"))
    return {
        "target": target, "exit": proc.returncode, "wall_s": round(wall, 1),
        "executions": int(executed[-1]) if executed else int(last[0]),
        "exec_per_s": round(int(executed[-1]) / wall) if executed and wall else int(last[5]),
        "coverage_edges": int(last[2]), "features": int(last[3]), "corpus": int(last[4]),
        "seeds": len(list(seeds.iterdir())) if seeds.is_dir() else 0,
        "findings": findings,
        "error_tail": (proc.stdout[-3000:] + proc.stderr[-2000:]) if proc.returncode else "",
    }


def bench_fuzz(
    targets: Annotated[str, typer.Option(help=f"Comma-separated: {', '.join(TARGETS)}.")] = ",".join(TARGETS),
    runs: Annotated[int, typer.Option(help="Executions per target.")] = 350_000,
    out: Annotated[str, typer.Option(help="Work folder (corpora, logs, findings); default: temp.")] = "",
    timeout: Annotated[int, typer.Option(help="Seconds one input may take before it is a hang.")] = 10,
    json_out: Annotated[str, typer.Option("--json", help="Also write the summary here.")] = "",
) -> None:
    """Fuzz the graph-table decoder, the manifest parser and the kernel-image sizer (atheris)."""
    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="ember-fuzz-"))
    results = []
    for target in [t.strip() for t in targets.split(",") if t.strip()]:
        if target not in TARGETS:
            raise typer.BadParameter(f"unknown target {target!r} (known: {', '.join(TARGETS)})")
        r = run_target(target, runs, folder, timeout=timeout)
        results.append(r)
        console.print(f"{target}: {r['executions']} executions in {r['wall_s']} s ({r['exec_per_s']}/s), "
                      f"cov {r['coverage_edges']} ft {r['features']} corpus {r['corpus']}, "
                      f"findings {r['findings'] or 'none'}")
        if r["error_tail"]:
            console.print(r["error_tail"], markup=False)
    summary = {"folder": str(folder), "results": results,
               "executions": sum(r["executions"] for r in results)}
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    console.print(f"total {summary['executions']} executions; work folder {folder}")
    if any(r["exit"] or r["findings"] for r in results):
        raise typer.Exit(1)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2:])
