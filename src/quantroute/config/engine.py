"""``Settings.engine``: how the llama.cpp worker processes run (``engines/``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from quantroute.types import WorkerFault


class EngineSettings(BaseModel):
    """How llama.cpp worker processes run."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    n_ctx: int = Field(
        0, ge=0, description="Context window per sequence; 0 uses the model's training context."
    )
    parallel: int = Field(
        4, ge=1, le=64, description="Sequences a worker decodes together (continuous batching)."
    )
    n_threads: int = Field(
        0, ge=0, description="Threads per worker; 0 splits the cores (less one) among workers."
    )
    n_batch: int = Field(512, ge=16, description="Most tokens in one llama_decode call.")
    start_timeout_s: float = Field(120.0, gt=0, description="Time a worker has to load its model.")
    restart_backoff_s: float = Field(
        0.5, gt=0, description="First wait before restarting a dead worker; doubles each time."
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="Longest restart wait.")
    pin_cpus: bool = Field(
        False,
        description="Pin each worker to its own cores (telemetry.cpu_affinity, or an even split).",
    )
    cancel_grace_s: float = Field(
        5.0, gt=0, description="Time a worker has to exit on shutdown before it is killed."
    )
    max_crashes: int = Field(
        3,
        ge=1,
        description="Failures in a row (a signal, a failed load, a death before any request "
        "finished) after which a branch is marked failed.",
    )
    failed_retry_s: float = Field(
        0.0,
        ge=0,
        description="How often a failed branch is tried again; 0 waits for "
        "POST /admin/branches/{id}/restart.",
    )
    n_gpu_layers: int = Field(
        -1,
        ge=-1,
        description="Layers offloaded to a GPU when a branch is placed on one: -1 all (or as "
        "many as fit), 0 none. Branches on the CPU offload nothing.",
    )
    gen_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a generation's next event from its worker; a worker "
        "that sends nothing at all for this long is replaced.",
    )
    score_timeout_s: float = Field(
        300.0, gt=0, description="Longest a drift-replay scoring command may take."
    )
    max_event_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 23,
        description="Longest event line a worker may send; a longer one fails its request only.",
    )
    prompt_cache: bool = Field(
        True,
        description="Keep finished sequences' KV cells in their slots and reuse the longest "
        "shared token prefix of a new prompt (prefill only the rest).",
    )
    faults: dict[str, WorkerFault] = Field(
        default_factory=dict,
        description="Fault injection for tests: branch name (or model:branch, or '*') -> how "
        "its worker fails, e.g. {'q8_0': 'sigill-at-first-decode'}.",
    )

    def fault_for(self, model: str, branch: str) -> str:
        """The fault injected into a branch's worker ('' for none)."""
        faults = self.faults
        return faults.get(f"{model}:{branch}") or faults.get(branch) or faults.get("*") or ""
