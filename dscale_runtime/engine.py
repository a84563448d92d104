"""The engine: the public API (`Engine.from_pretrained`, `add_request`, `step`, `generate`) and the decode step.

One step: schedule -> prefill the admitted requests -> draft (N x W, one drafter forward) -> verify (one
target forward over the packed rows) -> accept -> commit on the host (stop rules, lengths) -> inject the
accepted rows' target features into the drafter cache. `mode="target"` is the same step with W = 1 and no
drafter: the reference every speculative mode must reproduce token for token under greedy decoding.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, RequestOutput, SamplingParams
from dscale_runtime.kv_cache import PageAllocator, PagedKVCache
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.loader import load_drafter, load_target, resolve_dtype
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM
from dscale_runtime.sampling import SamplingBatch, policy_probs, sample, uniforms
from dscale_runtime.scheduler import Request, Scheduler
from dscale_runtime.verify import accept_greedy, accept_sampling


@dataclass
class StepStats:
    """What one decode step did (the collector and the metrics read this)."""

    step: int
    num_live: int
    """Requests decoded in this step."""
    request_ids: list[str]
    accepted_lens: list[int]
    """Accepted draft count per request (before stop rules cut the output)."""
    verify_lens: list[int]
    """Verified slots per request, anchor included."""
    num_verify_rows: int
    """Rows of the verification forward (M)."""


@dataclass
class EngineCounters:
    """Running totals since the engine started."""

    steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    accepted_drafts: int = 0
    request_steps: int = 0
    verify_rows: int = 0
    history: list[StepStats] = field(default_factory=list)


def load_tokenizer(folder: Path):
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def read_eos_ids(folder: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class Engine:
    def __init__(
        self,
        target: Qwen3ForCausalLM,
        drafter: DFlashDraftModel | None,
        config: EngineConfig,
        tokenizer=None,
        eos_token_ids: set[int] | None = None,
        keep_history: bool = False,
    ) -> None:
        self.config = config
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else target.config.eos_token_id)
        self.device = torch.device(config.device)
        self.dtype = next(target.parameters()).dtype
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
        lookahead = self.block_size
        cache_tokens = config.kv_cache_tokens or config.max_running_requests * (config.max_model_len + lookahead)
        if cache_tokens < config.max_model_len + lookahead:
            raise ValueError(
                f"EngineConfig.kv_cache_tokens={cache_tokens} cannot hold one request of max_model_len "
                f"{config.max_model_len} plus a block of {lookahead}; raise kv_cache_tokens or lower max_model_len"
            )
        num_pages = -(-cache_tokens // config.page_size) + 1  # + the scratch page
        self.allocator = PageAllocator(num_pages, config.page_size)
        tc = target.config
        self.target_cache = PagedKVCache(tc.num_hidden_layers, num_pages, config.page_size, tc.num_key_value_heads,
                                         tc.head_dim, self.dtype, self.device)
        self.drafter_cache = None
        if self.capture_layers:
            dc = drafter.config.layers
            self.drafter_cache = PagedKVCache(dc.num_hidden_layers, num_pages, config.page_size,
                                              dc.num_key_value_heads, dc.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(self.allocator, config.max_running_requests, lookahead)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.keep_history = keep_history
        self.last_step: StepStats | None = None
        self._ids = itertools.count()
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(config.seed)

    # ------------------------------------------------------------------ construction
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
        if predictor is not None:
            raise ValueError("a predictor is only used by mode='dscale', which this engine version does not offer")
        dtype = resolve_dtype(config.dtype) if config.dtype != "auto" else (
            torch.bfloat16 if torch.device(config.device).type == "cuda" else torch.float32)
        target_path = Path(target)
        target_model = load_target(target_path, dtype, config.device)
        drafter_model = None
        if config.mode != "target":
            if drafter is None:
                raise ValueError(f"EngineConfig.mode='{config.mode}' needs a drafter checkpoint: pass drafter=PATH")
            drafter_model = load_drafter(Path(drafter), target_model.config, dtype, config.device)
        tokenizer = load_tokenizer(target_path)
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
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(params.seed)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        admitted, decoding = self.scheduler.schedule()
        finished: list[Request] = []
        if admitted:
            finished += self._prefill(admitted)
        if decoding:
            finished += self._decode(decoding)
        outputs = []
        for request in finished:
            self.requests.pop(request.request_id, None)
            outputs.append(self._output(request))
        return outputs

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Decode every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate() takes a list of prompts; wrap a single prompt in a list")
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ step internals
    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _sampling_batch(self, requests: list[Request], rows_per_request: list[int]) -> SamplingBatch:
        temps, top_k, top_p, gens = [], [], [], []
        for request, rows in zip(requests, rows_per_request):
            p = request.params
            temps += [p.temperature or 1.0] * rows
            top_k += [p.top_k] * rows
            top_p += [p.top_p] * rows
            gens += [request.generator] * rows
        return SamplingBatch(
            torch.tensor(temps, dtype=torch.float32, device=self.device),
            self._tensor(top_k),
            torch.tensor(top_p, dtype=torch.float32, device=self.device),
            gens,
        )

    def _first_tokens(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            rows = self._tensor(sampled)
            subset = [requests[i] for i in sampled]
            probs = policy_probs(logits[rows], self._sampling_batch(subset, [1] * len(subset)))
            tokens[rows] = sample(probs, [r.generator for r in subset], self._generator)
        return tokens.tolist()

    def _prefill(self, requests: list[Request]) -> list[Request]:
        query = [r.all_token_ids[: r.num_tokens - 1] if r.output_token_ids else r.prompt_token_ids for r in requests]
        lens = [len(q) for q in query]
        meta = build_metadata(lens, [0] * len(requests), [r.pages for r in requests], self.config.page_size,
                              self.device, causal=True)
        last_rows = self._tensor(list(itertools.accumulate(lens))) - 1
        token_ids = self._tensor([t for q in query for t in q])
        logits, features = self.target(token_ids, meta, self.target_cache.layers, last_rows, self.capture_layers)
        if features is not None:
            self.drafter.inject_context(features, meta.positions, meta.slot_mapping, self.drafter_cache.layers)
        self.counters.prefill_tokens += sum(lens)
        fresh = [i for i, r in enumerate(requests) if not r.output_token_ids]
        for request, n in zip(requests, lens):
            request.num_computed = n
        finished = []
        if fresh:
            first = self._first_tokens(logits[self._tensor(fresh)], [requests[i] for i in fresh])
            for i, token in zip(fresh, first):
                if self._commit(requests[i], [token]):
                    finished.append(requests[i])
        return finished

    def _draft(self, requests: list[Request], ctx: list[int]) -> torch.Tensor:
        """One drafter forward over N blocks -> draft tokens [N, W] (slot 0 = anchor)."""
        n, w = len(requests), self.block_size
        block = torch.full((n, w), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = self._tensor([r.all_token_ids[-1] for r in requests])
        meta = build_metadata([w] * n, ctx, [r.pages for r in requests], self.config.page_size, self.device,
                              causal=False)
        hidden = self.drafter(self.target.embed(block.view(-1)), meta, self.drafter_cache.layers)
        draft_logits = self.target.compute_logits(hidden.view(n, w, -1)[:, 1:])  # [N, W-1, V]
        block[:, 1:] = draft_logits.argmax(dim=-1)
        return block

    def _verify(self, logits: torch.Tensor, draft_tokens: torch.Tensor, verify_lens: torch.Tensor,
                verify_offsets: torch.Tensor, requests: list[Request], lens: list[int]):
        accepted, successor = accept_greedy(logits.argmax(dim=-1), draft_tokens, verify_lens, verify_offsets)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            batch = self._sampling_batch(requests, lens)
            probs = policy_probs(logits, batch)
            gens = [r.generator for r in requests]
            coins = uniforms(len(requests), draft_tokens.shape[1] - 1, gens, self._generator, self.device)
            s_acc, s_succ = accept_sampling(probs, draft_tokens, verify_lens, verify_offsets, coins,
                                            lambda p: sample(p, gens, self._generator))
            is_sampled = torch.zeros(len(requests), dtype=torch.bool, device=self.device)
            is_sampled[self._tensor(sampled)] = True
            accepted = torch.where(is_sampled, s_acc, accepted)
            successor = torch.where(is_sampled, s_succ, successor)
        return accepted, successor

    def _decode(self, requests: list[Request]) -> list[Request]:
        n, w = len(requests), self.block_size
        ctx = [r.num_computed for r in requests]
        if self.config.mode == "target":
            draft_tokens = self._tensor([[r.all_token_ids[-1]] for r in requests])
        else:
            draft_tokens = self._draft(requests, ctx)
        lens = [w] * n
        verify_lens = self._tensor(lens)
        verify_offsets = self._tensor([i * w for i in range(n)])
        meta = build_metadata(lens, ctx, [r.pages for r in requests], self.config.page_size, self.device,
                              causal=True)
        logits, features = self.target(draft_tokens.view(-1), meta, self.target_cache.layers, None,
                                       self.capture_layers)
        accepted, successor = self._verify(logits, draft_tokens, verify_lens, verify_offsets, requests, lens)
        accepted_l, successor_l, drafts_l = accepted.tolist(), successor.tolist(), draft_tokens.tolist()
        if features is not None:
            rows = self._tensor([o + j for o, a in zip(verify_offsets.tolist(), accepted_l) for j in range(a + 1)])
            self.drafter.inject_context(features[rows], meta.positions[rows], meta.slot_mapping[rows],
                                        self.drafter_cache.layers)
        finished = []
        for request, a, succ, drafts, k in zip(requests, accepted_l, successor_l, drafts_l, lens):
            request.num_computed += a + 1
            request.stats.num_steps += 1
            request.stats.accepted_lens.append(a)
            request.stats.verify_lens.append(k)
            if self._commit(request, drafts[1 : a + 1] + [succ]):
                finished.append(request)
        self._record(requests, accepted_l, lens, sum(lens))
        return finished

    def _record(self, requests: list[Request], accepted: list[int], lens: list[int], rows: int) -> None:
        c = self.counters
        c.steps += 1
        c.request_steps += len(requests)
        c.accepted_drafts += sum(accepted)
        c.verify_rows += rows
        self.last_step = StepStats(c.steps, len(requests), [r.request_id for r in requests], accepted, lens, rows)
        if self.keep_history:
            c.history.append(self.last_step)

    # ------------------------------------------------------------------ commit and output
    def _commit(self, request: Request, new_tokens: list[int]) -> bool:
        """Append tokens under the stop rules; finishes the request and returns True when one fires."""
        p = request.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
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
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in request.params.stop if s in text]
            if cuts:
                text = text[: min(cuts)]
        return RequestOutput(request.request_id, request.prompt_token_ids, list(request.output_token_ids), text,
                             request.finish_reason or "abort", request.stats)
