"""Parallelism of a ModelDeployment (`spec.parallelism`): the shape each replica serves and the
alternatives an edit may switch it to (ember_operator/api.py re-exports these models)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from ember_operator.api_base import ApiModel, cel


class ShapeSpec(ApiModel):
    """Parallel degrees inside one replica (one pod of tensor × data GPUs, one engine process per
    rank). As part of an archive identity (GraphArchive spec) it carries no rules."""

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel degree.")
    expert: int = Field(1, ge=1, le=512, description="Expert-parallel degree: 1, or tensor × data (vLLM's "
                        "expert-parallel size is the tensor × data ranks).")
    data: int = Field(1, ge=1, le=64, description="Data-parallel degree inside one replica. vLLM with "
                      "expert 1: engines of their own (a dense model's), which restore the data-1 archive.")

    @property
    def gpus(self) -> int:
        return self.tensor * self.data

    def key(self) -> tuple[int, int, int]:
        return (self.tensor, self.expert, self.data)

    def label(self) -> str:
        return f"TP{self.tensor}/EP{self.expert}/DP{self.data}"


MAX_REPLICA_GPUS = 64  # one pod on one node (multi-node replicas: LeaderWorkerSet, docs/operator.md)
_SHAPE_RULES = (
    ("self.expert == 1 || self.expert == self.tensor * self.data",
     "parallelism: expert must be 1 or tensor × data (vLLM's expert-parallel size is tensor × data)"),
    (f"self.tensor * self.data <= {MAX_REPLICA_GPUS}",
     f"parallelism: tensor × data is the GPUs of one pod on one node: at most {MAX_REPLICA_GPUS}"),
)


class ParallelShape(ShapeSpec):
    """A shape a ModelDeployment serves or may switch to: admission checks the expert degree."""

    model_config = ConfigDict(json_schema_extra=cel(*_SHAPE_RULES))

    @model_validator(mode="after")
    def _expert(self) -> ParallelShape:
        # The operator's own check of objects stored before admission had the rule.
        if self.expert not in (1, self.gpus):
            raise ValueError(f"parallelism: expert {self.expert} must be 1 or tensor × data ({self.gpus})")
        if self.gpus > MAX_REPLICA_GPUS:
            raise ValueError(f"parallelism: tensor × data {self.gpus} is above {MAX_REPLICA_GPUS} GPUs")
        return self

    def shape(self) -> ShapeSpec:
        return ShapeSpec(tensor=self.tensor, expert=self.expert, data=self.data)


class ParallelismSpec(ParallelShape):
    """The shape each replica serves, and the shapes an edit may switch it to."""

    model_config = ConfigDict(json_schema_extra=cel(*_SHAPE_RULES))
    alternatives: list[ParallelShape] = Field(
        default_factory=list, max_length=8,
        description="Shapes this deployment may be switched to by editing tensor/expert/data: the "
        "operator saves an archive for each ahead of time (one single-GPU SAVE Job each, at low "
        "priority) and keeps warm pods of their GPU counts within warmPool.size, so a switch "
        "neither waits for SAVE nor captures. The current shape may be listed too (it is skipped).",
    )

    def shapes(self) -> list[ShapeSpec]:
        """The current shape, then each distinct alternative."""
        out = [self.shape()]
        for alt in self.alternatives:
            if alt.key() not in {s.key() for s in out}:
                out.append(alt.shape())
        return out


class ShapeStatus(ApiModel):
    """One shape of `spec.parallelism` (the current one or an alternative) and its archive."""

    tensor: int = Field(description="Tensor-parallel degree.")
    expert: int = Field(description="Expert-parallel degree.")
    data: int = Field(description="Data-parallel degree.")
    gpus: int = Field(description="GPUs of one replica (one pod) in this shape.")
    current: bool = Field(False, description="The shape the deployment serves (or is switching to).")
    archive: str = Field(description="Its GraphArchive.")
    phase: str | None = Field(None, description="The GraphArchive's phase (Available: a switch to this "
                              "shape needs no SAVE).")
    uri: str | None = Field(None, description="Manifest URI once Available (warm pods prefetch it).")


class SwitchStatus(ApiModel):
    """A switch between shapes in progress: new-shape pods become Ready, then old ones drain."""

    previous: ShapeSpec = Field(description="The shape being left.")
    target: ShapeSpec = Field(description="The shape being switched to (spec.parallelism).")
    started_time: str = Field(description="When the switch started (RFC 3339).")
    new_ready: int = Field(0, description="Ready pods of the target shape.")
    replicas: int = Field(0, description="Replicas wanted (spec.replicas).")
    old_serving: int = Field(0, description="Pods of the previous shape still in service.")
    draining: int = Field(0, description="Pods of the previous shape out of service, waiting out "
                          "spec.drainSeconds before deletion.")
    presaved: bool = Field(False, description="The target's archive was Available when the switch "
                           "started (no SAVE waited for).")
