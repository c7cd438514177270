# ruff: noqa: E501  (embedded C-call snippets read better unwrapped)
"""The kernel catalog against the stand-in driver: the loader hooks, content hashes, kept and
dropped options, reverse lookup of CUfunction/CUkernel handles, recorded function attributes,
and preloading + function() at LOAD."""

from __future__ import annotations

import json
import struct

PTX = b"//\n.version 8.0\n.target sm_90\n.entry foo(\n)\n{ ret; }\n.entry bar(\n)\n{ ret; }\n\0"
FATBIN = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 64) + bytes(range(64))

HELPERS = f"""
PTX = {PTX!r}
FATBIN = {FATBIN!r}
import struct
ptx_buf = ctypes.create_string_buffer(PTX, len(PTX))
fat_buf = ctypes.create_string_buffer(FATBIN, len(FATBIN))
wrapper = ctypes.create_string_buffer(struct.pack("<iiQQ", 0x466243B1, 1, ctypes.addressof(fat_buf), 0), 24)
def load_module(buf):
    m = ctypes.c_void_p()
    assert cuda.cuModuleLoadData(ctypes.byref(m), buf) == 0
    return m
def get_function(mod, name):
    f = ctypes.c_void_p()
    assert cuda.cuModuleGetFunction(ctypes.byref(f), mod, name) == 0
    return f.value
def load_library(buf, jit=(), lib=()):
    l = ctypes.c_void_p()
    jo = (ctypes.c_int * max(1, len(jit)))(*[k for k, _ in jit]); jv = (ctypes.c_void_p * max(1, len(jit)))(*[v for _, v in jit])
    lo = (ctypes.c_int * max(1, len(lib)))(*[k for k, _ in lib]); lv = (ctypes.c_void_p * max(1, len(lib)))(*[v for _, v in lib])
    assert cuda.cuLibraryLoadData(ctypes.byref(l), buf, jo, jv, len(jit), lo, lv, len(lib)) == 0
    return l
"""


def _last_json(out) -> dict:
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_save_catalogs_images_kernels_options_and_lookups(run_py) -> None:
    out = run_py(
        HELPERS + """
mod = load_module(ptx_buf)
foo = get_function(mod, b"foo")
assert cuda.cuFuncSetAttribute(ctypes.c_void_p(foo), 8, 100000) == 0   # max dynamic shared memory
m2 = ctypes.c_void_p()
jo = (ctypes.c_int * 2)(3, 0); jv = (ctypes.c_void_p * 2)(ctypes.addressof(ctypes.create_string_buffer(64)), 32)
assert cuda.cuModuleLoadDataEx(ctypes.byref(m2), fat_buf, 2, jo, jv) == 0   # info log buffer dropped, max regs kept
host_table = ctypes.create_string_buffer(16)
lib = load_library(wrapper, lib=[(0, ctypes.addressof(host_table)), (1, 1)])
k = ctypes.c_void_p()
assert cuda.cuLibraryGetKernel(ctypes.byref(k), lib, b"kernel_b") == 0
assert cuda.cuKernelSetAttribute(9, 50, k, 0) == 0
print(json.dumps({"cat": ip.catalog(), "foo": ip.lookup(foo, 0), "kern": ip.lookup(0, k.value),
                  "ptx_hash": ip.hash(PTX), "fat_hash": ip.hash(FATBIN),
                  "bytes_ok": ip.image_bytes(ip.hash(PTX)) == PTX, "st": ip.stats()["catalog"]}))
""",
        mode="save",
    )
    r = _last_json(out)
    cat = {c["hash"]: c for c in r["cat"]}
    assert len(cat) == 2  # the fatbin loaded twice (module + wrapped library) is one image
    ptx, fat = cat[r["ptx_hash"]], cat[r["fat_hash"]]
    assert ptx["kind"] == "ptx" and ptx["size"] == len(PTX) and ptx["kernels"] == ["foo", "bar"]
    assert ptx["attributes"] == {"foo": {"8": 100000}} and ptx["have_bytes"]
    assert fat["kind"] == "fatbin" and fat["size"] == len(FATBIN) and fat["jit_options"] == {"0": 32}
    assert fat["attributes"] == {"kernel_b": {"9": 50}}
    assert r["foo"] == [r["ptx_hash"], "foo"] and r["kern"] == [r["fat_hash"], "kernel_b"]
    assert r["bytes_ok"] and r["st"]["loads"] == 3 and r["st"]["unsized"] == 0


