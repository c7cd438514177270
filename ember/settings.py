"""Every `EMBER_*` knob of the engine side, in one place: its name, kind, default and what it does.

Code reads a knob through `on()`, `number()` or `text()`, never `os.environ` directly, and
`ember doctor` lists those set to something other than their default (`changed()`). The pod
contract's variables (EMBER_MODE, EMBER_STORE, EMBER_IDENTITY, EMBER_RUN_DIR, EMBER_VLLM_ARCHIVE,
...) are not knobs: `ember.contract` names them. A value that does not parse keeps the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "flag" (1 or 0), "number" or "text"
    default: str
    doc: str


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    # LOAD
    Setting("EMBER_LOAD_BACKGROUND", "flag", "1", "templates built on a thread while the model builds"),
    Setting("EMBER_DEDICATE", "flag", "1", "give every key an exec of its own in the background"),
    Setting("EMBER_DEDICATE_EARLY", "flag", "0", "own execs built once the templates are, not at serving"),
    Setting("EMBER_EXEC_MEMORY_MB", "number", "2048", "GPU memory all own execs may take (0: none)"),
    Setting("EMBER_BUILD_THREADS", "number", "1", "libember builder threads (the driver serialises builds)"),
    Setting("EMBER_UPLOAD_BEHIND", "flag", "0", "upload templates on their own thread behind the builder"),
    Setting("EMBER_NATIVE_BUILD", "flag", "1", "build graphs with libember's builder (0: the Python path)"),
    Setting("EMBER_NATIVE_READ", "flag", "1", "read a local archive's kernel images with libember's threads"),
    Setting("EMBER_SWITCH_INTERVAL_US", "number", "200", "switch interval for LOAD's threads"),
    Setting("EMBER_SWAP_AT_LAUNCH", "text", "", "tests: own execs take their keys at this launch"),
    Setting("EMBER_FAULT", "text", "", "tests: faults to inject (ember.runtime.faults)"),
    Setting("EMBER_STACKS_AFTER_S", "number", "300",
            "a SAVE or LOAD still running logs every thread's stack this often (0: never)"),
    Setting("EMBER_PROOF_POOL_CHECK", "flag", "0",
            "diagnosis: SAVE's proof tells, for graphs whose native replays differ, whether memory "
            "outside their state carries it and which (ember.runtime.proof.pool_check)"),
    Setting("EMBER_PROOF_PROFILE_S", "number", "0",
            "SAVE, a diagnosis: a graph whose proof takes longer is replayed once more under "
            "torch.profiler (CUPTI beside libember), its top kernels in the summary (0: never)"),
    # SAVE (the archive's layout)
    Setting("EMBER_SLIM_IMAGES", "flag", "1", "cut kernel images to this GPU's cubin and the kernels used"),
    Setting("EMBER_UNION_TEMPLATES", "flag", "1", "write (SAVE) and use (LOAD) union templates"),
    Setting("EMBER_UNION_PROGRAMMATIC", "flag", "0", "unions over programmatic edges (not GPU-proven)"),
    Setting("EMBER_UNION_MEMSETS", "flag", "0", "unions may leave out a 1-D memset (not GPU-proven)"),
    # vLLM
    Setting("EMBER_VLLM", "flag", "1", "the vLLM plugin acts (0: it stays out of vLLM entirely)"),
    Setting("EMBER_VLLM_COMPILE_CACHE", "flag", "1", "carry vLLM's compile cache in the archive"),
    Setting("EMBER_VLLM_PROBE", "flag", "0", "diagnosis: the vLLM plugin logs what it probes"),
    Setting("EMBER_VLLM_CANARY", "flag", "1",
            "bench: 0 leaves LOAD's canary out, to measure what it adds to the start (the restore "
            "then serves unproven and its report says so: never in production)"),
    Setting("EMBER_VLLM_CANARY_FULL_EAGER", "flag", "1",
            "LOAD's canary checks a FULL step against an eager one where SAVE left no fingerprint "
            "(N ranks; 0: that step is reported unchecked)"),
    Setting("EMBER_VLLM_CANARY_TIMEOUT_S", "number", "120",
            "N ranks: a LOAD canary not done (its vote included) by then ends the worker, stacks "
            "first, so a rank that failed inside it never leaves its peers in a collective until "
            "NCCL's timeout; the crash marker makes the next start native (0: no limit)"),
    Setting("EMBER_VLLM_CANARY_EAGER", "flag", "0",
            "test: LOAD's canary on one GPU checks against eager steps, as N ranks do, not against "
            "SAVE's fingerprints (that path's proof on a one-GPU machine)"),
    Setting("EMBER_VLLM_CANARY_EVERY_FULL", "flag", "0",
            "diagnosis: LOAD's canary runs every FULL size, not one (which graph differs)"),
    Setting("EMBER_VLLM_CANARY_PROFILE", "text", "",
            "diagnosis: a folder; LOAD's vLLM canary runs under cProfile and each worker writes its top "
            "functions there (canary-<pid>.txt): where the canary's time goes"),
    Setting("EMBER_VLLM_CAPTURE_NATIVELY", "flag", "0",
            "bench: LOAD sets up as ever (the archive's caches, KV size, one GPU per worker), then "
            "vLLM captures its graphs: what this pod computes natively, a restore's reference"),
    Setting("EMBER_VLLM_MEGA_AOT", "flag", "0",
            "SAVE and LOAD store vLLM's compiled model as one AOT artifact "
            "(ember.engines.vllm.args.COMPILE_ENV): loading it is seconds shorter (Llama-3-8B, one "
            "H200: 8 of 8 LOADs 0.11-0.14 of native, benchmarks/results/h200-20261202d, h200-20261203); "
            "not yet run at N ranks or on an H100, and it changes the operator's identity"),
    Setting("EMBER_VLLM_ONE_GPU", "flag", "1",
            "LOAD: each worker of a multi-GPU shape sees only its own GPU, as SAVE did"),
    Setting("EMBER_VLLM_MEMORY_TRACE", "text", "",
            "diagnosis: a folder for each vLLM worker's torch allocations with their stacks"),
)}

# Knobs a pod never takes from outside, pinned to their defaults in its engine and SAVE
# containers (`pinned_env`): a Secret or ConfigMap the pod template brings in through envFrom
# cannot set them (a container's own env wins over envFrom; `env` itself refuses EMBER_*). The
# tuning and diagnosis knobs stay open to envFrom: they change cost or logging, not what is served.
TESTS_ONLY = ("EMBER_FAULT", "EMBER_SWAP_AT_LAUNCH", "EMBER_VLLM_CANARY", "EMBER_VLLM_CANARY_EAGER",
              "EMBER_VLLM_CAPTURE_NATIVELY")
# layouts and a compile setting no GPU run has proven yet
UNPROVEN = ("EMBER_UNION_PROGRAMMATIC", "EMBER_UNION_MEMSETS", "EMBER_VLLM_MEGA_AOT")
WEAKENING = ("EMBER_VLLM_CANARY_FULL_EAGER",)  # 0 leaves a step LOAD's canary would check unchecked
PINNED = TESTS_ONLY + UNPROVEN + WEAKENING


def pinned_env() -> list[dict[str, str]]:
    """The pinned knobs at their defaults, as container env entries."""
    return [{"name": name, "value": SETTINGS[name].default} for name in PINNED]


def text(name: str) -> str:
    return os.environ.get(name, SETTINGS[name].default)


_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def on(name: str) -> bool:
    """A flag: 1/true/yes/on or 0/false/no/off; anything else is the default."""
    value = text(name).strip().lower()
    if value not in _YES + _NO:
        value = SETTINGS[name].default
    return value in _YES


def number(name: str) -> float:
    try:
        return float(text(name))
    except ValueError:
        return float(SETTINGS[name].default)


def changed() -> dict[str, str]:
    """The knobs this process runs with that differ from their defaults."""
    return {n: os.environ[n] for n, s in SETTINGS.items() if n in os.environ and os.environ[n] != s.default}
