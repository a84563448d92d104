"""The engine: the public API (`Engine.from_pretrained`, `add_request`, `step`, `generate`), scheduling,
prefill and commit.

One step: schedule -> prefill the admitted requests -> one decode step of the running batch through the step
runner (`runner.py`: draft, decide, verify, inject, on fixed buffers, captured on CUDA) -> commit on the host
(stop rules, lengths, observers). With `EngineConfig.overlap_schedule` (the default) the commit runs a step
behind: each call launches the next decode step first, its inputs (anchors, context lengths, DScale's context
features) advanced on the device from the previous step's verified results, then reads and commits the
previous step while the device runs; what a request produced after it finished is discarded, so the output is
the same token for token. Admission and preemption wait for the commit (the engine drains first). `mode="target"` is the runner's step with W = 1 and no drafter: the
reference every speculative mode must reproduce token for token under greedy decoding (and, with the top-1
rule, under seeded sampling).
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dscale_runtime.attention import build_metadata, host_to_device
from dscale_runtime.config import EngineConfig, RequestOutput, SamplingParams
from dscale_runtime.dvl.calibration import LiveCalibration
from dscale_runtime.dvl.features import FeatureSpec, context_features, drafter_feature_spec
from dscale_runtime.dvl.features import hidden_projection as seeded_projection
from dscale_runtime.dvl.predictor import AcceptancePredictor, load_predictor, pair_identity
from dscale_runtime.kv_cache import PageAllocator, PagedKVCache
from dscale_runtime.memory import RESERVE_FACTOR, kv_bytes_per_token, pool_tokens, transient_peak
from dscale_runtime.prefill import PrefillChunk, PrefillRunner, default_prefill_buckets
from dscale_runtime.prefix_cache import PrefixCachingAllocator
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.loader import load_drafter, load_target, load_tokenizer, read_eos_ids, resolve_dtype
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM
from dscale_runtime.runner import RULE_GREEDY, RULE_SAMPLED, RULE_TOP1, AsyncRead, StepKind, StepResult, StepRunner, \
    agreed_values
from dscale_runtime.sampling import split_seed
from dscale_runtime.scheduler import Request, Scheduler, Status
from dscale_runtime.stats import EngineCounters, StepStats, StepTrace, retained_drafts
from dscale_runtime.tokenizer_backend import rust_tokenizer

log = logging.getLogger("dscale.engine")

FALLBACK_PROBE = 16
"""With a live choice of steps, every this-many-th step runs a speculative step other than the best
(`Engine._mode_for`): DScale and DFlash both stay measured; a fallen-back bucket still speculates, PROBE_RUN steps
in a row every TARGET_PROBE-th step."""
ACCEPTANCE_WEIGHT = 0.05
"""Weight of each step in the running mean of live acceptance (about the last 20 steps)."""
PROBE_ACCEPTANCE_WEIGHT = 0.15
"""The weight of a probe's steps out of a fallen-back bucket (`Engine.acceptance_weight`): the estimate they correct
is as old as the fallback, and three of them move it ~40% of the way. At ACCEPTANCE_WEIGHT (14%) greedy runs on an
H100 whose acceptance had dipped took a third of their steps target-only (2026-12-06); at 0.3 a T = 1-like model
(`benchmarks/live_choice_sim.py`) flipped back to speculation on lucky probes often enough to cost it 1-2%."""
TARGET_PROBE = 8 * FALLBACK_PROBE
"""Where target-only steps are best, every this-many-th step speculates (PROBE_RUN steps in a row): acceptance
follows the traffic, so speculation's estimate must too. Each probe that finds target-only steps still best doubles
the bucket's period, up to TARGET_PROBE_MAX (`Engine._mode_for`)."""
TARGET_PROBE_MAX = 8 * TARGET_PROBE
"""The longest probe period of a fallen-back bucket: on the demo pair at T = 1 a probe (its DFlash steps, the
catch-up of the drafter context the target-only steps skipped, and a cycle without overlap) cost ~3% of the time
at concurrency 1 every 128 steps (an H100, 2026-12-06); every 1,024 steps a change of traffic is seen within
~0.3 s there. The period starts again from TARGET_PROBE once as many requests as the bucket holds have started:
acceptance varies from prompt to prompt (`benchmarks/live_choice_sim.py`, greedy-like drafts, 10 seeds: the worst
seed served 1.36x target-only without it, 1.50x with it; T = 1-like drafts lost ~1% to the extra probes)."""
TARGET_REFRESH = 8 * TARGET_PROBE
"""While speculation pays, every this-many-th step runs target-only steps (PROBE_RUN in a row) to keep their live
cost current. That cost follows only the batch and its sampling kind, not the traffic's acceptance, so few samples
do; each probe step serves ~1/3 of a greedy DFlash step's tokens on the demo pair (3 in 128 steps cost ~1.4% at
concurrency 1, 3 in 1,024 ~0.2%)."""
CHOICE_REFRESH = 8
"""Once every step of a (bucket, batch kind) has live estimates, the live choice's rates there are computed anew every
this-many steps and whenever a probe run starts or ends; in between its last best step stands (`Engine._mode_for`).
Computing them cost ~6-9 us of host work per step on a 2-core CPU; estimates that move by a twentieth of a sample
per step lose nothing in 8 steps."""
PROBE_RUN = 3
"""A probe into or out of target-only steps runs this many steps in a row: with the overlap schedule a cycle commits
the step before the one it launches, so only a probe's later cycles show its own host work (`host_ms`)."""
COST_DOWN_WEIGHT, COST_UP_WEIGHT = 0.3, 0.03
"""Weights of a sample below / above the live choice's current cost estimate of a (bucket, mode), device step time
(`live_step_ms`) and host work per cycle (`host_ms`) alike (`track_cost`): the estimates follow each cost's floor.
What lands on a step beside its own work only adds time (a step probed between another mode's steps: on an H100 at
T = 1, concurrency 1, the demo pair's target-only estimates read up to 0.35 ms of device time and 0.40-0.52 ms of
host work while probed between DFlash steps, against 0.25-0.29 and 0.28-0.30 in runs of target-only steps), and a
symmetric mean of such samples put the bucket back on DFlash steps (0.80x target-only's rate there) again and again.
A rise is at most COST_UP_WEIGHT of the estimate per sample: a served fallback on an H100 (T = 1, concurrency 1,
2026-12-06) read its target-only cycles at 0.233 ms, then at 0.535 after one stalled cycle (~10 ms: +0.03 x 10 ms),
and ran DFlash's dearer steps until probes brought the estimate back down."""
COST_SAMPLES, COST_PROBES = 6, 4
"""The live choice probes target-only steps (every FALLBACK_PROBE-th step, PROBE_RUN in a row) in a bucket where a
speculative step is best until its host work and wall time there have COST_SAMPLES samples: the first ones may come
from a cold or stalled cycle (an H100, demo pair, concurrency 8, T = 1: one probe's 0.45 ms per target-only cycle
against 0.29 in their own runs kept the fallback on DFlash steps at 0.73x target-only's rate). At most COST_PROBES
target-only probes of a bucket do so: where requests arrive every few steps most cycles hold a prefill and are no
sample (served at concurrency 32, probing until the samples came ran 13% of a greedy server's steps target-only)."""
CYCLE_WEIGHT = 0.1
"""Weight of each engine cycle in the running mean of the wall time between decode steps (`Engine.cycle_ms`)."""
CYCLE_REFERENCE_CAP = 8.0
"""The prefill chunk's reference (`Engine.stall_reference_ms`) is at most this many decode steps."""


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first of the stop strings it contains (all of it where none)."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def track_cost(estimates: dict, key, sample: float) -> None:
    """Update `estimates[key]`, a running estimate of a cost's floor: the first sample sets it, a later one moves it
    by COST_DOWN_WEIGHT of the difference where lower, COST_UP_WEIGHT of it where higher, but up by at most
    COST_UP_WEIGHT of the estimate itself (a real rise, e.g. sampled traffic's longer steps, is followed over ~25-30
    of the mode's samples; one stalled cycle is not a rise: see COST_UP_WEIGHT)."""
    old = estimates.get(key)
    if old is None:
        estimates[key] = sample
    elif sample < old:
        estimates[key] = old + COST_DOWN_WEIGHT * (sample - old)
    else:
        estimates[key] = old + COST_UP_WEIGHT * min(sample - old, old)


