"""Service configuration: one pydantic-settings class, read from ``NCAKNN_*`` variables.

Every field is documented here and in the README; ``python -m service --model ... --host ...
--port ...`` overrides the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.vocabulary import INDEX_KINDS

IndexType = Literal[("auto", *INDEX_KINDS)]  # type: ignore[valid-type]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NCAKNN_", extra="ignore", frozen=True)

    # what to serve
    model_path: Path = Field(Path("models/digits"), description="artifact directory to serve")
    model_repository: Path | None = Field(
        None,
        description="serve every model under this directory by name (DIR/NAME/, or "
        "DIR/NAME/VERSION/ with the highest version served) instead of model_path",
    )
    repository_memory_mib: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="the memory all of a repository's models may hold together, MiB (0: no "
        "budget); a load past it is refused and the models serving keep serving",
    )
    require_model_at_startup: bool = Field(
        True,
        description="fail fast when the model cannot be loaded at startup; if false, start "
        "unready (503) and wait for a reload or the poller to bring a model",
    )
    reload_poll_seconds: float = Field(
        0.0, ge=0, description="check the model path for a new artifact this often (0: never)"
    )
    reload_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="POST /v1/admin/reload answers 409 when the load has not finished within "
        "this many seconds (it goes on in the background); a reload asked for while another "
        "load runs is refused at once instead of queueing behind it",
    )

    # HTTP
    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    workers: int = Field(1, ge=1, description="uvicorn worker processes")
    worker_sync_seconds: float = Field(
        1.0,
        gt=0,
        description="with several workers: how often each checks whether another reloaded "
        "the model (every worker converges within this)",
    )
    runtime_dir: Path | None = Field(
        None,
        description="set by `python -m service` for several workers: where they share the "
        "reload generation and the Prometheus multiprocess files",
    )
    graceful_shutdown_seconds: int = Field(
        30, ge=0, description="on SIGTERM, how long to let requests in flight finish"
    )
    drain_delay_seconds: float = Field(
        5.0,
        ge=0,
        description="on SIGTERM, answer /readyz 503 at once but keep accepting and serving "
        "requests this long (while load balancers remove the pod), then stop accepting and "
        "finish what was accepted",
    )
    api_key: SecretStr | None = Field(
        None,
        description="if set, /v1 routes need 'Authorization: Bearer <key>' (surrounding "
        "whitespace is stripped; an empty key is an error)",
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="if set, POST /v1/admin/reload needs this key instead of api_key",
    )
    metrics_require_api_key: bool = Field(False, description="protect /metrics with the key too")
    docs: Literal["public", "protected", "off"] = Field(
        "protected",
        description="/docs, /redoc, /openapi.json and the model card at /: public, protected "
        "(need api_key when one is set) or off",
    )
    log_level: str = Field("info", description="debug, info, warning, error")
    log_json: bool = Field(True, description="structured JSON log lines")

    # connections (per worker process; see service/server/connections.py)
    max_connections: int = Field(
        1000,
        ge=1,
        description="most open HTTP connections per worker process; a connection beyond it "
        "is answered 503 at once and closed. The open-files limit must exceed it by 128 "
        "(checked at start-up; the soft limit is raised when the hard one allows). A "
        "connection holding a request at the header limit costs about 40 KiB (measured: 900 "
        "such connections added 34 MiB), so the default fits any pod; raise it with the pod's "
        "expected concurrent clients",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="the request line and headers must arrive within this many seconds of "
        "the connection opening (or of a request's first byte); else 408 and close",
    )
    keep_alive_timeout_seconds: float = Field(
        5.0, gt=0, description="close a kept-alive connection idle this many seconds"
    )
    max_header_bytes: int = Field(
        32768,
        ge=1024,
        description="largest request line plus headers in bytes; beyond it 431 and close",
    )
    max_headers: int = Field(
        100, ge=8, description="most header fields in one request; beyond it 431 and close"
    )
    body_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="a request's whole body must arrive within this many seconds of its "
        "headers; else 408 and close (at the default max_body_bytes a client must send "
        "about 2.2 MB/s)",
    )
    body_progress_seconds: float = Field(
        5.0,
        gt=0,
        description="while a request's body streams in, it must grow by 64 KiB (or be "
        "complete) in every window of this many seconds, else 408 and close (at the default "
        "a body must come at about 13 KB/s or faster); at the connection cap, a new "
        "connection takes the slot of a body that has been below half that rate for 0.5 s (or "
        "a quarter of this window, when shorter)",
    )
    send_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="once an answer stops draining, the client must take 64 KiB of it (or "
        "all it was sent) for every window of this many seconds, on average over the last "
        "4 windows (the first alone at the first check), counted on what its kernel "
        "acknowledged; else the connection is reset and the answer dropped. A connection "
        "closed with bytes not taken is dropped by the kernel after 4 windows without an "
        "acknowledgement",
    )
    max_body_bytes_in_flight: int = Field(
        256 * 2**20,
        ge=1024,
        description="most bytes of request bodies one worker holds at once, being received "
        "or parsed (HTTP bodies as their bytes arrive, gRPC calls their largest message "
        "before it is read); a body that does not fit is refused with 429",
    )
    max_answer_bytes_in_flight: int = Field(
        256 * 2**20,
        ge=1024,
        description="most bytes of HTTP answers one worker holds for clients that have not "
        "taken them yet (answers of 64 KiB or more, reserved when encoded, released when "
        "they have left the process); an answer that does not fit beside those held is refused "
        "with 503 answer_budget_spent, one larger than the whole budget with 413",
    )
    probe_port: int = Field(
        8082,
        ge=0,
        le=65535,
        description="port of the probe listener: GET /healthz and /readyz answered by a "
        "thread of its own, whatever the load on the main port (0: off). Point Kubernetes' "
        "probes here, and do not expose it",
    )
    liveness_stall_seconds: float = Field(
        10.0,
        gt=0,
        description="the probe port's /healthz fails when a worker's event loop has not "
        "turned for this long (a hung worker), and /readyz with it",
    )

    # limits and backpressure
    max_batch_rows: int = Field(4096, ge=1, description="most instances in one request (413)")
    max_body_bytes: int = Field(
        64 * 2**20, ge=1024, description="largest request body in bytes (413)"
    )
    max_in_flight: int = Field(
        512, ge=1, description="requests computing at once; more are refused with 429"
    )
    max_k: int = Field(256, ge=1, description="largest k a request may ask for (422)")
    v2_model_name: str = Field(
        "nca-knn",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the model's name in the Open Inference Protocol (/v2 and gRPC); its "
        "version is the artifact's version",
    )
    grpc_port: int = Field(
        8081,
        ge=0,
        le=65535,
        description="port of the Open Inference Protocol's gRPC service (0: off)",
    )
    outlier_quantile: float = Field(
        0.99,
        ge=0.5,
        le=0.999,
        description="a prediction is flagged as an outlier when its nearest reference is "
        "farther than this quantile of held-out points' nearest distances (the model's "
        "calibration); a request may ask for another",
    )
    max_response_values: int = Field(
        1_048_576,
        ge=1,
        description="most numbers in one JSON answer: rows x (classes + 2 + 3 k with neighbours) "
        "for classify, rows x 3 k for neighbors, rows x d for embed (413 before any search)",
    )

    # dynamic batching
    batching: bool = Field(True, description="merge concurrent requests into one search")
    batch_max_rows: int = Field(512, ge=1, description="most rows in one merged search")
    batch_max_wait_us: int = Field(
        200, ge=0, description="how long a batch waits for more requests, microseconds"
    )
    search_on_event_loop: Literal["auto", "always", "never"] = Field(
        "auto",
        description="run merged searches of at most 256 rows on the event loop instead of a "
        "worker thread (larger ones always use the thread); auto: when the process has one "
        "core (CPU affinity, cgroup quota), where thread hand-offs cost more than they overlap",
    )

    # index
    index_type: IndexType = Field(
        "auto",
        description="auto (the artifact's prebuilt index with its tuned parameter, else flat), "
        "flat (exact), ivf, hnsw or ivfpq (built at load unless the artifact has one)",
    )
    ivf_nlist: int = Field(0, ge=0, description="IVF lists (0: about 4 sqrt(N))")
    nprobe: int | None = Field(
        None, ge=1, description="IVF lists searched per query (unset: the tuned value, else 16)"
    )
    hnsw_m: int = Field(32, ge=2, description="HNSW graph degree")
    ef_construction: int = Field(80, ge=1, description="HNSW build-time beam width")
    ef_search: int | None = Field(
        None, ge=1, description="HNSW search beam width (unset: the tuned value, else 64)"
    )
    pq_m: int = Field(8, ge=1, description="IVF-PQ sub-quantisers (must divide d)")
    search_threads: int = Field(
        1,
        ge=0,
        description="FAISS threads per search (0: all cores); one is fastest when requests "
        "already keep the cores busy",
    )

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _usable_key(cls, value: SecretStr | None, info) -> SecretStr | None:
        if value is None:
            return None
        key = value.get_secret_value().strip()
        if not key:
            raise ValueError(
                f"{info.field_name} is empty: an empty key would let 'Bearer ' through; "
                f"unset NCAKNN_{info.field_name.upper()} to turn authentication off"
            )
        if any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError(f"{info.field_name} contains whitespace or control characters")
        return SecretStr(key)

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        value = value.lower()
        if value not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError(
                f"log_level must be debug, info, warning, error or critical, not {value!r}"
            )
        return value


def settings_table() -> str:
    """The README's settings table, generated from the fields above."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "(unset)" if default is None else getattr(default, "value", default)
        lines.append(f"| `NCAKNN_{name.upper()}` | `{shown}` | {field.description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m service.config --markdown
    print(settings_table(), end="")