def test_library_options_drop_host_pointers(run_py) -> None:
    out = run_py(
        HELPERS + """
host_table = ctypes.create_string_buffer(16)
lib = load_library(fat_buf, lib=[(0, ctypes.addressof(host_table)), (1, 1)])
print(json.dumps(ip.catalog()))
""",
        mode="save",
    )
    (img,) = _last_json(out)
    assert img["library_options"] == {"1": 1} and img["api"] == "cuLibraryLoadData"


def test_unsizable_image_is_counted_not_fatal(run_py) -> None:
    out = run_py(
        HELPERS + """
junk = ctypes.create_string_buffer(b"\\x01\\x02\\x03\\x04\\xff\\xfe" * 8)
load_module(junk)
print(json.dumps(ip.stats()["catalog"]))
""",
        mode="save",
    )
    r = _last_json(out)
    assert r["unsized"] == 1 and r["images"] == 0
    assert "could not size the image" in out.stderr


def test_load_preloads_and_function_waits_for_its_image(run_py) -> None:
    out = run_py(
        HELPERS + """
h_ptx, h_fat = ip.hash(PTX), ip.hash(FATBIN)
ip.preload([(h_ptx, PTX, {}), (h_fat, FATBIN, {"jit": {0: 32}, "library": {1: 1}})])
f = ip.function(h_ptx, "bar")
g = ip.function(h_fat, "kernel_a")
try:
    ip.function(h_ptx, "nope"); missing = 0
except EmberError as exc:
    missing = exc.code
try:
    ip.preload([("0" * 32, PTX, {})]); bad = 0
except EmberError as exc:
    bad = exc.code
print(json.dumps({"f": f, "g": g, "lookup": ip.lookup(f, 0), "missing": missing, "bad": bad,
                  "ptx_size": len(PTX), "fat_size": len(FATBIN),
                  "calls": calls(), "st": ip.stats()["catalog"], "cat": ip.catalog()}))
""",
        mode="load",
    )
    r = _last_json(out)
    assert r["f"] and r["g"] and r["lookup"][1] == "bar"
    assert r["missing"] == -5 and r["bad"] == -10
    assert r["calls"].count("cuLibraryLoadData") == 2 and "cuFuncLoad" in r["calls"]  # lazily loaded: forced
    assert r["st"]["preloaded"] == 2 and r["st"]["preload_failed"] == 0
    # each preload's load is reported: [bytes, start after the first preload (ms), load (ms)]
    assert sorted(size for size, _, _ in r["st"]["preloads"]) == sorted([r["ptx_size"], r["fat_size"]])
    assert all(start >= 0 and ms >= 0 for _, start, ms in r["st"]["preloads"])
    fat = next(c for c in r["cat"] if c["kind"] == "fatbin")
    assert fat["jit_options"] == {"0": 32} and fat["library_options"] == {"1": 1} and fat["preload"] == "loaded"


def test_function_uses_an_image_the_engine_loaded(run_py) -> None:
    out = run_py(
        HELPERS + """
mod = load_module(ptx_buf)
f = ip.function(ip.hash(PTX), "foo")
print(json.dumps({"same": f == get_function(mod, b"foo"), "loads": calls().count("cuLibraryLoadData")}))
""",
        mode="load",
    )
    assert _last_json(out) == {"same": True, "loads": 0}


def test_mode_off_catalogs_nothing(run_py) -> None:
    out = run_py(HELPERS + "load_module(ptx_buf)\nprint(json.dumps(ip.catalog()))\n")
    assert _last_json(out) == []


