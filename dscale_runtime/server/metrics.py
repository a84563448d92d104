"""/metrics through `prometheus_client`: one registry per server, names in the vLLM / SGLang style.

Every series carries the label `model_name` (the served model name; prometheus_client escapes it). Counters
and gauges the engine or the server already keeps are read at scrape time by a collector; latency and
speculative-decoding distributions are histograms observed by the engine thread as requests and steps end.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0,
               960.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """The histograms (thread-safe; the engine thread observes them) and the scrape of everything else."""

    def __init__(self, server_state, model_name: str, block_size: int, max_running: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"labelnames": ("model_name",), "registry": self.registry}

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, buckets=buckets, **labels).labels(model_name)

        self.ttft = histogram("dscale_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.first_chunk = histogram("dscale_time_to_first_chunk_seconds",
                                     "Time from a streaming request's arrival to the server writing its first "
                                     "text chunk (the TTFT histogram's end is the engine thread's first token).",
                                     TTFT_BUCKETS)
        self.tpot = histogram("dscale_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (generated tokens - 1).", TPOT_BUCKETS)
        self.e2e = histogram("dscale_e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token.", E2E_BUCKETS)
        self.accept_length = AcceptLengthHistogram(
            "dscale_spec_accept_length_per_step",
            "Tokens one request gained in one decode step (accepted drafts + 1).", block_size, model_name)
        self.registry.register(self.accept_length)
        row_buckets, rows = [], 1
        while rows < block_size * max_running:
            row_buckets.append(float(rows))
            rows *= 2
        self.verify_rows = histogram("dscale_verify_rows_per_step",
                                     "Target verification rows of one decode step (M).",
                                     (*row_buckets, float(block_size * max_running)))
        self.step_seconds = histogram("dscale_step_seconds", "Wall time of engine steps that decoded.", STEP_BUCKETS)
        self.registry.register(_ScrapeCollector(server_state, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AcceptLengthHistogram:
    """A histogram of tokens gained per request per step (accepted drafts + 1, an integer in 1..block_size), one
    bucket per value, filled a whole step at a time: `add(accepted)` costs one list update per request, where a
    `prometheus_client` observe costs a lock and a bucket search each (26 us a step at 32 requests against 1.5 us, on
    the engine thread, and in the engine-process mode again where the HTTP process replays it). The exposition is
    `prometheus_client`'s for the same observations (`_count` is the buckets' total, so a scrape between two
    requests of one step still reads a consistent histogram)."""

    def __init__(self, name: str, doc: str, block_size: int, model_name: str) -> None:
        self.name, self.doc, self.model = name, doc, model_name
        self.counts = [0] * (block_size + 1)  # NOTE: counts[v]: request-steps that gained v tokens (v >= 1)
        self.sum = 0

    def add(self, accepted: list[int]) -> None:
        """One step's accepted draft counts, one per request (each gained that many + 1 tokens)."""
        counts = self.counts
        for a in accepted:
            counts[a + 1] += 1
        self.sum += sum(accepted) + len(accepted)

    def describe(self):
        return []

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        buckets, total = [], 0
        for value, count in enumerate(self.counts[1:], 1):
            total += count
            buckets.append((floatToGoString(float(value)), total))
        buckets.append(("+Inf", total))
        family.add_metric([self.model], buckets, float(self.sum))
        yield family


