"""A Mamba-2 (state-space) drafter for a Transformer target, and the chain proposer that runs it.

The drafter reads token ids only. Its input embeddings and output head are the target's (frozen,
shared: a drafter that speaks the target's token space from step 0 and ships only its own layers);
the head covers a draft vocabulary (the most frequent target tokens, ids mapped back on output),
because on a CPU the full 49k-row head would cost more than the drafter's layers. Between them:
pre-norm residual Mamba-2 blocks (Dao & Gu 2024: scalar decay per head, so the prompt goes through
a chunked parallel scan and each drafted token through one recurrent step).

Memory per request is a fixed-size state: per layer a conv window [conv_dim, d_conv-1] and an SSM
state [heads, head_dim, d_state], whatever the context length. The proposer keeps, per request, one
snapshot per draft position in a slot of preallocated buffers; a rejection resumes from the
snapshot of the last accepted token, with no recomputation.

`kind="transformer"` swaps the mixer for causal self-attention with a KV cache (same embeddings,
head, norms and training): the baseline a Mamba drafter is measured against.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vllm_spec_plugins.proposers.base import (
    GOODPUT_HELP,
    NGRAM_ALONE,
    NGRAM_ALONE_PRIOR,
    BuildEnv,
    MethodConfig,
    Proposer,
    StepContext,
    key,
    ngram_alone,
)

#: help text of a `model` key naming a Mamba drafter
DRAFTER_HELP = ("Mamba drafter folder made by `python -m vllm_spec_plugins.tools.drafters --drafter mamba`, or "
                "'vllm_spec_plugins:smollm2-135m-instruct-mamba' (shipped)")


@dataclass
class MambaConfig(MethodConfig):
    method = "mamba"
    num_speculative_tokens: int = key(4, 1, 16, "draft chain length (k)")
    model: str = key(None, help=DRAFTER_HELP)
    goodput: bool = key(True, help=GOODPUT_HELP)

    def drafter_folder(self) -> str | None:
        return self.model

    def build(self, env: BuildEnv) -> Proposer:
        prop = MambaProposer(self.num_speculative_tokens, env.load_drafter(self.model), env.max_requests)
        if self.goodput:
            from .goodput import Goodput
            return Goodput(prop)
        return prop

DEFAULTS = dict(kind="mamba", n_layers=2, d_state=64, head_dim=64, expand=2, d_conv=4, chunk=64,
                n_heads=9, n_kv_heads=3, mlp=768, rope_theta=10000.0, eps=1e-5)


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Int8Linear(torch.nn.Module):
    """Weight-only int8 (one scale per output row; as gpt-fast's int8 mode): x [.., in] -> [.., out]
    through torch's int8-weight matmul, activations in bf16."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        w = w.float()
        scale = w.abs().amax(1).clamp(min=1e-8) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))

    def forward(self, x):
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.scale)
        return y.reshape(*shape[:-1], -1).to(x.dtype)

    @classmethod
    def of(cls, w: torch.Tensor) -> "Int8Linear | None":
        """An Int8Linear for weight `w`, or None where torch's int8 matmul cannot run it: it needs
        input widths in multiples of 32 here (torch 2.13 CPU: other widths gave NaN or crashed),
        and its product is checked once against float32."""
        if w.shape[1] % 32:
            return None
        q = cls(w)
        x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0))
        want, got = x @ w.float().T, q(x)
        ok = torch.isfinite(got).all() and (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-3
        return q if ok else None


def _lin(layer, x):
    """`layer(x)` in the weight's dtype (a bf16 drafter reads half the bytes), result in x's dtype."""
    if isinstance(layer, Int8Linear):
        return layer(x)
    w = layer.weight
    if w.dtype == torch.float32:      # (training: autocast decides)
        return layer(x)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def ssd_scan(x, dt, A, B, C, chunk: int, h0=None):
    """Chunked parallel scan of h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t.
    x [b, T, H, P], dt [b, T, H], A [H], B/C [b, T, N], h0 [b, H, P, N] -> y [b, T, H, P], h_T."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    pad = (-T) % chunk
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    nc = (T + pad) // chunk
    x = (x * dt[..., None]).view(b, nc, chunk, H, P)
    a = (dt * A).view(b, nc, chunk, H).permute(0, 3, 1, 2)           # [b, H, nc, Q]
    B, C = B.view(b, nc, chunk, N), C.view(b, nc, chunk, N)
    cs = a.cumsum(-1)
    seg = cs[..., :, None] - cs[..., None, :]                          # [b, H, nc, Q, Q]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    L = torch.exp(seg.masked_fill(~causal, -math.inf))
    y = torch.einsum("bcln,bcsn,bhcls,bcshp->bclhp", C, B, L, x)      # within each chunk
    decay = torch.exp(cs[..., -1:] - cs)                              # [b, H, nc, Q]
    states = torch.einsum("bcln,bhcl,bclhp->bchpn", B, decay, x)      # each chunk's own state
    h = torch.zeros(b, H, P, N, dtype=x.dtype) if h0 is None else h0.to(x.dtype)
    carry = torch.exp(cs[..., -1])                                    # [b, H, nc]
    prev = []
    for c in range(nc):                                               # nc = T / chunk steps
        prev.append(h)
        h = carry[:, :, c, None, None] * h + states[:, c]
    prev = torch.stack(prev, 1)                                       # state entering chunk c
    y = y + torch.einsum("bcln,bchpn,bhcl->bclhp", C, prev, torch.exp(cs))
    return y.reshape(b, nc * chunk, H, P)[:, :T], h


def _rope(x, pos, theta):
    """x [b, T, h, d], pos [T] (NeoX rotate-half, as Llama)."""
    d = x.shape[-1]
    ang = pos.float()[:, None] * (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


class Mamba2Mixer(torch.nn.Module):
    def __init__(self, d: int, cfg: dict):
        super().__init__()
        self.di = cfg["expand"] * d
        self.P, self.N, self.K = cfg["head_dim"], cfg["d_state"], cfg["d_conv"]
        self.H, self.chunk, self.eps = self.di // self.P, cfg["chunk"], cfg["eps"]
        self.conv_dim = self.di + 2 * self.N
        self.in_proj = torch.nn.Linear(d, self.di + self.conv_dim + self.H, bias=False)
        self.conv_w = torch.nn.Parameter(torch.randn(self.conv_dim, self.K) / self.K)
        self.conv_b = torch.nn.Parameter(torch.zeros(self.conv_dim))
        self.dt_bias = torch.nn.Parameter(torch.log(torch.expm1(torch.linspace(1e-3, 1e-1, self.H))))
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1, 16, self.H)))
        self.D = torch.nn.Parameter(torch.ones(self.H))
        self.norm_w = torch.nn.Parameter(torch.ones(self.di))
        self.out_proj = torch.nn.Linear(self.di, d, bias=False)

    def _split(self, u):
        z, xbc, dt = u.split([self.di, self.conv_dim, self.H], -1)
        return z, xbc, F.softplus(dt + self.dt_bias)

    def _out(self, y, xs, z):
        y = y + xs * self.D[:, None]
        y = y.flatten(-2) * F.silu(z)
        return _lin(self.out_proj, rms_norm(y, self.norm_w, self.eps))

    def forward(self, u, state=None):
        """u [b, T, d] -> (out [b, T, d], (conv window [b, conv_dim, K-1], ssm [b, H, P, N]))."""
        b, T, _ = u.shape
        z, xbc, dt = self._split(_lin(self.in_proj, u))
        xbc = xbc.transpose(1, 2)                                       # [b, conv_dim, T]
        prev = torch.zeros(b, self.conv_dim, self.K - 1, dtype=u.dtype) if state is None else state[0]
        full = torch.cat([prev, xbc], -1)
        conv = F.silu(F.conv1d(full, self.conv_w[:, None], self.conv_b, groups=self.conv_dim)).transpose(1, 2)
        xs, B, C = conv.split([self.di, self.N, self.N], -1)
        xs = xs.reshape(b, T, self.H, self.P)
        y, h = ssd_scan(xs, dt, -torch.exp(self.A_log), B, C, self.chunk, None if state is None else state[1])
        return self._out(y, xs, z), (full[..., full.shape[-1] - (self.K - 1):], h)

    def step(self, u, state):
        """One token per row: u [b, d]; the recurrent form of `forward`."""
        z, xbc, dt = self._split(_lin(self.in_proj, u))
        win = torch.cat([state[0], xbc[..., None]], -1)                # [b, conv_dim, K]
        conv = F.silu((win * self.conv_w).sum(-1) + self.conv_b)
        xs, B, C = conv.split([self.di, self.N, self.N], -1)
        xs = xs.view(-1, self.H, self.P)
        dA = torch.exp(dt * -torch.exp(self.A_log))                     # [b, H]
        h = dA[..., None, None] * state[1] + (dt[..., None] * xs)[..., None] * B[:, None, None, :]
        y = (h * C[:, None, None, :]).sum(-1)
        return self._out(y, xs, z), (win[..., 1:], h)

    def step_into(self, u, buf, slots, src, dst, kernel, out: bool = True):
        """`step` with the states in snapshot buffers (conv [slots, snaps, conv_dim, K-1], ssm
        [slots, snaps, H, P, N]): row r reads snapshot src[r] of slot slots[r] and writes
        snapshot dst[r], in place, through the C kernel (`vllm_spec_plugins.native.mamba_step`)."""
        u = _lin(self.in_proj, u).float().contiguous()
        (conv, ssm), b = buf, u.shape[0]
        y, scratch = torch.empty(b, self.di), torch.empty(self.conv_dim)
        A = -torch.exp(self.A_log)
        ptr = [t.data_ptr() for t in (self.conv_w, self.conv_b, self.dt_bias, A, self.D, self.norm_w)]
        if kernel(u.data_ptr(), u.stride(0), conv.data_ptr(), conv.stride(0), conv.stride(1),
                  ssm.data_ptr(), ssm.stride(0), ssm.stride(1), slots.data_ptr(), src.data_ptr(),
                  dst.data_ptr(), b, *ptr, self.eps, self.di, self.conv_dim, self.H, self.P, self.N,
                  self.K, y.data_ptr(), scratch.data_ptr()):
            raise RuntimeError("mamba_step kernel: unsupported shape")
        return _lin(self.out_proj, y) if out else None

    def steps(self, u, state):
        """A few tokens per row in one pass, with the state after each: u [b, T, d] ->
        (out [b, T, d], (conv windows [b, T, conv_dim, K-1], ssm [b, T, H, P, N])). The
        projections and the convolution are batched over T; only the state update loops."""
        b, T, _ = u.shape
        z, xbc, dt = self._split(_lin(self.in_proj, u))
        full = torch.cat([state[0], xbc.transpose(1, 2)], -1)          # [b, conv_dim, K-1+T]
        conv = F.silu(F.conv1d(full, self.conv_w[:, None], self.conv_b, groups=self.conv_dim)).transpose(1, 2)
        xs, B, C = conv.split([self.di, self.N, self.N], -1)
        xs = xs.reshape(b, T, self.H, self.P)
        dA = torch.exp(dt * -torch.exp(self.A_log))                     # [b, T, H]
        dx = (dt[..., None] * xs)[..., None] * B[:, :, None, None, :]   # [b, T, H, P, N]
        h, hs = state[1], []
        for t in range(T):
            h = dA[:, t, :, None, None] * h + dx[:, t]
            hs.append(h)
        hs = torch.stack(hs, 1)
        y = (hs * C[:, :, None, None, :]).sum(-1)
        wins = torch.stack([full[..., t + 1: t + self.K] for t in range(T)], 1)
        return self._out(y, xs, z), (wins, hs)


class AttentionMixer(torch.nn.Module):
    """Llama attention + MLP (the Transformer baseline); state = this request's KV cache."""

    def __init__(self, d: int, cfg: dict):
        super().__init__()
        self.nh, self.nkv, self.theta, self.eps = cfg["n_heads"], cfg["n_kv_heads"], cfg["rope_theta"], cfg["eps"]
        self.hd = d // self.nh
        self.qkv = torch.nn.Linear(d, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.o = torch.nn.Linear(self.nh * self.hd, d, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(d))
        self.gate_up = torch.nn.Linear(d, 2 * cfg["mlp"], bias=False)
        self.down = torch.nn.Linear(cfg["mlp"], d, bias=False)

    def forward(self, u, state=None):
        b, T, _ = u.shape
        q, k, v = self.qkv(u).view(b, T, -1, self.hd).split([self.nh, self.nkv, self.nkv], 2)
        past = 0 if state is None else state[0].shape[1]
        pos = torch.arange(past, past + T)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        if state is not None:
            k, v = torch.cat([state[0], k], 1), torch.cat([state[1], v], 1)
        rep = self.nh // self.nkv
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1),
                                           v.transpose(1, 2).repeat_interleave(rep, 1),
                                           is_causal=state is None, enable_gqa=False)
        x = u + self.o(a.transpose(1, 2).reshape(b, T, -1))
        g, up = self.gate_up(rms_norm(x, self.mlp_norm, self.eps)).chunk(2, -1)
        return x + self.down(F.silu(g) * up) - u, (k, v)

    def step(self, u, state):
        out, st = self.forward(u[:, None], state)
        return out[:, 0], st


