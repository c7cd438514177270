"""vLLM 0.26 as an engine adapter: one model runner (V1 or V2) behind `EngineAdapter`.

The plugin (`ember.engines.vllm.plugin`) builds one `VllmAdapter` inside vLLM's worker and hands
it to the one pipeline: `ember.runtime.save.save` around the runner's `capture_model` (SAVE) or
`ember.runtime.load.load` instead of it (LOAD). vLLM has allocated everything the graphs refer to
by then (weights, the KV cache sized by `kv_cache_memory_bytes`, the runner's persistent buffers),
so `prepare` only checks: the engine's own dispatcher keys against the mirror in `keys.py`, and at
LOAD the resolved sizing against the archive's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ember import contract, settings
from ember.engines.vllm import compile_cache
from ember.engines.vllm import graphs as sites
from ember.engines.vllm.args import archived, identity_workload, mismatches, parallelism
from ember.engines.vllm.keys import GraphConfig, GraphKey, enumerate_descs, enumerate_keys
from ember.engines.vllm.parallel import COMPILED_WITH, VOCAB_PATCH, archive_refusal
from ember.engines.vllm.versions import check_engine, engine_version, unsupported_features
from ember.identity import ArchiveIdentity, Parallelism, config_digest
from ember.runtime.adapter import COMPAT, ENGINE, LOAD, Refused

if TYPE_CHECKING:
    from ember.runtime.graphs.templates import GraphLibrary
    from ember.runtime.publish import ArchiveContent

log = logging.getLogger("ember.vllm")
KIND = "vllm"
PEER_REFUSED = "a peer rank refused the archive: every rank captures natively"


def runner_kind(runner: Any) -> str:
    return "v2" if type(runner).__module__.startswith("vllm.v1.worker.gpu.") else "v1"


def engine_descs(runner: Any) -> list[Any]:
    """The descriptors the engine's own dispatcher will capture, as `keys.Desc`."""
    from ember.engines.vllm.keys import Desc

    out = []
    if runner_kind(runner) == "v1":
        for mode, descs in runner.cudagraph_dispatcher.get_capture_descs():
            out += [Desc(mode.name, d.num_tokens, d.num_reqs, int(d.uniform)) for d in descs]
    else:
        for mode, descs in runner.cudagraph_manager._capture_descs.items():
            out += [Desc(mode.name, d.num_tokens, d.num_reqs, int(d.uniform_token_count or 0)) for d in descs]
    return out


def _model(runner: Any) -> Any:
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return model.unwrap() if hasattr(model, "unwrap") else model


def _ptr(buf: Any) -> int:
    return int(getattr(buf, "gpu", buf).data_ptr())


def static_addresses(runner: Any) -> dict[str, int]:
    """Addresses the graphs bake in and LOAD must find again: weights, KV cache, static inputs."""
    params = list(_model(runner).parameters())
    out = {"param.first": params[0].data_ptr(), "param.last": params[-1].data_ptr()}
    kv = [t for t in getattr(runner, "kv_caches", []) if hasattr(t, "data_ptr")]
    if kv:
        out.update({"kv.first": kv[0].data_ptr(), "kv.last": kv[-1].data_ptr()})
    bufs = getattr(runner, "input_buffers", runner)
    for name in ("input_ids", "positions"):
        if getattr(bufs, name, None) is not None:
            out[name] = _ptr(getattr(bufs, name))
    return out


class _Proof:
    """SAVE's proof over vLLM's graphs: each key's outputs compared; each key's own tensor
    arguments restored before every replay (a piecewise graph may update its input in place)."""

    def __init__(self, captured: Mapping[GraphKey, sites.Captured]) -> None:
        self.graphs = {k: c.graph for k, c in captured.items()}
        self._state = {k: _unique(c.inputs) for k, c in captured.items()}
        self.outs = {}
        for k, c in captured.items():
            reads = {t.data_ptr() for t in c.inputs}
            self.outs[k] = [t for t in sites.flat_tensors(c.output) if t.data_ptr() not in reads]

    def state_tensors(self) -> list[Any]:
        return []

    def state_for(self, key: GraphKey) -> list[Any]:
        return self._state.get(key, [])


def _unique(tensors: list[Any]) -> list[Any]:
    seen: dict[tuple[int, int], Any] = {}
    for t in tensors:
        seen.setdefault((t.data_ptr(), t.numel() * t.element_size()), t)
    return list(seen.values())


