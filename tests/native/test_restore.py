# ruff: noqa: E501  (embedded C and Python snippets read better unwrapped)
"""ember.runtime.restore.ArchiveRestore against libember over the stand-in driver (no GPU, no torch).

A SAVE process (EMBER_MODE=save) allocates a "model", records a capture window, and publishes an
archive to a local file store: a synthetic graph set whose kernels live in PTX images the stand-in
loads (KernelRef.image = libember's content hash of each image), the allocation log libember
exported, and the compatibility key `compat.current()` returns in that environment. A fresh LOAD
process (EMBER_MODE=load) then restores it through ArchiveRestore. The tests prove:

- with the default background thread, open() + library() hand over a GraphLibrary whose templates
  were built on that thread before library() was called, one instantiated template per topology
  group, node for node the graphs of the graph set, and the same graphs the foreground path
  (background=False) builds; a restored graph launches;
- a damaged blob refuses the archive ("archive damaged") before anything is built or launched
  (verified kernel images may be loaded meanwhile);
- a compatibility-key mismatch is refused by open() with stage "compat" without reading any blob
  (the store holds none) and before libember imports the allocation log.

The snippets run through `restore_py` (tests/native/conftest.py): the stand-in built again with
what cuda.bindings needs (tests/native/standin/bindings_shim.c: a cuGetProcAddress that falls back
to its own exports, device queries, events, function attributes, a counting cuGraphLaunch) and,
torch not being installed, a stand-in `torch` module with the two fields compat.current() reads;
the archive is written with the key compat.current() returns under it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.archive.graphs import NodeType
from ember.runtime.graphs.walk import ATTR_SIZES
from ember_testing.synthetic import synthetic_graphset

GRAPHS, NODES, GROUPS = 6, 300, 3  # the graph set both processes build (deterministic)



# ---- the snippets' common part -------------------------------------------------------------------

COMMON = f"""
from ember.archive import graph_table
from ember.archive.graphs import GraphSet, KernelRef, NodeType
from ember_testing.synthetic import synthetic_graphset
from ember.identity import ArchiveIdentity
from ember.runtime import compat, publish
from ember.runtime.adapter import Refused
from ember.runtime.restore import ArchiveRestore
for name in ("standin_graph_launches", "standin_events_alive", "standin_execs_alive", "standin_exec_updates",
             "standin_uploads"):
    getattr(cuda, name).restype = ctypes.c_int
cuda.standin_last_launched.restype = ctypes.c_uint64
cuda.standin_graph_dump.restype = ctypes.c_size_t
cuda.standin_graph_dump.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

ENGINE = "ember-restore-test"
STORE = os.environ["TEST_STORE"]
IDENTITY = ArchiveIdentity(model="ember-test/restore", engine=ENGINE, engine_version="0",
                           capture_sizes=tuple(range(1, {GRAPHS} + 1)))

# The synthetic graph set, its kernels moved into PTX images the stand-in loads (it keeps at most
# 16 kernels per module; the synthetic set puts 16 in each of its 3 images; TEST_IMAGE_PER_KERNEL=1:
# one image per kernel). TEST_NODES: a smaller set, whose groups use different kernels.
gs = synthetic_graphset(graphs={GRAPHS}, nodes=int(os.environ.get("TEST_NODES", {NODES})), groups={GROUPS},
                        child_graphs=os.environ.get("TEST_CHILD_GRAPHS") == "1")
home = (lambda k: k.name) if os.environ.get("TEST_IMAGE_PER_KERNEL") == "1" else (lambda k: k.image)
names = {{}}
for k in gs.kernels:
    names.setdefault(home(k), []).append(k.name)
ptx = {{old: (".version 8.0\\n.target sm_90\\n" + "".join(f".entry {{n}}(\\n)\\n{{{{ ret; }}}}\\n" for n in ns)).encode() + b"\\0"
        for old, ns in names.items()}}
new_hash = {{old: ip.hash(data) for old, data in ptx.items()}}
gs = GraphSet(gs.graphs, [KernelRef(new_hash[home(k)], k.name) for k in gs.kernels], gs.function_attrs)
by_hash = {{new_hash[old]: data for old, data in ptx.items()}}
# in SAVE's order: the templates' (graphs 0, 2, 4: keys (1,), (3,), (5,), in need order) images first
order = publish.execution_order(gs, [0, 2, 4])
if os.environ.get("TEST_CHILD_GRAPHS") == "1":  # the child's image last (past the parent's)
    order = [h for h in order if h != gs.kernels[1].image] + [gs.kernels[1].image]
images = [publish.Image(h, by_hash[h], "ptx") for h in order + [h for h in by_hash if h not in order]]
used = [sorted({{n.params.kernel for n in g.nodes if n.type == NodeType.KERNEL}}) for g in gs.graphs]

def model():                               # the engine's allocations before the capture window
    return [alloc(n) for n in (4096, 3 << 20, 100, 40 << 20)]

def window():                              # the capture window's allocations
    t = [alloc(2 << 20), alloc(100), alloc(1 << 20)]
    free(t[1])
    return t

def last_json(obj):
    print(json.dumps(obj))

def first_import():  # True if libember takes a log now: none was given to it before (else the code)
    try:
        ip.import_alloc_log(b"ember-alloclog 1\\nregion 0 0 0\\nheap_high 0\\nwindow 0 0\\n")
        return True
    except EmberError as exc:
        return exc.code
