"""Train drafters for a target on this CPU, reusing the target (``python -m vllm_spec_plugins.tools.drafters``).

Pipeline (every stage resumable, deterministic given ``--seed``, files under ``--work``):

1. ``generate``: the target's own greedy answers to training prompts (``split="train"`` only), by
   plain vLLM in chunks (``gen_NNNNN.json``): the drafter learns the text it will be asked to draft.
2. ``cache``: one teacher pass (transformers, bf16) over prompt + answer; per token the target's
   final hidden state (post-norm: what vLLM hands an EAGLE drafter) and its top-k logits
   (``cache_NNNNN.pt``). An SSM drafter needs only the top-k: ``generate --topk-from-vllm`` asks
   vLLM for them (logprobs + prompt_logprobs) and writes the cache itself, skipping this pass.
3. ``train``: an EAGLE-1 drafter (``fc`` over [token embedding, target hidden] + one Llama decoder
   layer; embeddings and output head are the target's and stay frozen) by distillation: KL to the
   teacher's top-k distribution + smooth-L1 to the next hidden state; bounded by ``--minutes``;
   checkpoints so a second call continues.
4. ``export``: a folder vLLM's own ``"method": "eagle"`` loads (Llama config with one layer,
   ``model.safetensors`` without embeddings / head: vLLM shares the target's, and ``drafter.json``
   with the target tokenizer's fingerprint), so the drafter's KV lives in vLLM's paged cache and
   drafting is vLLM's CUDA-graph loop.

Why EAGLE and not an early-exit or standalone drafter: a drafter reading the target's last hidden
state starts from the target's own features, and it costs one decoder layer.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_spec_plugins.config import DRAFTER_MARKER, shipped_drafter  # noqa: F401 - `drafters.shipped_drafter` is public

STAGES = ("generate", "cache", "text", "train", "export")
GEN_CHUNK = 128
CACHE_TOPK = 32


def _progress(it, **kw):
    try:
        from tqdm import tqdm
        return tqdm(it, **kw)
    except ImportError:     # pragma: no cover
        return it


# ---------------------------------------------------------------- 1. generate
def training_rows(n_chat: int, n_code: int | None, n_summarize: int, max_prompt_tokens: int,
                  tokenizer_dir: str, chat_from: int = 0) -> list[dict]:
    """chat_from: skip the first chats of the (prefix-stable) training order, so that a second
    --work holds new prompts only."""
    from vllm_spec_plugins.tools.data import assert_no_heldout, make_prompts
    rows = []
    for cat, n, skip in (("chat", n_chat, chat_from), ("code", n_code, 0), ("summarize", n_summarize, 0)):
        if n == 0:
            continue
        rows += make_prompts(categories=(cat,), n_per_category=None if n is None else skip + n, split="train",
                             max_prompt_tokens=max_prompt_tokens, tokenizer_dir=tokenizer_dir)[skip:]
    assert_no_heldout(r["id"] for r in rows)
    return rows


def generate(target: str, work: Path, rows: list[dict], max_tokens: int, batch: int, dtype: str,
             topk_from_vllm: bool = False, max_len: int = 640) -> None:
    """topk_from_vllm: vLLM also returns the target's top-k over prompt and answer (logprobs and
    prompt_logprobs), written as the teacher cache (`cache_NNNNN.pt`, no hidden states: enough for
    an SSM drafter, not for EAGLE) so the `cache` stage's second pass over the same tokens is skipped."""
    from vllm_spec_plugins.tools.runner import run_isolated
    work.mkdir(parents=True, exist_ok=True)
    chunks = [rows[i:i + GEN_CHUNK] for i in range(0, len(rows), GEN_CHUNK)]
    lp = ({"logprobs": CACHE_TOPK, "prompt_logprobs": CACHE_TOPK, "llm_kwargs": {"max_logprobs": CACHE_TOPK}}
          if topk_from_vllm else {})
    for i in _progress(range(len(chunks)), desc="teacher answers (vLLM)", unit="chunk"):
        path = work / f"gen_{i:05d}.json"
        if path.exists():
            continue
        res = run_isolated({"model": target, "groups": {"all": chunks[i]}, "max_tokens": max_tokens,
                            "temperature": 0.0, "batch_size": batch, "dtype": dtype,
                            "max_model_len": 2048, **lp}, env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)},
                           timeout=3600)["groups"]["all"]
        out = [{"id": r["id"], "category": r["category"], "prompt": p, "answer": o[0]}
               for r, p, o in zip(chunks[i], res["prompt_token_ids"], res["outputs"])]
        if topk_from_vllm:
            rows_pt = [vllm_topk_row(g, pl, ol[0], max_len)
                       for g, pl, ol in zip(out, res["prompt_logprobs"], res["logprobs"])]
            _save_chunk(rows_pt, work / f"cache_{i:05d}.pt")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        tmp.replace(path)