class VllmAdapter:
    """One vLLM model runner (bound late: LOAD opens the archive before the runner exists)."""

    kind = KIND
    # vLLM's profile and warm-up runs issue collectives on the communicators LOAD's background
    # thread would capture with: the splice is captured in open_restore instead (before them)
    splice_before_build = True

    def __init__(
        self,
        runner: Any = None,
        *,
        vllm_config: Any = None,
        runner_kind: str = "",
        native_capture: Callable[[], int] | None = None,
        model_name: str = "",
    ) -> None:
        self.runner = runner
        # None only for a runner without one (refused below); typed Any: vLLM's config object
        self.vllm_config: Any = vllm_config if vllm_config is not None else getattr(runner, "vllm_config",
                                                                                    None)
        self.runner_kind = runner_kind or (globals()["runner_kind"](runner) if runner is not None else "v1")
        self.native_capture = native_capture
        self.model_name = model_name or os.environ.get("EMBER_VLLM_MODEL", "")
        self.captured: dict[GraphKey, sites.Captured] = {}
        self.graph_bytes = 0
        self.voted: bool | None = None  # LOAD on N ranks: this rank's vote, once cast (`vote`)
        self._facts: dict[str, Any] = {}  # the archive's engine facts, from install (the canary's)
        self._before: dict[str, Any] = {}  # the engine's graph state before install (`uninstall`)
        self._installed = False
        self.canary: dict[str, Any] = {}  # LOAD's canary result (the plugin reports it)

    # -- 1 version ------------------------------------------------------------------------------
    @property
    def engine(self) -> str:
        return f"{KIND} {engine_version()}"

    def check_version(self) -> list[str]:
        problems = check_engine()
        if not problems and self.vllm_config is not None:
            problems = [f"not supported: {p}" for p in unsupported_features(self.vllm_config)]
        return problems

    # -- multi-GPU ------------------------------------------------------------------------------
    def _tensor(self) -> int:
        return int(self.vllm_config.parallel_config.tensor_parallel_size)

    def world(self) -> int:
        pc = self.vllm_config.parallel_config
        return int(pc.tensor_parallel_size) * int(pc.data_parallel_size) * int(pc.pipeline_parallel_size)

    def communicator(self) -> Any:
        """This worker's communicators by vLLM group name (None on one GPU): LOAD splices with them."""
        if self.world() < 2:
            return None
        from ember.engines.vllm.parallel import communicators

        return communicators()

    def stub_groups(self, stub: Any) -> dict[int, Any]:
        """SAVE under libember_nccl: the stub's communicator ids → vLLM's groups."""
        from ember.engines.vllm.parallel import stub_groups

        return stub_groups(stub)

    def vote(self, ok: bool) -> bool:
        """LOAD on N ranks: this rank's vote (once), every rank's verdict back (ranks restore
        together or capture together: parallel.agree)."""
        if self.voted is not None:
            return self.voted
        from ember.engines.vllm.parallel import agree

        self.voted = ok  # cast before the collective: one that raises is never joined again
        self.voted = agree(ok) if self.world() > 1 else ok
        return self.voted

    # -- 2 keys ---------------------------------------------------------------------------------
    def graph_config(self) -> GraphConfig:
        return GraphConfig.from_vllm(self.vllm_config, self.runner_kind)

    def keys(self) -> list[GraphKey]:
        return enumerate_keys(self.graph_config(), sites.piece_count())

    def identity(self) -> ArchiveIdentity:
        """The SAVE Job's identity (EMBER_IDENTITY, the operator's name for the archive) once this
        engine is checked to be it; else the one this engine's config describes."""
        raw = os.environ.get(contract.ENV_IDENTITY)
        if not raw:
            return self.own_identity()
        wanted = ArchiveIdentity.model_validate_json(raw)
        problems = mismatches(wanted, self.resolved())
        if problems:
            raise Refused(ENGINE, "vLLM is not running the archive identity: " + "; ".join(problems))
        return wanted

    def resolved(self) -> dict[str, Any]:
        """What `ember.engines.vllm.args.mismatches` compares with an identity."""
        cfg, mc = self.graph_config(), self.vllm_config.model_config
        return {
            "model": str(mc.model),
            "revision": str(getattr(mc, "revision", None) or "main"),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "engine_version": engine_version(),
            "capture_sizes": list(cfg.capture_sizes),
            "cudagraph_mode": cfg.cudagraph_mode,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": int(self.vllm_config.scheduler_config.max_num_batched_tokens),
            "parallelism": self._parallelism(),
        }

    def own_identity(self) -> ArchiveIdentity:
        """The identity this engine's config describes (no operator named one), with the
        operator's fields that the engine knows: its archived shape and ember's compile and canary
        settings too, so an archive of another shape or canary kind is never found under it."""
        import torch

        cfg, mc = self.graph_config(), self.vllm_config.model_config
        return ArchiveIdentity(
            model=self.model_name or os.path.basename(str(mc.model).rstrip("/")),
            revision=str(getattr(mc, "revision", None) or "main"),
            engine=KIND,
            engine_version=engine_version(),
            capture_sizes=cfg.capture_sizes,
            graph_mode=f"{cfg.cudagraph_mode}/{cfg.runner}",
            compile={"config_hash": str(self.vllm_config.compute_hash())},
            dtype=str(mc.dtype).removeprefix("torch."),
            max_num_tokens=int(self.vllm_config.scheduler_config.max_num_batched_tokens),
            max_batch=cfg.max_num_seqs,
            parallelism=archived(Parallelism(**self._parallelism())),
            gpu_product=torch.cuda.get_device_name(),
            config=self.config_digest(),
            workload=identity_workload(),
        )

    def config_digest(self) -> str:
        return config_digest(self.vllm_config.model_config.hf_config.to_dict())

    # -- 3 capture ------------------------------------------------------------------------------
    def prepare(self, facts: Mapping[str, Any] | None) -> None:
        """vLLM allocated everything already; check that its keys are the ones enumerated (and at
        LOAD, that it resolved SAVE's sizing)."""
        if (tensor := self._tensor()) > 1:
            from ember.engines.vllm.parallel import code_refusal, rank_dependent

            if odd_layers := rank_dependent(_model(self.runner)):
                raise Refused(ENGINE, "graph content would differ per rank: " + "; ".join(odd_layers[:3]))
            if why := code_refusal(_model(self.runner), tensor):
                raise Refused(ENGINE, why)
        mirror = sorted(enumerate_descs(self.graph_config()), key=repr)
        engine = sorted(engine_descs(self.runner), key=repr)
        if mirror != engine:
            odd = sorted(set(mirror) ^ set(engine), key=repr)[:4]
            raise Refused(ENGINE, f"vLLM's dispatcher keys differ from ember's enumeration, e.g. {odd}")
        if facts is None:
            return
        here = self._sizing()
        there = {k: facts.get(k) for k in here}
        if here != there:
            raise Refused(LOAD, f"engine resolved another sizing: {here} != archive {there}")

    def _sizing(self) -> dict[str, Any]:
        cc = self.vllm_config.cache_config
        return {
            "graph_config": self.graph_config().to_json(),
            "pieces": sites.piece_count(),
            "num_gpu_blocks": int(cc.num_gpu_blocks or 0),
            "kv_cache_memory_bytes": int(cc.kv_cache_memory_bytes or 0),
        }

    def capture(self) -> dict[GraphKey, Any]:
        """The engine's own capture_model, once, graphs kept; each key's outputs and inputs noted."""
        from ember.engines.transformers_cb.hooks import keep_graph

        assert self.native_capture is not None
        with keep_graph() as made, sites.recording_inputs() as inputs:
            self.graph_bytes = int(self.native_capture() or 0)
        for g in made:
            g.instantiate()
        self.captured = sites.captured_graphs(self.runner, inputs)
        return {k: c.graph for k, c in self.captured.items()}

    def proof_subject(self, graphs: Mapping[GraphKey, Any]) -> _Proof:
        return _Proof({k: self.captured[k] for k in graphs})

    # -- 4 sizing hints ------------------------------------------------------------------------
    def facts(self, graphs: Mapping[GraphKey, Any]) -> dict[str, Any]:
        import torch

        cc = self.vllm_config.compilation_config
        manager = getattr(self.runner, "cudagraph_manager", None)
        hidden = getattr(manager, "hidden_states", None) if self.runner_kind == "v2" else None
        name = ",".join
        out = {
            "kind": KIND,
            "version": engine_version(),
            "runner": self.runner_kind,
            **self._sizing(),
            "compile_cache_key": compile_cache.key_of(str(getattr(cc, "local_cache_dir", "") or "")),
            "device_index": int(torch.cuda.current_device()),  # in the compiled code (vllm.devices)
            "compilation_time_s": float(getattr(cc, "compilation_time", 0.0) or 0.0),
            "graph_memory_bytes": self.graph_bytes,
            "outputs": {name(map(str, k)): sites.describe(c.output) for k, c in self.captured.items()},
            "input_addresses": {name(map(str, k)): c.input_addresses for k, c in self.captured.items()},
            "v2_hidden_states": sites.describe(hidden) if hidden is not None else None,
            "inputs": static_addresses(self.runner),
            # prepare() refused compiled code without the patch (ember.engines.vllm.parallel)
            COMPILED_WITH: [VOCAB_PATCH] if self._tensor() > 1 else [],
            "parallelism": self._parallelism(),  # the engine's world, which accept() compares
        }
        from ember.engines.vllm import canary, canary_run

        # what LOAD's canary poisons beside the outputs (the canary module's doc), every world
        try:
            cases = canary.cases(list(graphs))
            out["scratch"], out["scratch_found"] = canary_run.scratch(self.captured, cases)
        except Exception as exc:  # the canary still poisons the outputs: weaker, not wrong
            log.warning("ember: the canary's scratch could not be found (%s: %s)", type(exc).__name__, exc)
            out["scratch"], out["scratch_found"] = {}, {"error": f"{type(exc).__name__}: {exc}"[:300]}
        if self.world() == 1:  # SAVE saw real data: LOAD's canary compares with what it computed
            out["canary"], out["scratch"] = canary_run.record(self.runner, self.runner_kind, list(graphs),
                                                              out)
        return out

    def accept(self, facts: Mapping[str, Any]) -> dict[str, Any]:
        """Before the runner exists: the archive is a vLLM one of this version, runner and
        graph config; its compile cache is on this node (else vLLM would recompile, and
        Inductor's autotuning would allocate differently from SAVE)."""
        if facts.get("kind") != KIND:
            raise Refused(COMPAT, f"archive is not a vLLM archive ({facts.get('kind')})")
        if facts.get("version") != engine_version():
            raise Refused(COMPAT, f"archive is from vLLM {facts.get('version')}, this is {engine_version()}")
        if facts.get("runner") != self.runner_kind:
            raise Refused(
                COMPAT, f"archive is for the {facts.get('runner')} runner, this is {self.runner_kind}"
            )
        # the resolved graph mode is compared in prepare(): here the attention backend has not
        # resolved it yet
        saved, here = GraphConfig.from_json(facts["graph_config"]), self.graph_config()
        if (saved.capture_sizes, saved.max_num_seqs) != (here.capture_sizes, here.max_num_seqs):
            raise Refused(COMPAT, f"graph config differs: archive {saved.to_json()}, here {here.to_json()}")
        cache = compile_cache.model_dir(dict(facts))
        if cache and not os.path.isdir(cache):
            raise Refused(COMPAT, f"vLLM's compile cache {cache} is not on this node (LOAD would recompile)")
        if not int(facts.get("kv_cache_memory_bytes") or 0):
            raise Refused(COMPAT, "archive has no kv_cache_memory_bytes")
        if why := archive_refusal(self._tensor(), facts):
            raise Refused(COMPAT, why)
        # The engine's own world, as vLLM runs it: a dense model's DP replica is DP 1 (the one-GPU
        # archive serves it), a MoE model's DP ranks without EP are one world of DP N, which a
        # one-GPU archive's graphs (no collective to splice) would serve wrongly.
        world = facts.get("parallelism") or parallelism(1, 1, False)
        if world != self._parallelism():
            raise Refused(COMPAT, f"archive is for the world {world}, this engine runs {self._parallelism()}")
        return dict(facts)

    def _parallelism(self) -> dict[str, int]:
        pc = self.vllm_config.parallel_config
        return parallelism(int(pc.tensor_parallel_size), int(pc.data_parallel_size),
                           bool(getattr(pc, "enable_expert_parallel", False)))

    def attachments(self) -> dict[str, bytes]:
        """vLLM's compile cache and model-class facts, so a fresh pod loads compiled code instead
        of compiling (EMBER_VLLM_COMPILE_CACHE=0: not shipped; LOAD then needs it on the node)."""
        if not settings.on("EMBER_VLLM_COMPILE_CACHE"):
            return {}
        packed = compile_cache.pack()
        return {compile_cache.NAME: packed} if packed else {}

    def attached(self, archive: Any) -> None:
        """At LOAD, before accept(): the archive's vLLM caches put under this process's cache
        root (what is there already is kept), unless the plugin did it when vLLM started. Not the
        code of an archive accept() refuses for it: vLLM would load it anyway."""
        if why := archive_refusal(self._tensor(), archive.manifest.engine):
            raise Refused(COMPAT, why)
        if compile_cache.placed_here():
            return
        try:
            data = archive.attachment(compile_cache.NAME)
            if data:
                self.report("compile_cache", **compile_cache.unpack(data))
        except Exception as exc:  # damaged blob, unsafe or broken tar, full disk
            raise Refused(LOAD, f"compile cache attachment: {type(exc).__name__}: {exc}") from exc

    # -- 5 install ------------------------------------------------------------------------------
    def static_addresses(self) -> dict[str, int]:
        return static_addresses(self.runner)

    def install(self, library: GraphLibrary, archive: ArchiveContent) -> int:
        facts = archive.engine
        restored = library.all_restored()
        expected = set(self.keys())
        if set(restored) != expected:
            odd = sorted(set(restored) ^ expected)[:4]
            raise Refused(LOAD, f"archive keys differ from the engine's: e.g. {odd}")
        if not self.vote(True):  # every refusal a rank can meet before this point is behind it
            raise Refused(LOAD, PEER_REFUSED)
        self.library = library  # keeps every exec alive while serving
        self._facts, self._before = dict(facts), sites.engine_state(self.runner)
        self._installed = True
        return sites.install(self.runner, restored, facts.get("outputs", {}), facts)

    def verify(self, library: GraphLibrary) -> dict[str, Any]:
        """LOAD's canary, every rank, before any request (`ember.engines.vllm.canary`): the
        restored steps against SAVE's fingerprint (one GPU) or the same step without graphs, the
        verdict every rank's (`parallel.agree`). Whatever goes wrong inside is a refusal, and every
        rank still reaches the agreement."""
        from ember.engines.vllm import canary, canary_run
        from ember.runtime import faults, verify
        from ember.runtime.stacks import exit_if_stuck

        world = self.world()
        if not settings.on("EMBER_VLLM_CANARY"):
            log.warning("ember: EMBER_VLLM_CANARY=0: this restore serves without LOAD's canary")
            self.canary = canary.skipped()
            return verify.settle(self.canary, world, self.rank(), self._agree if world > 1 else None)
        # N ranks: a rank that failed between two of the canary's collectives would leave its peers
        # in the next one until NCCL's timeout (minutes): past the limit the worker ends instead
        limit = settings.number("EMBER_VLLM_CANARY_TIMEOUT_S") if world > 1 else 0.0
        with exit_if_stuck(limit):
            try:
                if faults.active("canary-raise") and self.rank() == 1:  # tests: a rank failing inside it
                    raise RuntimeError("injected fault canary-raise")
                result = canary_run.run(self.runner, self.runner_kind, library, self._facts, world)
            except Exception as exc:
                log.exception("ember: LOAD's canary raised")
                result = canary.failed(f"the canary could not run: {type(exc).__name__}: {exc}")
            self.canary = result
            return verify.settle(result, world, self.rank(), self._agree if world > 1 else None)

    def _agree(self, ok: bool) -> bool:
        """The canary's verdict of every rank at once (the vote's MIN over vLLM's world group)."""
        from ember.engines.vllm.parallel import agree

        return agree(ok)

    def rank(self) -> int:
        import torch.distributed as dist

        return int(dist.get_rank()) if self.world() > 1 and dist.is_initialized() else 0

    def uninstall(self) -> None:
        """A LOAD refused after `install` (its canary): the restored graphs out of the engine, so
        the native capture that follows captures instead of replaying them."""
        if self._installed:
            sites.uninstall(self.runner, self._before)
            self._installed = False

    # -- 6 stages -------------------------------------------------------------------------------
    def report(self, stage: str, **fields: Any) -> None:
        from ember.engines.vllm import plugin

        plugin.report(stage, **fields)