"""

SAVE = COMMON + """
missing = os.environ.get("TEST_MISSING")   # a kernel no image holds, in the first or a later template
if missing:
    gone = used[0][0] if missing == "first" else min(set(used[4]) - set(used[0]) - set(used[2]))
    gs = GraphSet(gs.graphs, [KernelRef(r.image, r.name + "_gone") if i == gone else r
                              for i, r in enumerate(gs.kernels)], gs.function_attrs)
model()
ip.capture_begin()
window()
ip.capture_end()
key = compat.current(ENGINE)
if os.environ.get("TEST_FOREIGN_GPU") == "1":
    key = key.model_copy(update={"gpu_name": "NVIDIA H100 80GB HBM3"})
arc = publish.ArchiveContent(IDENTITY, key, graph_table.encode(gs), images, alloc_log=ip.export_alloc_log(),
                             attachments={"engine-files": b"EMBR" * 1000})
publish.write(STORE, arc, gs)
last_json({"identity": IDENTITY.hash(), "key": key.model_dump()})
"""

LOAD = COMMON + """
import time
background = os.environ["TEST_BACKGROUND"] == "1"
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE, background=background)
model()                                    # the engine builds its model meanwhile
restore.wait()
built_before_library = restore._lib is not None
ip.replay_window()
assert ip.divergence() is None
lib = restore.library()

def dump(g):
    buf = ctypes.create_string_buffer(1 << 20)
    n = cuda.standin_graph_dump(int(g), buf, len(buf))
    return buf.raw[:n].decode().splitlines()

def normalized(g):
    # Node lines with the CUfunction as its kernel index and each CUevent by first use (handles
    # differ between processes); edge lines as they are.
    fn = {f: i for i, f in enumerate(lib.functions)}
    events = {}
    out = []
    for line in dump(g):
        f = line.split()
        if f[0] == "N" and f[1] == "0":
            f[2] = "k%d" % fn[int(f[2])]
        elif f[0] == "N" and f[1] in ("6", "7"):
            f[2] = "e%d" % events.setdefault(f[2], len(events))
        out.append(" ".join(f))
    return out

templates = {g.template: normalized(lib._graphs[g.template]) for g in lib.groups}
execs = cuda.standin_execs_alive()
launches_before = cuda.standin_graph_launches()
lib.launch(lib.groups[0].template, cu.CUstream(0))
last_json({"built_before_library": built_before_library, "timings": restore.timings,
           "groups": [[g.template, list(g.members)] for g in lib.groups], "templates": templates,
           "template_execs": len(lib._templates), "execs": execs,
           "launches_before": launches_before, "launches": cuda.standin_graph_launches(),
           "kernels": [ip.lookup(f, 0) for f in lib.functions],
           "table_kernels": [[k.image, k.name] for k in gs.kernels]})
"""


def _last_json(out) -> dict:
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save(restore_py, store: Path, **env: str) -> dict:
    return _last_json(restore_py(SAVE, mode="save", env={"TEST_STORE": store.as_uri(), **env}))


def _expected_template(index: int) -> list[list[str]]:
    """What the stand-in should hold for graph `index` of the graph set: per node its type, and
    for kernel nodes the kernel index, grid, block x, shared memory and launch attribute ids."""
    graph = synthetic_graphset(graphs=GRAPHS, nodes=NODES, groups=GROUPS, child_graphs=False).graphs[index]
    nodes = []
    for n in graph.nodes:
        if n.type == NodeType.KERNEL:
            p = n.params
            nodes.append(["0", f"k{p.kernel}", *map(str, p.grid), str(p.block[0]), str(p.shared_mem),
                          *map(str, sorted(a for a in p.attrs if a in ATTR_SIZES))])
        else:
            nodes.append([str(int(n.type))])
    return nodes


# ---- the tests -----------------------------------------------------------------------------------


def test_background_restore_builds_the_templates_the_foreground_builds(restore_py, tmp_path: Path) -> None:
    store = tmp_path / "store"
    saved = _save(restore_py, store)
    assert saved["key"]["gpu_name"] == "Stand-in GPU" and saved["key"]["engine"] == "ember-restore-test"
    # Dedication off: its thread would add each key's own exec whenever it gets to run, and the
    # count below is of templates (dedicated execs have their own test further down).
    env = {"TEST_STORE": store.as_uri(), "EMBER_DEDICATE": "0"}
    bg = _last_json(restore_py(LOAD, mode="load", env={**env, "TEST_BACKGROUND": "1"}))
    fg = _last_json(restore_py(LOAD, mode="load", env={**env, "TEST_BACKGROUND": "0"}))

    # Built on the background thread, before library() was asked; handed over, not rebuilt.
    assert bg["built_before_library"] is True
    assert {"join_ms", "reconstruct_ms", "templates_ms", "read_table_ms", "read_blobs_ms"} <= set(bg["timings"])
    assert not {"foreground_ms", "background_error"} & set(bg["timings"])
    # The foreground path builds in library() instead.
    assert fg["built_before_library"] is False and "foreground_ms" in fg["timings"]

    # One instantiated template per topology group.
    assert bg["groups"] == [[0, [0, 1]], [2, [2, 3]], [4, [4, 5]]]
    assert bg["template_execs"] == GROUPS and bg["execs"] == GROUPS

    # The kernels are the archive's, resolved from the preloaded images by name.
    assert bg["kernels"] == bg["table_kernels"]

    # Node for node the graph set's graphs, and the same graphs the foreground path builds.
    assert bg["templates"] == fg["templates"]
    for index, lines in bg["templates"].items():
        nodes = [line.split()[1:] for line in lines if line.startswith("N ")]
        want = _expected_template(int(index))
        assert len(nodes) == len(want) > NODES - 10
        for got, exp in zip(nodes, want, strict=True):
            if exp[0] == "0":
                assert got[:7] + sorted(got[7:], key=int) == exp
            else:
                assert got[0] == exp[0]
        edges = [line for line in lines if line.startswith("E ")]
        assert len(edges) == len(nodes) and sum(line.split()[-1] != "0" for line in edges) >= 5

    # A restored graph launches (and the launch counter the refusal test relies on counts it).
    assert bg["launches_before"] == 0 and bg["launches"] == 1


DAMAGED = COMMON + """
result = {}
try:
    restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
