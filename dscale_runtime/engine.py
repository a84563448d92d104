"""The engine: the public API (`Engine.from_pretrained`, `add_request`, `step`, `generate`) and the decode step.

One step: schedule -> prefill the admitted requests -> draft (N x W, one drafter forward) -> verify (one
target forward over the packed rows) -> accept -> commit on the host (stop rules, lengths) -> inject the
accepted rows' target features into the drafter cache. `mode="target"` is the same step with W = 1 and no
drafter: the reference every speculative mode must reproduce token for token under greedy decoding.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Sequence

import torch

from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, RequestOutput, SamplingParams
from dscale_runtime.dvl.allocate import allocate, budget_rows
from dscale_runtime.dvl.features import FeatureSpec, acceptance_features, context_features, hidden_projection
from dscale_runtime.dvl.pack import flat_pack, packed_metadata
from dscale_runtime.dvl.predictor import AcceptancePredictor, load_predictor, pair_identity, seed_lengths
from dscale_runtime.kv_cache import PageAllocator, PagedKVCache
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.loader import load_drafter, load_target, load_tokenizer, read_eos_ids, resolve_dtype
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM
from dscale_runtime.sampling import SamplingBatch, policy_probs, sample, uniforms
from dscale_runtime.scheduler import Request, Scheduler
from dscale_runtime.stats import EngineCounters, StepStats, StepTrace, retained_drafts
from dscale_runtime.verify import accept_greedy, accept_sampling


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
        self.predictor = predictor
        self.feature_spec = predictor.spec if predictor is not None else FeatureSpec(num_positions=self.block_size - 1)
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
                                              dc.num_key_value_heads, dc.head_dim, drafter.dtype, self.device)
            drafter.head_weight(target.lm_head.weight)  # NOTE: its LM-head copy (when dtypes differ) made now
        self.scheduler = Scheduler(self.allocator, config.max_running_requests, lookahead)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.keep_history = keep_history
        self.last_step: StepStats | None = None
        self.step_observers: list = []
        """Callables receiving a `StepTrace` after every speculative decode step (features are computed only
        while at least one observer is registered, or in dscale mode)."""
        self.step_graphs = None  # fixed per-bucket decode steps (CUDA graphs on CUDA): EngineConfig.step_graphs
        if config.step_graphs and config.mode != "target":
            from dscale_runtime.step_graphs import StepGraphs

            if self.hidden_projection is None and config.mode == "dscale":
                self.hidden_projection = hidden_projection(self.feature_spec, drafter.config.layers.hidden_size).to(
                    self.device)
            self.step_graphs = StepGraphs(self)
            if self.step_graphs.use_graphs:
                self.step_graphs.prepare()
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
        if predictor is not None and config.mode != "dscale":
            raise ValueError(f"a predictor is only used by mode='dscale' (EngineConfig.mode is '{config.mode}')")
        dtype = resolve_dtype(config.dtype) if config.dtype != "auto" else (
            torch.bfloat16 if torch.device(config.device).type == "cuda" else torch.float32)
        target_path = Path(target)
        target_model = load_target(target_path, dtype, config.device)
        drafter_model = None
        if config.mode != "target":
            if drafter is None:
                raise ValueError(f"EngineConfig.mode='{config.mode}' needs a drafter checkpoint: pass drafter=PATH")
            draft_dtype = resolve_dtype(config.draft_dtype) if config.draft_dtype else dtype
            drafter_model = load_drafter(Path(drafter), target_model.config, draft_dtype, config.device)
        tokenizer = load_tokenizer(target_path)
        if config.mode == "dscale":
            if predictor is None:
                raise ValueError("EngineConfig.mode='dscale' needs predictor=PATH (an artifact from dscale-train)")
            identity = pair_identity(target_model.config, drafter_model.config)
            kwargs["predictor"], kwargs["hidden_projection"] = load_predictor(
                predictor, identity, device=config.device, drafter_folder=drafter)
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

    def generated_token_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Tokens an unfinished request has generated so far, from index `start` on (the streaming hook).

        Preemption keeps generated tokens, so the list only grows; a finished request's tokens come back in
        its `RequestOutput` from `step()`."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request with id '{request_id}'")
        return request.output_token_ids[start:]

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.scheduler.waiting)

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

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        """Per-request policy parameters (gather them per row with `.rows(row_req)`)."""
        ps = [r.params for r in requests]
        return SamplingBatch(
            torch.tensor([p.temperature or 1.0 for p in ps], dtype=torch.float32, device=self.device),
            self._tensor([p.top_k for p in ps]),
            torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=self.device),
            any(p.top_k > 0 or p.top_p < 1 for p in ps),
        )

    def _first_tokens(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            rows = self._tensor(sampled)
            subset = [requests[i] for i in sampled]
            probs = policy_probs(logits[rows], self._sampling_batch(subset))
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

    def _draft(self, requests: list[Request], block_meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafter forward over N blocks -> (draft tokens [N, W] with slot 0 = anchor,
        draft logits [N, W-1, V], drafter hidden states [N, W-1, d] at the draft positions).

        `block_meta` addresses the W slots after each request's context (the verification rows' own
        addresses); the drafter attends to them bidirectionally."""
        n, w = len(requests), self.block_size
        block = torch.full((n, w), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = self._tensor([r.last_token_id for r in requests])
        meta = dataclasses.replace(block_meta, causal=False)
        draft_logits, hidden = self.drafter.propose(block, self.target, meta, self.drafter_cache.layers)
        return block, draft_logits, hidden

    def _verify(self, logits: torch.Tensor, draft_tokens: torch.Tensor, verify_lens: torch.Tensor,
                verify_offsets: torch.Tensor, row_req: torch.Tensor, requests: list[Request]):
        """Accepted drafts [N] and successors [N] on the packed layout (row_req [M]: request of each row)."""
        accepted, successor = accept_greedy(logits.argmax(dim=-1), draft_tokens, verify_lens, verify_offsets)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            batch = self._sampling_batch(requests)
            probs = policy_probs(logits, batch.rows(row_req.clamp(max=len(requests) - 1)))
            gens = [r.generator for r in requests]
            coins = uniforms(len(requests), draft_tokens.shape[1] - 1, gens, self._generator, self.device)
            s_acc, s_succ = accept_sampling(probs, draft_tokens, verify_lens, verify_offsets, coins,
                                            lambda p: sample(p, gens, self._generator))
            is_sampled = torch.zeros(len(requests), dtype=torch.bool, device=self.device)
            is_sampled[self._tensor(sampled)] = True
            accepted = torch.where(is_sampled, s_acc, accepted)
            successor = torch.where(is_sampled, s_succ, successor)
        return accepted, successor

    def _features(self, requests: list[Request], ctx: list[int], draft_logits: torch.Tensor,
                  draft_hidden: torch.Tensor) -> torch.Tensor:
        """The shared acceptance features [N, spec.width] of this step's drafts."""
        if self.hidden_projection is None:
            self.hidden_projection = hidden_projection(self.feature_spec, draft_hidden.shape[-1]).to(self.device)
        context = context_features(self.feature_spec, len(requests), ctx, [r.stats.num_steps for r in requests],
                                   [r.stats.accepted_lens for r in requests], self.device)
        return acceptance_features(self.feature_spec, draft_logits, draft_hidden, self.hidden_projection, context)

    def _decide(self, features: torch.Tensor, num_live: int) -> tuple[torch.Tensor, int]:
        """DVL decision: predictor scores -> seeds -> Algorithm 1 -> verify lengths k [N] and M_live."""
        scores = self.predictor.scores(features)
        seeds = seed_lengths(scores, self.block_size)
        rows = budget_rows(num_live, self.block_size, self.config.budget_ratio)
        live = torch.ones(num_live, dtype=torch.bool, device=self.device)
        return allocate(scores, seeds, live, rows), rows

    def _decode(self, requests: list[Request]) -> list[Request]:
        n, w, mode = len(requests), self.block_size, self.config.mode
        if (self.step_graphs is not None and mode != "target" and not self.step_observers
                and not self.config.measure_retention and all(r.params.greedy for r in requests)):
            step_mode = self.step_graphs.mode_for(n)
            accepted_l, successor_l, lens_l, drafts_l, rows = self.step_graphs.run(requests, step_mode)
            finished = self._advance(requests, accepted_l, successor_l, drafts_l, lens_l)
            self._record(requests, accepted_l, lens_l, rows)
            return finished
        ctx = [r.num_computed for r in requests]
        full_meta = build_metadata([w] * n, ctx, [r.pages for r in requests], self.config.page_size, self.device,
                                   causal=True)
        if mode == "target":
            draft_tokens = self._tensor([[r.last_token_id] for r in requests])
        else:
            draft_tokens, draft_logits, draft_hidden = self._draft(requests, full_meta)
        full_accepted = None
        features_in = None
        decide = mode == "dscale" and n > self.config.full_width_max_batch
        if decide or (self.step_observers and mode != "target"):
            features_in = self._features(requests, ctx, draft_logits, draft_hidden)
        decode_steps = [r.stats.num_steps for r in requests]
        full_lens = self._tensor([w] * n)
        full_offsets = torch.arange(n, device=self.device) * w
        if decide:
            if self.config.measure_retention:
                # Full-width verification first, only to measure what DVL keeps (writes the same K/V values).
                logits, _ = self.target(draft_tokens.view(-1), full_meta, self.target_cache.layers)
                full_accepted, _ = accept_greedy(logits.argmax(-1), draft_tokens, full_lens, full_offsets)
            verify_lens, rows = self._decide(features_in, n)
            ctx_t = full_meta.kv_lens - w
            packed = flat_pack(verify_lens, draft_tokens, ctx_t, full_meta.block_tables, rows, self.config.page_size)
            meta = packed_metadata(packed, ctx_t, full_meta.block_tables, full_meta.max_kv, w)
            verify_offsets, token_ids, row_req = packed.verify_offsets, packed.token_ids, packed.row_req
        else:
            meta = full_meta
            verify_lens, verify_offsets = full_lens, full_offsets
            token_ids, row_req, rows = draft_tokens.view(-1), full_meta.row_req, n * w
        logits, features = self.target(token_ids, meta, self.target_cache.layers, None, self.capture_layers)
        accepted, successor = self._verify(logits, draft_tokens, verify_lens, verify_offsets, row_req, requests)
        if mode == "dscale" and not decide and self.config.measure_retention:
            full_accepted = accepted  # a full-width step retains everything
        # NOTE: the one device-to-host copy of the step: the commit needs lengths, successors and drafts.
        host = torch.cat([accepted, successor, verify_lens, verify_offsets, draft_tokens.reshape(-1)]
                         + ([full_accepted] if full_accepted is not None else [])).tolist()
        accepted_l, successor_l, lens_l, offsets_l = (host[i * n : (i + 1) * n] for i in range(4))
        drafts_l = [host[4 * n + i * w : 4 * n + (i + 1) * w] for i in range(n)]
        full_l = host[4 * n + n * w :] if full_accepted is not None else None
        if features is not None:
            inject = self._tensor([o + j for o, a in zip(offsets_l, accepted_l) for j in range(a + 1)])
            self.drafter.inject_context(features[inject], meta.positions[inject], meta.slot_mapping[inject],
                                        self.drafter_cache.layers)
        finished = self._advance(requests, accepted_l, successor_l, drafts_l, lens_l)
        self._record(requests, accepted_l, lens_l, rows, full_l)
        if self.step_observers and features_in is not None:
            trace = StepTrace([r.request_id for r in requests], decode_steps, ctx, n, features_in.float().cpu(),
                              accepted_l, lens_l)
            for observer in self.step_observers:
                observer(trace)
        return finished

    def _advance(self, requests: list[Request], accepted: list[int], successors: list[int],
                 drafts: list[list[int]], lens: list[int]) -> list[Request]:
        """Commit each request's accepted drafts and successor; returns the requests that finished."""
        finished = []
        for request, a, succ, block, k in zip(requests, accepted, successors, drafts, lens):
            request.num_computed += a + 1
            request.stats.num_steps += 1
            request.stats.accepted_lens.append(a)
            request.stats.verify_lens.append(k)
            if self._commit(request, block[1 : a + 1] + [succ]):
                finished.append(request)
        return finished

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
