"""/metrics: the engine's and the server's counters in the Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import math


def _line(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> str:
    rows = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        text = "NaN" if isinstance(value, float) and math.isnan(value) else repr(float(value))
        rows.append(f"{name}{labels} {text}")
    return "\n".join(rows)


def render(worker, model: str, requests_received: int, http_errors: dict[int, int], num_pending: int) -> str:
    """One scrape; reads plain numbers the engine thread updates (no locking needed for a snapshot)."""
    engine, stats = worker.engine, worker.stats
    c = engine.counters
    label = f'{{model="{model}"}}'
    mean_accept = 1.0 + c.accepted_drafts / c.request_steps if c.request_steps else float("nan")
    retention = c.retained_drafts / c.full_width_drafts if c.full_width_drafts else float("nan")
    rows_per_step = c.verify_rows / c.steps if c.steps else float("nan")
    mean_step = stats.step_seconds / stats.steps if stats.steps else float("nan")
    pages = engine.allocator.num_pages - 1
    blocks = [
        _line("dscale_requests_received_total", "counter", "Requests that reached the engine queue or were refused.",
              [(label, requests_received)]),
        _line("dscale_requests_finished_total", "counter", "Requests finished, by reason.",
              [(f'{{model="{model}",finish_reason="{r}"}}', n) for r, n in sorted(stats.finished.items())]),
        _line("dscale_http_errors_total", "counter", "Error answers, by HTTP status.",
              [(f'{{model="{model}",status="{s}"}}', n) for s, n in sorted(http_errors.items())]),
        _line("dscale_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
              [(label, stats.prompt_tokens)]),
        _line("dscale_generation_tokens_total", "counter", "Tokens generated.", [(label, c.generated_tokens)]),
        _line("dscale_requests_running", "gauge", "Requests in the running batch.", [(label, engine.num_running)]),
        _line("dscale_requests_waiting", "gauge", "Requests in the engine queue (new or preempted).",
              [(label, engine.num_waiting)]),
        _line("dscale_requests_pending", "gauge", "Requests the server holds (queued, running or streaming).",
              [(label, num_pending)]),
        _line("dscale_decode_steps_total", "counter", "Decode steps of the engine.", [(label, c.steps)]),
        _line("dscale_request_steps_total", "counter", "Sum over decode steps of the requests decoded.",
              [(label, c.request_steps)]),
        _line("dscale_accepted_drafts_total", "counter", "Draft tokens accepted by verification.",
              [(label, c.accepted_drafts)]),
        _line("dscale_verify_rows_total", "counter", "Target verification rows (M summed over steps).",
              [(label, c.verify_rows)]),
        _line("dscale_mean_acceptance_length", "gauge",
              "Tokens gained per request per decode step since start (accepted drafts + 1).", [(label, mean_accept)]),
        _line("dscale_retention", "gauge", "Drafts full-width verification accepts that DScale's prefixes keep "
              "(NaN unless --measure-retention).", [(label, retention)]),
        _line("dscale_verify_rows_per_step", "gauge", "Mean verification rows per decode step since start.",
              [(label, rows_per_step)]),
        _line("dscale_step_seconds", "summary", "Wall time of engine steps that decoded.",
              [(f"_sum{label}", stats.step_seconds), (f"_count{label}", stats.steps)]),
        _line("dscale_step_seconds_mean", "gauge", "Mean wall time of a decode step since start.",
              [(label, mean_step)]),
        _line("dscale_last_step_seconds", "gauge", "Wall time of the latest decode step.",
              [(label, stats.last_step_seconds)]),
        _line("dscale_kv_cache_usage", "gauge", "Share of KV-cache pages in use.",
              [(label, (pages - engine.allocator.num_free) / pages if pages else 0.0)]),
    ]
    return "\n".join(blocks) + "\n"
