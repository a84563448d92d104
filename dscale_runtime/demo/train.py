"""Training of the demo pair: a byte-level BPE tokenizer, a Qwen3 target, and a DFlash drafter.

The target is a transformers `Qwen3ForCausalLM` trained on the stdlib corpus (so its checkpoint is the
Hugging Face layout by construction). The drafter is our `DFlashDraftModel`, trained with the target
frozen to predict the target's own greedy continuations block-parallel: for an anchor at position p of a
greedy sequence, the context is the fused target features of positions < p, the block is
[x_p, mask x (W-1)] at positions p..p+W-1, and the labels are x_{p+1..p+W-1}. `draft_train_forward` is the
dense form of the drafter's paged inference forward (a test holds the two equal).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dscale_runtime.models.config import DFlash2Config, DFlashConfig, Qwen3Config
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.dflash2 import CandidateSelector, DFlash2DraftModel
from dscale_runtime.models.layers import apply_rope, rope_cos_sin

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


# ---------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, folder: Path, max_len: int):
    """Byte-level BPE with the end-of-text and DFlash mask special tokens; saved for AutoTokenizer."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                            show_progress=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
        "pad_token": EOS_TOKEN, "model_max_length": max_len, "clean_up_tokenization_spaces": False,
    }, indent=2))
    return tok


def encode_corpus(tok, texts: list[str]) -> np.ndarray:
    """Token ids of all texts, each followed by end-of-text (uint16 when the vocabulary allows)."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int32)


def random_windows(stream: np.ndarray, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen)
    return torch.stack([torch.from_numpy(stream[s : s + length].astype(np.int64)) for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------------- target
def make_target(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                max_positions: int, eos_id: int):
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM as HFModel

    cfg = HFConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                   max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=True,
                   eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id)
    return HFModel(cfg)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" or AUTOCAST_CPU)


AUTOCAST_CPU = False  # tests flip this to run the GPU's mixed-precision path on the CPU


def train_target(model, stream: np.ndarray, *, steps: int, batch: int, seq_len: int, lr: float, device: torch.device,
                 seed: int, log) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    curve, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        ids = random_windows(stream, batch, seq_len + 1, gen).to(device)
        with autocast(device):
            logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)})
            log(f"target step {step}/{steps} loss {loss.item():.3f}")
    return curve


@torch.no_grad()
def perplexity(model, stream: np.ndarray, *, seq_len: int, device: torch.device, max_windows: int = 256) -> float:
    """Held-out perplexity over consecutive non-overlapping windows."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    for start in range(0, n, 32):
        rows = [stream[(start + i) * seq_len : (start + i) * seq_len + seq_len + 1] for i in range(min(32, n - start))]
        ids = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with autocast(device):
            logits = model(ids[:, :-1]).logits
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += ids[:, 1:].numel()
    return math.exp(total / max(count, 1))


