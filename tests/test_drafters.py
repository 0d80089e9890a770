"""The drafter pipeline (vllm_spec_plugins.drafters): the EAGLE head computes what vLLM's
EagleLlamaForCausalLM computes (checked against transformers' Llama layer with the same weights),
and its export loads into vLLM's own `eagle` method."""
import json

import pytest
import torch

from vllm_spec_plugins import drafters


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
    a, c = torch.load(tmp_path / "a" / "drafter.ckpt")["drafter"], torch.load(tmp_path / "c" / "drafter.ckpt")["drafter"]
    assert all(torch.equal(a[k], c[k]) for k in a)
    fresh = drafters.new_drafter(drafters.load_target(tiny_model, torch.float32), seed=3).state_dict()
    assert not all(torch.equal(a[k], fresh[k]) for k in a)                  # training moved them


@pytest.mark.slow      # the default suite serves the shipped drafter (tests/test_serve.py, eagle YAML)
def test_export_runs_in_vllm_eagle_lossless(tiny_model, tmp_path):
    """vLLM's own `eagle` method loads an exported drafter (every weight name known to it) and
    its greedy output equals plain vLLM's (float32)."""
    from vllm_spec_plugins.data import make_prompts
    from vllm_spec_plugins.runner import run_isolated
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
def test_shipped_drafter_accepts_in_vllm_what_it_accepts_offline(default_model):
    """The shipped SmolLM2 drafter inside vLLM's `eagle` (k=1, float32): greedy output equals plain
    vLLM's, and vLLM's accepted-token counter equals what the same weights accept when replayed
    here in torch (so vLLM computes the drafter this project trained: layout, rotary, fc order)."""
    from vllm_spec_plugins.data import make_prompts
    from vllm_spec_plugins.runner import run_isolated
    rows = make_prompts(categories=("chat", "code"), n_per_category=4)
    job = {"model": default_model, "groups": {"all": rows}, "max_tokens": 32, "temperature": 0.0,
           "batch_size": 1, "dtype": "float32", "llm_kwargs": {"enforce_eager": True}}
    plain = run_isolated(job)["groups"]["all"]
    spec = run_isolated({**job, "speculative_config": {"method": "eagle", "num_speculative_tokens": 1,
                                                       "model": str(drafters.shipped_drafter())}})["groups"]["all"]
    assert spec["outputs"] == plain["outputs"]
    tm = drafters.load_target(default_model, torch.float32)
    d = drafters.load_exported(drafters.shipped_drafter(), tm)
    offline = sum(drafters.greedy_chain1_accepted(d, tm, p, o[0])
                  for p, o in zip(plain["prompt_token_ids"], plain["outputs"]))
    assert spec["accepted"] > 0.2 * spec["drafts"]             # it is a drafter, not noise
    assert abs(spec["accepted"] - offline) <= len(rows) + 0.1 * offline, (spec["accepted"], offline)
