"""The drafter pipeline (vllm_spec_plugins.tools.drafters): the EAGLE head computes what vLLM's
EagleLlamaForCausalLM computes (checked against transformers' Llama layer with the same weights),
and its export loads into vLLM's own `eagle` method."""
import json

import pytest
import torch

from vllm_spec_plugins.tools import drafters


def _hf_layer(cfg_dict, d):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures",)})
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    sd = {k.replace("layers.0.", ""): v for k, v in d.layer_state_dict().items() if k != "fc.weight"}
    missing = layer.load_state_dict(sd, strict=False).missing_keys
    assert missing == ["input_layernorm.weight"]
    layer.input_layernorm = torch.nn.Identity()      # EAGLE-1 drops the first layer's input norm
    return layer, LlamaRotaryEmbedding(cfg)


def test_eagle_head_matches_transformers_llama_layer(tiny_model):
    tm = drafters.load_target(tiny_model, torch.float32)
    d = drafters.new_drafter(tm, seed=0)
    with torch.no_grad():
        for p in d.parameters():                     # break the pass-through init: general weights
            p.add_(torch.randn_like(p) * 0.05)
    cfg = tm.config.to_dict()
    layer, rope = _hf_layer(cfg, d)
    T = 11
    ids = torch.randint(0, cfg["vocab_size"], (1, T))
    hid = torch.randn(1, T, cfg["hidden_size"])
    pos = torch.arange(5, 5 + T)[None]               # an offset window: positions must be absolute
    with torch.no_grad():
        ours = d(ids, hid, pos)
        x = d.fc(torch.cat([torch.nn.functional.embedding(ids, d.embed), hid], -1))
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        ref = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))
        ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # logits go through the target's head (tied embeddings here)
    torch.testing.assert_close(d.logits(ours), ours @ tm.lm_head.weight.T)


