"""What does cuLibraryLoadData pay for in a fatbin: every architecture's entry, or only this GPU's?

    python benchmarks/results/diag/diag_fatbin_load.py STORE --out DIR --tag H100

For the one archive in STORE, each fatbin image is cut three ways, and each way is loaded in its
own fresh process (plain driver through ctypes, no libember, default lazy module loading):
  full    the archive's fatbin as is;
  entry   a fatbin holding only this GPU's ELF entries, their (compressed) payload untouched;
  elf     this GPU's ELF entry decompressed: the bare cubin.
Timed per image: cuLibraryLoadData, then resolving every kernel the archive's graphs use from it
(cuLibraryGetKernel, cuKernelGetFunction, cuFuncLoad). The archive's cubins are loaded as they are
in every way, so each way's total also shows what a whole LOAD's images would cost.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FATBIN_MAGIC = 0xBA55ED50
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ELF_KIND = 2
COMPRESSED = 0x8000


def entries(fat: bytes) -> list[dict[str, Any]]:
    magic, _, hsize, body = struct.unpack_from("<IHHQ", fat, 0)
    assert magic == FATBIN_MAGIC, hex(magic)
    out, pos, end = [], hsize, hsize + body
    while pos + 64 <= end:
        kind, _, ehsize, padded, size = struct.unpack_from("<HHIQI", fat, pos)
        arch = struct.unpack_from("<I", fat, pos + 28)[0]
        flags, _, raw = struct.unpack_from("<QQQ", fat, pos + 40)
        if ehsize == 0:
            break
        out.append(
            {
                "kind": kind,
                "arch": arch,
                "flags": flags,
                "size": size,
                "raw": raw,
                "at": pos,
                "header": ehsize,
                "padded": padded,
                "zstd": fat[pos + ehsize : pos + ehsize + 4] == ZSTD_MAGIC,
            }
        )
        pos += ehsize + padded
    return out


def pruned(elf: bytes, names: list[str]) -> bytes:
    from ember.archive import kernel_images

    return kernel_images.prune(elf, set(names))


def cut(fat: bytes, arch: int) -> dict[str, bytes]:
    """The 'entry' and 'elf' ways of one fatbin for this GPU's architecture."""
    import zstandard

    mine = [e for e in entries(fat) if e["kind"] == ELF_KIND and e["arch"] == arch]
    if not mine:
        return {}
    parts = [fat[e["at"] : e["at"] + e["header"] + e["padded"]] for e in mine]
    body = b"".join(parts)
    ways = {"entry": fat[:8] + struct.pack("<Q", len(body)) + body}
    e = mine[0]
    payload = fat[e["at"] + e["header"] : e["at"] + e["header"] + e["size"]]
    if e["flags"] & COMPRESSED or e["zstd"]:
        payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=max(e["raw"], 1 << 28))
    if payload[:4] == b"\x7fELF":
        ways["elf"] = payload
    return ways


class Driver:
    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0))
        dev, self.ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), 0))
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        self.check(self.cu.cuCtxSetCurrent(self.ctx))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev))  # compute capability
        self.check(self.cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev))
        self.arch = major.value * 10 + minor.value

    @staticmethod
    def check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"CUresult {rc}")

    def load(self, data: bytes) -> tuple[ctypes.c_void_p, float]:
        lib, buf = ctypes.c_void_p(), ctypes.create_string_buffer(data, len(data))
        t = time.perf_counter()
        self.check(self.cu.cuLibraryLoadData(ctypes.byref(lib), buf, None, None, 0, None, None, 0))
        return lib, (time.perf_counter() - t) * 1e3

    def resolve(self, lib: ctypes.c_void_p, name: str) -> tuple[float, list[int]]:
        k, f = ctypes.c_void_p(), ctypes.c_void_p()
        t = time.perf_counter()
        self.check(self.cu.cuLibraryGetKernel(ctypes.byref(k), lib, name.encode()))
        self.check(self.cu.cuKernelGetFunction(ctypes.byref(f), k))
        self.check(self.cu.cuFuncLoad(f))
        ms = (time.perf_counter() - t) * 1e3
        attrs = []
        for a in range(17):  # CU_FUNC_ATTRIBUTE_*: registers, shared/const/local sizes, versions, ...
            v = ctypes.c_int(-1)
            self.cu.cuFuncGetAttribute(ctypes.byref(v), a, f)
            attrs.append(v.value)
        return ms, attrs