# ---------------------------------------------------------------------------------------------- drafter
def drafter_config(target: Qwen3Config, *, layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: tuple[int, ...], dflash2: DFlash2Config | None = None
                   ) -> tuple[DFlashConfig, dict]:
    """Our DFlashConfig and the z-lab style config.json dict describing the same drafter: DFlash 1, or DFlash 2
    (`DFlash2DraftModel`, its convolution and selector fields in `dflash_config`) when `dflash2` is given."""
    draft_layers = Qwen3Config(
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim, vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings, torch_dtype="bfloat16")
    architecture = "DFlashDraftModel" if dflash2 is None else "DFlash2DraftModel"
    cfg = DFlashConfig(draft_layers, block_size, mask_token_id, tuple(target_layer_ids), target.num_hidden_layers,
                       architecture=architecture, dflash2=dflash2)
    as_json = {
        "architectures": [architecture], "model_type": "qwen3", "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                          **(asdict(dflash2) if dflash2 is not None else {})},
        "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
        "num_hidden_layers": layers, "num_target_layers": target.num_hidden_layers,
        "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim, "vocab_size": target.vocab_size, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta, "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    return cfg, as_json


def init_drafter(cfg: DFlashConfig, seed: int) -> DFlashDraftModel:
    """A fresh drafter (DFlash 2 when `cfg.dflash2` is set). DFlash 2's additions start as no-ops, so training
    starts from a DFlash 1 drafter: every block convolution is the identity (base tap 1 at the slot itself, no
    dynamic taps), and the selector's bilinear term is zero (successor codebook 0, predecessor codebook 1), its
    scores the draft logits."""
    torch.manual_seed(seed)
    model = (DFlashDraftModel if cfg.dflash2 is None else DFlash2DraftModel)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0
            elif name.endswith(("kernel_projection.weight", "successor_codebook")):
                p.zero_()
            elif name.endswith("predecessor_codebook"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def draft_train_forward(
    drafter: DFlashDraftModel,
    embed: torch.nn.Embedding,
    features: torch.Tensor,  # [B, S, L_t * d] target layer outputs of the whole sequence
    tokens: torch.Tensor,  # [B, S]
    anchors: torch.Tensor,  # [B, nb] anchor positions (context = positions < anchor)
) -> torch.Tensor:  # [B, nb, W - 1, d] final-normed hidden states of the draft positions
    """Dense drafter forward over nb blocks per sequence, each attending to its own context and block. A DFlash 2
    drafter's layers also convolve each block's own rows around attention and around the MLP (the paged forward's
    `DFlash2DecoderLayer`); the context is never convolved."""
    cfg = drafter.config
    w, (b, s), nb = cfg.block_size, tokens.shape, anchors.shape[1]
    device = tokens.device
    attn0 = drafter.layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    fused = drafter.fuse_context(features)  # [B, S, d]
    block_pos = anchors[:, :, None] + torch.arange(w, device=device)  # [B, nb, W]
    block_tok = torch.full((b, nb, w), cfg.mask_token_id, dtype=torch.long, device=device)
    block_tok[:, :, 0] = tokens.gather(1, anchors)
    x = embed(block_tok).reshape(b, nb * w, -1).to(fused.dtype)
    if cfg.input_embedding_scale != 1.0:
        x = x * cfg.input_embedding_scale
    ctx_pos = torch.arange(s, device=device)
    sees_ctx = (ctx_pos[None, None, :] < anchors[:, :, None]).repeat_interleave(w, dim=1)  # [B, nb*W, S]
    block_id = torch.arange(nb, device=device).repeat_interleave(w)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)  # [B, nb*W, nb*W]
    mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]  # [B, 1, nb*W, S + nb*W]
    theta = cfg.layers.rope_theta
    cos_c, sin_c = rope_cos_sin(ctx_pos, head_dim, theta, fused.dtype)
    cos_b, sin_b = rope_cos_sin(block_pos.reshape(-1), head_dim, theta, fused.dtype)

    def rope(t, cos, sin):  # t [B, T, heads, D]; cos/sin [T, D] or [B*T, D]
        flat = t.reshape(-1, t.shape[2], t.shape[3])
        if cos.shape[0] != flat.shape[0]:
            cos, sin = cos.repeat(t.shape[0], 1), sin.repeat(t.shape[0], 1)
        return apply_rope(flat, cos, sin).view_as(t)

    def convolve(conv, rows):  # rows [B, nb*W, d] -> (convolved, the finish side's taps); `conv` None: as is
        if conv is None:
            return rows, None
        out, later = conv.prepare(rows.reshape(b * nb * w, -1), w)
        return out.view_as(rows), later

    def finish(conv, rows, later):
        return rows if conv is None else conv.finish(rows.reshape(b * nb * w, -1), later).view_as(rows)

    for layer in drafter.layers:
        a = layer.self_attn
        attention_conv, mlp_conv = getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)
        h, later = convolve(attention_conv, layer.input_layernorm(x))
        q = rope(a.q_norm(a.q_proj(h).view(b, nb * w, heads, head_dim)), cos_b, sin_b)
        k_ctx = rope(a.k_norm(a.k_proj(fused).view(b, s, kv_heads, head_dim)), cos_c, sin_c)
        k_blk = rope(a.k_norm(a.k_proj(h).view(b, nb * w, kv_heads, head_dim)), cos_b, sin_b)
        v = torch.cat([a.v_proj(fused).view(b, s, kv_heads, head_dim),
                       a.v_proj(h).view(b, nb * w, kv_heads, head_dim)], dim=1)
        k = torch.cat([k_ctx, k_blk], dim=1).to(v.dtype)
        q = q.to(v.dtype)  # NOTE: under autocast the norms return fp32 while v_proj returns bf16
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=a.scale, enable_gqa=heads != kv_heads)
        x = x + finish(attention_conv, a.o_proj(out.transpose(1, 2).reshape(b, nb * w, heads * head_dim)), later)
        h, later = convolve(mlp_conv, layer.post_attention_layernorm(x))
        x = x + finish(mlp_conv, layer.mlp(h), later)
    return drafter.norm(x).view(b, nb, w, -1)[:, :, 1:]