def _fake_generations(work, target, n=6, length=40, seed=0):
    """Teacher answers without an engine: the `cache` and `train` stages only need token ids."""
    g = torch.Generator().manual_seed(seed)
    rows = [{"id": f"fake:{i}", "category": "chat", "prompt": torch.randint(3, 1000, (length,), generator=g).tolist(),
             "answer": torch.randint(3, 1000, (length // 2,), generator=g).tolist()} for i in range(n)]
    work.mkdir(parents=True, exist_ok=True)
    (work / "gen_00000.json").write_text(json.dumps(rows))


def test_a_second_work_folder_holds_new_prompts_and_trains_after_the_first(tiny_model, tmp_path):
    """--chat-from N continues the training order where a first folder stopped (no prompt twice),
    and --also appends that folder's rows after --work's, so --work's held-back rows stay put."""
    ids = lambda rows: [r["id"] for r in rows]                        # noqa: E731
    both = drafters.training_rows(5, 0, 0, 512, tiny_model)
    first = drafters.training_rows(3, 0, 0, 512, tiny_model)
    second = drafters.training_rows(2, 0, 0, 512, tiny_model, chat_from=3)
    assert len(both) == 5 and ids(first) + ids(second) == ids(both)
    for w, seed in (("a", 0), ("b", 1)):
        _fake_generations(tmp_path / w, tiny_model, seed=seed)
        drafters.cache(tiny_model, tmp_path / w, max_len=48)
    a, b = drafters.load_cache(tmp_path / "a"), drafters.load_cache(tmp_path / "b")
    ab = drafters.load_cache(tmp_path / "a", [tmp_path / "b"])
    assert len(ab) == 12 and all(torch.equal(x["ids"], y["ids"]) for x, y in zip(ab, a + b))
    assert not torch.equal(a[0]["ids"], b[0]["ids"])


def test_cache_train_resume_deterministic(tiny_model, tmp_path):
    """Same seed, same steps -> same weights, whether trained in one call or two (resumed)."""
    for w in ("a", "b"):
        _fake_generations(tmp_path / w, tiny_model)
        drafters.cache(tiny_model, tmp_path / w, max_len=48)
    rows = drafters.load_cache(tmp_path / "a")
    assert len(rows) == 6 and rows[0]["hidden"].shape == (48, 64) and rows[0]["topk_idx"].shape == (48, 32)
    assert rows[0]["answer_start"] == 48 - 20 and rows[0]["position0"] == 12   # 60 tokens, tail 48
    kw = dict(seed=3, lr=1e-3, batch_tokens=64, max_len=32)
    drafters.train(tiny_model, tmp_path / "a", minutes=5, steps=4, **kw)
    drafters.train(tiny_model, tmp_path / "b", minutes=5, steps=2, **kw)   # stops at 2 of 2 ...
    ck = torch.load(tmp_path / "b" / "drafter.ckpt")
    assert ck["step"] == 2
    # ... a later call with a longer schedule continues from step 2 (LR schedule differs: compare
    # only that it resumed, then a fresh 4-step run twice for determinism)
    drafters.train(tiny_model, tmp_path / "b", minutes=5, steps=4, **kw)
    assert torch.load(tmp_path / "b" / "drafter.ckpt")["step"] == 4
    (tmp_path / "c").mkdir()
    for f in ("gen_00000.json", "cache_00000.pt"):
        (tmp_path / "c" / f).write_bytes((tmp_path / "a" / f).read_bytes())
    drafters.train(tiny_model, tmp_path / "c", minutes=5, steps=4, **kw)
    a = torch.load(tmp_path / "a" / "drafter.ckpt")["drafter"]
    c = torch.load(tmp_path / "c" / "drafter.ckpt")["drafter"]
    assert all(torch.equal(a[k], c[k]) for k in a)
    fresh = drafters.new_drafter(drafters.load_target(tiny_model, torch.float32), seed=3).state_dict()
    assert not all(torch.equal(a[k], fresh[k]) for k in a)                  # training moved them


def test_unrolled_steps_are_the_drafting_loop(tiny_model):
    """Training-time test: draft step s at place i (the masked, batched form `drafter_loss` trains)
    equals running the drafter over the real prefix and then its own drafts one by one, as
    vLLM's EAGLE loop does: real entries (token i+1, target hidden i) up to place i, then
    (token i+2, the drafter's output at i), then (token i+3, its output of that)."""
    d = drafters.new_drafter(drafters.load_target(tiny_model, torch.float32), seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
        T, h = 12, d.fc.weight.shape[0]
        ids, hid = torch.randint(0, 200, (1, T)), torch.randn(1, T, h)
        pos = torch.arange(T)[None] + 5
        L = T - 1
        out1, kv = d.step(ids[:, 1:], hid[:, :-1], pos[:, :L])
        nxt = torch.zeros(1, L, dtype=torch.long)
        nxt[:, :T - 2] = ids[:, 2:]
        out2, kv = d.step(nxt, out1, pos[:, :L] + 1, kv)
        nxt3 = torch.zeros(1, L, dtype=torch.long)
        nxt3[:, :T - 3] = ids[:, 3:]
        out3, _ = d.step(nxt3, out2, pos[:, :L] + 2, kv)
        assert not torch.allclose(out2, out1, atol=1e-3)       # the unrolled steps differ
        for i in (0, 3, 8):
            seq_ids = torch.cat([ids[0, 1:i + 2], ids[0, i + 2:i + 4]])[None]
            seq_hid = torch.cat([hid[0, :i + 1], out1[0, i:i + 1], out2[0, i:i + 1]])[None]
            seq_pos = torch.cat([pos[0, :i + 1], pos[0, i:i + 1] + 1, pos[0, i:i + 1] + 2])[None]
            ref = d(seq_ids, seq_hid, seq_pos)[0]
            torch.testing.assert_close(ref[i], out1[0, i], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ref[i + 1], out2[0, i], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ref[i + 2], out3[0, i], atol=1e-4, rtol=1e-4)


def test_unrolled_loss_trains(tiny_model, tmp_path):
    """unroll=2 runs end to end (reports agreement for both draft steps) and is deterministic."""
    _fake_generations(tmp_path / "a", tiny_model)
    drafters.cache(tiny_model, tmp_path / "a", max_len=48)
    kw = dict(seed=3, lr=1e-3, batch_tokens=64, max_len=32, unroll=2)
    drafters.train(tiny_model, tmp_path / "a", minutes=5, steps=3, **kw)
    rep = json.loads((tmp_path / "a" / "train_report.json").read_text())
    assert rep["unroll"] == 2 and len(rep["val_agreement_per_step"]) == 3
    assert len(rep["train_tail"][-1]["agree"]) == 2
    first = torch.load(tmp_path / "a" / "drafter.ckpt")["drafter"]
    (tmp_path / "a" / "drafter.ckpt").unlink()
    drafters.train(tiny_model, tmp_path / "a", minutes=5, steps=3, **kw)
    again = torch.load(tmp_path / "a" / "drafter.ckpt")["drafter"]
    assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.slow
def test_export_runs_in_vllm_eagle_lossless(tiny_model, tmp_path):
    """vLLM's own `eagle` method loads an exported drafter (every weight name known to it) and
    its greedy output equals plain vLLM's (float32)."""
    from vllm_spec_plugins.tools.data import make_prompts
    from vllm_spec_plugins.tools.runner import run_isolated
    d = drafters.new_drafter(drafters.load_target(tiny_model, torch.float32), seed=0)
    path = drafters.export_drafter(d, tiny_model, tmp_path / "eagle")
    assert json.loads((path / "drafter.json").read_text())["target_hidden_size"] == 64
    rows = make_prompts(categories=("chat", "code"), n_per_category=3)
    job = {"model": tiny_model, "groups": {"all": rows}, "max_tokens": 24, "temperature": 0.0,
           "batch_size": 4, "dtype": "float32", "llm_kwargs": {"enforce_eager": True}}
    plain = run_isolated(job)["groups"]["all"]
    spec = run_isolated({**job, "speculative_config": {"method": "eagle", "model": str(path),
                                                       "num_speculative_tokens": 3}})["groups"]["all"]
    assert spec["outputs"] == plain["outputs"]
    assert spec["drafts"] > 0


def test_drafter_for_another_tokenizer_is_refused(tiny_model, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_spec_plugins
    vllm_spec_plugins.register()
    d = drafters.new_drafter(drafters.load_target(tiny_model, torch.float32), seed=0)
    path = drafters.export_drafter(d, tiny_model, tmp_path / "eagle")
    meta = json.loads((path / "drafter.json").read_text())
    (path / "drafter.json").write_text(json.dumps({**meta, "target_tokenizer": "0" * 40}))
    args = EngineArgs(model=tiny_model, speculative_config={"method": "eagle", "model": str(path),
                                                            "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="drafter for another tokenizer"):
        args.create_engine_config()


@pytest.mark.slow
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.extended), 3])   # k=3 feeds features back
def test_shipped_drafter_accepts_in_vllm_what_it_accepts_offline(default_model, k):
    """The shipped SmolLM2 drafter inside vLLM's `eagle` (float32): greedy output equals plain
    vLLM's, and vLLM's accepted-token counter equals what the same weights accept when replayed
    here in torch (so vLLM computes the drafter this project trained: layout, rotary, fc order,
    and at k=3 the drafter's own features fed back, as the training-time test trains it)."""
    from vllm_spec_plugins.tools.data import make_prompts
    from vllm_spec_plugins.tools.runner import run_isolated
    rows = make_prompts(categories=("chat", "code"), n_per_category=4)
    job = {"model": default_model, "groups": {"all": rows}, "max_tokens": 32, "temperature": 0.0,
           "batch_size": 1, "dtype": "float32", "llm_kwargs": {"enforce_eager": True}}
    plain = run_isolated(job)["groups"]["all"]
    spec = run_isolated({**job, "speculative_config": {"method": "eagle", "num_speculative_tokens": k,
                                                       "model": str(drafters.shipped_drafter())}})["groups"]["all"]
    assert spec["outputs"] == plain["outputs"]
    tm = drafters.load_target(default_model, torch.float32)
    d = drafters.load_exported(drafters.shipped_drafter(), tm)
    offline = sum(drafters.greedy_chain_accepted(d, tm, p, o[0], k)
                  for p, o in zip(plain["prompt_token_ids"], plain["outputs"]))
    assert spec["accepted"] > 0.2 * spec["drafts"] / k          # it is a drafter, not noise
    assert abs(spec["accepted"] - offline) <= len(rows) + 0.1 * offline, (spec["accepted"], offline)


def test_teacher_cache_from_vllm_logprobs_is_the_targets_topk(tiny_model, tmp_path):
    """`generate --topk-from-vllm` writes teacher rows whose top-k at position i is the target's
    distribution of token i + 1 (checked against the target's own float32 logits), so an SSM
    drafter trains on them as on the `cache` stage's rows."""
    from vllm_spec_plugins.tools.data import make_prompts
    rows = make_prompts(categories=("chat", "code"), n_per_category=2)
    drafters.generate(tiny_model, tmp_path, rows, max_tokens=12, batch=4, dtype="float32",
                      topk_from_vllm=True, max_len=40)
    gens, cached = drafters._load_generations(tmp_path), drafters.load_cache(tmp_path)
    assert len(cached) == len(gens) == 4
    tm = drafters.load_target(tiny_model, torch.float32)
    for g, r in zip(gens, cached):
        full = g["prompt"] + g["answer"]
        cut = max(0, len(full) - 1 - 40)
        assert r["ids"].tolist() == full[cut:-1] and r["position0"] == cut
        assert r["answer_start"] == max(0, len(g["prompt"]) - cut) and r["topk_idx"].shape == (len(r["ids"]), 32)
        with torch.no_grad():
            logits = tm(torch.tensor([full[:-1]])).logits[0, cut:]
        ref = logits.topk(32, -1).indices
        assert (r["topk_idx"][:, 0] == ref[:, 0]).float().mean() >= 0.95          # the same token, same place
        a = r["answer_start"]
        assert r["topk_idx"][a - 1:, 0].tolist() == full[cut + a:]                 # greedy answers are the top-1
        lp = torch.log_softmax(logits, -1).topk(32, -1).values
        torch.testing.assert_close(r["topk_val"].float()[:, :8], lp[:, :8], atol=2e-2, rtol=1e-2)


def test_eagle_training_refuses_a_cache_without_hidden_states(tiny_model, tmp_path):
    torch.save([{"ids": torch.arange(8, dtype=torch.int32), "topk_idx": torch.zeros(8, 32, dtype=torch.int32),
                 "topk_val": torch.zeros(8, 32, dtype=torch.float16), "answer_start": 4, "position0": 0,
                 "category": "chat"}], tmp_path / "cache_00000.pt")
    with pytest.raises(SystemExit, match="no hidden states"):
        drafters.train(tiny_model, tmp_path, minutes=1, steps=1, seed=0, lr=1e-3, batch_tokens=8, max_len=8)


def test_transformer_baseline_has_the_mamba_drafters_parameter_count():
    """The `tau at least a same-size Transformer's` comparison: at the default target's width
    (576) the two trained kinds have the same number of parameters (within 0.1%)."""
    from vllm_spec_plugins.proposers.mamba import StateSpaceDrafter
    emb = torch.zeros(64, 576)
    n = {k: sum(p.numel() for p in StateSpaceDrafter({"kind": k, **drafters.SSM_SIZES[k]}, emb, emb,
                                                     torch.arange(8)).parameters())
         for k in ("mamba", "transformer")}
    assert abs(n["transformer"] / n["mamba"] - 1) < 1e-3, n