class _ScrapeCollector:
    """Counters and gauges read from the engine and the server state at each scrape."""

    def __init__(self, state, model_name: str) -> None:
        self.state = state
        self.model = model_name

    def describe(self):
        return []

    def collect(self):
        state, model = self.state, self.model
        engine, stats = state.engine, state.worker.stats
        c = engine.counters

        def counter(name: str, doc: str, value: float):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def gauge(name: str, doc: str, value: float):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield counter("dscale_requests_received", "Requests that reached the server queue or were refused there.",
                      state.requests_received)
        success = CounterMetricFamily("dscale_request_success", "Requests finished, by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(stats.finished.items()):
            success.add_metric([model, reason], n)
        yield success
        errors = CounterMetricFamily("dscale_http_errors", "Error answers, by HTTP status.",
                                     labels=["model_name", "status"])
        for status, n in sorted(state.http_errors.items()):
            errors.add_metric([model, str(status)], n)
        yield errors
        yield counter("dscale_prompt_tokens", "Prompt tokens of admitted requests.", stats.prompt_tokens)
        yield counter("dscale_generation_tokens", "Tokens generated.", c.generated_tokens)
        yield counter("dscale_decode_steps", "Decode steps of the engine.", c.steps)
        yield counter("dscale_request_steps", "Sum over decode steps of the requests decoded.", c.request_steps)
        yield counter("dscale_accepted_drafts", "Draft tokens accepted by verification.", c.accepted_drafts)
        yield counter("dscale_verify_rows", "Target verification rows (M summed over steps).", c.verify_rows)
        yield counter("dscale_engine_step_failures", "Engine steps that raised (their requests got a 500).",
                      stats.step_failures)
        yield gauge("dscale_num_requests_running", "Requests in the running batch.", engine.num_running)
        yield gauge("dscale_num_requests_waiting", "Requests in the engine queue (new or preempted).",
                    engine.num_waiting)
        yield gauge("dscale_num_requests_pending", "Requests the server holds (tokenizing, queued, running or "
                    "streaming).", state.num_pending)
        pages = engine.allocator.num_pages - 1
        yield gauge("dscale_kv_cache_usage_perc", "Share of KV-cache pages in use (0-1).",
                    (pages - engine.allocator.num_free) / pages if pages else 0.0)
        yield gauge("dscale_spec_accept_length", "Tokens gained per request per decode step since start "
                    "(accepted drafts + 1; NaN before the first step).",
                    1.0 + c.accepted_drafts / c.request_steps if c.request_steps else float("nan"))
        yield gauge("dscale_retention", "Drafts full-width verification accepts that DScale's prefixes keep "
                    "(NaN unless --measure-retention).",
                    c.retained_drafts / c.full_width_drafts if c.full_width_drafts else float("nan"))
        by_mode = CounterMetricFamily("dscale_decode_steps_by_step", "Decode steps by the step they ran (target, "
                                      "dflash or dscale: the policies' choices).", labels=["model_name", "step"])
        for mode, n in sorted(c.steps_by_mode.items()):
            by_mode.add_metric([model, mode], n)
        yield by_mode
        live = GaugeMetricFamily("dscale_live_accept_length", "Running mean of accepted drafts + 1 per request-step, "
                                 "per speculative step, for batches of the latest batch's kind (the live choice's "
                                 "estimate).",
                                 labels=["model_name", "step"])
        for mode, accepted in sorted(getattr(engine, "live_acceptance", {}).items()):
            live.add_metric([model, mode], 1.0 + accepted)
        yield live
        def by_bucket(name: str, doc: str, table: str):
            """A gauge per (bucket, step mode) of one of the live choice's cost tables on the engine."""
            family = GaugeMetricFamily(name, doc, labels=["model_name", "bucket", "step"])
            for (bucket, mode), ms in sorted(getattr(engine, table, {}).items()):
                family.add_metric([model, str(bucket), mode], ms)
            return family

        yield by_bucket("dscale_live_step_ms", "A bucket's decode step device time (ms), a running floor, per step mode "
                        "while serving (the live choice's costs; captured steps only).", "live_step_ms")
        yield by_bucket("dscale_live_host_ms", "The host's own work (ms), a running floor, per engine cycle that "
                        "launched a bucket's step of this mode (the cycle's wall time less its waits for the device); a "
                        "step costs the live choice at least this.", "host_ms")
        yield by_bucket("dscale_live_wall_ms", "The wall time (ms), a running floor, of an engine cycle that launched a "
                        "bucket's step of this mode, in that mode's own runs (device, host and the gaps between them); "
                        "a step costs the live choice at least this.", "wall_ms")
        cycle = getattr(engine, "cycle_ms", None)
        if cycle is not None:
            yield gauge("dscale_engine_cycle_ms", "Running mean of the wall time between engine steps while requests "
                        "decode, away from prefills (the prefill chunk bound's reference where above the device "
                        "step).", cycle)
        calibration = getattr(engine, "calibration", None)
        if calibration is not None:
            yield from _calibration_families(calibration.report(), model)
        cache = getattr(engine, "prefix_cache_stats", {})
        if cache:
            yield counter("dscale_prefix_cache_queries", "Prefix-cache lookups (one per admission).", cache["queries"])
            yield counter("dscale_prefix_cache_query_tokens", "Tokens looked up in the prefix cache.",
                          cache["query_tokens"])
            yield counter("dscale_prefix_cache_hit_tokens", "Looked-up tokens whose K/V the prefix cache held.",
                          cache["hit_tokens"])
            yield gauge("dscale_prefix_cache_hit_rate", "Hit tokens / looked-up tokens since start.", cache["hit_rate"])
        policy = getattr(engine, "step_policy", {})
        runs = GaugeMetricFamily("dscale_step_policy", "1 for the step each graph bucket runs (target, dflash or "
                                 "dscale; DScale's measured policy picks per bucket).",
                                 labels=["model_name", "bucket", "step"])
        timed = GaugeMetricFamily("dscale_step_policy_ms", "Greedy step time per bucket measured at start-up for "
                                  "DScale's policy (DScale engines with step graphs).",
                                  labels=["model_name", "bucket", "step"])
        for size, entry in policy.items():
            runs.add_metric([model, str(size), entry["mode"]], 1.0)
            for step in ("dflash", "dscale", "target"):
                if step in entry:
                    timed.add_metric([model, str(size), step], entry[step])
        yield runs
        yield timed


def _calibration_families(report: dict, model: str):
    """DScale's watch of its acceptance predictor (`dvl/calibration.py`): per draft position j, over the recent
    request-steps that verified j (a decayed window), predicted vs realised P(accepted >= j) and, at j = 1..3,
    the calibration error of the scores the steps used and of the raw predictor's."""
    families = {
        "predicted": GaugeMetricFamily("dscale_predictor_predicted_acceptance", "Mean P(accepted >= j) the DScale "
                                       "steps allocated by (live-calibrated when on), per draft position j, over "
                                       "recent request-steps that verified j.", labels=["model_name", "position"]),
        "predicted_raw": GaugeMetricFamily("dscale_predictor_raw_predicted_acceptance", "The same mean of the raw "
                                           "predictor's P(accepted >= j).", labels=["model_name", "position"]),
        "realised": GaugeMetricFamily("dscale_predictor_realised_acceptance", "Share of those request-steps that "
                                      "accepted j drafts or more.", labels=["model_name", "position"]),
        "weight": GaugeMetricFamily("dscale_predictor_watched_request_steps", "Request-steps in that decayed "
                                    "window (their weights' sum) per draft position.", labels=["model_name", "position"]),
        "error": GaugeMetricFamily("dscale_predictor_calibration_error", "Live calibration error (debiased ECE over "
                                   "10 bins) of the P(accepted >= j) the steps used, j = 1..3.",
                                   labels=["model_name", "position"]),
        "error_raw": GaugeMetricFamily("dscale_predictor_raw_calibration_error", "The same error of the raw "
                                       "predictor's scores.", labels=["model_name", "position"]),
    }
    for key, family in families.items():
        for j, value in enumerate(report[key], 1):
            family.add_metric([model, str(j)], value)
        yield family
    refreshes = CounterMetricFamily("dscale_predictor_calibration_refreshes", "Refreshes of the live calibration "
                                    "map (0 with --live-calibration off).", labels=["model_name"])
    refreshes.add_metric([model], report["refreshes"])
    yield refreshes