def vllm_topk_row(gen: dict, prompt_lp: list, answer_lp: list, max_len: int, k: int = CACHE_TOPK) -> dict:
    """A teacher-cache row from vLLM's logprobs: position i of prompt + answer carries the target's
    top-k for token i + 1 (prompt_lp[j] / answer_lp[j] are the distributions of prompt token j /
    answer token j). The last token has none and is dropped; the tail of max_len is kept."""
    full = gen["prompt"] + gen["answer"]
    dists = prompt_lp[1:] + answer_lp
    assert len(dists) == len(full) - 1, (len(dists), len(full))
    cut = max(0, len(dists) - max_len)
    idx = torch.zeros(len(dists) - cut, k, dtype=torch.int32)
    val = torch.full((len(dists) - cut, k), -6e4, dtype=torch.float16)
    for n, d in enumerate(dists[cut:]):
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        idx[n, :len(top)] = torch.tensor([int(t) for t, _ in top], dtype=torch.int32)
        val[n, :len(top)] = torch.tensor([v for _, v in top]).clamp(min=-6e4).to(torch.float16)
    return {"ids": torch.tensor(full[cut:len(full) - 1], dtype=torch.int32), "topk_idx": idx, "topk_val": val,
            "answer_start": max(0, len(gen["prompt"]) - cut), "position0": cut, "category": gen["category"]}