except Refused as exc:
    result.update(refused_in="open", reason=exc.reason, stage=exc.stage)
else:
    model()
    ip.replay_window()
    try:
        restore.library()
        result["refused_in"] = None
    except Refused as exc:
        result.update(refused_in="library", reason=exc.reason, stage=exc.stage)
    restore.abandon()
import threading
last_json({**result, "launches": cuda.standin_graph_launches(), "execs": cuda.standin_execs_alive(),
           "calls": calls(), "threads": [t.name for t in threading.enumerate()]})
"""


def test_damaged_blob_is_refused_before_any_launch(restore_py, tmp_path: Path) -> None:
    store = tmp_path / "store"
    _save(restore_py, store)
    blob = max((store / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0x40
    blob.write_bytes(bytes(data))

    r = _last_json(restore_py(DAMAGED, mode="load", env={"TEST_STORE": store.as_uri()}))
    # The largest blob is the graph table: open() reads only the manifest and the allocation
    # log, the background thread finds the damage and library() refuses with it.
    assert r["refused_in"] == "library", r
    assert r["reason"].startswith("archive damaged") and "blob 'graphs'" in r["reason"], r
    assert r["stage"] == "load"
    assert r["launches"] == 0 and "cuGraphLaunch" not in r["calls"]
    assert not any(c.startswith("cuLaunchKernel") for c in r["calls"])
    assert r["execs"] == 0                          # nothing instantiated
    # The reader may have loaded kernel images meanwhile (each checked against its digest), but
    # no kernel of them was resolved: no graph was built; and no reader thread is left behind.
    assert "cuLibraryGetKernel" not in r["calls"]
    assert not any(name.startswith("ember-read") for name in r["threads"]), r["threads"]


READERS = {"native": {}, "python": {"EMBER_NATIVE_READ": "0"}}  # libember's reader threads, or Python's


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_damaged_image_the_first_template_does_not_need_still_refuses_before_the_hand_over(
    restore_py, tmp_path: Path, reader: str
) -> None:
    """The first key's images are read first and its template builds while the reader thread
    goes on with the rest: damage found there refuses the archive all the same, before any
    launch, and what was built is released (either reader)."""
    from ember.archive import bundle

    store = tmp_path / "store"
    _save(restore_py, store, **SMALL)
    arc = bundle.open_archive(store.as_uri())
    last = arc.manifest.engine["image_order"][-1]  # first used after graph 0 (execution order)
    image = next(k for k in arc.manifest.kernel_images if k.content_hash == last)
    blob = store / "blobs" / arc.manifest.blob(image.blob).sha256
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))

    r = _last_json(restore_py(DAMAGED, mode="load", env={"TEST_STORE": store.as_uri(), **SMALL, **READERS[reader]}))
    assert r["refused_in"] == "library" and r["stage"] == "load", r
    assert r["reason"].startswith("archive damaged") and repr(image.blob) in r["reason"], r
    assert "cuLibraryLoadData" in r["calls"]   # the first key's images were loaded meanwhile
    assert r["launches"] == 0 and "cuGraphLaunch" not in r["calls"]
    assert r["execs"] == 0                     # whatever was built meanwhile was released
    assert not any(name.startswith("ember-read") for name in r["threads"]), r["threads"]


FOREIGN = COMMON + """
try:
    ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
    result = {"refused": False}
except Refused as exc:
    result = {"refused": True, "reason": exc.reason, "stage": exc.stage}
result["first_import"] = first_import()
last_json(result)
"""


def test_compat_mismatch_is_refused_before_any_blob_is_read(restore_py, tmp_path: Path) -> None:
    store = tmp_path / "store"
    _save(restore_py, store, TEST_FOREIGN_GPU="1")
    blobs = list((store / "blobs").iterdir())
    assert blobs
    for blob in blobs:  # only the manifest is left: reading any blob would fail
        blob.unlink()

    r = _last_json(restore_py(FOREIGN, mode="load", env={"TEST_STORE": store.as_uri()}))
    assert r["refused"] and r["stage"] == "compat", r
    assert r["reason"].startswith("compatibility key differs")
    assert "gpu_name: archive='NVIDIA H100 80GB HBM3' here='Stand-in GPU'" in r["reason"]
    assert r["first_import"] is True


ACCEPT = COMMON + """
order = []
def attached(archive):
    order.append(["attached", archive.attachment("engine-files").decode()[:8]])