def test_version2_wrapper_is_prelinked_at_save(run_py) -> None:
    out = run_py(
        HELPERS + """
extra1 = ctypes.create_string_buffer(struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 8) + b"AAAAAAAA")
extra2 = ctypes.create_string_buffer(struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 8) + b"BBBBBBBB")
links = (ctypes.c_void_p * 3)(ctypes.addressof(extra1), ctypes.addressof(extra2), None)
w2 = ctypes.create_string_buffer(struct.pack("<iiQQ", 0x466243B1, 2, ctypes.addressof(fat_buf), ctypes.addressof(links)), 24)
lib = load_library(w2)
bad_links = (ctypes.c_void_p * 2)(ctypes.addressof(ctypes.create_string_buffer(b"\\xff\\xfe junk")), None)
w_bad = ctypes.create_string_buffer(struct.pack("<iiQQ", 0x466243B1, 2, ctypes.addressof(fat_buf), ctypes.addressof(bad_links)), 24)
load_library(w_bad)
cat = ip.catalog()
linked = next(c for c in cat if c["linked_from"])
print(json.dumps({"cat": cat, "bytes": ip.image_bytes(linked["hash"]).decode(errors="replace"),
                  "fat": ip.hash(FATBIN), "calls": calls()}))
""",
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    linked = next(c for c in r["cat"] if c["linked_from"])
    assert linked["kind"] == "elf" and linked["wrapper_version"] == 2 and len(linked["linked_from"]) == 3
    assert linked["linked_from"][0] == r["fat"] and r["bytes"].count(".entry linked_") == 3
    assert "cuLinkComplete" in r["calls"] and "cuLinkDestroy" in r["calls"]
    unlinked = [c for c in r["cat"] if c["hash"] == r["fat"]]
    assert unlinked and not unlinked[0]["linked_from"]          # the bad list: kept unlinked, with a warning
    assert "could not prelink" in out.stderr


SLOW_FAST = """
import time
slow = b".version 8.0\\n.entry SLOW_kernel(\\n)\\n{}\\n\\0"
fast = b".version 8.0\\n.entry fast_kernel(\\n)\\n{}\\n\\0"
t0 = time.perf_counter()
ip.preload([(ip.hash(slow), slow, {}), (ip.hash(fast), fast, {})])   # returns at once
t_pre = time.perf_counter() - t0
ip.function(ip.hash(fast), "fast_kernel")
t_fast = time.perf_counter() - t0
ip.function(ip.hash(slow), "SLOW_kernel")
t_slow = time.perf_counter() - t0
print(json.dumps({"pre": t_pre, "fast": t_fast, "slow": t_slow, "st": ip.stats()["catalog"]}))
"""


def test_function_waits_only_for_its_own_image(run_py) -> None:
    out = run_py(SLOW_FAST, mode="load")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["pre"] < 0.5 and r["fast"] < 1.0 <= 1.4 <= r["slow"] < 10
    assert r["st"]["preloaded"] == 2 and r["st"]["seconds"]["function_wait"] >= 1.0


def test_loader_threads_are_configurable(run_py) -> None:
    """With one loader thread (EMBER_LOADER_THREADS=1) the images load one after the other, in
    the order given: the fast image waits behind the slow one."""
    r = _last_json(run_py(SLOW_FAST, mode="load", env={"EMBER_LOADER_THREADS": "1"}))
    assert r["pre"] < 0.5 and 1.4 <= r["fast"] <= r["slow"] < 10
    (_, start_slow, ms_slow), (_, start_fast, _) = r["st"]["preloads"]
    assert ms_slow >= 1400 and start_fast >= start_slow + ms_slow


def test_stats_report_every_preload_of_a_large_hand_off(run_py) -> None:
    """The stats stay one JSON document however many images were preloaded."""
    r = _last_json(run_py(
        """
images = [b".version 8.0\\n.entry k%03d(\\n)\\n{}\\n\\0" % i for i in range(150)]
ip.preload([(ip.hash(im), im, {}) for im in images])
for i, im in enumerate(images):
    ip.function(ip.hash(im), "k%03d" % i)
print(json.dumps({"st": ip.stats()["catalog"], "sizes": sorted(len(im) for im in images)}))
""",
        mode="load",
    ))
    assert r["st"]["preloaded"] == 150 and sorted(size for size, _, _ in r["st"]["preloads"]) == r["sizes"]