def _save_chunk(rows: list[dict], path: Path) -> None:
    """Write a teacher-cache chunk so that a killed run never leaves a partial file behind."""
    torch.save(rows, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def _load_generations(work: Path) -> list[dict]:
    rows = []
    for p in sorted(work.glob("gen_*.json")):
        rows += json.loads(p.read_text())
    return rows


# ---------------------------------------------------------------- 2. cache teacher outputs
def load_target(target: str, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=dtype)
    model.eval().requires_grad_(False)
    return model


@torch.no_grad()
def teacher_outputs(model, ids: list[int], topk: int = CACHE_TOPK) -> dict:
    """Post-norm last hidden states (as vLLM's Llama returns them) and top-k logits of `ids`."""
    x = torch.tensor([ids])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.model(input_ids=x).last_hidden_state[0]
        logits = model.lm_head(h).float()
    val, idx = logits.topk(topk, dim=-1)
    return {"ids": x[0].to(torch.int32), "hidden": h.to(torch.bfloat16),
            "topk_idx": idx.to(torch.int32), "topk_val": val.to(torch.float16)}


def _cache_rows(target: str, work: Path, rows: list[dict], prefix: str, desc: str, max_len: int) -> None:
    """Teacher outputs over prompt + answer of `rows`, in chunk files `{prefix}_NNNNN.pt` (resumable)."""
    chunks = [rows[i:i + GEN_CHUNK] for i in range(0, len(rows), GEN_CHUNK)]
    todo = [i for i in range(len(chunks)) if not (work / f"{prefix}_{i:05d}.pt").exists()]
    if not todo:
        return
    model = load_target(target)
    torch.set_num_threads(os.cpu_count() or 1)
    for i in _progress(todo, desc=desc, unit="chunk"):
        out = []
        for r in chunks[i]:
            full = r["prompt"] + r["answer"]
            cut = max(0, len(full) - max_len)            # keep the tail: all of the answer
            t = teacher_outputs(model, full[cut:])
            t.update(answer_start=max(0, len(r["prompt"]) - cut), position0=cut, category=r["category"])
            out.append(t)
        _save_chunk(out, work / f"{prefix}_{i:05d}.pt")


def cache(target: str, work: Path, max_len: int) -> None:
    rows = _load_generations(work)
    if not rows:
        raise SystemExit(f"no teacher answers in {work}: run the `generate` stage first")
    _cache_rows(target, work, rows, "cache", "teacher hidden states + top-k", max_len)


def text_rows(n: int, seed: int, tokenizer_dir: str, max_len: int) -> list[dict]:
    """Human-written ShareGPT exchanges (train split): first user turn + first assistant answer,
    as chat-template token ids. Distillation needs the teacher's distribution, not its text: these
    cost one teacher pass each, not a generation (measured: generation is the slow stage)."""
    from transformers import AutoTokenizer

    from vllm_spec_plugins.tools.data import assert_no_heldout, is_englishish, sharegpt_conversations
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    convs = [c for c in sharegpt_conversations("train") if len(c["messages"]) >= 2
             and c["messages"][0]["role"] == "user" and c["messages"][1]["role"] == "assistant"
             and is_englishish(c["messages"][0]["content"]) and 20 <= len(c["messages"][1]["content"]) <= 6000]
    random.Random(seed).shuffle(convs)
    rows = []
    for c in convs[:n]:
        prompt = tok.apply_chat_template(c["messages"][:1], add_generation_prompt=True, tokenize=True)
        full = tok.apply_chat_template(c["messages"][:2], tokenize=True)
        if hasattr(prompt, "input_ids"):        # BatchEncoding on newer transformers
            prompt, full = prompt["input_ids"], full["input_ids"]
        rows.append({"id": c["id"], "category": "text", "prompt": list(prompt), "answer": list(full[len(prompt):])})
    assert_no_heldout(r["id"] for r in rows)
    return rows


def cache_text(target: str, work: Path, n: int, seed: int, max_len: int) -> None:
    """Stage `text`: teacher outputs over `n` human-written exchanges (files text_NNNNN.pt)."""
    _cache_rows(target, work, text_rows(n, seed, target, max_len), "text", "teacher top-k over human text", max_len)


def load_cache(work: Path, also: Sequence[Path] = ()) -> list[dict]:
    """Cached teacher rows: the target's own answers (cache_*), then human text (text_*); then
    those of each folder in `also` (appended, so rows of `work` keep their places and the
    held-back split, every 20th row, keeps its rows of `work`)."""
    rows = []
    for w in (work, *also):
        for pattern in ("cache_*.pt", "text_*.pt"):
            for p in sorted(w.glob(pattern)):
                rows += torch.load(p)
    return rows


# ---------------------------------------------------------------- 3. the drafter and its training
class RMSNorm(torch.nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x, pos, theta: float):
    """Llama (NeoX-style, rotate-half) rotary embedding; x [B, H, T, D], pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None, :, None] * inv          # [B, 1, T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class EagleDrafter(torch.nn.Module):
    """EAGLE-1 head in vLLM's layout (vllm/model_executor/models/llama_eagle.py): fc over
    [embed(next token), target hidden], one Llama decoder layer without input norm, no final norm;
    logits through the target's (frozen) output head."""

    def __init__(self, cfg: dict, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        h, self.nh, self.nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        self.theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        i, eps = cfg["intermediate_size"], cfg.get("rms_norm_eps", 1e-5)
        lin = lambda a, b: torch.nn.Linear(a, b, bias=False)   # noqa: E731
        self.fc = lin(2 * h, h)
        self.q_proj, self.k_proj = lin(h, self.nh * self.hd), lin(h, self.nkv * self.hd)
        self.v_proj, self.o_proj = lin(h, self.nkv * self.hd), lin(self.nh * self.hd, h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.gate_proj, self.up_proj, self.down_proj = lin(h, i), lin(h, i), lin(i, h)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("head", head, persistent=False)

    def forward(self, next_ids, hidden, pos):
        """next_ids [B, T], hidden [B, T, h] (target's hidden at the same positions), pos [B, T]
        -> drafter hidden [B, T, h] predicting the target's hidden at position + 1."""
        return self.step(next_ids, hidden, pos)[0]

    def step(self, next_ids, hidden, pos, past=None):
        """`forward`, also returning this step's (k, v) appended to `past`. With `past` (earlier
        unrolled steps' (k, v)) this is draft step len(past) + 1 of a training-time test: position
        i attends to the first step's keys up to i (real tokens, the target's hidden states) and to
        its own entries of every later step, as the drafter sees its cache when drafting the
        (len(past) + 1)-th token."""
        B, T, _ = hidden.shape
        x = self.fc(torch.cat([F.embedding(next_ids, self.embed).to(hidden.dtype), hidden], -1))
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        kv = list(past or []) + [(k, v)]
        rep = self.nh // self.nkv
        if len(kv) == 1:
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True)
        else:
            ks = torch.cat([t[0] for t in kv], 2).repeat_interleave(rep, 1)
            vs = torch.cat([t[1] for t in kv], 2).repeat_interleave(rep, 1)
            eye = torch.eye(T, dtype=torch.bool)
            mask = torch.cat([torch.ones(T, T, dtype=torch.bool).tril()] + [eye] * (len(kv) - 1), 1)
            a = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)), kv

    def logits(self, out):
        return out @ self.head.to(out.dtype).T

    def layer_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under vLLM's EAGLE checkpoint names (no embeddings / head: shared with the target)."""
        names = {"fc": "fc.weight", "post_attention_layernorm": "layers.0.post_attention_layernorm.weight"}
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[n] = f"layers.0.self_attn.{n}.weight"
        for n in ("gate_proj", "up_proj", "down_proj"):
            names[n] = f"layers.0.mlp.{n}.weight"
        return {names[k.rsplit(".", 1)[0]]: v for k, v in self.state_dict().items()}


def new_drafter(target_model, seed: int) -> EagleDrafter:
    """Reuse the target: embeddings and output head are the target's (shared, frozen); fc starts
    as a pass-through of the target's hidden state, the decoder layer small and random (EAGLE).
    Measured: starting the layer from the target's last layer blows the post-norm hidden state up
    (norm 39 -> 1100) and trains 5x slower."""
    torch.manual_seed(seed)
    cfg = target_model.config.to_dict()
    emb = target_model.model.embed_tokens.weight.detach().float()
    head = target_model.lm_head.weight.detach().float()
    d = EagleDrafter(cfg, emb, head)
    h = cfg["hidden_size"]
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            torch.nn.init.normal_(getattr(d, n).weight, 0, 0.02)
        d.fc.weight.zero_()
        d.fc.weight[:, h:] = torch.eye(h)
        d.fc.weight[:, :h].normal_(0, 0.02)
    return d


