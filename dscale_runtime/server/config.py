"""`ServeConfig`: every option of `dscale-serve` (the CLI flags are generated from its fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dscale_runtime.config import MODES

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = REPO_ROOT / "artifacts" / "demo" / "target"
DEMO_DRAFTER = REPO_ROOT / "artifacts" / "demo" / "drafter"
DEMO_PREDICTOR = REPO_ROOT / "artifacts" / "demo.pt"
ROUTER_POLICIES = ("round_robin", "power_of_two", "random", "cache_aware")
"""sglang-router's policies for a data-parallel dscale-serve (`--router-policy`)."""
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
"""`--loop`: the HTTP process's event loop ('auto': uvloop where it is installed, as uvicorn's own 'auto')."""
HTTP_PARSERS = ("auto", "h11", "httptools")
"""`--http`: the HTTP/1.1 implementation ('auto': httptools where it is installed, as uvicorn's own 'auto')."""


@dataclass(frozen=True)
class ServeConfig:
    """What the server loads and how it answers."""

    target: str | None = None
    """Qwen3 target folder (config.json, safetensors, tokenizer); default: the demo pair's target."""
    drafter: str | None = None
    """DFlash drafter folder (modes dflash and dscale); default: the demo pair's drafter."""
    predictor: str | None = None
    """Acceptance predictor artifact from dscale-train (mode dscale); default: artifacts/demo.pt."""
    mode: str = "dscale"
    """Decoding: 'dscale' (adaptive verification), 'dflash' (full-width) or 'target' (target only)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    max_running_requests: int = 32
    """Most requests decoded together; later ones wait in the queue and join the batch as others finish."""
    max_waiting_requests: int = 1024
    """Most requests waiting for a batch slot; beyond it requests are refused with 429."""
    max_model_len: int | None = None
    """Context limit (prompt + output tokens); default: the target's max_position_embeddings, at most 4096
    (the KV cache holds max-running-requests requests of this length unless --kv-cache-tokens says otherwise)."""
    kv_cache_tokens: int | None = None
    """KV-cache capacity in tokens; default: max-running-requests full-length requests (see --memory-fraction)."""
    memory_fraction: float | None = None
    """CUDA: share of GPU memory for weights, workspaces, graphs and the KV pool together; the pool gets what the
    others leave, and requests that do not fit wait (SGLang's --mem-fraction-static); e.g. 0.85."""
    budget_ratio: float = 0.5
    """DScale verification rows as a share of full width (M = ratio x 16 x N)."""
    full_width_max_batch: int = 1
    """DScale: steps with at most this many running requests verify all 16 slots without the predictor
    (the DFlash step), where the decision costs more than it saves; 0 = always decide. The default keeps a
    lone request at full width (8 rows lose drafts there); profile larger values per model and GPU."""
    dscale_policy: str = "measured"
    """DScale with step graphs: 'measured' times every bucket's DFlash and DScale steps at start-up and decides
    only where that is faster (the log shows the choice); 'always' decides in every bucket above
    --full-width-max-batch; 'live' times both and then runs, per bucket, the one with more tokens per second by
    the live acceptance of each (every 16th step the other)."""
    target_fallback: bool = False
    """Speculative modes with step graphs: run a batch size's steps target-only while the live acceptance and the
    step times say speculation yields fewer tokens per second (3 speculative steps in a row every 128 or more keep
    measuring; while speculating, 3 target-only steps every 1,024); /metrics shows the choice per bucket. Off by
    default (measured: docs/benchmarks.md, 2026-12-06: speculation alone served above target-only at every point
    once sampled steps cost what greedy ones do); `--target-fallback true` for a pair whose drafts are rarely
    accepted."""
    measure_retention: bool = False
    """DScale: also run full-width verification to report retention in /metrics (costs a second forward)."""
    live_calibration: bool = False
    """DScale: refresh a calibration of the acceptance predictor from the served steps and decide by it (verify
    lengths change, output never does); off: the raw scores decide. /metrics reports predicted vs realised
    acceptance per draft position and the live calibration error either way (EngineConfig.live_calibration)."""
    calibration_window: int = 128
    """DScale with --live-calibration: request-steps the calibration's statistics decay over."""
    step_graphs: bool | None = None
    """Speculative modes: greedy decode steps on fixed per-batch-bucket buffers, captured as CUDA graphs at
    start-up on CUDA; default: on with a CUDA device (4-8x the tokens/s of eager steps on the demo pair,
    docs/benchmarks.md), off elsewhere (without graphs the fixed buckets only add padding rows)."""
    prefix_caching: bool = True
    """Reuse the K/V of prompt prefixes other requests computed (full 16-token pages; hit rate in /metrics)."""
    chunked_prefill_tokens: int = 8192
    """Most prompt tokens prefilled per engine step; a longer prompt is prefilled over several steps while the
    running requests keep decoding; 0: every prompt whole in one step."""
    prefill_graphs: bool = True
    """With step graphs: prefill through captured token-bucket graphs too (forward, drafter context and first token
    in one replay; eager above the largest bucket); false: eager prefill."""
    prefill_stall_ratio: float = 0.8
    """While requests decode, a prefill chunk lasts at most this share of the decode step beside it (start-up
    measurements), so decoding slows about (1 + ratio)x during a long prompt's prefill, which then takes more
    steps; 0: only --chunked-prefill-tokens bounds a chunk."""
    admission_group: int = 0
    """While requests decode and at least this many wait, admit them in groups of this many (held at most 4
    steps) so one prefill serves several; 1: admit as soon as a slot frees; 0 (default): by concurrency
    (--max-running-requests // 8 for dflash and dscale, 1 for target)."""
    overlap_schedule: bool = True
    """Launch each decode step before the host has committed the previous one (inputs advanced on the device,
    commit and streaming a step behind; output unchanged); false: commit every step before the next starts."""
    api_key: str | None = None
    """When set, every request but GET /health must send 'Authorization: Bearer KEY'."""
    enable_docs: bool = False
    """Serve FastAPI's /docs, /redoc and /openapi.json (behind --api-key when it is set)."""
    trust_request_chat_template: bool = False
    """Render chat templates sent by requests ('chat_template', or 'chat_template' in 'chat_template_kwargs');
    without it only the model's own template runs and requests carry template variables only (vLLM's flag)."""
    template_timeout: float = 5.0
    """Seconds a chat template may take to render one request's messages (400 past it)."""
    max_prompt_chars: int = 1 << 20
    """Longest prompt text in characters (a rendered chat included); a longer one gets 400."""
    timeout_keep_alive: int = 5
    """Seconds an idle keep-alive connection stays open (uvicorn's --timeout-keep-alive)."""
    header_timeout: float = 10.0
    """Seconds a request's line and headers may take, from the connection or, on a keep-alive connection, from the
    request's first bytes, before the connection is closed (an idle keep-alive connection: `timeout_keep_alive`)."""
    engine_process: bool = True
    """Run the engine in a process of its own, joined to this HTTP process by a pipe (vLLM's API-server /
    engine-core split), so HTTP, tokenising and SSE never take the GIL from the decode loop; false: the engine
    runs in a thread of this process (one process: for a machine with a single core, where the two processes
    share it). Measured on an H200 (demo pair, `dscale-bench --launch`, c = 32, 2026-12-06): 65.1K output tok/s
    for DScale against 22.8K with the engine thread, TTFT p99 / median 2.14 (docs/benchmarks.md)."""
    switch_interval_ms: float = 1.0
    """Python's thread switch interval in this process (sys.setswitchinterval, CPython's default 5 ms): how long
    the busy engine thread may keep the GIL while the HTTP loop waits for it. The loop gives the GIL up at every
    socket read and write, so each of its trips costs up to this long while the engine thread runs; 5 ms starves
    it at high concurrency (measured: benchmarks/serve_frontend.py, docs/benchmarks.md)."""
    loop: str = "auto"
    """The HTTP process's event loop: 'uvloop' (libuv; cheaper socket writes and wake-ups than asyncio's, which a
    streaming server pays per step and request), 'asyncio', or 'auto' (uvloop when it is installed, as uvicorn)."""
    http: str = "auto"
    """HTTP/1.1 implementation: 'httptools' (llhttp, C), 'h11' (pure Python) or 'auto' (httptools when it is
    installed, as uvicorn); either one closes connections whose headers outlast --header-timeout."""
    served_model_name: str | None = None
    """Model name in the API; default: the target folder's name."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted; a larger one gets 413."""
    max_header_bytes: int = 1 << 14
    """Largest request line and headers accepted (uvicorn's h11 default); a longer head gets 431 (--http
    httptools) or 400 (h11) and its connection is closed."""
    device: str = "cpu"
    """Torch device ('cpu', 'cuda', ...)."""
    dtype: str = "auto"
    """'float32', 'bfloat16', 'float16' or 'auto' (bf16 on CUDA, fp32 on CPU)."""
    draft_dtype: str | None = None
    """The drafter's dtype; default: --dtype. Output never depends on it (the target verifies every token);
    a bf16 drafter beside an fp32 target is faster on a CPU."""
    seed: int = 0
    """Seed of the engine's random stream for requests without a seed."""
    sampling_rule: str = "auto"
    """Acceptance rule of sampled requests: 'top1' (the paper's; seeded output equals target-only sampling),
    'sampled' (drafts sampled from the drafter, z-lab's) or 'auto' (EngineConfig.sampling_rule)."""
    log_level: str = "info"
    """uvicorn log level ('warning' keeps the console quiet)."""
    data_parallel_size: int = 1
    """Engine replicas, each a dscale-serve process on its own port (replica i on --port + 1 + i), behind
    sglang-router on --host/--port (pip install -e '.[distributed]'); a replica that exits is restarted. 1: one
    engine served directly; 0: no local replica, only the router in front of --worker-urls."""
    data_parallel_gpus: str | None = None
    """With --device cuda and --data-parallel-size N: the GPU of each replica, comma-separated (as numbered in
    CUDA_VISIBLE_DEVICES), e.g. '0,1,2,3', or '0,0' for two replicas sharing GPU 0; default: replica i on GPU
    i mod the number of GPUs."""
    worker_urls: str | None = None
    """Comma-separated URLs of dscale-serve replicas running elsewhere (other nodes) that the router serves besides
    its own --data-parallel-size replicas."""
    router: bool = True
    """With --data-parallel-size: start sglang-router on --port in front of the replicas; false: only the replicas
    and their supervisor (for a router on another node that lists them in its --worker-urls)."""
    router_policy: str = "round_robin"
    """sglang-router's choice of replica: 'round_robin', 'power_of_two' (the less loaded of two, from /get_load),
    'random' or 'cache_aware' (prompt-prefix affinity: a prefix goes to the replica whose prefix cache holds it)."""
    router_metrics_port: int | None = None
    """Port of the router's own Prometheus metrics (smg_*); default: --port + N + 1 with N replicas. Every
    replica's /metrics, merged and labelled worker_addr, is served at the router's GET /engine_metrics."""
    router_args: str | None = None
    """Further sglang-router flags, passed on as written (e.g. --router-args='--health-check-interval-secs 10')."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if not self.prefill_stall_ratio >= 0:
            raise ValueError(f"--prefill-stall-ratio must be >= 0 (0 = off), got {self.prefill_stall_ratio}")
        if self.admission_group < 0:
            raise ValueError(f"--admission-group must be >= 1 (0 = by concurrency), got {self.admission_group}")
        if self.chunked_prefill_tokens < 0:
            raise ValueError(f"--chunked-prefill-tokens must be >= 0 (0 = off), got {self.chunked_prefill_tokens}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be positive, got {self.max_request_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max-header-bytes must be at least 1024, got {self.max_header_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for flag, value in (("--template-timeout", self.template_timeout), ("--max-prompt-chars", self.max_prompt_chars),
                            ("--timeout-keep-alive", self.timeout_keep_alive), ("--header-timeout", self.header_timeout),
                            ("--switch-interval-ms", self.switch_interval_ms)):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        for flag, value, choices in (("--loop", self.loop, EVENT_LOOPS), ("--http", self.http, HTTP_PARSERS)):
            if value not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}, got '{value}'")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty (leave the flag out to serve without a key)")
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        if self.data_parallel_size < 0:
            raise ValueError(f"--data-parallel-size must be >= 0, got {self.data_parallel_size}")
        if self.data_parallel_size == 0 and not (self.worker_urls and self.router):
            raise ValueError("--data-parallel-size 0 starts only the router: give it --worker-urls URL,URL,...")
        if self.worker_urls is not None:
            if not self.router:
                raise ValueError("--worker-urls are the router's replicas: leave out --router false")
            if not self.worker_url_list:
                raise ValueError("--worker-urls is empty: give URL,URL,... or leave the flag out")
            for url in self.worker_url_list:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"--worker-urls: '{url}' is not an http:// or https:// URL")
        if self.data_parallel_gpus is not None:
            gpus = self.data_parallel_gpus.split(",")
            if len(gpus) != self.data_parallel_size or not all(g.strip().isdigit() for g in gpus):
                raise ValueError(f"--data-parallel-gpus must list one GPU number per replica ({self.data_parallel_size}"
                                 f" for --data-parallel-size), e.g. '0,1' or '0,0'; got '{self.data_parallel_gpus}'")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}, got '{self.router_policy}'")
        if self.data_parallel and self.port + self.data_parallel_size + 1 > 65535:
            raise ValueError(f"--port {self.port}: the replicas and the router's metrics take the ports up to --port + "
                             f"{self.data_parallel_size + 1}; choose a lower --port")
        if self.router_metrics_port is not None and not 0 <= self.router_metrics_port < 65536:
            raise ValueError(f"--router-metrics-port must be in [0, 65535], got {self.router_metrics_port}")
        if not self.data_parallel:
            given = [flag for flag, value in (("--data-parallel-gpus", self.data_parallel_gpus),
                                              ("--router-policy", self.router_policy != "round_robin" or None),
                                              ("--router-metrics-port", self.router_metrics_port),
                                              ("--router-args", self.router_args)) if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to data-parallel serving: add --data-parallel-size N "
                                 "(N > 1), or --worker-urls")

    @property
    def data_parallel(self) -> bool:
        """Whether dscale-serve starts replicas and a router (data_parallel.py) rather than one engine."""
        return self.data_parallel_size != 1 or self.worker_urls is not None or not self.router

    @property
    def worker_url_list(self) -> list[str]:
        return [url.strip().rstrip("/") for url in (self.worker_urls or "").split(",") if url.strip()]

    @property
    def target_path(self) -> Path:
        return Path(self.target) if self.target else DEMO_TARGET

    @property
    def drafter_path(self) -> Path | None:
        if self.mode == "target":
            return None
        return Path(self.drafter) if self.drafter else DEMO_DRAFTER

    @property
    def predictor_path(self) -> Path | None:
        if self.mode != "dscale":
            return None
        return Path(self.predictor) if self.predictor else DEMO_PREDICTOR

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target_path.resolve().name