def accept(facts):
    order.append(["accept"])
    if os.environ.get("TEST_REFUSE") == "1":
        raise Refused("compat", "archive is not for this engine")
    return ("sizing", sorted(facts)[:1])
try:
    restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE, accept=accept, attached=attached,
                                  background=False)
    result = {"accepted": list(restore.accepted)}
except Refused as exc:
    result = {"refused": exc.reason, "stage": exc.stage}
result["first_import"] = first_import()
result["order"] = order
last_json(result)
"""


def _saved(restore_py, tmp_path: Path) -> dict[str, str]:
    """SAVE into a fresh store; the env a LOAD snippet reads it with."""
    store = tmp_path / "store"
    _save(restore_py, store)
    return {"TEST_STORE": store.as_uri()}


def test_engine_check_sees_the_facts_and_refuses_before_the_allocation_log(restore_py, tmp_path: Path) -> None:
    env = _saved(restore_py, tmp_path)
    ok = _last_json(restore_py(ACCEPT, mode="load", env=env))
    assert ok["accepted"][0] == "sizing" and ok["accepted"][1]  # what accept() returned, kept
    assert ok["first_import"] != True  # noqa: E712 - accepted: open() imported the log itself
    # The engine's attachments are put in place first (vLLM's compile cache, which accept looks for).
    assert ok["order"] == [["attached", "EMBREMBR"], ["accept"]]
    refused = _last_json(restore_py(ACCEPT, mode="load", env={**env, "TEST_REFUSE": "1"}))
    assert refused["stage"] == "compat" and refused["refused"] == "archive is not for this engine"
    assert refused["first_import"] is True


POLICY = COMMON + """
from ember.runtime.graphs.restored import RestoredGraph
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
lib.wait_templates()                       # handed over after the first; the others follow
if os.environ.get("TEST_HOT_AFTER") == "0":
    lib.own.hot_after = 0
group = lib.groups[0]
other = next(m for m in group.members if m != group.template)
template = int(lib._templates[group.index].handle)
graph = RestoredGraph(lib, other)
stream = cu.CUstream(0)
seen = {"execs": cuda.standin_execs_alive()}

def step(name):
    graph.replay(stream)
    seen[name] = {"exec": "template" if cuda.standin_last_launched() == template else "other",
                  "updates": cuda.standin_exec_updates(), "execs": cuda.standin_execs_alive()}

step("first")          # the template, updated to this key; a dedicated exec is asked for
seen["pending_after_settle"] = lib.own.settle(timeout=30)
step("second")         # the dedicated exec: no update
step("third")
graph.reset()          # the engine drops the graph: its exec goes, the template serves again
seen["execs_after_reset"] = cuda.standin_execs_alive()
step("after_reset")    # ... and, used again, the key is given its own exec again
lib.own.settle(timeout=30)
step("after_reset_settled")
last_json(seen)
"""


def test_a_key_switched_to_gets_a_dedicated_exec_that_serves_it_from_then_on(restore_py, tmp_path: Path) -> None:
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0"}  # only the keys switched to
    r = _last_json(restore_py(POLICY, mode="load", env=env))
    base = r["execs"]  # the templates
    assert r["first"] == {"exec": "template", "updates": 1, "execs": r["first"]["execs"]}
    assert r["pending_after_settle"] == 0
    # One exec more, launched instead of the template, and no further exec update.
    assert r["second"] == {"exec": "other", "updates": 1, "execs": base + 1}
    assert r["third"] == r["second"]
    # reset() destroys it; the template still holds the key (no update needed) and serves it
    # until a new dedicated exec is ready.
    assert r["execs_after_reset"] == base
    assert r["after_reset"]["exec"] == "template" and r["after_reset"]["updates"] == 1
    assert r["after_reset_settled"] == {"exec": "other", "updates": 1, "execs": base + 1}

    # With dedication off, the template serves every step.
    off = _last_json(restore_py(POLICY, mode="load", env={**env, "TEST_HOT_AFTER": "0"}))
    assert off["second"] == {"exec": "template", "updates": 1, "execs": off["execs"]}
    assert off["third"] == off["second"]


# which thread prepared each graph (prepared_on: index -> thread name without its number)
PREPARED_ON = """
import threading
from ember.runtime.graphs import rebuild
prepared_on = {}
prepare_from_table = rebuild.prepare_from_table

def spy_prepare(table, i, *a, **k):
    prepared_on[i] = threading.current_thread().name.split("_")[0]
    return prepare_from_table(table, i, *a, **k)

rebuild.prepare_from_table = spy_prepare
"""

OWN_EXECS = COMMON + PREPARED_ON + """
from ember.runtime.graphs.restored import RestoredGraph
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
assert lib.own.wait(timeout=30)
templates = {g.index: int(lib._templates[g.index].handle) for g in lib.groups}
own = {i: int(ex) for i, ex in lib.own.execs.items()}
updates = cuda.standin_exec_updates()
launched = {}
for i in lib.order:                        # every key once, in need order
    RestoredGraph(lib, i).replay(cu.CUstream(0))
    launched[i] = cuda.standin_last_launched()