PROMPT_WEIGHT = 0.5     # loss weight of prompt positions (answers, the target's own text, weigh 1)
REG_WEIGHT = 0.2        # smooth-L1 to the next hidden state, next to the KL on the top-k
FEATURE_NOISE = 0.05    # uniform noise on input hidden states (EAGLE), for robustness to own drafts


def _windows(rows: list[dict], rng: random.Random, tokens: int, max_len: int) -> list[tuple]:
    """Random (row, start, end) windows of <= max_len tokens, up to `tokens` tokens in all."""
    picked, total = [], 0
    while total < tokens:
        r = rows[rng.randrange(len(rows))]
        n = len(r["ids"])
        s = rng.randrange(0, n - max_len + 1) if n > max_len else 0
        picked.append((r, s, min(n, s + max_len)))
        total += picked[-1][2] - s
    return picked


def _set_lr(opt, lr: float, step: int, steps: int) -> None:
    """Warm-up over 50 steps, then cosine down to 0.1 x `lr` over `steps` (a time limit only
    truncates the schedule)."""
    for g in opt.param_groups:
        g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))


def _update(opt, loss: torch.Tensor, model: torch.nn.Module) -> None:
    """One optimizer step on `loss`, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _batch(rows: list[dict], rng: random.Random, tokens: int, max_len: int):
    """Random sequences up to `tokens` tokens in all, right-padded; windows of <= max_len."""
    picked = _windows(rows, rng, tokens, max_len)
    T = max(e - s for _, s, e in picked)
    B, h = len(picked), picked[0][0]["hidden"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    hid = torch.zeros(B, T, h, dtype=torch.bfloat16)
    pos = torch.zeros(B, T, dtype=torch.long)
    tk_i = torch.zeros(B, T, CACHE_TOPK, dtype=torch.long)
    tk_v = torch.zeros(B, T, CACHE_TOPK)
    w = torch.zeros(B, T)
    for b, (r, s, e) in enumerate(picked):
        n = e - s
        ids[b, :n] = r["ids"][s:e].long()
        hid[b, :n] = r["hidden"][s:e]
        pos[b, :n] = r["position0"] + torch.arange(s, e)
        tk_i[b, :n] = r["topk_idx"][s:e].long()
        tk_v[b, :n] = r["topk_val"][s:e].float()
        w[b, :n] = torch.where(torch.arange(s, e) >= r["answer_start"], 1.0, PROMPT_WEIGHT)
    return ids, hid, pos, tk_i, tk_v, w


def _ahead(t, s: int, length: int):
    """t[:, i + s] at place i for i < length (zeros past the end): the inputs and targets of
    unrolled draft step s."""
    out = torch.zeros_like(t[:, :length])
    out[:, :t.shape[1] - s] = t[:, s:]
    return out


def drafter_loss(d: EagleDrafter, batch, noise: float = FEATURE_NOISE, gen=None, negatives: int = 2048,
                 unroll: int = 1):
    """KL to the teacher's top-k + smooth-L1 to its next hidden state. The softmax runs over the
    batch's candidate tokens (union of teacher top-k) plus `negatives` random ones (sampled
    softmax: the full 49k-token head would cost 5-10x more per step on a CPU); negatives=0: full.

    unroll > 1: training-time test (EAGLE-3, HASS). Draft step s reads the drafter's own output of
    step s - 1 as its feature, as vLLM's EAGLE loop feeds it when drafting the s-th token, and is
    scored on the teacher's distribution s tokens ahead (tokens teacher-forced: a later draft only
    counts if the earlier ones were accepted). Measured before this: trained on the target's
    features only, the second draft position accepted 0.09 on chat."""
    ids, hid, pos, tk_i, tk_v, w = batch
    L = ids.shape[1] - 1
    feat = hid[:, :-1]
    if noise:
        feat = feat + (torch.rand(feat.shape, generator=gen) * 2 - 1).to(feat.dtype) * noise
    tk_p = torch.softmax(tk_v, -1)
    if negatives:
        vocab = d.head.shape[0]
        cand = torch.unique(torch.cat([tk_i.reshape(-1), torch.randint(0, vocab, (negatives,), generator=gen)]))
        head, tk_i = d.head[cand], torch.searchsorted(cand, tk_i.contiguous())   # targets' places in cand
    else:
        head = d.head

    total, weight, agree, past = 0.0, 0.0, [], None
    for s in range(1, unroll + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, past = d.step(_ahead(ids, s, L), feat, pos[:, :L] + (s - 1), past)
            logits = out @ head.to(out.dtype).T
        logp = torch.log_softmax(logits.float(), -1)
        tgt_i, tgt_p, wt = _ahead(tk_i, s, L), _ahead(tk_p, s, L), _ahead(w, s, L)
        cls = -(tgt_p * logp.gather(-1, tgt_i)).sum(-1)
        reg = F.smooth_l1_loss(out.float(), _ahead(hid, s, L).float(), reduction="none").mean(-1)
        total = total + ((cls + REG_WEIGHT * reg) * wt).sum()
        weight = weight + wt.sum()
        full = wt == 1
        agree.append((((logp.argmax(-1) == tgt_i[..., 0]) & full).sum() / full.sum().clamp(min=1)).item())
        feat = out.to(hid.dtype)
    return total / weight, agree


@torch.no_grad()
def held_back_agreement(d: EagleDrafter, val: list[dict], seed: int, batch_tokens: int, max_len: int,
                        steps: int = 3, batches: int = 8) -> list[float]:
    """Top-1 agreement with the teacher per draft step (own features fed back), on held-back rows."""
    vr = random.Random(seed)
    agree = [drafter_loss(d, _batch(val, vr, batch_tokens, max_len), noise=0.0, negatives=0, unroll=steps)[1]
             for _ in range(batches)]
    return [sum(a[s] for a in agree) / len(agree) for s in range(steps)]


def train(target: str, work: Path, minutes: float, steps: int, seed: int, lr: float,
          batch_tokens: int, max_len: int, unroll: int = 1, also: Sequence[Path] = ()) -> Path:
    rows = load_cache(work, also)
    if not rows:
        raise SystemExit(f"no teacher cache in {work}: run the `cache` stage first")
    if any("hidden" not in r for r in rows):
        raise SystemExit(f"the teacher cache in {work} has no hidden states (made with --topk-from-vllm): "
                         "an EAGLE drafter needs them; use a --work folder made by the `cache` stage")
    val = [r for i, r in enumerate(rows) if i % 20 == 0]        # 5% for a held-back agreement
    rows = [r for i, r in enumerate(rows) if i % 20 != 0]
    torch.set_num_threads(os.cpu_count() or 1)
    tm = load_target(target, torch.float32)
    d = new_drafter(tm, seed)
    del tm
    opt = torch.optim.AdamW(d.parameters(), lr=lr, weight_decay=0.0)
    ckpt, step = work / "drafter.ckpt", 0
    if ckpt.exists():
        st = torch.load(ckpt)
        d.load_state_dict(st["drafter"], strict=False)
        opt.load_state_dict(st["opt"])
        step = st["step"]
    t_end = time.time() + 60 * minutes
    bar = _progress(range(step, steps), desc="train EAGLE drafter", unit="step", initial=step, total=steps)
    log, done = [], step
    for step in bar:
        if time.time() > t_end:
            break
        _set_lr(opt, lr, step, steps)
        rng = random.Random(seed * 1_000_003 + step)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        loss, agree = drafter_loss(d, _batch(rows, rng, batch_tokens, max_len), gen=gen, unroll=unroll)
        _update(opt, loss, d)
        log.append({"step": step, "loss": loss.item(), "agree": agree})
        done = step + 1
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}", agree=" ".join(f"{a:.2f}" for a in agree))
    torch.save({"drafter": d.state_dict(), "opt": opt.state_dict(), "step": done, "unroll": unroll}, ckpt)
    per_step = held_back_agreement(d, val, seed, batch_tokens, max_len)
    report = {"step": done, "steps": steps, "unroll": unroll, "val_agreement": per_step[0],
              "val_agreement_per_step": per_step, "train_tail": log[-20:]}
    (work / "train_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("step", "steps", "unroll", "val_agreement_per_step")}))
    return ckpt


# ---------------------------------------------------------------- 3b. token-only drafters (Mamba, Transformer baseline)
DRAFT_VOCAB = 8192      # head rows: the most frequent tokens of the teacher data
# The Transformer baseline's MLP width makes its parameter count the Mamba drafter's (at hidden 576).
SSM_SIZES = {"mamba": dict(n_layers=2), "transformer": dict(n_layers=2, mlp=693)}


def draft_vocabulary(rows: list[dict], size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the cached sequences (ties: lower id), sorted."""
    counts = torch.zeros(int(max(int(r["ids"].max()) for r in rows)) + 1, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["ids"].long(), minlength=len(counts))
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order))