class Engine:
    def __init__(
        self,
        target: Qwen3ForCausalLM,
        drafter: DFlashDraftModel | None,
        config: EngineConfig,
        tokenizer=None,
        eos_token_ids: set[int] | None = None,
        keep_history: bool = False,
        predictor: AcceptancePredictor | None = None,
        hidden_projection: torch.Tensor | None = None,
        trace_features: bool = False,
    ) -> None:
        """`trace_features`: a DFlash engine whose step observers will read features (the trace collector) keeps
        what the v3 agreement columns read (the token ring); a DScale engine always does, other engines need not."""
        self.config = config
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else target.config.eos_token_id)
        self.device = torch.device(config.device)
        self.dtype = next(target.parameters()).dtype
        self.tensor_parallel = config.tensor_parallel_size > 1
        """Every rank runs this engine on the same requests and schedules alike without talking (SPMD), so what the
        scheduler reads must be equal on every rank: start-up measurements are agreed across the ranks
        (`agreed_values`), and times measured while serving (`cycle_ms`, `live_step_ms`, `host_ms`) are not read."""
        if config.mode == "target":
            self.block_size = 1
        else:
            if drafter is None:
                raise ValueError(f"EngineConfig.mode='{config.mode}' needs a drafter (pass drafter=PATH)")
            native = drafter.config.block_size
            self.block_size = config.block_size or native
            if self.block_size != native:
                raise ValueError(
                    f"EngineConfig.block_size={config.block_size} differs from the drafter's block_size {native}"
                )
        self.capture_layers = tuple(drafter.config.target_layer_ids) if drafter is not None and config.mode != "target" else ()
        self.predictor = predictor
        self.feature_spec = predictor.spec if predictor is not None else (
            drafter_feature_spec(drafter.config) if drafter is not None and config.mode != "target"
            else FeatureSpec(num_positions=self.block_size - 1))
        self.hidden_projection = hidden_projection
        if config.mode == "dscale":
            if predictor is None or hidden_projection is None:
                raise ValueError("EngineConfig.mode='dscale' needs an acceptance predictor: pass predictor=PATH "
                                 "(an artifact from dscale-train)")
            if predictor.spec.num_positions != self.block_size - 1:
                raise ValueError(f"the predictor scores {predictor.spec.num_positions} draft positions, the drafter "
                                 f"block has {self.block_size - 1}")
            self.predictor = predictor.to(self.device).eval()
            self.hidden_projection = hidden_projection.to(self.device)
        lookahead = self.block_size
        # NOTE: the overlap schedule launches a step before the previous one is committed: two blocks of room
        self.overlap_lookahead = 2 * self.block_size
        if config.kv_cache_tokens:
            cache_tokens = config.kv_cache_tokens
        elif config.memory_fraction is not None and self.device.type == "cuda":
            cache_tokens = self._pool_from_memory(config.max_model_len + lookahead)
        else:
            cache_tokens = config.max_running_requests * (
                config.max_model_len + (self.overlap_lookahead if config.overlap_schedule else lookahead))
        if cache_tokens < config.max_model_len + lookahead:
            raise ValueError(
                f"EngineConfig.kv_cache_tokens={cache_tokens} cannot hold one request of max_model_len "
                f"{config.max_model_len} plus a block of {lookahead}; raise kv_cache_tokens or lower max_model_len"
            )
        num_pages = -(-cache_tokens // config.page_size) + 1  # + the scratch page
        log.info("KV cache: %d tokens in %d pages of %d (%s)", (num_pages - 1) * config.page_size, num_pages - 1,
                 config.page_size, "kv_cache_tokens" if config.kv_cache_tokens else (
                     f"memory_fraction {config.memory_fraction}" if config.memory_fraction is not None
                     and self.device.type == "cuda" else "max_running_requests x max_model_len"))
        self.allocator = (PrefixCachingAllocator if config.prefix_caching else PageAllocator)(num_pages,
                                                                                            config.page_size)
        tc = target.config
        self.target_cache = PagedKVCache(tc.num_hidden_layers, num_pages, config.page_size, tc.num_key_value_heads,
                                         tc.head_dim, self.dtype, self.device)
        self.drafter_cache = None
        if self.capture_layers:
            dc = drafter.config.layers
            self.drafter_cache = PagedKVCache(dc.num_hidden_layers, num_pages, config.page_size,
                                              dc.num_key_value_heads, dc.head_dim, drafter.dtype, self.device)
            drafter.head_weight(target.lm_head.weight)  # NOTE: its LM-head copy (when dtypes differ) made now
        self.scheduler = Scheduler(self.allocator, config.max_running_requests, lookahead, config.admission)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.keep_history = keep_history
        self.last_step: StepStats | None = None
        self.step_observers: list = []
        """Callables receiving a `StepTrace` after every speculative decode step (features are computed only
        while at least one observer is registered, or in dscale mode)."""
        if self.hidden_projection is None and config.mode != "target":
            self.hidden_projection = seeded_projection(self.feature_spec, drafter.config.layers.hidden_size).to(
                self.device)
        self.runner = StepRunner(
            target, drafter if config.mode != "target" else None, self.target_cache.layers,
            self.drafter_cache.layers if self.drafter_cache is not None else None, mode=config.mode,
            block_size=self.block_size, max_batch=config.max_running_requests,
            max_pages=-(-(config.max_model_len + self.overlap_lookahead) // config.page_size), page_size=config.page_size,
            budget_ratio=config.budget_ratio, full_width_max_batch=config.full_width_max_batch,
            feature_spec=self.feature_spec, predictor=self.predictor, projection=self.hidden_projection,
            buckets=list(config.graph_buckets) if config.graph_buckets else None,
            use_graphs=config.step_graphs and self.device.type == "cuda", device=self.device,
            measured_policy=config.dscale_policy in ("measured", "live"),
            policy_context=min(1024, config.max_model_len // 2),
            target_fallback=config.target_fallback and not config.measure_retention,
            live_policy=config.dscale_policy == "live" and not config.measure_retention,
            calibration=config.mode == "dscale" and config.live_calibration,
            token_ring=config.mode == "dscale" or trace_features, traced=trace_features)
        self.calibration = LiveCalibration(self.block_size - 1, self.runner.calibration_knots is not None,
                                           config.calibration_window) if config.mode == "dscale" else None
        """DScale: the watch of the predictor's calibration over committed DScale steps, and its live map."""
        self.acceptance_by_traffic: dict[tuple[bool, bool], dict[str, float]] = {}
        """(sampled, filtered) of a batch -> running mean of accepted drafts per request-step, per speculative step
        ('dflash', 'dscale'), over the steps of batches of that kind (`live_acceptance`: the latest batch's)."""
        self._traffic: tuple[bool, bool] = (False, False)
        """(sampled, filtered) of the batch whose step was chosen last (`_decode`)."""
        self.live_step_ms: dict[tuple[int, str], float] = {}
        """(bucket, step mode) -> its steps' device time (ms) while serving, a running estimate of its floor
        (`track_cost`): the actual batch's kinds (sampled ones cost more than the greedy steps timed at start-up) at
        its actual context lengths."""
        self.time_live_steps = self.runner.use_graphs and not self.tensor_parallel
        """Whether committed steps update `live_step_ms` (captured steps: their start-up times exist to start from)."""
        self.host_ms: dict[tuple[int, str], float] = {}
        """(bucket, step mode) -> the host's own work (ms) per engine cycle that launched such a step, a running
        estimate of its floor (`track_cost`): the cycle's wall time less the time it waited for the device. With
        the overlap schedule a step costs the loop about max(device time, host time), so the live choice compares
        that (`step_costs`): in a host-bound loop (a server streaming every token) speculation's extra device time
        hides behind the host's."""
        self.wall_ms: dict[tuple[int, str], float] = {}
        """(bucket, step mode) -> the wall time (ms) of an engine cycle that launched such a step, a running estimate
        of its floor (`track_cost`), from the cycles `host_ms` reads: what a step of that mode costs the loop in its
        own runs, device time, host work and the gaps between them together (the live choice's cost is at least
        this, `step_costs`). On an H100 at T = 1, in the tail buckets of a concurrency-8 demo-pair run, DFlash's
        device floor read 0.49 ms and its host work 0.28 ms while its steps cost the loop ~0.64 ms, and the choice
        ran DFlash in a third of its steps where target-only steps served ~1.3x its rate (2026-12-06)."""
        self.time_host = self.time_live_steps and self.device.type == "cuda"
        """Whether cycles update `host_ms` and `wall_ms` (captured CUDA steps, whose device times are measured
        apart)."""
        self.cost_samples: dict[tuple[int, str], int] = {}
        """(bucket, step mode) -> how many cycles `host_ms` and `wall_ms` have taken there (COST_SAMPLES)."""
        self._target_probes: dict[int, int] = {}
        """bucket -> target-only probes run there out of a speculative best step (COST_PROBES)."""
        self._live_steps = 0
        self._probe_run: tuple[str, int] | None = None
        """The probed step and how many more steps in a row it runs (PROBE_RUN in all)."""
        self._last_run: dict[str, int] = {}
        """Step mode -> `_live_steps` when it last ran (the live choice probes the one run least recently)."""
        self._best: dict[tuple[int, tuple[bool, bool]], tuple[str, int]] = {}
        """(bucket, batch kind) -> the live choice's best step and the `_live_steps` it was computed at."""
        self._target_period: dict[tuple[int, tuple[bool, bool]], tuple[int, int]] = {}
        """(bucket, batch kind) -> its probe period while target-only steps are best there (TARGET_PROBE, doubled per
        probe) and `_admitted` when it was set: once as many requests as the bucket holds have started since, the
        traffic is new and the period starts again from TARGET_PROBE (acceptance varies from prompt to prompt)."""
        self._admitted = 0
        """Requests whose prompt has been prefilled (their first decode step follows)."""
        if self.runner.use_graphs:
            self.runner.prepare(self._serving_kinds())
            if self.runner.bucket_modes:
                log.info("DScale policy (measured step ms per bucket): %s", self.step_policy)
        captured_prefill = self.runner.use_graphs and config.prefill_graphs
        largest = min(config.chunked_prefill_tokens or 8192, config.max_model_len)
        self.prefiller = PrefillRunner(
            target, drafter if self.capture_layers else None, self.target_cache.layers,
            self.drafter_cache.layers if self.drafter_cache is not None else None, self.runner.state,
            capture_layers=self.capture_layers, max_requests=config.max_running_requests,
            max_pages=self.runner.max_pages, page_size=config.page_size,
            buckets=list(config.prefill_buckets or default_prefill_buckets(largest)),
            pad=captured_prefill or config.prefill_buckets is not None, use_graphs=captured_prefill,
            device=self.device, pool=self.runner.pool)
        self.decode_ms: dict[int, float] = {}
        """Measured greedy decode step (ms) of each bucket's served step, for the prefill chunk budget."""
        if captured_prefill:  # NOTE: nothing holds a page yet: the bucket timings may write every pool page
            self.prefiller.prepare(free_pages=self.allocator.num_pages - 1)
            self.decode_ms = self._time_decode_steps()
            if self.tensor_parallel:
                self._agree_chunk_timings()
            log.info("prefill ms per token bucket (one request's chunk, from 0 / after %d keys): %s; the full "
                     "buckets: %s; the variants between, from 0: %s", next(iter(self.prefiller.bucket_ms.values()))[2],
                     {b: (round(a, 3), round(c, 3)) for b, (a, c, _) in self.prefiller.bucket_ms.items()},
                     {b: (round(a, 3), round(c, 3)) for b, (a, c, _) in self.prefiller.many_ms.items()},
                     {r: {b: round(a, 3) for b, (a, _, _) in t.items()} for r, t in self.prefiller.group_ms.items()})
            # NOTE: with the prefill times, what sets the chunk budget beside decoding (`prefill_stall_ratio`)
            log.info("decode ms per bucket (the chunk budget's reference): %s",
                     {b: round(ms, 3) for b, ms in self.decode_ms.items()})
        self._pending: list = []  # launched steps not committed yet, oldest first: callables -> finished requests
        self._catch_up = False
        """Whether the next `step` commits every launched step first: a speculative step was due for a request whose
        drafter context target-only steps had skipped, and the tokens of those steps were not on the host yet."""
        self.cycle_ms: float | None = None
        """Running mean of the wall time (ms) from one `step` call to the next while requests decode, over the
        cycles with no prefill in them or in the two before (with the overlap schedule a chunk's device time
        shows two cycles later, in the wait for the step launched after it): what a decode step costs the loop
        that drives the engine (a server's streaming and HTTP work included), the chunk bound's reference where
        it exceeds the device step."""
        # [perf_counter at the last step call, bit i: prefilled i cycles before it, ms it waited for the device,
        #  (bucket, mode) of the decode step it launched, modes of the decode steps it committed]
        self._cycle: list | None = None
        self._texts_later = False
        """Whether finished requests' outputs leave their text to `generate` (`_set_texts`, one batch call)."""
        self._ids = itertools.count()
        self._generator = torch.Generator()
        self._generator.manual_seed(config.seed)

    # ------------------------------------------------------------------ construction
    def _agree_chunk_timings(self) -> None:
        """Tensor parallelism: the chunk budget's inputs (`decode_ms`, the prefill buckets' times) become the ranks'
        maxima, the same on every rank, so every rank cuts the same chunks."""
        decode = agreed_values(list(self.decode_ms.values()), self.device)
        self.decode_ms = dict(zip(self.decode_ms, decode))
        pre = self.prefiller

        def agreed(measured: dict) -> dict:
            times = agreed_values([t for short, long, _ in measured.values() for t in (short, long)], self.device)
            return {tokens: (times[2 * i], times[2 * i + 1], keys)
                    for i, (tokens, (_, _, keys)) in enumerate(measured.items())}

        pre.bucket_ms, pre.many_ms = agreed(pre.bucket_ms), agreed(pre.many_ms)
        pre.group_ms = {slots: agreed(pre.group_ms[slots]) for slots in sorted(pre.group_ms)}

    def _time_decode_steps(self, reps: int = 5) -> dict[int, float]:
        """The greedy decode step each bucket serves (`StepRunner.mode_for`), timed as the runner's measured
        policy does (every row live at `policy_context` tokens, all pages the scratch page): the chunk budget's
        reference (`prefill_stall_ratio`). A time the measured policy took on the served graph is reused; after the
        policy dropped its graphs (a DScale engine on DFlash steps only: its graphs carried the history and token
        ring), the served steps are timed here as a DFlash engine's are, so both engines bound chunks alike."""
        runner, times = self.runner, {}
        for size in runner.buckets:
            mode = runner.mode_for(size)
            known = runner.policy_ms.get(size, {}) if runner.policy_steps_served else {}
            if mode in known:
                times[size] = known[mode]
                continue
            times[size] = runner.get(size, StepKind(mode)).timed_ms(runner.timing_context, reps, warmup=1)
        return times


    def _kv_layout(self) -> list[tuple[int, int, int, torch.dtype]]:
        """(layers, kv heads, head dim, dtype) of the target's cache and, for speculative modes, the drafter's."""
        tc = self.target.config
        layout = [(tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim, self.dtype)]
        if self.capture_layers:
            dc = self.drafter.config.layers
            layout.append((dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, self.drafter.dtype))
        return layout

    def _pool_from_memory(self, min_tokens: int) -> int:
        """KV-pool tokens from `memory_fraction` (`dscale_runtime/memory.py`): the device's share less the
        weights already loaded and twice the transient peak of one largest-bucket decode step of the heaviest
        kind and one prefill chunk, both run eagerly on a small temporary cache."""
        config, device = self.config, self.device
        layout = self._kv_layout()
        n, ps = config.max_running_requests, config.page_size
        chunk = min(config.chunked_prefill_tokens or config.max_model_len, config.max_model_len)

        def work() -> None:
            pages = 2 + -(-chunk // ps)
            caches = [PagedKVCache(layers, pages, ps, heads, dim, dtype, device) for layers, heads, dim, dtype in layout]
            drafting = len(caches) > 1
            runner = StepRunner(
                self.target, self.drafter if drafting else None, caches[0].layers,
                caches[1].layers if drafting else None, mode=config.mode, block_size=self.block_size, max_batch=n,
                max_pages=2, page_size=ps, budget_ratio=config.budget_ratio, full_width_max_batch=0,
                feature_spec=self.feature_spec, predictor=self.predictor, projection=self.hidden_projection,
                buckets=[n], device=device)
            kind = StepKind(config.mode, sampled=True, filtered=True, draft_sampling=drafting)
            context = np.zeros((n, self.feature_spec.num_context), dtype=np.float32)
            runner.launch([0] * n, [1] * n, [[]] * n, [(1, 0, 50, RULE_SAMPLED if drafting else RULE_TOP1, 1.0, 0.9)] * n,
                          kind, context).result()  # NOTE: every row on the scratch page
            meta = build_metadata([chunk], [0], [list(range(1, pages))], ps, device, causal=True)
            tokens = torch.zeros(chunk, dtype=torch.long, device=device)
            _, features = self.target(tokens, meta, caches[0].layers, self._tensor([chunk - 1]), self.capture_layers)
            if features is not None:
                self.drafter.inject_context(features, meta.positions, meta.slot_mapping, caches[1].layers)

        with torch.no_grad():
            peak = transient_peak(device, work)
        free, total = torch.cuda.mem_get_info(device)
        tokens = pool_tokens(config.memory_fraction, total, torch.cuda.memory_allocated(device), int(RESERVE_FACTOR * peak),
                             kv_bytes_per_token(*layout), ps, min_tokens, free_bytes=free)
        if self.tensor_parallel:  # NOTE: one pool size on every rank (the smallest), so pages run out alike
            tokens = int(agreed_values([tokens], device, "min")[0])
        log.info("memory_fraction %.2f of %.1f GiB: %.2f GiB in use (weights), %.2f GiB transient peak, pool of %d "
                 "tokens%s", config.memory_fraction, total / 2**30, torch.cuda.memory_allocated(device) / 2**30,
                 peak / 2**30, tokens, " (the ranks' smallest)" if self.tensor_parallel else "")
        return tokens

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        drafter: str | Path | None = None,
        predictor: str | Path | None = None,
        config: EngineConfig | None = None,
        **kwargs,
    ) -> "Engine":
        """Load a Qwen3 target folder and (for speculative modes) a DFlash drafter folder."""
        config = config or EngineConfig()
        if predictor is not None and config.mode != "dscale":
            raise ValueError(f"a predictor is only used by mode='dscale' (EngineConfig.mode is '{config.mode}')")
        dtype = resolve_dtype(config.dtype) if config.dtype != "auto" else (
            torch.bfloat16 if torch.device(config.device).type == "cuda" else torch.float32)
        target_path = Path(target)
        tp = None
        if config.tensor_parallel_size > 1:  # NOTE: each rank loads its shards; every rank runs this engine
            from dscale_runtime.distributed import init_tensor_parallel

            tp = init_tensor_parallel(config.device, config.tensor_parallel_size)
        target_model = load_target(target_path, dtype, config.device, tp=tp)
        drafter_model = None
        if config.mode != "target":
            if drafter is None:
                raise ValueError(f"EngineConfig.mode='{config.mode}' needs a drafter checkpoint: pass drafter=PATH")
            draft_dtype = resolve_dtype(config.draft_dtype) if config.draft_dtype else dtype
            drafter_model = load_drafter(Path(drafter), target_model.config, draft_dtype, config.device, tp=tp)
        tokenizer = load_tokenizer(target_path)
        if config.mode == "dscale":
            if predictor is None:
                raise ValueError("EngineConfig.mode='dscale' needs predictor=PATH (an artifact from dscale-train)")
            identity = pair_identity(target_model.config, drafter_model.config)
            # NOTE: the drafter's own spec: its W - 1 draft slots (DFlash 2 may set W = 8), its feature version
            kwargs["predictor"], kwargs["hidden_projection"] = load_predictor(
                predictor, identity, drafter_feature_spec(drafter_model.config), device=config.device,
                drafter_folder=drafter)
        if torch.device(config.device).type == "cuda":  # NOTE: fewer, larger GEMMs; CPU keeps the plain layout
            target_model.fuse_projections()
            if drafter_model is not None:
                drafter_model.fuse_projections()
        return cls(target_model, drafter_model, config, tokenizer, read_eos_ids(target_path, tokenizer), **kwargs)

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer in the target folder; pass token ids instead")
            token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            token_ids = [int(t) for t in prompt]
        vocab = self.target.config.vocab_size
        if not token_ids:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens does not fit max_model_len={self.config.max_model_len} "
                "(it must leave room for at least one generated token)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer in the target folder; use stop_token_ids instead")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        request = Request(request_id, token_ids, params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**63 - 1, (), generator=self._generator))
        top_k = params.top_k if 0 < params.top_k < vocab else -1  # NOTE: k >= vocabulary keeps every token
        request.sampling = (*split_seed(seed % 2**64), top_k, self._rule(params), params.temperature or 1.0,
                            params.top_p)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()  # NOTE: launched steps of finished requests only commit nothing

    def generated_token_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Tokens an unfinished request has generated so far, from index `start` on (the streaming hook).

        Preemption keeps generated tokens, so the list only grows; a finished request's tokens come back in
        its `RequestOutput` from `step()`."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request with id '{request_id}'")
        return request.output_token_ids[start:]

    @property
    def step_policy(self) -> dict[int, dict]:
        """The step each bucket runs now (the measured policies with the live acceptance) and, where measured,
        its greedy step times in ms per mode."""
        return {size: {"mode": self._mode_for(size, probe=False), **self.runner.policy_ms.get(size, {})}
                for size in self.runner.buckets}

    @property
    def prefix_cache_stats(self) -> dict[str, float]:
        """Prefix caching: lookups, tokens looked up, tokens found cached, and their ratio (empty when off)."""
        return dict(self.allocator.stats) if isinstance(self.allocator, PrefixCachingAllocator) else {}

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (with the overlap schedule, those
        the commit of the previous decode step finished)."""
        finished: list[Request] = []
        self._time_cycle()
        decoding = [r for r in self.scheduler.running if not r.prefilling]
        if self._pending and (self._catch_up or not (decoding and self._overlapping()
                                                     and self.scheduler.reserve(decoding, self.overlap_lookahead))):
            finished += self._drain()
        self._catch_up = False
        if self._pending:
            # Overlap: launch the next step first, commit the previous ones while it runs, then admit and prefill.
            launched = len(self._pending)
            finished += self._isolated(self._decode, decoding)
            finished += self._drain(upto=launched)
            self.scheduler.admit()
            finished += self._prefill_chunks()
        else:
            _, scheduled = self.scheduler.schedule()
            finished += self._prefill_chunks()
            decoding = [r for r in scheduled if not r.prefilling]
            if decoding:
                finished += self._isolated(self._decode, decoding)
        if not self._overlapping():
            finished += self._drain()
        outputs = []
        for request in finished:
            self.requests.pop(request.request_id, None)
            outputs.append(self._output(request))
        if not (decoding and self.has_unfinished()):
            self._cycle = None  # NOTE: the time until the next call is not a decode cycle (idle, or no decoding)
        return outputs

    def _time_cycle(self) -> None:
        """At each `step` call: the wall time since the previous call, when that one decoded, work remained and
        neither it nor the two before prefilled, into `cycle_ms` (the first two cycles of a run count as
        prefilled: they follow its first admission); from the same cycles, less their waits for the device, the
        host's work per cycle of the (bucket, mode) launched (`host_ms`)."""
        now, last = time.perf_counter(), self._cycle
        if last is not None and not last[1]:
            sample = (now - last[0]) * 1e3
            self.cycle_ms = sample if self.cycle_ms is None else self.cycle_ms + CYCLE_WEIGHT * (sample - self.cycle_ms)
        # NOTE: host work is a mode's own only in a cycle that committed nothing but that mode's steps (a probe's
        # first cycle commits the step of the mode before it), and only away from prefills: a prefill's host work,
        # and a server's handling of a new request and its first token, are no decode step's (at concurrency 1 the
        # first decode cycle of every request held them, and a mode's estimate could start from one such sample)
        if (last is not None and not last[1] and last[3] is not None and self.time_host
                and last[4] <= {last[3][1]}):
            wall = (now - last[0]) * 1e3
            track_cost(self.host_ms, last[3], max(0.0, wall - last[2]))  # key (bucket, mode)
            track_cost(self.wall_ms, last[3], wall)
            self.cost_samples[last[3]] = self.cost_samples.get(last[3], 0) + 1
        self._cycle = [now, (last[1] << 1) & 0b110 if last is not None else 0b110, 0.0, None, set()]

    def _waited(self, ms: float) -> None:
        """Count host time spent waiting for the device in the current cycle (not host work)."""
        if self._cycle is not None:
            self._cycle[2] += ms

    def stall_reference_ms(self, decoding: int) -> float:
        """The decode step a prefill chunk beside `decoding` running requests is bounded against
        (`prefill_stall_ratio`): the bucket's measured device step, or the loop's live cycle (`cycle_ms`) where
        that is longer (a host-bound loop, e.g. a server streaming every token, where a chunk the device runs
        while the host works delays no step), at most CYCLE_REFERENCE_CAP device steps. Under tensor parallelism the
        device step alone (the cycle is each rank's own wall time; the ranks must cut the same chunks)."""
        device = self.decode_ms[self.runner.bucket(decoding)]
        if self.tensor_parallel:  # NOTE: the live cycle is this rank's own wall time: the ranks would cut apart
            return device
        return min(max(device, self.cycle_ms or 0.0), CYCLE_REFERENCE_CAP * device)

    def _prefill_chunks(self) -> list[Request]:
        """Prefill the running requests that still need it, in admission order, at most
        `chunked_prefill_tokens` tokens in all per step (a request's chunk goes on from its computed tokens:
        a cached prefix, earlier chunks), in prefills of at most the largest bucket's tokens (`_prefill_groups`)."""
        waiting = [r for r in self.scheduler.running if r.prefilling]
        if not waiting:
            return []
        budget = self.config.chunked_prefill_tokens or None
        largest = self.prefiller.buckets[-1] if self.prefiller.pad and self.prefiller.buckets else None
        decoding = len(self.scheduler.running) - len(waiting)
        if budget is not None and decoding and self.decode_ms and self.config.prefill_stall_ratio > 0:
            # NOTE: beside decoding, a chunk lasts at most stall_ratio x the decode step (measured at start-up)
            limit = self.config.prefill_stall_ratio * self.stall_reference_ms(decoding)
            budget = self.prefiller.budget(limit, budget, waiting[0].num_computed, requests=len(waiting))
        batch = []
        for request in waiting:
            remaining = len(request.prefill_token_ids) - request.num_computed
            # NOTE: with chunking, one request's chunk fits the largest bucket (the default buckets reach the budget
            # or max_model_len, so only given buckets cut it)
            request.prefill_chunk = remaining if budget is None else min(remaining, budget, largest or budget)
            batch.append(request)
            if budget is not None:
                budget -= request.prefill_chunk
                if budget <= 0:
                    break
        if not batch:
            return []
        if self._cycle is not None:
            self._cycle[1] |= 1
        finished = []
        for group in self._prefill_groups(batch, largest):
            finished += self._isolated(self._prefill, group)
        return finished

    @staticmethod
    def _prefill_groups(batch: list, largest: int | None, sizes: list[int] | None = None) -> list[list]:
        """The step's prefill batch (requests, their `prefill_chunk` tokens each, or items of `sizes` tokens: the
        drafter context's catch-up chunks) as consecutive groups of at most `largest` tokens each (one group without
        buckets): each group is one prefill in a bucket, captured on CUDA, where the whole batch above the largest
        bucket would run eagerly. (With max_model_len below the budget, requests admitted together exceeded it: the
        demo pair's target-only engine at c = 8, whose requests all finish on one step, ran 31 eager prefills of more
        than 1,024 tokens in a run on an H100.) A chunk above `largest` (chunking off) is a group of its own."""
        if largest is None:
            return [batch]
        groups, tokens = [[]], 0
        for item, size in zip(batch, sizes if sizes is not None else [r.prefill_chunk for r in batch]):
            if groups[-1] and tokens + size > largest:
                groups.append([])
                tokens = 0
            groups[-1].append(item)
            tokens += size
        return groups

    def _overlapping(self) -> bool:
        """Whether commits may run a step behind: the overlap schedule is on and no step observer waits for
        each step's trace."""
        return self.config.overlap_schedule and not self.step_observers

    def _drain(self, upto: int | None = None) -> list[Request]:
        """Commit the launched steps, oldest first (the first `upto` of them); returns the finished requests."""
        finished = []
        count = len(self._pending) if upto is None else upto
        for _ in range(count):
            finished += self._pending.pop(0)()
        return finished

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Decode every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate() takes a list of prompts; wrap a single prompt in a list")
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(self._encode_batch(prompts), per_prompt)]
        done: dict[str, RequestOutput] = {}
        # NOTE: texts are decoded together at the end (`_set_texts`), not one by one inside the steps
        self._texts_later = self.tokenizer is not None
        try:
            while len(done) < len(ids):
                for out in self.step():
                    done[out.request_id] = out
        finally:
            self._texts_later = False
        outputs = [done[i] for i in ids]
        if self.tokenizer is not None:
            self._set_texts(outputs, [(sp or SamplingParams()).stop for sp in per_prompt])
        return outputs

    def _encode_batch(self, prompts: Sequence[str | Sequence[int]]) -> list[str | Sequence[int]]:
        """The prompts with their strings tokenized in one batch call of the fast tokenizer's backend (its Rust
        threads: 64 demo prompts in ~2.3 ms instead of ~14.6 one by one on an H100 host, time the GPU idles before
        a batch's first prefill); the ids of `add_request`'s `tokenizer.encode(text, add_special_tokens=False)`
        (`rust_tokenizer`). Without such a tokenizer, or for one string, the strings stay for `add_request`."""
        where = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        backend = rust_tokenizer(self.tokenizer, encode=True) if self.tokenizer is not None and len(where) > 1 else None
        if backend is None:
            return list(prompts)
        encoded = backend.encode_batch([prompts[i] for i in where], add_special_tokens=False)
        out = list(prompts)
        for i, e in zip(where, encoded):
            out[i] = e.ids
        return out

    def _set_texts(self, outputs: list[RequestOutput], stops: list[Sequence[str]]) -> None:
        """Each output's text (`_output`'s: decoded without special tokens, cut before a stop string), the
        decoding in one batch call of the fast tokenizer's backend where it has one (`rust_tokenizer`: 64 outputs
        of 128 tokens in a fraction of the ~3.5 ms one by one on an H100 host)."""
        backend = rust_tokenizer(self.tokenizer)
        ids = [o.token_ids for o in outputs]
        texts = (backend.decode_batch(ids, skip_special_tokens=True) if backend is not None
                 else [self.tokenizer.decode(t, skip_special_tokens=True) for t in ids])
        for output, text, stop in zip(outputs, texts, stops):
            output.text = cut_at_stop(text, stop)

    # ------------------------------------------------------------------ step internals
    def _isolated(self, part, requests: list[Request]) -> list[Request]:
        """`part(requests)` (prefill or decode); when it raises, the batch is split until the requests that
        fail alone are found: each of those finishes with finish_reason 'error', the others go on (a request
        is never advanced twice: a part commits only after its device work, and a failing commit fails its
        request alone, `_commit_or_fail`). Returns the finished ones."""
        try:
            return part(requests)
        except Exception as exc:  # noqa: BLE001 - attributed to requests below, never swallowed silently
            if len(requests) == 1:
                request = requests[0]
                log.exception("request %s failed in %s; it is aborted alone", request.request_id, part.__name__)
                request.error = f"{type(exc).__name__} in the engine's {part.__name__.strip('_')}"
                self.scheduler.finish(request, "error")
                return [request]
        half = len(requests) // 2
        return self._isolated(part, requests[:half]) + self._isolated(part, requests[half:])

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return host_to_device(values, self.device, dtype)

    def _rule(self, params: SamplingParams) -> int:
        """The acceptance rule of a request (`EngineConfig.sampling_rule`; DESIGN 3.5)."""
        if params.greedy:
            return RULE_GREEDY
        rule = self.config.sampling_rule
        if rule == "auto":
            rule = "sampled" if params.temperature >= self.config.sampled_drafts_min_temperature else "top1"
        return RULE_SAMPLED if rule == "sampled" and self.config.mode != "target" else RULE_TOP1

    def _serving_kinds(self) -> list[StepKind]:
        """The step kinds captured at start-up: greedy, and sampled with and without filters (with sampled
        drafts where the configured rule can pick them)."""
        mode = self.config.mode
        rules = {"top1": (False,), "sampled": (True,), "auto": (False, True)}[self.config.sampling_rule]
        kinds = [StepKind(mode)]
        for filtered in (False, True):
            for drafts in (rules if mode != "target" else (False,)):
                kinds.append(StepKind(mode, sampled=True, filtered=filtered, draft_sampling=drafts))
        return kinds

    @property
    def live_acceptance(self) -> dict[str, float]:
        """Step mode -> running mean of its accepted drafts per request-step, for batches of the latest batch's kind
        (greedy, sampled, sampled with top-k / top-p filters: acceptance follows the sampling far more than the
        prompts, so traffic that changes kind is judged at once by what that kind accepted before)."""
        return self.acceptance_by_traffic.setdefault(self._traffic, {})

    @staticmethod
    def _traffic_of(requests: list[Request]) -> tuple[bool, bool]:
        """(sampled, filtered) of a batch: any sampled request, any sampled one with top-k or top-p."""
        rules = [r.sampling[3] for r in requests]
        sampled = any(rule != RULE_GREEDY for rule in rules)
        filtered = any(rule != RULE_GREEDY and (r.sampling[2] > 0 or r.sampling[5] < 1)
                       for rule, r in zip(rules, requests))
        return sampled, filtered

    def _step_kind(self, requests: list[Request], mode: str, traffic: tuple[bool, bool] | None = None) -> StepKind:
        """The kind of this batch's step: decided on the host from the requests' sampling parameters (`traffic`:
        their `_traffic_of`, where the caller has it)."""
        sampled, filtered = traffic if traffic is not None else self._traffic_of(requests)
        rules = [r.sampling[3] for r in requests]
        traced = bool(self.step_observers) and mode != "target"
        return StepKind(mode, sampled=sampled, filtered=filtered,
                        draft_sampling=mode != "target" and RULE_SAMPLED in rules, features=traced,
                        retention=self.config.measure_retention and mode == "dscale")

    def _prefill(self, requests: list[Request]) -> list[Request]:
        """Prefill each request's next `prefill_chunk` tokens (its prompt, or after a preemption every token but
        the pending anchor) after its computed ones, through the prefill runner (a captured token bucket on
        CUDA). A fresh request whose prompt is done gets its first token drawn on the device, where the next
        decode step reads it; the host commits it later (`_drain`)."""
        chunks = []
        for request in requests:
            start, ids = request.num_computed, request.prefill_token_ids  # NOTE: a copy per read after preemption
            tokens = ids[start : start + request.prefill_chunk]
            done = not request.output_token_ids and start + len(tokens) == len(request.prompt_token_ids)
            chunk = PrefillChunk(tokens, start, request.pages, request.slot if done else None, request.sampling,
                                 len(request.prompt_token_ids))
            if self.runner.token_ring and start + len(tokens) == len(ids):  # NOTE: the v3 features' ring starts here
                chunk.tail_slot, chunk.tail_end = request.slot, len(ids)
                chunk.tail = ids[max(0, len(ids) - self.runner.token_ring) :]
            chunks.append(chunk)
        first = self.prefiller.run(chunks)
        self.counters.prefill_tokens += sum(len(c.tokens) for c in chunks)
        for request, chunk in zip(requests, chunks):
            request.num_computed += len(chunk.tokens)
            self.scheduler.register(request)  # NOTE: its full pages are final once this forward has run
        done = [i for i, c in enumerate(chunks) if c.slot is not None]
        if not done:
            return []
        self._admitted += len(done)
        fresh = [requests[i] for i in done]
        read = AsyncRead(first)
        for request in fresh:
            request.ahead += 1

        def commit() -> list[Request]:
            finished = []
            tokens = read.get().tolist()
            self._waited(read.waited_ms)
            for request, i in zip(fresh, done):
                request.ahead -= 1
                if request.status is Status.RUNNING and self._commit_or_fail(request, [tokens[i]]):
                    finished.append(request)
            return finished

        self._pending.append(commit)
        return []

    def _catch_up_context(self, requests: list[Request]) -> None:
        """Write the drafter context that target-only steps skipped (`StepRunner.defer_context`), from each request's
        `context_from` up to its computed tokens, before its next speculative step reads it: the target forward
        over those tokens through the prefill runner (captured token buckets on CUDA), which captures the layers the
        drafter reads and injects them, and rewrites the target's K/V there with what it holds (the same tokens at
        the same positions; its pages are the request's own: registered pages end before `context_from`). No token
        is drawn. Pieces of at most the largest bucket's tokens, one piece of a request per prefill, grouped as a step's
        prefill is (`_prefill_groups`; a decode batch never holds more requests than a prefill does)."""
        largest = self.prefiller.buckets[-1] if self.prefiller.pad and self.prefiller.buckets else None
        starts = [r.context_from for r in requests]
        while True:
            chunks = []
            for i, request in enumerate(requests):
                end = request.num_computed if largest is None else min(request.num_computed, starts[i] + largest)
                if starts[i] < end:
                    chunks.append(PrefillChunk(request.all_token_ids[starts[i] : end], starts[i], request.pages))
                    starts[i] = end
            if not chunks:
                break
            for group in self._prefill_groups(chunks, largest, [len(c.tokens) for c in chunks]):
                self.prefiller.run(group)
            self.counters.context_tokens += sum(len(c.tokens) for c in chunks)
        for request in requests:
            request.context_from = None

    def _mode_for(self, n: int, probe: bool = True) -> str:
        """The step a batch of n runs: the runner's (DScale's measured policy), or, among the steps the runner
        timed at start-up for the bucket (`StepRunner.live_modes`: DFlash and DScale with `dscale_policy`
        'live', the target-only step with `target_fallback`), the one with the most expected tokens per second:
        (1 + live accepted drafts per request-step) / step cost, 1 / step cost for target-only, the costs being
        the steps' live device times where they have run (`step_costs`). Every
        `FALLBACK_PROBE`-th step runs the speculative step other than the best that ran least recently (one
        never run, as soon as the first has an estimate), so every estimate follows the traffic; where the best
        is target-only, every `TARGET_PROBE`-th step, for `PROBE_RUN` steps in a row, so that the later cycles of the
        run show the speculative step's own host work (and the probes, slower than target-only steps there, take
        ~5% of the time at concurrency 1 on the demo pair at T = 1, rather than the 13% of one step in 16); each
        probe after which target-only steps stay best doubles the (bucket, batch kind)'s period, up to
        `TARGET_PROBE_MAX`. Acceptance is read for the batch's kind (`live_acceptance`). With live times a
        target-only step is probed too, once per bucket, then every `FALLBACK_PROBE`-th step until its cycles there
        have COST_SAMPLES samples (COST_PROBES probes at most), then every `TARGET_REFRESH`-th step, for `PROBE_RUN`
        steps in a row."""
        mode = self.runner.mode_for(n)
        modes = self.runner.live_modes(n) if not self.step_observers else [mode]
        if len(modes) < 2:
            return mode
        bucket = self.runner.bucket(n)
        key = (bucket, self._traffic)
        if probe and self._probe_run is not None:
            probed, left = self._probe_run
            self._probe_run = (probed, left - 1) if left > 1 else None
            if left == 1:
                self._best.pop(key, None)  # NOTE: the run ends: its steps' estimates count at once
            if probed in modes:
                self._live_steps += 1
                self._last_run[probed] = self._live_steps
                return probed
        acceptance = self.live_acceptance
        known = mode == "target" or mode in acceptance
        cached = self._best.get(key) if probe else None
        if cached is not None and 0 <= self._live_steps - cached[1] < CHOICE_REFRESH:
            best = cached[0]
        else:
            times = self.step_costs(bucket, modes)
            rates = {m: (1 + acceptance[m] if m != "target" else 1) / times[m]
                     for m in modes if m == "target" or m in acceptance}
            best = max(rates, key=lambda m: (rates[m], m == mode)) if known else mode
            if probe and len(rates) == len(modes) and all((bucket, m) in self.live_step_ms for m in modes):
                # NOTE: only once every step has live estimates here: before, each new one may change the choice
                self._best[key] = (best, self._live_steps)
        if probe:
            self._live_steps += 1
            chosen = best
            others = [m for m in modes if m not in (best, "target")]
            unknown = [m for m in others if m not in acceptance]
            # NOTE: a target step gains one token: it is probed only for its live time, once per bucket (as soon as
            # the best step has one there) and then every TARGET_REFRESH-th step
            target_probe = self.time_live_steps and best != "target" and "target" in modes
            if unknown and known:  # NOTE: a step never measured runs once the first one has an estimate
                best = unknown[0]
            elif target_probe and (bucket, "target") not in self.live_step_ms and (bucket, best) in self.live_step_ms:
                best = "target"
            elif self._live_steps % FALLBACK_PROBE == 0:
                if target_probe and (self._live_steps % TARGET_REFRESH == 0 or (
                        self.time_host and self.cost_samples.get((bucket, "target"), 0) < COST_SAMPLES
                        and self._target_probes.get(bucket, 0) < COST_PROBES)):
                    others.append("target")
                entry = self._target_period.get(key)
                # NOTE: new traffic (as many requests started as the bucket holds) is probed as a fallback's start is
                period = TARGET_PROBE if entry is None or self._admitted - entry[1] >= bucket else entry[0]
                if others and (chosen != "target" or self._live_steps % period == 0):
                    best = min(others, key=lambda m: self._last_run.get(m, -1))
                    if chosen == "target":  # NOTE: back to TARGET_PROBE once a probe wins the bucket back
                        self._target_period[key] = (min(2 * period, TARGET_PROBE_MAX), self._admitted)
            if chosen != "target":
                self._target_period.pop(key, None)
            # NOTE: a probe that leaves or enters target-only steps runs PROBE_RUN steps: a cycle commits the step
            # before the one it launches, so only the run's later cycles are the probed step's own (`host_ms`)
            if best == "target" != chosen:
                self._target_probes[bucket] = self._target_probes.get(bucket, 0) + 1
            if best != chosen and "target" in (best, chosen) and PROBE_RUN > 1:
                self._probe_run = (best, PROBE_RUN - 1)
                self._best.pop(key, None)
            self._last_run[best] = self._live_steps
        return best

    def step_costs(self, bucket: int, modes: list[str]) -> dict[str, float]:
        """The cost (ms) of each step mode in `bucket` that the live choice compares: its live device time
        (`live_step_ms`) once it has run there, else its start-up time (`StepRunner.policy_ms`) scaled by the
        live / start-up ratio of the modes that have run in the bucket (1 before any has), so that start-up
        and live times compare on one scale; at least the host's own work per cycle of that mode (`host_ms`),
        which the overlap schedule cannot hide, and the wall time of such a cycle (`wall_ms`: device, host and
        the gaps between them), target-only's host work and wall time each at most the speculative modes' least."""
        # NOTE: plain floats and loops, no numpy and no dicts built per mode: this runs before every decode step, whose
        # host cycle at concurrency 8 is ~0.2 ms on the demo pair (np.mean made `_mode_for` ~15 us on a 2-core CPU;
        # comprehensions over dicts ~9 us, ~6 of them here, which cost a served fallback ~10% against the default with
        # the same steps: `benchmarks/serve_host_cpu.py --gpu-choice`)
        start, step_ms = self.runner.policy_ms[bucket], self.live_step_ms
        keys = [(bucket, m) for m in modes]
        cost = [step_ms.get(k) for k in keys]
        ratio, live = 0.0, 0
        for m, c in zip(modes, cost):
            if c is not None:
                ratio, live = ratio + c / start[m], live + 1
        scale = ratio / live if live else 1.0
        cost = [start[m] * scale if c is None else c for m, c in zip(modes, cost)]
        target = modes.index("target") if "target" in modes else -1
        for measured in (self.host_ms, self.wall_ms):
            floor = [measured.get(k) for k in keys]
            known = [f for f in floor if f is not None]
            if not known:
                continue
            if target >= 0 and floor[target] is not None and len(known) > 1:
                # NOTE: a target-only cycle does a part of a speculative one's work (one token per request to commit
                # and stream, no drafts, a shorter step): at most the speculative modes' least. Its samples come
                # mostly from probes between speculative steps, which read high (host work 0.40-0.52 ms against 0.28
                # in its own runs on an H100, T = 1, concurrency 1); an estimate that started from them would keep a
                # bucket speculating at any acceptance
                floor[target] = min(floor[target], min(f for i, f in enumerate(floor) if i != target and f is not None))
                known = [f for f in floor if f is not None]
            fallback = sum(known) / len(known)  # NOTE: a mode not measured yet: the measured ones' mean
            cost = [max(c, fallback if f is None else f) for c, f in zip(cost, floor)]
        cost = dict(zip(modes, cost))
        return cost

    def _decode(self, requests: list[Request]) -> list[Request]:
        """Launch one decode step of the running batch through the runner; its host commit is queued
        (`_drain`). A request with a launched, uncommitted step starts from the device state."""
        n = len(requests)
        self._traffic = traffic = self._traffic_of(requests)
        mode = self._mode_for(n)
        behind = [r for r in requests if r.context_from is not None] if mode != "target" else []
        if behind:
            if any(r.ahead for r in behind):
                # NOTE: the tokens of their launched target-only steps are not on the host yet: one more target-only
                # step, and the next `step` commits everything before it decodes (one cycle without overlap); a
                # probe keeps its PROBE_RUN speculative steps
                if self._probe_run is not None and self._probe_run[0] == mode:
                    self._probe_run = (mode, self._probe_run[1] + 1)
                mode, self._catch_up = "target", True
            else:
                self._catch_up_context(behind)
                if self._cycle is not None:
                    # NOTE: the next cycle waits for the catch-up's device time too: neither is a step's own cost
                    self._cycle[1] |= 0b010
        if mode == "target" and self.runner.defer_context:
            # NOTE: this step writes no drafter context; a request's computed count on the host is at most the
            # step's position (it counts the commits only), so the catch-up may rewrite a few positions, never miss one
            for request in requests:
                if request.context_from is None:
                    request.context_from = request.num_computed
        bucket = self.runner.bucket(n)
        weight = self.acceptance_weight(bucket, mode)
        if self._cycle is not None:
            self._cycle[3] = (bucket, mode)
        kind = self._step_kind(requests, mode, traffic)
        ctx = [r.num_computed for r in requests]
        decode_steps = [r.stats.num_steps for r in requests]
        host = [r.ahead == 0 for r in requests]
        context = None
        # DScale's decisions read the history; rows a step ahead of the host take theirs from the device state
        if (self.runner.state.history is not None and any(host)) or kind.features:
            context = context_features(self.feature_spec, n, ctx, decode_steps,
                                       [r.stats.accepted_lens for r in requests], "cpu").numpy()
        pending = self.runner.launch([r.last_token_id for r in requests], ctx, [r.pages for r in requests],
                                     [r.sampling for r in requests], kind, context, [r.slot for r in requests], host)
        # NOTE: the map this step read (the host replaces it, never changes it in place, on each refresh)
        knots = self.calibration.knots if self.calibration is not None and self.calibration.apply else None
        for request in requests:
            request.ahead += 1

        def commit() -> list[Request]:
            for request in requests:
                request.ahead -= 1
            result = pending.result()
            self._waited(result.waited_ms)
            return self._commit_step(requests, result, mode, kind, ctx, decode_steps, knots, (weight, traffic))

        self._pending.append(commit)
        return []

    def _commit_step(self, requests: list[Request], result: StepResult, mode: str, kind: StepKind,
                     ctx: list[int], decode_steps: list[int], knots: np.ndarray | None = None,
                     acceptance: tuple[float, tuple[bool, bool]] | None = None) -> list[Request]:
        """Commit one decode step's results. Rows of requests that finished after it was launched (their
        output ended in the step before, or an abort) commit nothing; the step's statistics count every row
        the device verified (the calibration's too: `knots` is the map the step ran with)."""
        if self.calibration is not None and result.conditionals is not None:
            if self.calibration.observe(result.conditionals, result.accepted, result.verify_lens, knots):
                self.runner.write_calibration(self.calibration.knots)
        full = result.full_accepted
        if self.config.measure_retention and self.config.mode == "dscale" and mode != "dscale":
            full = result.accepted  # a full-width step retains everything
        self._record(requests, result.accepted, result.verify_lens, result.num_rows, full)
        self.counters.steps_by_mode[mode] = self.counters.steps_by_mode.get(mode, 0) + 1
        if self._cycle is not None:
            self._cycle[4].add(mode)
        if self.time_live_steps and result.device_ms is not None and self.runner.policy_ms:
            track_cost(self.live_step_ms, (self.runner.bucket(len(requests)), mode), result.device_ms)
        if mode != "target" and result.accepted:
            self.observe_acceptance(mode, result.accepted, *(acceptance or ()))
        live = [i for i, r in enumerate(requests) if r.status is Status.RUNNING]
        finished = self._advance([requests[i] for i in live], [result.accepted[i] for i in live],
                                 [result.successors[i] for i in live], [result.drafts[i] for i in live],
                                 [result.verify_lens[i] for i in live])
        if self.step_observers and result.features is not None:
            trace = StepTrace([r.request_id for r in requests], decode_steps, ctx, len(requests), result.features,
                              result.accepted, result.verify_lens, result.drafts)
            for observer in self.step_observers:
                observer(trace)
        return finished

    def observe_acceptance(self, mode: str, accepted: list[int], weight: float = ACCEPTANCE_WEIGHT,
                           traffic: tuple[bool, bool] | None = None) -> None:
        """Fold one committed speculative step's accepted drafts per row into the running mean of its batch's kind
        (`traffic`, the latest batch's by default: `live_acceptance`)."""
        mean = sum(accepted) / len(accepted)
        estimates = self.live_acceptance if traffic is None else self.acceptance_by_traffic.setdefault(traffic, {})
        old = estimates.get(mode)
        estimates[mode] = mean if old is None else old + weight * (mean - old)

    def acceptance_weight(self, bucket: int, mode: str) -> float:
        """The weight of a speculative step of `mode` launched now in `bucket` in the live acceptance: a probe's out
        of a bucket where target-only steps are best (PROBE_ACCEPTANCE_WEIGHT), else ACCEPTANCE_WEIGHT."""
        fallen_back = (bucket, self._traffic) in self._target_period
        return PROBE_ACCEPTANCE_WEIGHT if mode != "target" and fallen_back else ACCEPTANCE_WEIGHT

    def _advance(self, requests: list[Request], accepted: list[int], successors: list[int],
                 drafts: list[list[int]], lens: list[int]) -> list[Request]:
        """Commit each request's accepted drafts and successor; returns the requests that finished."""
        finished = []
        for request, a, succ, block, k in zip(requests, accepted, successors, drafts, lens):
            request.num_computed += a + 1
            request.stats.num_steps += 1
            request.stats.accepted_lens.append(a)
            request.stats.verify_lens.append(k)
            if self._commit_or_fail(request, block[1 : a + 1] + [succ]):
                finished.append(request)
        return finished

    def _commit_or_fail(self, request: Request, new_tokens: list[int]) -> bool:
        """`_commit`, except that a failure there (a stop-string check, say) finishes this request alone."""
        try:
            return self._commit(request, new_tokens)
        except Exception as exc:  # noqa: BLE001 - the request ends with finish_reason 'error', logged
            log.exception("request %s failed while committing its tokens; it is aborted alone", request.request_id)
            request.error = f"{type(exc).__name__} while committing tokens"
            self.scheduler.finish(request, "error")
            return True

    def _record(self, requests: list[Request], accepted: list[int], lens: list[int], rows: int,
                full_accepted: list[int] | None = None) -> None:
        c = self.counters
        c.steps += 1
        c.request_steps += len(requests)
        c.accepted_drafts += sum(accepted)
        c.verify_rows += rows
        self.last_step = StepStats(c.steps, len(requests), [r.request_id for r in requests], accepted, lens, rows,
                                   full_accepted)
        if full_accepted is not None:
            c.full_width_drafts += sum(full_accepted)
            c.retained_drafts += retained_drafts(full_accepted, lens)
        if self.keep_history:
            c.history.append(self.last_step)

    # ------------------------------------------------------------------ commit and output
    def _commit(self, request: Request, new_tokens: list[int]) -> bool:
        """Append tokens under the stop rules; finishes the request and returns True when one fires."""
        p = request.params
        stop_ids = request.stop_ids
        if stop_ids is None:
            stop_ids = request.stop_ids = frozenset(p.stop_token_ids) | frozenset(() if p.ignore_eos
                                                                                 else self.eos_token_ids)
        if not p.stop:  # NOTE: the rules below, token by token, without a loop per token
            out = request.output_token_ids
            room = min(p.max_tokens - len(out), self.config.max_model_len - request.num_tokens)
            last = max(room, 1) - 1  # the token at which the length limit fires
            stop = next((i for i, token in enumerate(new_tokens) if token in stop_ids), None) if stop_ids else None
            end = min(len(new_tokens) - 1, last if stop is None else min(stop, last))
            out.extend(new_tokens[: end + 1])
            self.counters.generated_tokens += end + 1
            reason = "stop" if stop is not None and stop <= last else "length" if last <= end else None
            if reason:
                self.scheduler.finish(request, reason)
            return reason is not None
        reason = None
        for token in new_tokens:
            request.output_token_ids.append(token)
            self.counters.generated_tokens += 1
            if token in stop_ids:
                reason = "stop"
            elif p.stop and self._hits_stop_string(request):
                reason = "stop"
            elif len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= self.config.max_model_len:
                reason = "length"
            if reason:
                break
        if reason:
            self.scheduler.finish(request, reason)
        return reason is not None

    def _hits_stop_string(self, request: Request) -> bool:
        window = max(len(s) for s in request.params.stop) + 4
        tail = self.tokenizer.decode(request.output_token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in request.params.stop)

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None and not self._texts_later:
            text = cut_at_stop(self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True),
                               request.params.stop)
        return RequestOutput(request.request_id, request.prompt_token_ids, list(request.output_token_ids), text,
                             request.finish_reason or "abort", request.stats, request.error)