st = lib.own.dedicator.stats
last_json({"keys": [list(k) for k in lib.keys], "order": lib.order,
           "groups": [[g.template, list(g.members)] for g in lib.groups],
           "templates": templates, "own": own, "launched": launched,
           "updates": cuda.standin_exec_updates() - updates, "uploads": cuda.standin_uploads(),
           "prepared_on": prepared_on,
           "stats": {"execs": st.execs, "bytes": st.bytes, "capped": st.capped, "failed": st.failed}})
"""


EARLY = COMMON + """
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
restore._handover.wait()                   # the first template is built; the model is not
ready = restore._lib.own.wait(timeout=2)
execs = restore._lib.own.dedicator.stats.execs
model()
ip.replay_window()
lib = restore.library()
last_json({"ready_before_serving": ready, "execs_before_serving": execs,
           "ready": lib.own.wait(timeout=30), "execs": lib.own.dedicator.stats.execs})
"""


def test_own_execs_start_with_serving_or_once_the_templates_are_built_when_told(
    restore_py, tmp_path: Path
) -> None:
    """By default the own execs wait until serving starts (library()): a cold pod's model build
    is not slowed by them. EMBER_DEDICATE_EARLY=1 starts them once the templates are built,
    before the model is."""
    env = _saved(restore_py, tmp_path)
    early = _last_json(restore_py(EARLY, mode="load", env={**env, "EMBER_DEDICATE_EARLY": "1"}))
    assert early["ready_before_serving"] is True and early["execs_before_serving"] > 0
    late = _last_json(restore_py(EARLY, mode="load", env=env))
    assert late["ready_before_serving"] is False and late["execs_before_serving"] == 0
    assert late["ready"] and early["ready"] and early["execs"] == late["execs"] > 0


BATCHES = COMMON + """
from ember.runtime.graphs import rebuild, templates
templates.TEMPLATE_BATCH = 1
calls = []                                 # per template build: the groups ready when it started
build_native = rebuild.build_native

def spy(preps, *a, **k):
    if k.get("instantiate") and restore._lib is not None:
        # every template before this one becomes ready (uploaded behind) without waiting for it
        earlier = list(restore._lib._ready.items())[: len(calls) + 1]
        calls.append([g for g, ev in earlier if ev.wait(10)])
    return build_native(preps, *a, **k)

rebuild.build_native = spy
""" + PREPARED_ON + """
uploaded_on = []
upload = templates.Uploader.upload

def spy_upload(self, execs):
    uploaded_on.append([threading.current_thread().name.split("_")[0], len(execs)])
    return upload(self, execs)

templates.Uploader.upload = spy_upload
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
lib.wait_templates()
at = [lib.launchable_at(i) for i in lib.order]
last_json({"calls": calls, "groups": len(lib.groups), "templates": [g.template for g in lib.groups],
           "prepared_on": prepared_on, "uploaded_on": uploaded_on,
           "ready_in_need_order": all(a is not None for a in at) and at == sorted(at),
           "ready_at": [lib.ready_at[g.index] for g in lib.groups]})
"""


def test_templates_after_the_first_are_launchable_one_batch_at_a_time(restore_py, tmp_path: Path) -> None:
    """A key whose template is built early need not wait for the last template: each batch is
    ready (built and uploaded) without waiting for the next one's build (EMBER_UPLOAD_BEHIND=1: it
    uploads on its own thread meanwhile)."""
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0"}
    r = _last_json(restore_py(BATCHES, mode="load", env=env))
    assert r["groups"] == GROUPS
    # the second and third templates: built after the first, and after each other was ready
    assert r["calls"] == [[0], [0, 1]]
    assert r["ready_in_need_order"] is True and r["ready_at"] == sorted(r["ready_at"])
    # the first template is prepared on the reconstruct thread; the others ahead, on the pool
    on = {int(i): name for i, name in r["prepared_on"].items()}
    first, *rest = r["templates"]
    assert on[first] == "ember-reconstruct" and all(on[t] == "ember-prepare" for t in rest)
    # uploaded where it was built, then one by one on the uploader's thread, each in turn
    assert r["uploaded_on"] == [["ember-reconstruct", 1]] * 3  # in line by default
    behind = _last_json(restore_py(BATCHES, mode="load", env={**env, "EMBER_UPLOAD_BEHIND": "1"}))
    assert behind["calls"] == r["calls"]
    assert behind["uploaded_on"] == [["ember-reconstruct", 1], ["ember-upload", 1], ["ember-upload", 1]]


RACE = COMMON + """
import threading, time
from ember.runtime.graphs import rebuild
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
lib.wait_templates()
i = next(k for k in lib.order if k not in lib._prepared)
prepare_from_table = rebuild.prepare_from_table

def slow(*a, **k):                         # both threads are inside before either is done
    time.sleep(0.2)
    return prepare_from_table(*a, **k)