class StateSpaceDrafter(torch.nn.Module):
    """embed (target's, frozen) -> n pre-norm residual mixer blocks -> norm -> head over the draft
    vocabulary (the target's embedding rows of those tokens, frozen)."""

    #: the C recurrent step (`vllm_spec_plugins.native.mamba_step()`, set by the plugin when it
    #: builds): proposers then step states in their snapshot buffers in place (`step_into`);
    #: None: the torch path, same math
    step_kernel = None

    def __init__(self, cfg: dict, embed: torch.Tensor, head: torch.Tensor, draft_vocab: torch.Tensor):
        super().__init__()
        self.cfg = cfg = {**DEFAULTS, **cfg}
        d = embed.shape[1]
        mixer = {"mamba": Mamba2Mixer, "transformer": AttentionMixer}[cfg["kind"]]
        self.layers = torch.nn.ModuleList(mixer(d, cfg) for _ in range(cfg["n_layers"]))
        self.norms = torch.nn.Parameter(torch.ones(cfg["n_layers"] + 1, d))
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("head", head[draft_vocab.long()].clone(), persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.long())

    def _embed(self, ids):
        return F.embedding(ids, self.embed).float()

    def forward(self, ids, states=None):
        """ids [b, T] -> (final hidden [b, T, d], per-layer states after the last token)."""
        x, out = self._embed(ids), []
        for i, layer in enumerate(self.layers):
            y, st = layer(rms_norm(x, self.norms[i], self.cfg["eps"]), None if states is None else states[i])
            x = x + y
            out.append(st)
        return rms_norm(x, self.norms[-1], self.cfg["eps"]), out

    def step(self, ids, states):
        """ids [b] -> (final hidden [b, d], new states)."""
        x, out = self._embed(ids), []
        for i, layer in enumerate(self.layers):
            y, st = layer.step(rms_norm(x, self.norms[i], self.cfg["eps"]), states[i])
            x = x + y
            out.append(st)
        return rms_norm(x, self.norms[-1], self.cfg["eps"]), out

    def step_into(self, ids, bufs, slots, src, dst, kernel, hidden: bool = True):
        """`step` reading and writing per-layer snapshot buffers in place (`Mamba2Mixer.step_into`;
        slots, src, dst: int64 [b]). Returns the final hidden [b, d] (None when not `hidden`:
        a catch-up needs only the states)."""
        x, n = self._embed(ids), len(self.layers)
        for i, layer in enumerate(self.layers):
            if not hidden and i == n - 1:
                layer.step_into(rms_norm(x, self.norms[i], self.cfg["eps"]), bufs[i], slots, src, dst, kernel,
                                out=False)
                return None
            x = x + layer.step_into(rms_norm(x, self.norms[i], self.cfg["eps"]), bufs[i], slots, src, dst, kernel)
        return rms_norm(x, self.norms[-1], self.cfg["eps"])

    def steps(self, ids, states):
        """ids [b, T] -> (final hidden [b, T, d], per layer (conv [b, T, ...], ssm [b, T, ...]):
        the state after each of the T tokens). Mamba layers only."""
        x, out = self._embed(ids), []
        for i, layer in enumerate(self.layers):
            y, st = layer.steps(rms_norm(x, self.norms[i], self.cfg["eps"]), states[i])
            x = x + y
            out.append(st)
        return rms_norm(x, self.norms[-1], self.cfg["eps"]), out

    def logits(self, h):
        """Logits over the draft vocabulary (index i is target token draft_vocab[i])."""
        if isinstance(self.head, Int8Linear):
            return self.head(h)
        if self.head.dtype == torch.float32:
            return h @ self.head.T
        return (h.to(self.head.dtype) @ self.head.T).to(h.dtype)

    def matmuls_in(self, dtype: "torch.dtype | str",
                   fallback: torch.dtype = torch.bfloat16) -> "StateSpaceDrafter":
        """Store the mixers' projections and the head in `dtype` (their matmuls then run in it),
        or "int8": weight-only int8 (`Int8Linear`), activations in bf16, and `fallback` for a
        matrix int8 cannot run (`Int8Linear.of`); states, norms, convolution and scan stay
        float32. These matmuls read every weight once per drafted token and the bytes are the
        cost: int8 reads half the bytes of bf16 and a quarter of float32."""
        if dtype == "int8":
            for layer in self.layers:
                for name in ("in_proj", "out_proj"):
                    m = getattr(layer, name)
                    q = Int8Linear.of(m.weight.data)
                    if q is None:
                        m.weight.data = m.weight.data.to(fallback)
                    else:
                        setattr(layer, name, q)
            q = Int8Linear.of(self.head)
            if q is None:
                self.head = self.head.to(fallback)
            else:
                del self.head
                self.head = q
            return self
        for layer in self.layers:
            for m in (layer.in_proj, layer.out_proj):
                m.weight.data = m.weight.data.to(dtype)
        self.head = self.head.to(dtype)
        return self

    def state_nbytes(self, states) -> int:
        return sum(t.numel() * t.element_size() for st in states for t in st)


