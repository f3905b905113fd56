"""What a profile records besides its layers: the job it was measured in (:class:`JobShape`) and
the machine's load while it was measured (:class:`MeasuredLoad`). Pure Python (pydantic); every
field optional in a profile, so older profiles load as before (:mod:`.profile`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobShape(_Strict):
    """The shape of the job a profile was measured in (``hippie.profile``): ``hippie-ds plan`` keeps it
    unless told otherwise (:mod:`.job_shape`)."""

    stages: int = Field(ge=1, description="pipeline stages (the module's num_stages, or its topology's pipe size)")
    data_parallel: int = Field(ge=1, description="data-parallel replicas (world size / stages)")
    micro_batch_size: int = Field(ge=1, description="train_micro_batch_size_per_gpu")
    global_batch: int = Field(ge=1, description="train_batch_size: samples per step over all replicas")
    virtual_stages: int = Field(1, ge=1, description="model chunks per stage (pipeline.virtual_stages)")

    @model_validator(mode="after")
    def _whole_micro_batches(self) -> "JobShape":
        if self.global_batch % (self.data_parallel * self.micro_batch_size):
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of data_parallel "
                f"{self.data_parallel} x micro_batch_size {self.micro_batch_size}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.stages * self.data_parallel

    @property
    def micro_batches(self) -> int:
        """gradient_accumulation_steps: micro-batches a replica runs per step."""
        return self.global_batch // (self.data_parallel * self.micro_batch_size)

    def describe(self) -> str:
        chunks = f" ({self.virtual_stages} model chunks each)" if self.virtual_stages > 1 else ""
        return (
            f"{self.stages} stage{'s' if self.stages != 1 else ''}{chunks} x {self.data_parallel} "
            f"replica{'s' if self.data_parallel != 1 else ''}, micro-batch {self.micro_batch_size}, "
            f"global batch {self.global_batch}"
        )


class MeasuredLoad(_Strict):
    """The machine while the profile was measured: a busy machine's times spread."""

    cpus: int | None = Field(None, ge=1, description="CPU cores the machine has (os.cpu_count)")
    load_before: float | None = Field(None, ge=0, description="1-minute load average when measuring began")
    load_after: float | None = Field(None, ge=0, description="1-minute load average when measuring ended")
    cpu_share: float | None = Field(
        None,
        ge=0,
        description="process CPU seconds / wall seconds while measuring "
        "(about the threads' share of the cores they got; low: the machine was busy)",
    )
    wall_seconds: float | None = Field(None, ge=0, description="seconds the measurement took")