rebuild.prepare_from_table = slow
got = []
threads = [threading.Thread(target=lambda: got.append(lib.prepared(i))) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
last_json({"n": len(got), "same": got[0] is got[1] is lib._prepared[i]})
"""


def test_a_graph_prepared_by_two_threads_at_once_is_one_object(restore_py, tmp_path: Path) -> None:
    """The pool prepares ahead while a launch may prepare the same graph: both get the first."""
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0"}
    r = _last_json(restore_py(RACE, mode="load", env=env))
    assert r == {"n": 2, "same": True}


UPLOAD_RACE = COMMON + """
import threading, time
from ember.runtime.graphs import templates
events = []
upload = templates.Uploader.upload

def slow_upload(self, execs):
    if threading.current_thread().name.startswith("ember-upload"):
        time.sleep(0.3)                    # the uploads behind the builder take their time
        events.append("uploaded")
    return upload(self, execs)

templates.Uploader.upload = slow_upload
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()                    # handed over after the first template
g = lib.groups[1]
while g.index not in lib._templates:       # built; its upload is still behind
    time.sleep(0.001)
pending = not lib._ready[g.index].is_set()
lib.launch(g.template, cu.CUstream(0))
events.append("launched")
lib.wait_templates()
last_json({"pending": pending, "events": events})
"""


def test_a_template_is_not_launched_before_its_upload_behind_the_builder_is_done(
    restore_py, tmp_path: Path
) -> None:
    """A launch (or exec update) racing the exec's upload on another stream is undefined: a key
    whose template is built but still uploading waits for the upload."""
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0", "EMBER_UPLOAD_BEHIND": "1"}
    r = _last_json(restore_py(UPLOAD_RACE, mode="load", env=env))
    assert r["pending"] is True  # the launch came while the upload was under way
    assert r["events"] == ["uploaded", "launched"]


SWITCH = COMMON + """
import sys
from ember.runtime.graphs import need
seen = {}

def spy(name, fn):
    def wrapped(*a, **k):
        seen[name] = sys.getswitchinterval()
        return fn(*a, **k)
    return wrapped

ArchiveRestore._reconstruct = spy("reconstruct", ArchiveRestore._reconstruct)
need.Dedicator.run = spy("dedicate", need.Dedicator.run)
before = sys.getswitchinterval()
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
assert lib.own.wait(timeout=30)
restore._thread.join()
lib.own.dedicator.join()
last_json({"before": before, **seen, "after": sys.getswitchinterval()})
"""


def test_background_work_runs_with_a_short_switch_interval_and_restores_the_engines(
    restore_py, tmp_path: Path
) -> None:
    """The reconstruction and the own execs run while the engine's thread holds the GIL: each
    of their thousands of GIL hand-backs waits at most the switch interval (ember/runtime/gil.py)."""
    env = _saved(restore_py, tmp_path)
    r = _last_json(restore_py(SWITCH, mode="load", env=env))
    assert r["reconstruct"] == r["dedicate"] == pytest.approx(200e-6)
    assert r["before"] == r["after"] == pytest.approx(0.005)
    off = _last_json(restore_py(SWITCH, mode="load", env={**env, "EMBER_SWITCH_INTERVAL_US": "0"}))
    assert off["reconstruct"] == off["dedicate"] == off["after"] == pytest.approx(0.005)


def test_every_key_gets_its_own_exec_in_need_order_within_the_memory_cap(restore_py, tmp_path: Path) -> None:
    env = _saved(restore_py, tmp_path)
    r = _last_json(restore_py(OWN_EXECS, mode="load", env=env))
    keys, order = [tuple(k) for k in r["keys"]], r["order"]
    assert [keys[i] for i in order] == sorted(keys)  # need order: smallest first
    rank = {i: n for n, i in enumerate(order)}
    groups = r["groups"]
    # groups in need order, each one's template its first needed member
    assert [min(rank[m] for m in members) for _, members in groups] == sorted(
        min(rank[m] for m in members) for _, members in groups
    )
    assert all(t == min(members, key=rank.__getitem__) for t, members in groups)
    template_keys = {t for t, _ in groups}
    others = [i for i in order if i not in template_keys]
    assert sorted(map(int, r["own"])) == sorted(others) and r["stats"]["failed"] == []
    group_of = {m: n for n, (_, members) in enumerate(groups) for m in members}
    for i in order:  # each key launched through its own exec, a template key through its template
        want = r["templates"][str(group_of[i])] if i in template_keys else r["own"][str(i)]
        assert r["launched"][str(i)] == want
    assert r["updates"] == 0  # no exec update on the request path
    assert r["uploads"] == len(groups) + len(others)  # every exec uploaded off the request path
    assert r["stats"]["bytes"] == len(others) << 20  # the stand-in's 1 MiB per exec, measured
    # the first batch prepared on the Dedicator's thread, the next ahead on the library's pool
    on = {int(i): name for i, name in r["prepared_on"].items()}
    assert {on[i] for i in others[:2]} == {"ember-dedicate"} and on[others[2]] == "ember-prepare"

    capped = _last_json(restore_py(OWN_EXECS, mode="load", env={**env, "EMBER_EXEC_MEMORY_MB": "2"}))
    st = capped["stats"]
    assert st["execs"] == 2 and st["bytes"] == 2 << 20  # one batch of two, then the cap
    assert sorted(map(int, capped["own"])) == sorted(others[:2])  # the first needed ones
    assert [tuple(k) for k in st["capped"]] == [keys[i] for i in others[2:4]]  # the next batch refused
    assert capped["updates"] == len(others) - 2  # the rest ride their templates


def test_signed_archive_loads_and_a_bad_signature_is_refused_before_any_blob(restore_py, tmp_path: Path) -> None:
    from ember.archive import signing

    key, other = (signing.Ed25519PrivateKey.generate() for _ in range(2))
    key_file = tmp_path / "signing-key.pem"
    key_file.write_bytes(signing.private_key_pem(key))
    store = tmp_path / "store"
    _save(restore_py, store, EMBER_SIGNING_KEY=str(key_file))  # SAVE signs through publish.write
    assert list(store.glob("archives/*/manifest.sig"))

    def load(*trusted: signing.Ed25519PrivateKey) -> dict:
        keys = signing.trusted_keys_json([(f"k{i}", signing.public_key_text(k)) for i, k in enumerate(trusted)])
        return _last_json(restore_py(FOREIGN, mode="load", env={"TEST_STORE": store.as_uri(),
                                                             "EMBER_TRUSTED_KEYS": keys}))

    ok = load(other, key)  # rotation: either trusted key will do
    assert ok["refused"] is False and ok["first_import"] is not True, ok  # the allocation log was imported
    for blob in (store / "blobs").iterdir():  # from here on, reading any blob would fail
        blob.unlink()
    wrong = load(other)
    assert wrong["refused"] and wrong["stage"] == "load", wrong
    assert wrong["reason"].startswith("archive signature refused") and "does not trust" in wrong["reason"]
    assert wrong["first_import"] is True  # refused before the allocation log (a blob) was read

    manifest = next(store.glob("archives/*/manifest"))
    manifest.write_bytes(manifest.read_bytes().replace(b"{", b"{ ", 1))  # one byte more, same JSON
    forged = load(key)
    assert forged["refused"] and "does not match the manifest" in forged["reason"], forged
    assert forged["first_import"] is True


NEED = COMMON + """
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
result = {"used": used, "kernels": len(gs.kernels)}
try:
    lib = restore.library()
except Refused as exc:
    result.update(refused=exc.reason, stage=exc.stage)
else:
    lib.wait_templates()
    result["preloaded"] = [im["hash"] for im in ip.catalog() if im["api"] == "preload"]
    result["kernel_images"] = [k.image for k in gs.kernels]
    result["image_order"] = restore.manifest.engine["image_order"]
    result["python_read_images"] = sorted({k.blob for k in restore.manifest.kernel_images} & set(restore.opened._blobs))
    A = cu.CUfunction_attribute
    result["attrs"] = {  # each resolved kernel's attributes now, and SAVE's
        k: [[cu.cuFuncGetAttribute(a, cu.CUfunction(lib.functions[k]))[1] for a in (
                A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                A.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, A.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT,
                A.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH)],
            [gs.function_attrs[k].max_dynamic_shared, gs.function_attrs[k].non_portable_cluster,
             *gs.function_attrs[k].required_cluster]]
        for k in range(len(gs.kernels)) if lib.functions._have[k]}
    result["attr_sets"] = calls().count("cuFuncSetAttribute")
    result["launched"] = {}
    for i in lib.order:
        try:
            lib.launch(i, cu.CUstream(0))
            result["launched"][i] = "ok"
        except Exception as exc:
            result["launched"][i] = f"{type(exc).__name__}: {exc}"
result["timings"] = {k: v for k, v in restore.timings.items() if isinstance(v, int | float | str)}
restore.abandon()
last_json(result)
"""

SMALL = {"TEST_NODES": "40", "TEST_IMAGE_PER_KERNEL": "1", "EMBER_DEDICATE": "0"}  # groups differ in kernels


@pytest.mark.parametrize("reader", sorted(READERS))
def test_the_first_template_waits_only_for_its_own_kernels_and_their_images(
    restore_py, tmp_path: Path, reader: str
) -> None:
    store = tmp_path / "store"
    _save(restore_py, store, **SMALL)
    r = _last_json(restore_py(NEED, mode="load", env={"TEST_STORE": store.as_uri(), **SMALL, **READERS[reader]}))
    first = r["used"][0]  # graph (1,): the first needed key, its group's template
    assert 0 < len(first) < r["kernels"]
    tm = r["timings"]
    assert tm["image_reader"] == reader
    # libember read the images: Python read none of them (the other blobs it reads itself)
    assert (len(r["python_read_images"]) == 0) == (reader == "native")
    # every resolved kernel has SAVE's attributes, set only where the loaded function differed
    assert r["attrs"] and not {k: v for k, v in r["attrs"].items() if v[0] != v[1]}
    assert r["attr_sets"] == sum(sum(v != 0 for v in saved) for _, saved in r["attrs"].values()) > 0
    # Only the first template's kernels were resolved before the hand-over ...
    assert tm["kernels_first"] == len(first)
    # ... and their images were handed to libember's loaders before any other.
    images = {r["kernel_images"][k] for k in first}
    assert tm["images_first"] == len(images) < len(r["preloaded"])
    # ... the images were handed to libember's loaders in the archive's order, which leads with them.
    assert r["preloaded"] == r["image_order"] and set(r["image_order"][: len(images)]) == images
    # ... and the reader held the others back until the first template went to the builder (it
    # reads READ_AHEAD = 8 before the decoded table names the first key's).
    assert len(images) <= tm["images_at_first_build"] <= max(len(images), 8) < len(r["preloaded"])
    assert tm["images_held_ms"] <= tm["images_handed_ms"]
    # Every template's kernels are resolved by the time all templates are built, and every key runs.
    templates = {0, 2, 4}
    assert tm["kernels_resolved"] == len({k for g in templates for k in r["used"][g]})
    assert set(r["launched"].values()) == {"ok"} and "templates_failed" not in tm


def test_a_child_graphs_kernel_past_the_first_keys_images_does_not_stall_the_reader(
    restore_py, tmp_path: Path
) -> None:
    """A child graph's kernels are not in its parent's chunk, so the first key's images the
    reader reads first are its parent's: the first template may need an image the reader holds
    back (here the child's is last). Looking it up lets the reader go on; the archive restores."""
    env = {**SMALL, "TEST_CHILD_GRAPHS": "1"}
    store = tmp_path / "store"
    _save(restore_py, store, **env)
    r = _last_json(restore_py(NEED, mode="load", env={"TEST_STORE": store.as_uri(), **env}))
    assert "refused" not in r, r.get("refused")
    tm = r["timings"]
    # the synthetic child graph's kernel (1): not the parent's, its image past the first key's
    assert 1 not in r["used"][0]
    assert r["image_order"].index(r["kernel_images"][1]) >= tm["images_first"]
    assert set(r["launched"].values()) == {"ok"}


def test_a_kernel_missing_from_its_image(restore_py, tmp_path: Path) -> None:
    """In the first template: the archive is refused before the hand-over (the engine captures).
    In a later one: the first keys are served; that group's template fails on the background
    thread (reported), and its keys raise at launch, naming the kernel; the other groups serve."""
    store = tmp_path / "first"
    _save(restore_py, store, **SMALL, TEST_MISSING="first")
    r = _last_json(restore_py(NEED, mode="load", env={"TEST_STORE": store.as_uri(), **SMALL}))
    assert r["stage"] == "load" and r["refused"].startswith("kernel not found after preload")
    assert "_gone" in r["refused"] and "function: function:" not in r["refused"]  # named once

    store = tmp_path / "later"
    _save(restore_py, store, **SMALL, TEST_MISSING="later")
    r = _last_json(restore_py(NEED, mode="load", env={"TEST_STORE": store.as_uri(), **SMALL}))
    assert "refused" not in r
    assert "(5,): EmberError" in r["timings"]["templates_failed"] and "_gone" in r["timings"]["templates_failed"]
    bad = {k: v for k, v in r["launched"].items() if v != "ok"}
    assert sorted(bad) == ["4", "5"] and all("_gone" in v for v in bad.values())


SWAP = COMMON + """
restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
lib.wait_templates()
lib.own.wait(timeout=30)             # built; with EMBER_SWAP_AT_LAUNCH they wait for that launch
for name in ("standin_graph_dump", "standin_exec_dump"):
    getattr(cuda, name).restype = ctypes.c_size_t
    getattr(cuda, name).argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

def nodes(dump, handle):
    buf = ctypes.create_string_buffer(1 << 20)
    n = dump(int(handle), buf, len(buf))
    return [line for line in buf.raw[:n].decode().splitlines() if line.startswith("N ")]

steps = []
for s in range(3 * len(lib.keys)):         # every key three times, in need order, round and round
    i = lib.order[s % len(lib.keys)]
    lib.launch(i, cu.CUstream(0))
    launched = cuda.standin_last_launched()
    own = launched == int(lib.own.execs[i]) if i in lib.own.execs else False
    steps.append([own, nodes(cuda.standin_exec_dump, launched) == nodes(cuda.standin_graph_dump, lib.graph(i))])
last_json({"steps": steps, "templates": [g.template for g in lib.groups], "order": lib.order})
"""


@pytest.mark.parametrize("at", [0, 4, 9])
def test_a_swap_to_own_execs_at_any_step_launches_what_the_key_holds(restore_py, tmp_path: Path, at: int) -> None:
    """The swap from a template (exec-updated from key to key) to each key's own exec, forced at
    launch `at` (EMBER_SWAP_AT_LAUNCH): before it every key runs on its group's template, from it
    on every key but the templates' own on its own exec, and every launch runs exactly the nodes
    and parameters of that key's graph, whichever exec ran it."""
    env = {**_saved(restore_py, tmp_path), "EMBER_SWAP_AT_LAUNCH": str(at)}
    r = _last_json(restore_py(SWAP, mode="load", env=env))
    templates = set(r["templates"])
    assert all(same for _, same in r["steps"]), r["steps"]
    for s, (own, _) in enumerate(r["steps"]):
        key = r["order"][s % len(r["order"])]
        assert own == (s >= at and key not in templates), (s, key)


OWN_EXEC = SWAP.split("steps = []")[0] + """
i = lib.order[-1]
ex = lib.own.get(i)
last_json({"same": nodes(cuda.standin_exec_dump, ex) == nodes(cuda.standin_graph_dump, lib.graph(i)),
           "adopted": int(lib.own.execs[i]) == int(ex), "again": int(lib.own.get(i)) == int(ex)})
"""


def test_the_canary_builds_a_keys_own_exec_now_as_the_dedicator_would(restore_py, tmp_path: Path) -> None:
    """`OwnExecs.get` (LOAD's canary launches it): the key's graph, adopted, built once."""
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0"}
    assert _last_json(restore_py(OWN_EXEC, mode="load", env=env)) == {"same": True, "adopted": True, "again": True}