@torch.no_grad()
def greedy_chain_accepted(d: StateSpaceDrafter, prompt: list[int], answer: list[int], k: int) -> tuple[int, int]:
    """Replay of chain speculation while the target greedily emits `answer` after `prompt`:
    (verification steps, tokens accepted). Exact for greedy decoding with a token-only drafter."""
    seq = list(prompt) + [answer[0]]
    h, st = d(torch.tensor([seq]))
    h = h[:, -1]
    j, steps, acc = 1, 0, 0
    while j < len(answer):
        drafts, snaps, hs = [], [st], [h]
        for _ in range(k):
            t = d.draft_vocab[d.logits(h).argmax(-1)]
            drafts.append(int(t))
            h, st = d.step(t, st)
            snaps.append(st), hs.append(h)
        a = 0
        while a < k and j + a < len(answer) and drafts[a] == answer[j + a]:
            a += 1
        steps, acc = steps + 1, acc + a
        if j + a >= len(answer):
            break
        h, st = d.step(torch.tensor([answer[j + a]]), snaps[a])
        j += a + 1
    return steps, acc


#: drafter confidence (its softmax probability of the token it drafts) -> class bin, for `Goodput`
CONF_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
CONF_PRIOR = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.7, 0.9)   # a calibrated drafter's rate per bin