@torch.no_grad()
def target_features(hf_target, tokens: torch.Tensor, layer_ids: tuple[int, ...],
                    with_logits: bool = False) -> tuple[torch.Tensor, ...]:
    """(outputs of the target layers `layer_ids` [B, S, len(layer_ids) * d], greedy next tokens [B, S]
    [, next-token logits [B, S, V] when `with_logits`])."""
    out = hf_target(tokens, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return (feats, out.logits.argmax(-1), out.logits) if with_logits else (feats, out.logits.argmax(-1))


def _anchors(batch: int, count: int, low, high, gen: torch.Generator) -> torch.Tensor:
    """`count` distinct sorted anchor positions in [low, high] per row (ints, or tensors [batch] of per-row
    bounds; every row's range must hold `count` positions)."""
    low = torch.as_tensor(low).expand(batch).tolist()
    high = torch.as_tensor(high).expand(batch).tolist()
    picks = [torch.randperm(h - lo + 1, generator=gen)[:count] + lo for lo, h in zip(low, high)]
    return torch.stack(picks).sort(dim=1).values


def draft_slot_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None,
                    kl_weight: float) -> torch.Tensor:
    """Per draft slot [...]: (1 - kl_weight) x cross-entropy of `logits` [..., V] on `labels` [...] +
    kl_weight x KL(softmax(teacher_logits) || softmax(logits)) (teacher needed when kl_weight > 0)."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    if kl_weight == 0:
        return ce.view_as(labels)
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = F.kl_div(F.log_softmax(logits.float(), dim=-1), teacher, log_target=True, reduction="none").sum(-1)
    return (1 - kl_weight) * ce.view_as(labels) + kl_weight * kl


def selector_slot_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                       first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash 2's candidate selector, teacher-forced: per draft slot [..., P], the cross-entropy of the selector's
    scores over the slot's candidates on the label, and whether the selector would pick the label (the label is
    among the top k and scores best).

    The candidates are the top `selector.top_k` of the (scaled) draft `logits` [..., P, V], with the label put in
    place of the last one where the top k lack it; a slot's predecessor is the label before it (`first` [...], the
    anchor, before slot 1): the token the walk has chosen there whenever the path so far is accepted, which is
    when the slot's choice matters. Scores as `CandidateSelector.walk`: logit + <pred[prev] * proj(h), succ[c]>."""
    k = selector.top_k
    top = logits.detach().topk(k, dim=-1).indices  # [..., P, K]
    present = (top == labels[..., None]).any(-1, keepdim=True)
    candidates = torch.where(present, top, torch.cat([top[..., :-1], labels[..., None]], dim=-1))
    target = (candidates == labels[..., None]).long().argmax(-1)  # [..., P] the label's index
    prev = torch.cat([first[..., None], labels[..., :-1]], dim=-1)  # [..., P]
    left = selector.predecessor_codebook[prev] * selector.hidden_projection(hidden)  # [..., P, r]
    right = selector.successor_codebook[candidates]  # [..., P, K, r]
    scores = logits.gather(-1, candidates) + (right @ left[..., None])[..., 0].float()
    loss = F.cross_entropy(scores.reshape(-1, k), target.reshape(-1), reduction="none").view_as(labels)
    return loss, (scores.argmax(-1) == target) & present[..., 0]


