# ruff: noqa: E501  (embedded C-call snippets read better unwrapped)
"""The fixed-base region against the stand-in driver (which simulates VMM with mmap): the
deterministic allocator, perturbation before arming, reservations, record/replay of the capture
window, divergence, and the fallback when the base is taken."""

from __future__ import annotations

import json
import re
import textwrap

BASE = 0x600000000000


def _events(log: str) -> list[tuple[str, ...]]:
    return [tuple(line.split()[2:8]) for line in log.splitlines() if line.startswith("E ")]


def test_save_mode_serves_from_the_fixed_base_and_memory_is_usable(run_py) -> None:
    out = run_py(
        """
        a = alloc(1000); b = alloc(3 << 20); c = alloc(512)
        base, size = ip.region()
        ctypes.memset(a, 0xAB, 1000); ctypes.memset(b, 0xCD, 3 << 20)  # mapped and accessible
        free(a); a2 = alloc(1000)   # same rounded size: LIFO reuse
        d = alloc(2000)             # other size: bumps
        st = ip.stats()
        print(json.dumps({"base": base, "a": a, "b": b, "c": c, "a2": a2, "d": d, "st": st,
                          "native": "cuMemAlloc_v2" in calls()}))
        """,
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["base"] == BASE and r["a"] == BASE
    assert r["b"] == BASE + (2 << 20)            # >= 2 MiB: 2 MiB aligned
    assert r["c"] == BASE + (2 << 20) + (3 << 20)
    assert r["a2"] == r["a"] and r["d"] == r["c"] + 512
    assert not r["native"]
    assert r["st"]["allocations"] == 5 and r["st"]["frees"] == 1 and r["st"]["bytes_mapped"] >= 256 << 20


def test_freed_blocks_coalesce_split_and_return_to_the_bump(run_py) -> None:
    out = run_py(
        """
        MB = 1 << 20
        a = alloc(2 * MB); b = alloc(2 * MB); c = alloc(2 * MB); top = alloc(512)
        free(a); free(b)                 # adjacent: one 4 MiB block
        big = alloc(3 * MB)              # fits only in the coalesced block: no bump
        small = alloc(512)               # the 1 MiB left after it (smallest fit), not the bump
        free(top); after_top = alloc(2 * MB)  # fits no free block; the freed top gave its space back
        print(json.dumps({"a": a, "b": b, "c": c, "top": top, "big": big, "small": small,
                          "after_top": after_top}))
        """,
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["big"] == r["a"]
    assert r["small"] == r["a"] + (3 << 20)
    assert r["after_top"] == r["top"]


def test_memory_freed_by_one_size_serves_another_when_the_heap_is_full(run_py) -> None:
    """torch's release-and-retry on OOM: free everything cached, ask for a new size. With reuse by
    exact size only this failed although the freed memory was enough."""
    out = run_py(
        """
        MB = 1 << 20
        blocks = [alloc(20 * MB) for _ in range(3)]
        p = ctypes.c_uint64()
        too_big = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(50 * MB))
        for x in blocks:
            free(x)
        again = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(50 * MB))
        print(json.dumps({"too_big": too_big, "again": again, "addr": p.value, "first": blocks[0]}))
        """,
        mode="save",
        env={"EMBER_HEAP_SIZE": str(64 << 20)},
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["too_big"] == 2  # CUDA_ERROR_OUT_OF_MEMORY: 60 of 64 MiB in use
    assert r["again"] == 0 and r["addr"] == r["first"]


SEQUENCE = """
ps = [alloc(n) for n in (4096, 1 << 20, 5 << 20, 777, 64 << 20)]
free(ps[1]); ps.append(alloc(1 << 20)); ps.append(alloc(123456))
r = reserve(8 << 20)
ip.capture_begin()
w = [alloc(2 << 20), alloc(100)]
free(w[1]); w.append(alloc(100))
ip.capture_end()
log = ip.export_alloc_log().decode()
print("LOG-BEGIN"); print(log); print("LOG-END")
"""


def _log_of(stdout: str) -> str:
    return stdout.split("LOG-BEGIN\n", 1)[1].split("LOG-END", 1)[0]


def test_perturbed_process_gets_the_same_addresses(run_py) -> None:
    clean = run_py("ip.arm()\n" + SEQUENCE, mode="save", env={"EMBER_ARM": "manual"})
    perturbed = run_py(
        textwrap.dedent("""
        junk = [alloc(n) for n in (12345, 3 << 20, 999)]   # before arming: not in the region
        junk_r = reserve(4 << 20)
        assert not any(ip.region())
        free(junk[0])
        ip.arm()
        """) + SEQUENCE,
        mode="save", env={"EMBER_ARM": "manual"},
    )
    a, b = _events(_log_of(clean.stdout)), _events(_log_of(perturbed.stdout))
    assert len(a) == 13 and a == b
    assert all(int(e[2], 16) >= BASE for e in a if e[0] in ("alloc", "reserve"))


def test_reservations_are_subranges_and_callers_map_into_them(run_py) -> None:
    out = run_py(
        """
        r1 = reserve(64 << 20); r2 = reserve(32 << 20, align=16 << 20)
        base, size = ip.region()
        class Prop(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("htype", ctypes.c_int), ("loc_type", ctypes.c_int),
                        ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]
        class Acc(ctypes.Structure):
            _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]
        h = ctypes.c_uint64()
        prop = Prop(1, 0, 1, 0)
        assert cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(20 << 20), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
        assert cuda.cuMemMap(ctypes.c_uint64(r1), ctypes.c_size_t(20 << 20), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)) == 0
        acc = Acc(1, 0, 3)
        assert cuda.cuMemSetAccess(ctypes.c_uint64(r1), ctypes.c_size_t(20 << 20), ctypes.byref(acc), ctypes.c_size_t(1)) == 0
        ctypes.memset(r1, 1, 20 << 20)
        assert cuda.cuMemUnmap(ctypes.c_uint64(r1), ctypes.c_size_t(20 << 20)) == 0
        assert cuda.cuMemAddressFree(ctypes.c_uint64(r1), ctypes.c_size_t(64 << 20)) == 0
        bad = cuda.cuMemAddressFree(ctypes.c_uint64(r2), ctypes.c_size_t(2 << 20))  # wrong size
        r3 = reserve(64 << 20)                    # same size as r1: reused
        hinted = reserve(2 << 20, hint=0x500000000000)   # an explicit hint: the driver's business
        unaligned = cuda.cuMemAddressReserve(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(12345),
                                             ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        log = ip.export_alloc_log().decode()
        print(json.dumps({"r1": r1, "r2": r2, "r3": r3, "base": base, "size": size, "bad": bad,
                          "hinted": hinted, "unaligned": unaligned, "maps": log.count(" map "),
                          "unmaps": log.count(" unmap ")}))
        """,
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    heap = 2 << 30  # 1.25 x the stand-in's 1 GiB, rounded up to GiB
    assert r["r1"] == r["base"] + heap and r["r2"] == r["r1"] + (64 << 20)
    assert r["r2"] % (16 << 20) == 0 and r["r3"] == r["r1"]
    assert r["bad"] == 1  # CUDA_ERROR_INVALID_VALUE
    assert r["hinted"] == 0x500000000000
    assert r["unaligned"] == 1
    assert r["maps"] == 1 and r["unmaps"] == 1


def test_get_address_range_of_region_allocations(run_py) -> None:
    out = run_py(
        """
        a = alloc(3000); b = alloc(5000)
        base = ctypes.c_uint64(); size = ctypes.c_size_t()
        assert cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(b + 100)) == 0
        print(base.value == b, size.value)
        """,
        mode="save",
    )
    assert out.stdout.split()[-2:] == ["True", "5120"]


PRE = """
ws = [alloc(n) for n in (4096, 3 << 20, 100)]
kv = alloc(40 << 20)
"""
WINDOW = """
ip.capture_begin()
t = [alloc(2 << 20), alloc(100), alloc(1 << 20)]
free(t[1])
r = reserve(4 << 20)
ip.capture_end()
"""


def _save(run_py, tmp_path):
    out = run_py(
        PRE + WINDOW + f"""
open({str(tmp_path / 'log')!r}, 'wb').write(ip.export_alloc_log())
print(json.dumps({{"t": t, "r": r}}))
""",
        mode="save",
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_replays_the_window_at_the_same_addresses(run_py, tmp_path) -> None:
    saved = _save(run_py, tmp_path)
    out = run_py(
        PRE + f"""
ip.import_alloc_log(open({str(tmp_path / 'log')!r}, 'rb').read())
ip.replay_window()
assert ip.divergence() is None
ctypes.memset({saved["t"][0]}, 7, 2 << 20)   # replayed memory is mapped and writable
after = alloc(4096)
print(json.dumps({{"log": ip.export_alloc_log().decode(), "st": ip.stats(), "after": after}}))
""",
        mode="load",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    saved_log = (tmp_path / "log").read_text()
    assert _events(r["log"])[: len(_events(saved_log))] == _events(saved_log)
    assert r["st"]["window_events"] == 5 and not r["st"]["diverged"]
    assert r["st"]["seconds"]["replay"] >= 0 and r["after"] > max(saved["t"])


def test_load_premaps_the_saved_extent_in_one_piece_unless_told_pieces(run_py, tmp_path) -> None:
    _save(run_py, tmp_path)
    snippet = f"""
ip.arm()  # as ember.runtime.session does: armed, then the log imported (which premaps)
ip.import_alloc_log(open({str(tmp_path / 'log')!r}, 'rb').read())
""" + PRE + """
ip.replay_window()
assert ip.divergence() is None
st = ip.stats()
print(json.dumps({"maps": st["map_calls"], "mapped": st["bytes_mapped"]}))
"""
    runs = {piece: json.loads(run_py(snippet, mode="load", env={"EMBER_MAP_CHUNK": "2M", **env})
                              .stdout.strip().splitlines()[-1])
            for piece, env in (("one", {}), ("8M", {"EMBER_PREMAP_PIECE": "8M"}))}
    # the same extent either way (it holds the 40 MiB block), in 1 piece or in 8 MiB pieces
    assert runs["one"]["mapped"] == runs["8M"]["mapped"] >= 40 << 20
    assert runs["one"]["maps"] == 1
    assert runs["8M"]["maps"] == -(-runs["8M"]["mapped"] // (8 << 20))


def test_extra_allocation_in_load_is_divergence_and_process_continues(run_py, tmp_path) -> None:
    _save(run_py, tmp_path)
    out = run_py(
        """
ws = [alloc(n) for n in (4096, 3 << 20, 100)]
extra = alloc(8192)             # injected: not in SAVE's sequence
kv = alloc(40 << 20)
""" + f"""
ip.import_alloc_log(open({str(tmp_path / 'log')!r}, 'rb').read())
msg = ip.divergence()
try:
    ip.replay_window()
    raised = False
except EmberDivergence as exc:
    raised = exc.code == -4
later = alloc(4096)             # still served: a valid address, never a crash
ctypes.memset(later, 1, 4096)
print(json.dumps({{"msg": msg, "raised": raised}}))
""",
        mode="load",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["raised"] and r["msg"] and "differs from SAVE" in r["msg"]
    assert "[thread python" in r["msg"]  # the thread that made the call (here the main one)
    assert "Diverged from SAVE" in out.stderr  # and a log line
    # then the native stack of that call, down to the code that made it (here ctypes' call)
    assert re.search(r"#\d+ libember\.so .*\n(.*\n)*.*#\d+ libffi\S* ffi_call\+0x", out.stderr), out.stderr


def test_load_with_fewer_allocations_diverges_at_replay(run_py, tmp_path) -> None:
    _save(run_py, tmp_path)
    out = run_py(
        f"""
ws = [alloc(n) for n in (4096, 3 << 20, 100)]
ip.import_alloc_log(open({str(tmp_path / 'log')!r}, 'rb').read())
try:
    ip.replay_window(); print("no-error")
except EmberDivergence as exc:
    print("diverged:", exc)
""",
        mode="load",
    )
    assert "diverged:" in out.stdout and "SAVE had 4" in out.stdout


# torch empties its cache when a capture starts: SAVE's window frees a block allocated before it
# and graph memory reuses the space. A LOAD process never captured, so its allocator still holds
# that block and would hand it out again: it must release it before the replay.
CACHED = """
cached = alloc(8 << 20)        # a cached, unused segment of the process's allocator
kv = alloc(40 << 20)
"""


def _save_with_cache_release(run_py, tmp_path):
    out = run_py(
        CACHED + f"""
ip.capture_begin()
free(cached)                   # empty_cache at capture start
pool = alloc(6 << 20)          # graph memory lands where the cached segment was
ip.capture_end()
open({str(tmp_path / 'log')!r}, 'wb').write(ip.export_alloc_log())
print(json.dumps({{"cached": cached, "pool": pool}}))
""",
        mode="save",
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_needs_blocks_save_freed_in_the_window_released_first(run_py, tmp_path) -> None:
    saved = _save_with_cache_release(run_py, tmp_path)
    assert saved["pool"] == saved["cached"]
    load = CACHED + f"""
ip.import_alloc_log(open({str(tmp_path / 'log')!r}, 'rb').read())
before = ip.replay_blockers()
if os.environ.get("RELEASE") == "1":
    free(cached)               # what LOAD does now: torch.cuda.empty_cache() before the replay
if os.environ.get("EXTRA") == "1":
    free(kv)                   # a block SAVE still held in its window: freed after the replay
blockers = ip.replay_blockers()  # what LOAD asks before it pays for gc.collect()
try:
    ip.replay_window(); err = None
except EmberDivergence as exc:
    err = str(exc)
later = alloc(6 << 20)         # the process's next allocation
try:
    ip.replay_blockers(); again = None
except EmberError as exc:
    again = exc.code
print(json.dumps({{"err": err, "later": later, "div": ip.divergence(), "before": before,
                  "blockers": blockers, "again": again}}))
"""
    kept = json.loads(run_py(load, mode="load").stdout.strip().splitlines()[-1])
    assert kept["err"] and "still holds" in kept["err"] and "empty_cache" in kept["err"]
    # the dry run names the block the replay then refused
    n, first = kept["blockers"]
    assert n == 1 and hex(saved["cached"])[2:] in first and kept["before"] == kept["blockers"]
    assert kept["again"] is not None  # after the replay there is nothing left to ask
    released = json.loads(run_py(load, mode="load", env={"RELEASE": "1"}).stdout.strip().splitlines()[-1])
    assert released["err"] is None and released["div"] is None
    assert released["before"][0] == 1 and released["blockers"] == [0, ""]
    pool = saved["pool"]
    assert not (pool <= released["later"] < pool + (6 << 20))  # never inside the graphs' memory
    extra = run_py(load, mode="load", env={"RELEASE": "1", "EXTRA": "1"})
    extra = json.loads(extra.stdout.strip().splitlines()[-1])
    assert extra["err"] is None and extra["div"] is None
    assert not (pool <= extra["later"] < pool + (6 << 20))


def test_async_free_inside_capture_is_never_reused(run_py) -> None:
    out = run_py(
        """
        cuda.standin_set_capturing(1)
        p = ctypes.c_uint64()
        assert cuda.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(4096), None) == 0
        assert cuda.cuMemFreeAsync(p, None) == 0
        q = ctypes.c_uint64()
        assert cuda.cuMemAllocAsync(ctypes.byref(q), ctypes.c_size_t(4096), None) == 0
        cuda.standin_set_capturing(0)
        assert cuda.cuMemFreeAsync(q, None) == 0
        s = ctypes.c_uint64()
        assert cuda.cuMemAllocAsync(ctypes.byref(s), ctypes.c_size_t(4096), None) == 0
        print(p.value != q.value, s.value == q.value, "cuStreamSynchronize" in calls())
        """,
        mode="save",
    )
    assert out.stdout.split()[-3:] == ["True", "True", "True"]


def test_taken_base_falls_back_to_pass_through(run_py) -> None:
    out = run_py(
        f"""
        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        got = libc.mmap({BASE}, 1 << 21, 0, 0x22 | 0x100000, -1, 0)   # MAP_PRIVATE|ANON|FIXED_NOREPLACE
        assert got == {BASE}
        a = alloc(4096)
        try:
            ip.arm(); armed = True
        except EmberError as exc:
            armed = exc.code
        print(json.dumps({{"a": a, "armed": armed, "region": ip.region(), "native": "cuMemAlloc_v2" in calls(),
                           "st": ip.stats()}}))
        """,
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["armed"] == -7 and r["region"] == [0, 0] and r["native"] and r["st"]["failed"]
    assert "not at 0x600000000000" in out.stderr


def test_mode_off_is_pure_pass_through(run_py) -> None:
    out = run_py(
        """
        a = alloc(4096); free(a); r = reserve(4 << 20)
        print(json.dumps({"mode": ip.mode, "region": ip.region(), "calls": calls(), "st": ip.stats()}))
        """,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mode"] == "off" and r["region"] == [0, 0]
    assert {"cuMemAlloc_v2", "cuMemFree_v2", "cuMemAddressReserve"} <= set(r["calls"])
    assert r["st"]["events"] == 0 and r["st"]["bypassed"] == 0


def test_control_api_error_paths(run_py) -> None:
    out = run_py(
        """
        res = {}
        def code(f, *a):
            try:
                f(*a); return 0
            except EmberError as exc:
                return exc.code
        res["replay_in_save"] = code(ip.replay_window)
        res["import_in_save"] = code(ip.import_alloc_log, b"ember-alloclog 1")
        res["end_without_begin"] = code(ip.capture_end)
        res["begin_unarmed"] = code(ip.capture_begin)
        a = alloc(4096)        # auto-arm
        res["set_mode_armed"] = code(ip.set_mode, "load")
        res["begin"] = code(ip.capture_begin)
        res["begin_twice"] = code(ip.capture_begin)
        res["lookup_zero"] = code(ip.lookup, 0, 0)
        res["lookup_unknown"] = ip.lookup(12345, 0)
        res["function_unknown"] = code(ip.function, "00" * 16, "k")
        res["bytes_unknown"] = code(ip.image_bytes, "00" * 16)
        res["free_unknown_in_region"] = cuda.cuMemFree_v2(ctypes.c_uint64(a + 8))
        many = [alloc(512) for _ in range(2000)]    # a log larger than the first 64 KiB buffer
        res["log_len"] = len(ip.export_alloc_log())
        print(json.dumps(res))
        """,
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["replay_in_save"] == -2 and r["import_in_save"] == -2
    assert r["end_without_begin"] == -3 and r["begin_unarmed"] == -3
    assert r["set_mode_armed"] == -3 and r["begin"] == 0 and r["begin_twice"] == -3
    assert r["lookup_zero"] == -1 and r["lookup_unknown"] is None
    assert r["function_unknown"] == -5 and r["bytes_unknown"] == -5
    assert r["free_unknown_in_region"] == 1 and r["log_len"] > 65536


def test_load_mode_error_paths(run_py) -> None:
    out = run_py(
        """
        res = {}
        def code(f, *a):
            try:
                f(*a); return 0
            except EmberError as exc:
                return exc.code
        res["replay_before_import"] = code(ip.replay_window)
        res["capture_in_load"] = code(ip.capture_begin)
        res["garbage"] = code(ip.import_alloc_log, b"not a log at all")
        res["bad_event"] = code(ip.import_alloc_log, b"ember-alloclog 1\\nregion 0 0 0\\nheap_high 0\\nwindow 1 0\\nE 0 bogus pre 0 0 0 0 x\\n")
        res["ok"] = code(ip.import_alloc_log, b"ember-alloclog 1\\nregion 0 0 0\\nheap_high 0\\nwindow 0 0\\n")
        res["twice"] = code(ip.import_alloc_log, b"ember-alloclog 1\\nregion 0 0 0\\nheap_high 0\\nwindow 0 0\\n")
        res["replay_unarmed"] = code(ip.replay_window)
        print(json.dumps(res))
        """,
        mode="load", env={"EMBER_ARM": "manual"},
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"replay_before_import": -3, "capture_in_load": -2, "garbage": -10, "bad_event": -10,
                 "ok": 0, "twice": -3, "replay_unarmed": -3}


def test_concurrent_allocations_are_all_accounted(run_py) -> None:
    out = run_py(
        """
        import threading
        got, errors = [], []
        def work():
            try:
                for i in range(150):
                    p = alloc(512 * (1 + i % 7)); got.append(p); free(p) if i % 3 == 0 else None
            except Exception as exc:
                errors.append(repr(exc))
        ts = [threading.Thread(target=work) for _ in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        st = ip.stats()
        print(json.dumps({"errors": errors, "allocs": st["allocations"], "frees": st["frees"],
                          "events": st["events"], "live": len({p for i, p in enumerate(got)})}))
        """,
        mode="save",
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["errors"] == [] and r["allocs"] == 1200 and r["frees"] == 400 and r["events"] == 1600