def confidence_classes(conf: torch.Tensor, first_depth: torch.Tensor | int = 0) -> torch.Tensor:
    """conf [b, T] -> class [b, T]: bin * DEPTHS + min(depth, DEPTHS - 1), depth = first_depth + column."""
    from .goodput import DEPTHS
    bins = torch.bucketize(conf, torch.tensor(CONF_EDGES, dtype=conf.dtype), right=True)
    depth = (torch.as_tensor(first_depth).reshape(-1, 1) + torch.arange(conf.shape[1])).clamp(max=DEPTHS - 1)
    return bins * DEPTHS + depth


class MambaProposer(Proposer):
    """Chain proposer over a `StateSpaceDrafter` (kind "mamba").

    Slot buffers (preallocated, grown by doubling): per layer and slot, k+1 snapshots of the conv
    window and SSM state. snapshot j = state after the request's first `ntok` tokens + its first j
    drafts. Each step, for all drafting rows at once: the state after all of a row's tokens but
    the last (snapshot[accepted], or a short catch-up scan, see `before_last`), then the last
    token in, then k recurrent drafting steps (static shapes, no host sync inside the loop; ids
    and confidences stay on the device until one sync after it). Steps without drafts (budget 0)
    cost nothing: the next drafting step scans the tokens it missed from the last valid snapshot.
    While the drafter does not pay (`Goodput`), n-gram lookup in the request's own text drafts
    alone (`propose_fallback`); the drafter catches up on those tokens as on skipped ones."""

    # class = confidence bin * DEPTHS + depth; from `ALONE` on, n-gram lookup's tokens drafted alone
    class_prior = np.concatenate([np.repeat(CONF_PRIOR, 4), np.ravel(NGRAM_ALONE_PRIOR)])
    ALONE = len(CONF_PRIOR) * 4
    #: slots allocated up front (each k+1 snapshots, ~0.6 MiB apiece for the shipped drafter): not
    #: vLLM's max_num_seqs, which defaults to hundreds
    PREALLOC = 16
    clock = staticmethod(time.perf_counter)     # `once_seconds` (a `Goodput` around it sets its own)
    #: catch-ups of at most this many tokens (a tree's sibling, an accepted last draft, a skipped
    #: step) run as recurrent steps: the chunked scan pads them to a whole chunk
    STEP_SCAN = 4

    def __init__(self, num_speculative_tokens: int, drafter: StateSpaceDrafter, max_requests: int = 8,
                 scratch_snapshots: int = 0):
        super().__init__(num_speculative_tokens)
        self.scratch = scratch_snapshots          # snapshots past k a caller writes (a cascade's extra steps)
        self.kernel = drafter.step_kernel
        if drafter.cfg["kind"] != "mamba":
            raise ValueError("MambaProposer runs kind='mamba' drafters")
        self.d = drafter.eval().requires_grad_(False)
        self.slots: dict[str, int] = {}           # req_id -> slot
        self.ntok: dict[str, int] = {}            # tokens consumed by snapshot 0
        self.free: list[int] = []
        self.buf: list[tuple[torch.Tensor, torch.Tensor]] = []   # per layer (conv, ssm) [slots, k+1, ...]
        self._grow(max(1, min(max_requests, self.PREALLOC)))   # grows by doubling past that
        self.states = self.slots                   # what plugin_state_summary counts
        self.spine: dict[str, list[int]] = {}     # req_id -> greedy chain of the last tree drafted (`draft_tree`)
        self.last_snap: dict[str, int] = {}       # req_id -> last valid snapshot, when below k (`_draft`)
        #: requests whose last drafts the drafter did not make (`propose_fallback`, a cascade's
        #: level 0 alone): its snapshots hold none of them
        self.alone: set[str] = set()
        #: seconds of per-request one-off work (scans of a whole request), which `Goodput` does
        #: not count as a step's drafting cost
        self.once_seconds = 0.0

    @property
    def capacity(self) -> int:
        return self.buf[0][0].shape[0]

    @property
    def snapshots(self) -> int:
        """Snapshots per slot: 0..k, then `scratch` more."""
        return self.k + 1 + self.scratch

    def _grow(self, n: int) -> None:
        k1, f32 = self.snapshots, torch.float32
        old = self.capacity if self.buf else 0
        new = [(torch.zeros(n, k1, L.conv_dim, L.K - 1, dtype=f32), torch.zeros(n, k1, L.H, L.P, L.N, dtype=f32))
               for L in self.d.layers]
        for (c, s), (oc, os_) in zip(new, self.buf):
            c[:old], s[:old] = oc, os_
        self.buf = new
        self.free += list(range(n - 1, old - 1, -1))

    def release(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        self.ntok.pop(req_id, None)
        self.spine.pop(req_id, None)
        self.last_snap.pop(req_id, None)
        self.alone.discard(req_id)
        if slot is not None:
            self.free.append(slot)

    def state_nbytes(self, req_id: str) -> int:
        """Bytes one request holds: its slot (fixed size, whatever its context length)."""
        return sum(c.nbytes + s.nbytes for c, s in self.buf) // self.capacity

    def _slot(self, req_id: str) -> int:
        if req_id not in self.slots:
            if not self.free:
                self._grow(2 * self.capacity)
            self.slots[req_id] = self.free.pop()
        return self.slots[req_id]

    @torch.no_grad()
    def _scan(self, req_id: str, tokens: np.ndarray, snap: int | None) -> None:
        """Snapshot 0 := the state after `tokens`, fed from snapshot `snap` (None: from scratch:
        a new or resumed request, its seconds counted in `once_seconds`)."""
        if snap is None:
            t0 = self.clock()
            try:
                self._scan_from(req_id, tokens, snap)
            finally:
                self.once_seconds += self.clock() - t0
        else:
            self._scan_from(req_id, tokens, snap)

    def _scan_from(self, req_id: str, tokens: np.ndarray, snap: int | None) -> None:
        slot = self._slot(req_id)
        if len(tokens):
            ids = torch.from_numpy(np.array(tokens, dtype=np.int64))[None]
            init = None if snap is None else [(c[slot, snap][None], s[slot, snap][None]) for c, s in self.buf]
            if snap is not None and ids.shape[1] <= self.STEP_SCAN and self.kernel is not None:
                sl, src, zero = torch.tensor([slot]), torch.tensor([snap]), torch.zeros(1, dtype=torch.int64)
                for t in range(ids.shape[1]):   # snapshot snap -> snapshot 0, in place
                    self.d.step_into(ids[:, t], self.buf, sl, src if t == 0 else zero, zero, self.kernel, hidden=False)
                return
            if init is not None and ids.shape[1] <= self.STEP_SCAN:
                st = init              # a short catch-up: recurrent steps, not a scan padded to a chunk
                for t in range(ids.shape[1]):
                    _, st = self.d.step(ids[:, t], st)
            else:
                _, st = self.d(ids, init)
            for (c, s), (cs, ss) in zip(self.buf, st):
                c[slot, 0], s[slot, 0] = cs[0], ss[0]
        elif snap is None:
            for c, s in self.buf:
                c[slot, 0], s[slot, 0] = 0, 0
        elif snap:
            for c, s in self.buf:
                c[slot, 0], s[slot, 0] = c[slot, snap], s[slot, snap]

    def before_last(self, req, a: int | None = None) -> int:
        """Snapshot index, in the request's slot, of the drafter state after all its tokens but
        the last. Last step's drafts accepted: snapshot[accepted] (`a`: accepted tokens that are
        the drafter's own chain, default all accepted). Tokens the drafter has not seen (steps
        without drafts, a tree's sibling): a scan of just those, from the last valid snapshot.
        New, resumed after preemption, or out of step: one scan over the whole request. Past the
        last valid snapshot (`_draft` does not feed its last draft): a scan from that one."""
        rid, n = req.req_id, len(req.token_ids)
        a = req.num_accepted if a is None else a
        prev = self.ntok.get(rid)
        if prev is None or a > self.k or prev + a > n - 1:
            self._scan(rid, req.token_ids[:n - 1], None)
            return 0
        s = min(a, self.last_snap.get(rid, self.k))
        if prev + s < n - 1:
            self._scan(rid, req.token_ids[prev + s:n - 1], s)
            return 0
        return s

    def own_accepted(self, req, a: int | None = None) -> int | None:
        """`a` (last step's accepted drafts the snapshots hold; None: all accepted), or 0 when
        the drafter did not make last step's drafts (`alone`)."""
        if req.req_id in self.alone:
            self.alone.discard(req.req_id)
            return 0
        return a

    def propose_fallback(self, ctx: StepContext) -> list:
        """N-gram lookup in each request's own text, the drafter skipped: what `Goodput` drafts
        while the drafter does not pay. Classes from `ALONE` on."""
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        k = ctx.budget(self.k)
        out: list[list[int]] = [[] for _ in ctx.requests]
        self.classes = [[] for _ in ctx.requests]
        for i, req in enumerate(ctx.requests):
            if not req.sampled:
                continue
            self.skip(req, self.own_accepted(req))
            if k:
                out[i], self.classes[i] = ngram_alone(req.token_ids, k, *NGRAM_ALONE, self.ALONE)
                if out[i]:
                    self.alone.add(req.req_id)
        return out

    def skip(self, req, a: int | None = None) -> None:
        """A step without drafts for this request: keep the state of what was accepted."""
        prev, a = self.ntok.get(req.req_id), req.num_accepted if a is None else a
        if prev is None or not a:
            return
        if a > self.k or prev + a > len(req.token_ids) - 1:
            self.release(req.req_id)
            return
        s = min(a, self.last_snap.get(req.req_id, self.k))
        self._scan(req.req_id, req.token_ids[prev + s:prev + a], s)   # snapshot a (or s + scan) -> snapshot 0
        self.ntok[req.req_id] = prev + a

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> list:
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        out: list[list[int]] = [[] for _ in ctx.requests]
        self.classes = [[] for _ in ctx.requests]
        sel, ids, conf = self._draft(ctx, [i for i, r in enumerate(ctx.requests) if r.sampled], ctx.budget(self.k), 1)
        if sel:
            ids, cls = ids[..., 0].tolist(), confidence_classes(conf[..., 0]).tolist()   # the one host sync
            for i, d, c in zip(sel, ids, cls):
                out[i], self.classes[i] = d, c
        return out

    @torch.no_grad()
    def _draft(self, ctx: StepContext, rows, depth: int, width: int, tree: bool = False):
        """One drafter pass for rows `rows` of the batch (the other live rows skip): the state
        after each row's tokens, then greedy recurrent steps, snapshot j = the state after j
        drafts (j < depth: the last draft is fed next step, only if it was accepted, which saves
        one step of k+1); at each step its top `width` (ids, probabilities). Returns (rows drafted,
        ids [rows, depth, width], probs [rows, depth, width]), still on the device (static
        shapes, no host sync in the loop). `tree`: last step's drafts were `draft_tree`'s, whose
        accepted path may leave the greedy chain (`_on_spine`)."""
        rows = set(rows) if depth else set()
        sel, slots, snap, last = [], [], [], []
        for i, req in enumerate(ctx.requests):
            if not req.sampled:
                continue
            a = None
            if tree:
                a = self._on_spine(req)
                self.spine.pop(req.req_id, None)
            a = self.own_accepted(req, a)
            if i not in rows:
                self.skip(req, a)
                continue
            snap.append(self.before_last(req, a))
            sel.append(i), slots.append(self.slots[req.req_id]), last.append(int(req.token_ids[-1]))
            self.ntok[req.req_id] = len(req.token_ids)
            self.last_snap[req.req_id] = depth - 1
        if not sel:
            return sel, None, None
        sl, sn = torch.tensor(slots), torch.tensor(snap)
        toks, probs, kernel = [], [], self.kernel
        if kernel is not None:          # states stay in the buffers: snapshot j -> j + 1 in place
            at = [torch.full_like(sl, j) for j in range(depth)]
            h = self.d.step_into(torch.tensor(last), self.buf, sl, sn, at[0], kernel)
        else:
            h, st = self.d.step(torch.tensor(last), [(c[sl, sn], s[sl, sn]) for c, s in self.buf])
        for j in range(depth):
            if kernel is None:
                for (c, s), (cb, sb) in zip(st, self.buf):
                    cb[sl, j], sb[sl, j] = c, s
            p, t = torch.softmax(self.d.logits(h), -1).topk(width, -1)
            t = self.d.draft_vocab[t]
            toks.append(t), probs.append(p)
            if j + 1 < depth:   # the last draft is fed only if accepted, next step (`before_last`)
                if kernel is not None:
                    h = self.d.step_into(t[:, 0], self.buf, sl, at[j], at[j + 1], kernel)
                else:
                    h, st = self.d.step(t[:, 0], st)
        return sel, torch.stack(toks, 1), torch.stack(probs, 1)

    def _on_spine(self, req) -> int:
        """Accepted tokens of the last verified tree that are the drafter's own greedy chain (the
        snapshots hold its states): the common prefix of the accepted path and that chain."""
        spine = self.spine.get(req.req_id)
        if not req.drafts or not spine:
            return 0
        a = 0
        for x, y in zip(req.sampled[:-1], spine):
            if x != y:
                break
            a += 1
        return a

    def draft_tree(self, ctx: StepContext, rows, depth: int, width: int) -> dict[int, tuple]:
        """Tree candidates for `bandit_tree`, for rows `rows` of the batch (the other live rows
        skip): the drafter's greedy chain of `depth` tokens (the spine; its states are the
        snapshots, so a rejection anywhere rolls back as for a chain) and, at each depth, its next
        `width - 1` best tokens as leaves under the spine's node above. A sibling that gets
        accepted is fed from the snapshot where it left the spine next step (`_on_spine`, the
        catch-up scan). Returns {row: (tokens, parents, scores)}, parents before children, a
        node's score its drafter probability times its spine ancestors' (its chance of being
        reached and accepted, were the drafter calibrated). One drafter pass (`_draft`), one
        host sync."""
        w = max(1, min(width, self.d.draft_vocab.numel()))
        sel, T, P = self._draft(ctx, rows, min(depth, self.k), w, tree=True)
        if not sel:
            return {}
        T, P = T.tolist(), P.tolist()                   # [rows, depth, w]: the one host sync
        out = {}
        for i, tr, pr in zip(sel, T, P):
            tokens, parents, scores = [], [], []
            up, reach = -1, 1.0                        # spine node above, its score
            for tj, pj in zip(tr, pr):
                node = len(tokens)
                for x, q in zip(tj, pj):
                    tokens.append(x), parents.append(up), scores.append(reach * q)
                up, reach = node, scores[node]
            out[i] = (tokens, parents, scores)
            self.spine[ctx.requests[i].req_id] = [tj[0] for tj in tr]
        return out


def target_embeddings(target_dir: str):
    """(input embeddings, output head) of a target folder's safetensors; head = embeddings when tied."""
    import glob
    import os

    from safetensors import safe_open
    found = {}
    for f in sorted(glob.glob(os.path.join(target_dir, "*.safetensors"))):
        with safe_open(f, "pt") as fh:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in fh.keys():
                    found[name] = fh.get_tensor(name)
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"the mamba drafter shares the target's embeddings, but {target_dir!r} has no "
                         "model.embed_tokens.weight in its safetensors")
    emb = found["model.embed_tokens.weight"]
    return emb, found.get("lm_head.weight", emb).float()


def load_drafter(path, embed: torch.Tensor, head: torch.Tensor,
                 matmul_dtype: "torch.dtype | str" = torch.float32,
                 fallback: torch.dtype = torch.bfloat16) -> StateSpaceDrafter:
    """A drafter folder (config.json + model.safetensors) over the target's embeddings / head;
    its matmuls in `matmul_dtype` (`StateSpaceDrafter.matmuls_in`, with its `fallback`)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    cfg = json.loads((Path(path) / "config.json").read_text())
    w = load_file(str(Path(path) / "model.safetensors"))
    d = StateSpaceDrafter(cfg, embed, head.float(), w["draft_vocab"]).float()
    d.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in w.items()})
    return (d if matmul_dtype == torch.float32 else d.matmuls_in(matmul_dtype, fallback)).eval()