def new_ssm_drafter(target_model, kind: str, seed: int, draft_vocab: torch.Tensor, **cfg):
    from vllm_spec_plugins.proposers.mamba import StateSpaceDrafter
    torch.manual_seed(seed)
    emb = target_model.model.embed_tokens.weight.detach().float()
    d = StateSpaceDrafter({"kind": kind, **SSM_SIZES[kind], **cfg}, emb,
                          target_model.lm_head.weight.detach().float(), draft_vocab)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.dim() == 2 and n != "norms":
                torch.nn.init.normal_(p, 0, 0.02)
        d.norms[-1] = target_model.model.norm.weight.detach().float()   # the head expects its scale
    return d


def _token_batch(rows, rng, tokens, max_len):
    picked = _windows(rows, rng, tokens, max_len)
    T, B = max(e - s for _, s, e in picked), len(picked)
    ids = torch.zeros(B, T, dtype=torch.long)
    tk_i, tk_v, w = torch.zeros(B, T, CACHE_TOPK, dtype=torch.long), torch.zeros(B, T, CACHE_TOPK), torch.zeros(B, T)
    for b, (r, s, e) in enumerate(picked):
        n = e - s
        ids[b, :n], tk_i[b, :n], tk_v[b, :n] = (r["ids"][s:e].long(), r["topk_idx"][s:e].long(),
                                                r["topk_val"][s:e].float())
        w[b, :n] = torch.where(torch.arange(s, e) >= r["answer_start"] - 1, 1.0, PROMPT_WEIGHT)
    return ids, tk_i, tk_v, w