def train_drafter(drafter: DFlashDraftModel, hf_target, sequences: torch.Tensor, corpus: np.ndarray, *,
                  prompt_lens: torch.Tensor, new_tokens: int, steps: int, batch: int, blocks_per_seq: int,
                  lr: float, device: torch.device, seed: int, log, decay: float = 7.0,
                  kl_weight: float = 0.0, selector_weight: float = 1.0) -> list[dict]:
    """Half of every batch: `sequences` [num, S] (a prompt of `prompt_lens[i]` tokens + the target's greedy
    continuation of `new_tokens`, right-padded; anchors inside the continuation). Other half: corpus windows
    with teacher-forced target predictions as labels, kept only on the prefix where the corpus agrees with the
    target's greedy choice, so every label used is exactly the target's greedy continuation from that anchor.
    Loss per draft slot: (1 - kl_weight) x cross-entropy on that label + kl_weight x KL(target || drafter), the
    target's full next-token distribution at the same (teacher-forced, hence greedy) context. A DFlash 2 drafter
    adds `selector_weight` x its selector's loss (`selector_slot_loss`) per slot, under the same weights and mask;
    its reported train acceptance is then the selector's."""
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight={kl_weight}: must lie in [0, 1]")
    if selector_weight < 0:
        raise ValueError(f"selector_weight={selector_weight}: must be >= 0")
    selector = getattr(drafter, "candidate_selector", None)
    gen = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    w = cfg.block_size
    hf_target.to(device).eval().requires_grad_(False)
    embed = hf_target.get_input_embeddings()
    lm_head = hf_target.get_output_embeddings()
    drafter.to(device).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    # NOTE: early positions decide the accepted prefix, so they weigh more (exponential decay over j).
    weights = torch.exp(-torch.arange(w - 1, device=device, dtype=torch.float32) / decay)
    s = sequences.shape[1]
    half = batch // 2
    offsets = torch.arange(1, w, device=device)
    curve, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        picked = torch.randint(0, sequences.shape[0], (half,), generator=gen)
        greedy_rows, greedy_lens = sequences[picked], prompt_lens[picked]
        corpus_rows = random_windows(corpus, batch - half, s, gen)
        tokens = torch.cat([greedy_rows, corpus_rows]).to(device)
        # Greedy rows: anchors whose W-1 labels all lie in the continuation. Corpus rows: any anchor with context.
        anchors = torch.cat([_anchors(half, blocks_per_seq, greedy_lens - 1, greedy_lens + new_tokens - w, gen),
                             _anchors(batch - half, blocks_per_seq, 1, s - w, gen)]).to(device)
        with autocast(device):
            feats, greedy_next, *target_logits = target_features(hf_target, tokens, cfg.target_layer_ids,
                                                                 with_logits=kl_weight > 0)
            hidden = draft_train_forward(drafter, embed, feats, tokens, anchors)
            logits = drafter.scale_logits(lm_head(hidden).float())  # [B, nb, W-1, V]
        label_pos = anchors[:, :, None] + offsets  # [B, nb, W-1] positions the drafts stand for
        corpus_labels = greedy_next.gather(1, (label_pos - 1).reshape(batch, -1)).view_as(label_pos)
        written = tokens.gather(1, label_pos.reshape(batch, -1)).view_as(label_pos)
        # A teacher-forced label at slot j is the greedy continuation iff slots 1..j-1 agreed with the corpus.
        agree = (written == corpus_labels).long()
        valid = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1].cumprod(-1)], dim=-1).bool()
        is_greedy = (torch.arange(batch, device=device) < half)[:, None, None]
        labels = torch.where(is_greedy, written, corpus_labels)
        valid = valid | is_greedy
        teacher = None
        if kl_weight > 0:
            # The target's distribution one position before each label: the context the draft slot stands in.
            idx = (label_pos - 1).reshape(batch, -1, 1).expand(-1, -1, target_logits[0].shape[-1])
            teacher = target_logits[0].gather(1, idx).view_as(logits)
        per_slot = draft_slot_loss(logits, labels, teacher, kl_weight)
        if selector is not None:
            with autocast(device):
                selected, picks = selector_slot_loss(selector, hidden, logits, labels, tokens.gather(1, anchors))
            per_slot = per_slot + selector_weight * selected
        weighted = per_slot * weights * valid
        loss = weighted.sum() / (weights * valid).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            with torch.no_grad():
                hit = (logits[:half].argmax(-1) == labels[:half]) if selector is None else picks[:half]
                hit = hit.float()
                run = hit.cumprod(-1).sum(-1).mean().item()  # accepted drafts on the greedy half
            curve.append({"step": step, "loss": round(loss.item(), 4), "train_accepted": round(run, 3),
                          "seconds": round(time.time() - t0, 1)})
            log(f"drafter step {step}/{steps} loss {loss.item():.3f} accepted~{run:.2f}")
    return curve


