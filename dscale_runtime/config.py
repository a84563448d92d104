"""Public configuration of the engine (`EngineConfig`) and of a request (`SamplingParams`).

Both are frozen dataclasses whose field docstrings document every option; invalid values raise a
`ValueError` that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("target", "dflash", "dscale")
SAMPLING_RULES = ("auto", "top1", "sampled")
DSCALE_POLICIES = ("measured", "always", "live")
DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: decoding mode, batch and memory limits, device and numerics."""

    mode: str = "dflash"
    """'target': target-only decoding (the reference); 'dflash': full-width DFlash verification of all
    `block_size` slots; 'dscale': DVL compact verification of M = budget_ratio x W x N rows, prefix lengths
    chosen by the acceptance predictor (needs `predictor=PATH`)."""
    max_running_requests: int = 32
    """Most requests decoded together (continuous batching); more wait in the queue."""
    max_model_len: int = 4096
    """Longest prompt + output of one request, in tokens; a longer prompt is refused."""
    device: str = "cpu"
    """Torch device of the models and caches ('cpu', 'cuda', 'cuda:1', ...)."""
    dtype: str = "auto"
    """Weights, activations and KV cache: 'float32', 'bfloat16', 'float16' or 'auto' (bf16 on CUDA,
    fp32 on CPU)."""
    draft_dtype: str | None = None
    """The drafter's weights, activations and KV cache (its LM-head rows too): a dtype name as for `dtype`;
    None = `dtype`. The target verifies every token, so the drafter's precision never changes the output,
    only how many drafts are accepted: e.g. a bf16 drafter beside an fp32 target reads half the drafter
    bytes on a CPU, whose decode steps are bound by memory bandwidth."""
    block_size: int | None = None
    """Slots per DFlash block W (anchor + W-1 drafts); None takes the drafter's `block_size`."""
    page_size: int = 16
    """Tokens per KV-cache page."""
    kv_cache_tokens: int | None = None
    """Total KV-cache capacity in tokens, shared by all requests (target and drafter alike); None sizes it
    for `max_running_requests` full-length requests. Requests that do not fit wait in the queue."""
    memory_fraction: float | None = None
    """CUDA: the share of the device's memory that weights, workspaces, captured graphs and the KV pool take
    together (SGLang's --mem-fraction-static); the pool gets what the others leave (weights as loaded, twice
    the measured peak of one largest-bucket step and one prefill chunk), bounded by the free memory, and
    requests that do not fit wait. None: the pool holds `max_running_requests` full-length requests.
    `kv_cache_tokens` overrides both."""
    seed: int = 0
    """Seed of the engine's random stream for requests that carry no seed of their own."""
    budget_ratio: float = 0.5
    """DScale verification budget as a share of full width: M_live = round(budget_ratio x W x N_live)."""
    full_width_max_batch: int = 0
    """DScale only: steps with at most this many live requests verify all W slots without running the
    decision (the DFlash step), where the decision costs more than the rows it saves; 0 = leave it to
    `dscale_policy`. An override of the measured policy (`benchmarks/gpu_step.py project` prints the best
    policy per N)."""
    dscale_policy: str = "measured"
    """DScale only: 'measured' (with `step_graphs` on CUDA): after capture, time every bucket's greedy DFlash and
    DScale steps and run the decision only in buckets where its step is faster (logged, `Engine.step_policy`);
    'always': decide in every bucket above `full_width_max_batch`; 'live': time them as 'measured' does, then
    while serving run in each bucket the step with the most tokens per second by the live traffic (start-up
    step time x (1 + accepted drafts per request-step of that step, a running mean); every 16th step runs the
    other step to keep both estimates current). Without graphs (CPU) all three mean 'always'."""
    target_fallback: bool = False
    """Speculative modes with `step_graphs` on CUDA: also capture and time each bucket's target-only step, and
    run a bucket's steps target-only while the live acceptance says speculation yields fewer tokens per second
    (step costs: live device times, host work and wall time per cycle, each a running estimate of its floor,
    start-up times before those; x (1 + accepted drafts per request-step of the batch's kind, a running mean)); a
    fallen-back bucket still speculates, 3 steps in a row every 128 or more, and a speculating one runs target-only
    steps 3 in a row every 1,024, keeping the estimates current. Off by default, by measurement (docs/benchmarks.md,
    2026-12-06, H100, the demo pair served at c = 1, 8, 32 at T = 0, 1 and 0.7 / top_p 0.8): since sampled steps
    cost about what greedy ones do, DScale without it served 1.20-2.37x target-only at every point, and the
    fallback, which ran target-only steps only as its probes, served 0.87-0.92x the best at four points where
    DScale without it served 0.96-0.99x. Turn it on for a pair whose drafts are rarely accepted. Without graphs
    (CPU) it is off whatever this says."""
    live_calibration: bool = False
    """DScale only: refresh a calibration of the acceptance predictor's scores from the served steps and apply
    it inside the step (`dscale_runtime/dvl/calibration.py`: a per-position monotone piecewise-linear map of
    the conditional acceptance P(accepted >= j | accepted >= j-1), fitted on the host every 32 request-steps
    from the positions each step verified, which keeps the fit unbiased although DScale sees only k - 1 drafts;
    identity at start). It changes verify lengths only, never the output. Off (the default, for now: its
    captured step has not run on a GPU yet, and on the demo pair it changed retention by < 0.005 at budgets 0.5 and
    0.25 for 0.2-0.35 ms of host time per DScale step): the raw scores decide; /metrics still reports predicted vs
    realised acceptance either way."""
    calibration_window: int = 128
    """DScale with `live_calibration`: request-steps the calibration's statistics decay over (exponential
    window): shorter follows drifting traffic (other prompts, other temperatures) sooner, longer fits less
    noise."""
    measure_retention: bool = False
    """DScale only: also run full-width verification each step to measure retention (costs a second
    target forward; for analysis, not serving)."""
    step_graphs: bool = False
    """Capture the step runner's decode steps (`dscale_runtime/runner.py`) as CUDA graphs, one per batch bucket
    and step kind, at start-up (CUDA only). Every step runs through the runner either way; without graphs it
    runs eagerly (always on the CPU)."""
    prefix_caching: bool = True
    """Share the K/V of full prompt pages between requests with the same prefix and keep released ones cached
    until their pages are needed (vLLM's automatic prefix caching: pages keyed by a chained hash of their
    tokens, target and drafter caches alike); a request prefills only what the cache does not hold. Output is
    unchanged; the hit rate is in `Engine.prefix_cache_stats` and /metrics."""
    chunked_prefill_tokens: int = 8192
    """Most prompt tokens prefilled per engine step, over all requests being prefilled: a longer prompt is
    prefilled in chunks between decode steps, so the running requests keep producing tokens (SGLang's
    --chunked-prefill-size); 0 prefills every admitted prompt whole in one step."""
    prefill_graphs: bool = True
    """With `step_graphs` on CUDA: prefill through captured graphs too, one per token bucket
    (`prefill_buckets`) and first-token draw kind (greedy, sampled, filtered), replayed with the chunk padded to
    its bucket (padding rows on the scratch page): the target forward, the drafter's context injection and
    the first token of each completed prompt in one replay (`dscale_runtime/prefill.py`). A step's prefill
    runs as replays of at most the largest bucket's tokens each; with chunking off (`chunked_prefill_tokens=0`)
    a prompt above the largest bucket runs the same step eagerly. False: every prefill runs eagerly."""
    prefill_buckets: tuple[int, ...] | None = None
    """Token counts of the prefill graphs; None: 16, 32, 64, 128, 256, then steps of x1.5 / x1.33 up to
    `chunked_prefill_tokens` (8,192 when chunking is off) and `max_model_len`. Given on a CPU engine, prefills
    are padded to them too (what the captured path does, eagerly: for tests)."""
    prefill_stall_ratio: float = 0.8
    """While requests decode, a step's prefill chunk lasts at most this share of the decode step beside it
    (by the prefill and decode step times measured at start-up, the chunk's context included), so a decode
    step with a chunk takes at most (1 + ratio) x one without; a prompt then prefills over more steps. The
    default leaves room under 2x for what live steps spread beyond the start-up timings (at 1.0 the longest
    step read 1.98-2.17x at Qwen3-8B shape); beside decoding, a long prompt's prefill then spans ~(1 + r) / r x
    its own prefill time (2.25x at 0.8, 2x at 1.0). The decode step is the device's, or the driving loop's live
    cycle where that is longer (a host-bound server: `Engine.stall_reference_ms`). Needs captured prefill; 0 = no
    such bound (`chunked_prefill_tokens` alone). With nothing decoding the whole `chunked_prefill_tokens` budget
    is used (in prefills of at most the largest bucket's tokens each, captured on CUDA)."""
    admission_group: int = 0
    """While requests decode, admit waiting requests in groups of up to this many: with at least this many
    waiting and fewer slots free, admission waits (at most 4 steps) until the group fits, so one prefill serves
    several requests (SGLang's --min-free-slots-delay); a shorter queue is admitted at once. 1 = admit as soon
    as a slot frees. 0 (default): by concurrency (`admission`): max_running_requests // 8 for DFlash and DScale
    (groups of 4 at 32, none below 16), 1 for target-only. Measured on the demo pair (docs/benchmarks.md): groups
    of 4 gave +3.6% / +4.1% and +7% / +4% (DFlash / DScale) at c = 32 and -2.6% to -4% at c = 8."""
    overlap_schedule: bool = True
    """Launch each decode step before the previous one is committed on the host: the device advances the next
    step's inputs from the verified results, and the host reads and commits a step behind (stop rules,
    streaming), discarding what a finished request produced after its end; output is unchanged. It hides the
    host's work behind the device's (SGLang's overlap scheduler). Off (or while step observers are registered):
    every step is committed before the next one starts."""
    graph_buckets: tuple[int, ...] | None = None
    """Batch sizes the runner keeps fixed buffers (and, with `step_graphs`, graphs) for: a batch of n runs in the
    smallest bucket >= n. None: 1, 2, 4, every multiple of 4 to 64, of 8 beyond, up to `max_running_requests`
    (`runner.default_buckets`: chosen on measured step times)."""
    tensor_parallel_size: int = 1
    """Ranks the target and drafter are split over (tensor parallelism, `dscale_runtime.distributed`): start that
    many processes with torchrun, each building the same engine and given the same requests; 1 = one process."""
    sampling_rule: str = "auto"
    """Acceptance rule of sampled requests (greedy requests always take the argmax): 'top1' (the paper's rule:
    top-1 drafts accepted with probability p(x); seeded output equals target-only sampling token for token),
    'sampled' (drafts sampled from the drafter's policy q, accepted with min(1, p/q): z-lab's reference rule)
    or 'auto' ('sampled' at temperatures >= `sampled_drafts_min_temperature`, else 'top1'). Both are exact."""
    sampled_drafts_min_temperature: float = 0.0
    """With sampling_rule='auto': the temperature from which requests use sampled drafts, below it the top-1
    rule. 0: every sampled request uses sampled drafts, which accepted more at every temperature and top_p
    measured on the demo pair's held-out prompts (T 0.3-1.0, top_p 0.8-1; `benchmarks/sampling_rules.py`,
    docs/benchmarks.md); raise it for a pair whose top-1 drafts win at low temperature."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"EngineConfig.mode must be one of {MODES}, got '{self.mode}'")
        if self.max_running_requests < 1:
            raise ValueError(f"EngineConfig.max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.page_size < 1:
            raise ValueError(f"EngineConfig.page_size must be >= 1, got {self.page_size}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"EngineConfig.block_size must be >= 2, got {self.block_size}")
        if not 0 < self.budget_ratio <= 1:
            raise ValueError(f"EngineConfig.budget_ratio must be in (0, 1], got {self.budget_ratio}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dscale_policy not in DSCALE_POLICIES:
            raise ValueError(f"EngineConfig.dscale_policy must be one of {DSCALE_POLICIES}, got '{self.dscale_policy}'")
        if self.full_width_max_batch < 0:
            raise ValueError(f"EngineConfig.full_width_max_batch must be >= 0, got {self.full_width_max_batch}")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES + ('auto',)}, got '{self.dtype}'")
        if self.draft_dtype is not None and self.draft_dtype not in DTYPES:
            raise ValueError(f"EngineConfig.draft_dtype must be None or one of {DTYPES}, got '{self.draft_dtype}'")
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"EngineConfig.sampling_rule must be one of {SAMPLING_RULES}, got '{self.sampling_rule}'")
        if not self.sampled_drafts_min_temperature >= 0:
            raise ValueError("EngineConfig.sampled_drafts_min_temperature must be >= 0, got "
                             f"{self.sampled_drafts_min_temperature}")
        if self.graph_buckets is not None:
            object.__setattr__(self, "graph_buckets", tuple(int(b) for b in self.graph_buckets))
            if not self.graph_buckets or min(self.graph_buckets) < 1 or max(self.graph_buckets) < self.max_running_requests:
                raise ValueError(f"EngineConfig.graph_buckets must be sizes >= 1 whose largest reaches "
                                 f"max_running_requests={self.max_running_requests}, got {self.graph_buckets}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"EngineConfig.memory_fraction must be in (0, 1] or None, got {self.memory_fraction}")
        if self.chunked_prefill_tokens < 0:
            raise ValueError(f"EngineConfig.chunked_prefill_tokens must be >= 0 (0 = off), got "
                             f"{self.chunked_prefill_tokens}")
        if self.prefill_buckets is not None:
            object.__setattr__(self, "prefill_buckets", tuple(sorted({int(b) for b in self.prefill_buckets})))
            if not self.prefill_buckets or min(self.prefill_buckets) < 1:
                raise ValueError(f"EngineConfig.prefill_buckets must be token counts >= 1, got {self.prefill_buckets}")
        if self.admission_group < 0:
            raise ValueError(f"EngineConfig.admission_group must be >= 1 (0 = by concurrency), got "
                             f"{self.admission_group}")
        if not self.prefill_stall_ratio >= 0:
            raise ValueError(f"EngineConfig.prefill_stall_ratio must be >= 0 (0 = off), got {self.prefill_stall_ratio}")
        if self.calibration_window < 16:
            raise ValueError(f"EngineConfig.calibration_window must be >= 16 request-steps, got {self.calibration_window}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"EngineConfig.kv_cache_tokens must be positive, got {self.kv_cache_tokens}")

    @property
    def admission(self) -> int:
        """The admission group the scheduler uses: `admission_group`, or by concurrency where it is 0."""
        if self.admission_group:
            return self.admission_group
        return max(1, self.max_running_requests // ADMISSION_PER_RUNNING) if self.mode != "target" else 1


ADMISSION_PER_RUNNING = 8
"""`EngineConfig.admission_group` 0: speculative engines admit in groups of max_running_requests // this."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options (the vLLM/OpenAI vocabulary)."""

    temperature: float = 1.0
    """0 means greedy decoding; otherwise logits are divided by it before top-k/top-p."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = -1
    """Keep the k most likely tokens (-1 or 0 = off)."""
    max_tokens: int = 16
    """Most tokens to generate."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one; the text ends before it."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (kept as the last token id, left out of the text)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""
    seed: int | None = None
    """Seed of this request's own random stream (reproducible sampling whatever the batch)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestStats:
    """What one request's decoding did."""

    num_steps: int = 0
    """Decode steps the request took part in (prefill excluded)."""
    accepted_lens: list[int] = field(default_factory=list)
    """Accepted draft count at each decode step (0..W-1; always 0 in target mode)."""
    verify_lens: list[int] = field(default_factory=list)
    """Verified slots k at each decode step (anchor included)."""

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per decode step: accepted drafts + the successor."""
        return 1.0 + sum(self.accepted_lens) / len(self.accepted_lens) if self.accepted_lens else 0.0


@dataclass
class RequestOutput:
    """The result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated token ids (a stop token id or EOS that ended the request is the last one)."""
    text: str | None
    """Detokenized output without special tokens, cut before a stop string (None without a tokenizer)."""
    finish_reason: str
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or max_model_len), 'abort', or 'error'
    (this request failed inside an engine step; the others went on)."""
    stats: RequestStats
    error: str | None = None
    """With finish_reason 'error': what failed (the log has the traceback under the request id)."""