def ssm_loss(d, batch, to_draft: torch.Tensor):
    """Cross-entropy to the teacher's top-k distribution restricted to the draft vocabulary; top-1
    agreement with the teacher (a teacher top-1 outside the draft vocabulary counts as a miss)."""
    ids, tk_i, tk_v, w = batch
    h, _ = d(ids)
    logp = torch.log_softmax(d.logits(h), -1)
    j = to_draft[tk_i]                                       # -1: not in the draft vocabulary
    p = torch.softmax(tk_v, -1) * (j >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    ce = -(p * logp.gather(-1, j.clamp(min=0))).sum(-1)
    loss = (ce * w).sum() / w.sum()
    hit = (d.draft_vocab[logp.argmax(-1)] == tk_i[..., 0]).float()
    agree = (hit * (w == 1)).sum() / (w == 1).sum().clamp(min=1)
    return loss, agree.item()


def replay_tau(d, rows: list[dict], k: int) -> dict:
    """Offline greedy chain replay on cached rows (their answers are the target's greedy text):
    tau = tokens per verification step (accepted drafts + 1)."""
    from vllm_spec_plugins.proposers.mamba import greedy_chain_accepted
    steps = acc = 0
    for r in rows:
        ids, a0 = r["ids"].tolist(), max(1, r["answer_start"])
        if len(ids) - a0 < 2:
            continue
        s, a = greedy_chain_accepted(d, ids[:a0], ids[a0:], k)
        steps, acc = steps + s, acc + a
    return {"k": k, "steps": steps, "accepted": acc, "tau": 1 + acc / max(steps, 1)}


def train_ssm(target: str, work: Path, kind: str, minutes: float, steps: int, seed: int, lr: float,
              batch_tokens: int, max_len: int, also: Sequence[Path] = ()) -> Path:
    rows = load_cache(work, also)
    if not rows:
        raise SystemExit(f"no teacher cache in {work}: run the `cache` stage first")
    val = [r for i, r in enumerate(rows) if i % 20 == 0]
    rows = [r for i, r in enumerate(rows) if i % 20 != 0]
    torch.set_num_threads(os.cpu_count() or 1)
    tm = load_target(target, torch.float32)
    ckpt, step = work / f"{kind}.ckpt", 0
    st = torch.load(ckpt) if ckpt.exists() else None
    dv = st["drafter"]["draft_vocab"] if st else draft_vocabulary(rows, DRAFT_VOCAB)
    d = new_ssm_drafter(tm, kind, seed, dv)
    del tm
    to_draft = torch.full((d.embed.shape[0],), -1, dtype=torch.long)
    to_draft[dv] = torch.arange(len(dv))
    opt = torch.optim.AdamW(d.parameters(), lr=lr, weight_decay=0.0)
    if st:
        d.load_state_dict(st["drafter"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
    t_end = time.time() + 60 * minutes
    bar = _progress(range(step, steps), desc=f"train {kind} drafter", unit="step", initial=step, total=steps)
    log, done = [], step
    for step in bar:
        if time.time() > t_end:
            break
        _set_lr(opt, lr, step, steps)
        batch = _token_batch(rows, random.Random(seed * 1_000_003 + step), batch_tokens, max_len)
        loss, agree = ssm_loss(d, batch, to_draft)
        _update(opt, loss, d)
        log.append({"step": step, "loss": loss.item(), "agree": agree})
        done = step + 1
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{agree:.2f}")
    torch.save({"drafter": d.state_dict(), "opt": opt.state_dict(), "step": done}, ckpt)
    d.eval()
    with torch.no_grad():
        vr = random.Random(seed)
        agree = [ssm_loss(d, _token_batch(val, vr, batch_tokens, max_len), to_draft)[1] for _ in range(8)]
        tau = replay_tau(d, [r for r in val if r.get("category") != "text"][:24], 4)   # target's own answers
    report = {"kind": kind, "step": done, "steps": steps, "params": sum(p.numel() for p in d.parameters()),
              "val_agreement": sum(agree) / len(agree), "val_replay_k4": tau, "train_tail": log[-20:]}
    (work / f"{kind}_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("kind", "step", "params", "val_agreement", "val_replay_k4")}))
    return ckpt


def write_ssm_drafter(weights: dict, kind: str, target: str, out_dir: Path, meta: dict | None = None,
                      **cfg) -> Path:
    """A folder the plugin's `"method": "mamba"` loads: config.json (the drafter's own shape),
    model.safetensors (its layers + the draft vocabulary, bf16; embeddings / head are read from
    the target at load time), drafter.json (the target tokenizer's fingerprint)."""
    from safetensors.torch import save_file

    from vllm_spec_plugins.proposers.mamba import DEFAULTS
    from vllm_spec_plugins.tools.models import tokenizer_fingerprint
    tcfg = json.loads((Path(target) / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()},
              str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({**DEFAULTS, "kind": kind, **SSM_SIZES[kind], **cfg,
                                                     "hidden_size": tcfg["hidden_size"]}, indent=1))
    (out_dir / DRAFTER_MARKER).write_text(json.dumps(
        {"kind": kind, "target_tokenizer": tokenizer_fingerprint(target),
         "target_vocab_size": tcfg["vocab_size"], "target_hidden_size": tcfg["hidden_size"], **(meta or {})},
        indent=1))
    return out_dir


def export_ssm(target: str, work: Path, kind: str, out_dir: Path) -> Path:
    st = torch.load(work / f"{kind}.ckpt")
    rp = work / f"{kind}_report.json"
    report = json.loads(rp.read_text()) if rp.exists() else {}
    return write_ssm_drafter(st["drafter"], kind, target, out_dir,
                             {"steps": st["step"], "val_agreement": report.get("val_agreement"),
                              "val_replay_k4": report.get("val_replay_k4")})


def random_ssm_drafter(target: str, out_dir: Path, seed: int = 0, kind: str = "mamba", **cfg) -> Path:
    """An untrained drafter for `target` in seconds (tests: lossless whatever the drafts are)."""
    from vllm_spec_plugins.proposers.mamba import StateSpaceDrafter, target_embeddings
    torch.manual_seed(seed)
    emb, head = target_embeddings(target)
    dv = torch.arange(min(DRAFT_VOCAB, emb.shape[0]))
    d = StateSpaceDrafter({"kind": kind, **SSM_SIZES[kind], **cfg}, emb.float(), head, dv)
    return write_ssm_drafter(d.state_dict(), kind, target, out_dir, {"steps": 0}, **cfg)


# ---------------------------------------------------------------- 4. export for vLLM's "eagle"
def export_drafter(d: EagleDrafter, target: str, out_dir: Path, meta: dict | None = None) -> Path:
    """Write `d` as a folder vLLM's `"method": "eagle"` loads. No tokenizer files: vLLM drafts with
    the target's tokenizer; `drafter.json` records the target tokenizer's fingerprint and the
    plugin refuses the drafter for a target whose tokenizer differs (config.check_drafter_marker)."""
    from safetensors.torch import save_file

    from vllm_spec_plugins.tools.models import tokenizer_fingerprint
    cfg = json.loads((Path(target) / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in d.layer_state_dict().items()},
              str(out_dir / "model.safetensors"))
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    cfg.pop("dtype", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    (out_dir / DRAFTER_MARKER).write_text(json.dumps(
        {"kind": "eagle", "vllm_method": "eagle", "target_tokenizer": tokenizer_fingerprint(target),
         "target_vocab_size": cfg["vocab_size"], "target_hidden_size": cfg["hidden_size"], **(meta or {})},
        indent=1))
    return out_dir


def export(target: str, work: Path, out_dir: Path) -> Path:
    st = torch.load(work / "drafter.ckpt")
    cfg = json.loads((Path(target) / "config.json").read_text())
    d = EagleDrafter(cfg, torch.zeros(1, cfg["hidden_size"]), torch.zeros(1, cfg["hidden_size"]))
    d.load_state_dict(st["drafter"], strict=False)
    rp = work / "train_report.json"
    report = json.loads(rp.read_text()) if rp.exists() else {}
    return export_drafter(d, target, out_dir, {"steps": st["step"], "unroll": st.get("unroll", 1),
                                               "val_agreement": report.get("val_agreement"),
                                               "val_agreement_per_step": report.get("val_agreement_per_step")})


def load_exported(path: str | Path, target_model) -> EagleDrafter:
    """An exported drafter folder back into an EagleDrafter over `target_model`'s head (float32)."""
    from safetensors.torch import load_file
    d = EagleDrafter(target_model.config.to_dict(), target_model.model.embed_tokens.weight.detach().float(),
                     target_model.lm_head.weight.detach().float())
    names = {v: k for k, v in zip(d.state_dict(), d.layer_state_dict())}
    d.load_state_dict({names[k]: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()})
    return d.eval()


@torch.no_grad()
def greedy_chain_accepted(d: EagleDrafter, target_model, prompt: list[int], answer: list[int], k: int = 1) -> int:
    """Tokens a k-token EAGLE chain accepts while the target greedily emits `answer` after `prompt`,
    replayed as vLLM drafts: the first draft for answer[j] reads answer[j-1] and the target's hidden
    state two positions back; draft s reads the drafter's own output of draft s - 1 (the unrolled
    steps of `drafter_loss`, tokens teacher-forced: a draft only counts after its predecessors hit).
    A step emits its accepted drafts and one more token."""
    ids = torch.tensor([prompt + answer])
    h = target_model.model(input_ids=ids).last_hidden_state
    T = ids.shape[1]
    pos = torch.arange(T - 1)[None]
    preds, feat, past = [], h[:, :-1], None
    for s in range(1, k + 1):
        feat, past = d.step(_ahead(ids, s, T - 1), feat, pos + (s - 1), past)
        preds.append(d.logits(feat).argmax(-1)[0])
    L, acc, j = len(prompt), 0, 1
    while j < len(answer):
        n = 0
        while n < k and j + n < len(answer) and preds[n][L + j - 2].item() == answer[j + n]:
            n += 1
        acc, j = acc + n, j + n + 1
    return acc


def main(argv: list[str] | None = None) -> int:
    from vllm_spec_plugins.tools.models import default_model_dir
    ap = argparse.ArgumentParser(prog="python -m vllm_spec_plugins.tools.drafters",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="*", metavar="STAGE",
                    help=f"any of {', '.join(STAGES)} (default: all, in order)")
    ap.add_argument("--target", default=None, help="target model folder (default: the built SmolLM2-135M)")
    ap.add_argument("--work", default="out/drafter/work", help="teacher cache + checkpoint folder")
    ap.add_argument("--out", default="out/drafter/eagle", help="exported drafter folder")
    ap.add_argument("--chat", type=int, default=1024, help="training chat prompts")
    ap.add_argument("--chat-from", type=int, default=0,
                    help="skip the first N training chats (new prompts for a second --work; see --also)")
    ap.add_argument("--also", nargs="*", default=[], metavar="WORK",
                    help="train: more teacher-cache folders, after --work's (checkpoint stays in --work)")
    ap.add_argument("--code", type=int, default=None, help="training code prompts (default: all)")
    ap.add_argument("--summarize", type=int, default=256, help="training summarize prompts")
    ap.add_argument("--max-tokens", type=int, default=128, help="teacher answer length")
    ap.add_argument("--text", type=int, default=0, help="stage `text`: human-written exchanges to add")
    ap.add_argument("--max-len", type=int, default=640, help="tokens per cached sequence (the tail)")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the teacher's vLLM runs")
    ap.add_argument("--topk-from-vllm", action="store_true",
                    help="`generate` also writes the teacher cache from vLLM's logprobs "
                         "(SSM drafters only: no hidden states)")
    ap.add_argument("--minutes", type=float, default=25.0, help="training time budget (this call)")
    ap.add_argument("--steps", type=int, default=3000, help="training steps (schedule length)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unroll", type=int, default=1,
                    help="eagle: draft steps trained per position, each reading the drafter's own "
                         "previous output (training-time test); 1 = EAGLE-1, target features only")
    ap.add_argument("--drafter", default="eagle", choices=("eagle", "mamba", "transformer"),
                    help="eagle: EAGLE-1 head for vLLM's eagle; mamba: token-only Mamba-2 drafter for the "
                         "plugin's mamba method; transformer: its same-size attention baseline")
    if argv is None and sys.argv[1:2] == ["path"]:     # `... drafters path`: the shipped drafter
        print(shipped_drafter())
        return 0
    a = ap.parse_args(argv)
    a.stages = a.stages or list(STAGES)
    if bad := [s for s in a.stages if s not in STAGES]:
        ap.error(f"unknown stage(s) {bad}; choose from {list(STAGES)}")
    target = a.target or str(default_model_dir())
    work, also = Path(a.work), [Path(w) for w in a.also]
    if "generate" in a.stages:
        rows = training_rows(a.chat, a.code, a.summarize, 512, target, a.chat_from)
        random.Random(a.seed).shuffle(rows)
        generate(target, work, rows, a.max_tokens, 64, a.dtype, a.topk_from_vllm, a.max_len)
    if "cache" in a.stages:
        cache(target, work, a.max_len)
    if "text" in a.stages:
        cache_text(target, work, a.text, a.seed, a.max_len)
    if "train" in a.stages:
        if a.drafter == "eagle":
            train(target, work, a.minutes, a.steps, a.seed, a.lr, a.batch_tokens, 384, a.unroll, also)
        else:
            train_ssm(target, work, a.drafter, a.minutes, a.steps, a.seed, a.lr, a.batch_tokens, 384, also)
    if "export" in a.stages:
        print(export(target, work, Path(a.out)) if a.drafter == "eagle" else
              export_ssm(target, work, a.drafter, Path(a.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