def archive_images(store: str) -> tuple[list[str], dict[str, bytes], dict[str, list[str]], set[str]]:
    from ember.archive import bundle
    from ember.archive import graph_table as fmt
    from ember.runtime import publish
    from ember.runtime.graphs.need import need_order

    arc = bundle.open_archive(store)
    table = fmt.decode(arc.blob_bytes(arc.manifest.graphs.table))
    order = publish.image_order(arc.manifest)
    used: dict[str, list[str]] = {}
    for k in table.kernels:
        used.setdefault(k.image, []).append(k.name)
    first = {
        table.kernels[k].image for k in set(table.chunk(need_order(table.keys)[0]).kpar["kernel"].tolist())
    }
    return order, {h: arc.kernel_image(h) for h in order}, used, first


def child(store: str, way: str) -> dict[str, Any]:
    order, data, used, first = archive_images(store)
    drv = Driver()
    rows = []
    for h in order:  # need order: the first key's images lead
        d = data[h]
        fat = d[:4] == struct.pack("<I", FATBIN_MAGIC)
        if way == "prune":
            elf = cut(d, drv.arch).get("elf", b"") if fat else d
            d = pruned(elf, sorted(set(used.get(h, [])))) if elf else b""
        elif fat and way != "full":
            d = cut(d, drv.arch).get(way, b"")
            if not d:
                rows.append({"image": h[:12], "fatbin": True, "error": f"no {way} for sm_{drv.arch}"})
                continue
        try:
            lib, load_ms = drv.load(d)
            resolved = [drv.resolve(lib, n) for n in sorted(set(used.get(h, [])))]
        except RuntimeError as e:
            rows.append({"image": h[:12], "fatbin": fat, "error": str(e)})
            continue
        rows.append(
            {
                "image": h[:12],
                "fatbin": fat,
                "first": h in first,
                "bytes": len(d),
                "load_ms": load_ms,
                "resolve_ms": sum(ms for ms, _ in resolved),
                "kernels": len(resolved),
                "attrs": [a for _, a in resolved],
            }
        )
    return {"arch": drv.arch, "rows": rows}


def describe(store: str) -> list[dict[str, Any]]:
    """Every fatbin's entries, as the parser reads them."""
    _, data, used, first = archive_images(store)
    return [
        {
            "image": h[:12],
            "bytes": len(d),
            "first": h in first,
            "kernels_used": len(used.get(h, [])),
            "entries": [
                {k: e[k] for k in ("kind", "arch", "flags", "size", "raw", "zstd")} for e in entries(d)
            ],
        }
        for h, d in data.items()
        if d[:4] == struct.pack("<I", FATBIN_MAGIC)
    ]


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {"errors": len(rows) - len(ok)}
    for name, sel in (
        ("first", [r for r in ok if r["first"]]),
        ("fatbins", [r for r in ok if r["fatbin"]]),
        ("all", ok),
    ):
        out[name] = {
            "n": len(sel),
            "mb": round(sum(r["bytes"] for r in sel) / 2**20, 2),
            "load_ms": round(sum(r["load_ms"] for r in sel), 1),
            "resolve_ms": round(sum(r["resolve_ms"] for r in sel), 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tag", default="gpu")
    ap.add_argument("--ways", default="full,entry,elf,prune,full,prune")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.store, a.child)))
        return
    report: dict[str, Any] = {"fatbins": describe(a.store), "runs": []}
    for way in a.ways.split(","):
        p = subprocess.run(
            [sys.executable, __file__, a.store, "--child", way], capture_output=True, text=True, timeout=300
        )
        if p.returncode != 0:
            report["runs"].append({"way": way, "error": p.stderr[-2000:]})
            print(way, "failed:", p.stderr[-600:], flush=True)
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r.update(way=way, totals=totals(r["rows"]))
        base = next((x for x in report["runs"] if x.get("way") == "full" and "rows" in x), None)
        if base is not None:  # the same kernels' attributes as the whole fatbin's
            whole = {x["image"]: x.get("attrs") for x in base["rows"]}
            r["totals"]["attrs_differ"] = [
                x["image"] for x in r["rows"] if "attrs" in x and x["attrs"] != whole.get(x["image"])
            ]
        report["runs"].append(r)
        print(
            way,
            json.dumps(r["totals"]),
            next((x["error"] for x in r["rows"] if "error" in x), ""),
            flush=True,
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"diag-fatbin-load-{a.tag}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(report, indent=1)
    )


if __name__ == "__main__":
    main()