@torch.no_grad()
def held_out_acceptance(drafter: DFlashDraftModel, hf_target, sequences: torch.Tensor, *, prompt_lens: torch.Tensor,
                        new_tokens: int, device: torch.device, blocks_per_seq: int = 8) -> float:
    """Mean accepted drafts on greedy sequences the drafter never trained on (teacher-forced blocks); a DFlash 2
    drafter's drafts are its selector's greedy walk, as served."""
    selector = getattr(drafter, "candidate_selector", None)
    drafter.eval()
    w = drafter.config.block_size
    gen = torch.Generator().manual_seed(1234)
    total, count = 0.0, 0
    for start in range(0, sequences.shape[0], 64):
        tokens = sequences[start : start + 64].to(device)
        lens = prompt_lens[start : start + 64]
        anchors = _anchors(tokens.shape[0], blocks_per_seq, lens - 1, lens + new_tokens - w, gen).to(device)
        with autocast(device):
            feats, _ = target_features(hf_target, tokens, drafter.config.target_layer_ids)
            hidden = draft_train_forward(drafter, hf_target.get_input_embeddings(), feats, tokens, anchors)
            logits = drafter.scale_logits(hf_target.get_output_embeddings()(hidden).float())
            drafts = logits.argmax(-1) if selector is None else _walk(selector, hidden, logits,
                                                                        tokens.gather(1, anchors))
        labels = tokens.gather(1, (anchors[:, :, None] + torch.arange(1, w, device=device)).reshape(
            tokens.shape[0], -1)).view(tokens.shape[0], blocks_per_seq, w - 1)
        total += (drafts == labels).float().cumprod(-1).sum().item()
        count += labels.shape[0] * labels.shape[1]
    drafter.train()
    return total / max(count, 1)


def _walk(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The selector's greedy path over blocks [B, nb, P] (`CandidateSelector.walk` on their top-k candidates)."""
    b, nb, p = logits.shape[:3]
    unary, candidates = logits.reshape(b * nb, p, -1).topk(selector.top_k, dim=-1)
    path, _, _ = selector.walk(hidden.reshape(b * nb, p, -1), unary, candidates, first.reshape(-1))
    return path.view(b, nb, p)
