"""Tests for vllm_spec_plugins.tools.models (local model folders) and vllm_spec_plugins.tools.data (prompts).

Fast tests build a tiny random model (seconds). The GGUF -> HF conversion of the default model
is marked slow (run with ``-m slow``).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

try:
    import vllm_spec_plugins  # noqa: F401
except ImportError:  # running pytest without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_spec_plugins.tools import data as D  # noqa: E402
from vllm_spec_plugins.tools import models as M  # noqa: E402


def _sha256(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------
def test_split_of_is_stable_and_grouped():
    # Pinned values: changing the hash would silently move heldout items into training.
    assert D.split_of("8NfdthH_0") == "heldout"
    assert D.split_of("QWJhYvA_0") == "train"
    assert D.split_of("HumanEval/0") == "train"
    for i in ["8NfdthH_0", "QWJhYvA_0", "HumanEval/7", "x"]:
        assert D.split_of(i) == D.split_of(i) in D.SPLITS
    # row-id forms and sibling parts of one ShareGPT conversation agree
    assert D.split_of("sharegpt:8NfdthH_0") == D.split_of("8NfdthH_3") == D.split_of(
        "sharegpt:8NfdthH_5#summarize-1") == "heldout"
    assert D.split_of("humaneval:HumanEval/7") == D.split_of("HumanEval/7")
    # roughly 10 % heldout
    frac = sum(D.split_of(f"id{i}") == "heldout" for i in range(20000)) / 20000
    assert 0.08 < frac < 0.12


def test_iter_json_array_truncated():
    text = '[\n {"id": "a", "v": [1, 2]},\n {"id": "b", "v": "x,]"} ,{"id": "c", "v": "unterm'
    assert [o["id"] for o in D.iter_json_array(text)] == ["a", "b"]
    assert list(D.iter_json_array("[1, 2, 3]")) == [1, 2, 3]
    assert list(D.iter_json_array("[]")) == []


def test_load_sharegpt_recovers_conversations():
    convs = D.load_sharegpt()
    assert len(convs) > 17000  # ~17,671 complete objects before the truncation
    assert all("id" in c and isinstance(c["conversations"], list) for c in convs)


def test_splits_are_disjoint_and_cover_everything():
    train = {c["id"] for c in D.sharegpt_conversations("train")}
    held = {c["id"] for c in D.sharegpt_conversations("heldout")}
    everything = {c["id"] for c in D.sharegpt_conversations("all")}
    assert train and held
    assert not train & held
    assert train | held == everything
    assert 0.06 < len(held) / len(everything) < 0.14
    # no heldout conversation *group* appears in train
    assert not {D.split_key(i) for i in train} & {D.split_key(i) for i in held}
    D.assert_no_heldout(train)
    with pytest.raises(ValueError):
        D.assert_no_heldout(list(train)[:5] + [next(iter(held))])

    he_train = {p["task_id"] for p in D.humaneval_problems("train")}
    he_held = {p["task_id"] for p in D.humaneval_problems("heldout")}
    assert len(he_train) + len(he_held) == 164 and not he_train & he_held and he_held

    for split in D.SPLITS:
        rows = D.make_prompts(n_per_category=15, split=split)
        assert {D.split_of(r["id"]) for r in rows} == {split}


# ---------------------------------------------------------------------------------------------
# prompt sets
# ---------------------------------------------------------------------------------------------
def test_prompt_rows_well_formed_and_deterministic():
    rows = D.make_prompts(n_per_category=8, split="heldout", seed=0)
    assert rows == D.make_prompts(n_per_category=8, split="heldout", seed=0)
    by_cat: dict[str, list] = {}
    for r in rows:
        assert set(r) == {"category", "messages", "id"}
        assert isinstance(r["id"], str) and r["id"]
        msgs = r["messages"]
        assert isinstance(msgs, list) and len(msgs) == 1
        assert msgs[0]["role"] == "user" and isinstance(msgs[0]["content"], str)
        assert msgs[0]["content"].strip()
        by_cat.setdefault(r["category"], []).append(r)
    assert set(by_cat) == {"chat", "code", "summarize"}
    assert all(len(v) == 8 for v in by_cat.values())
    assert len({r["id"] for r in rows}) == len(rows)

    for r in by_cat["chat"]:
        text = r["messages"][0]["content"]
        assert D.CHAT_MIN_CHARS <= len(text) <= D.CHAT_MAX_CHARS
        assert r["id"].startswith("sharegpt:") and D.is_englishish(text)
    for r in by_cat["summarize"]:
        text = r["messages"][0]["content"]
        assert text.startswith("Summarize the following text:\n\n")
        assert len(text) - len(D.SUMMARIZE_INSTRUCTION) >= D.SUMMARIZE_MIN_CHARS
        assert r["id"].startswith("sharegpt:") and "#summarize-" in r["id"]
    for r in by_cat["code"]:
        text = r["messages"][0]["content"]
        assert text.startswith("Complete the following Python function:\n```python\n")
        assert text.endswith("```") and "def " in text
        assert r["id"].startswith("humaneval:HumanEval/")

    # other seeds pick other prompts; categories subset; n respected
    other = D.make_prompts(categories=("chat",), n_per_category=8, split="heldout", seed=1)
    assert [r["id"] for r in other] != [r["id"] for r in by_cat["chat"]]
    assert {r["category"] for r in other} == {"chat"}
    with pytest.raises(ValueError):
        D.make_prompts(categories=("poetry",))
    with pytest.raises(ValueError):
        D.make_prompts(split="test")


def test_make_prompts_max_tokens(tiny_dir):
    rows = D.make_prompts(categories=("chat", "summarize"), n_per_category=5, split="heldout",
                          max_prompt_tokens=300, tokenizer_dir=tiny_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    assert len(rows) == 10
    for r in rows:
        # the chat template adds ~30 tokens on top of the content
        assert len(tok.encode(r["messages"][0]["content"], add_special_tokens=False).ids) <= 300


def test_jsonl_roundtrip(tmp_path):
    rows = D.make_prompts(n_per_category=2)
    p = D.write_jsonl(rows, tmp_path / "sub" / "p.jsonl")
    assert D.read_jsonl(p) == rows
    assert len(p.read_text(encoding="utf-8").splitlines()) == len(rows)


def test_make_prompts_cli(tmp_path):
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "heldout.jsonl"
    subprocess.run([sys.executable, str(repo / "scripts" / "make_prompts.py"), "--split", "heldout",
                    "--n", "3", "--out", str(out)], check=True, cwd=repo)
    rows = D.read_jsonl(out)
    assert rows == D.make_prompts(n_per_category=3, split="heldout")


# ---------------------------------------------------------------------------------------------
# tiny model + tokenizer checks
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    M.build_tiny_model(d, seed=0)
    return str(d)


def test_tiny_model_builds_fast_and_loads(tiny_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = Path(tiny_dir)
    assert M.is_complete(d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 49152
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert M.model_vocab_size(d) == 49152
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert size < 20e6, size

    # rebuild with the same seed (tokenizer now copied): byte-identical weights
    again = M.build_tiny_model(tmp_path / "again", seed=0, tokenizer_dir=d)
    assert _sha256(again / "model.safetensors") == _sha256(d / "model.safetensors")
    other = M.build_tiny_model(tmp_path / "other", seed=1, tokenizer_dir=d)
    assert _sha256(other / "model.safetensors") != _sha256(d / "model.safetensors")
    # force=False reuses a complete folder built with the same arguments
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert M.build_tiny_model(again, seed=0, tokenizer_dir=d, force=False) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert len(tok) == 49152
    assert model.get_input_embeddings().weight.shape[0] == 49152
    assert model.config.vocab_size == 49152
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert len(out) == 24
    assert len(set(out.tolist())) > 4  # not a constant / single-token loop
    with torch.no_grad():
        p = model(**ids).logits[0, -1].softmax(-1)
    assert 0.05 < p.max().item() < 0.999  # peaky but not one-hot (logit_scale)


def test_same_tokenizer(tiny_dir, tmp_path):
    d = Path(tiny_dir)
    other = M.build_tiny_model(tmp_path / "other", seed=3, hidden=32, num_layers=1, tokenizer_dir=d)
    ok, reason = M.same_tokenizer(d, other)
    assert ok, reason

    if M.is_complete(M.default_model_dir()):
        ok, reason = M.same_tokenizer(d, M.default_model_dir())
        assert ok, reason

    # a tokenizer with a changed vocab (two tokens swapped) is refused
    changed = tmp_path / "changed"
    shutil.copytree(d, changed)
    tj = json.loads((changed / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (changed / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    ok, reason = M.same_tokenizer(d, changed)
    assert not ok and "vocab" in reason

    # a different vocab_size is refused too
    bigger = tmp_path / "bigger"
    shutil.copytree(d, bigger)
    cfg = json.loads((bigger / "config.json").read_text())
    cfg["vocab_size"] = 49216
    (bigger / "config.json").write_text(json.dumps(cfg))
    ok, reason = M.same_tokenizer(d, bigger)
    assert not ok and "vocab_size" in reason


def test_default_model_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(M.CACHE_ENV, str(tmp_path))
    assert M.default_model_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv(M.CACHE_ENV)
    assert M.default_model_dir() == Path.home() / ".cache" / "vllm_spec_plugins" / "smollm2-135m-instruct"
    assert M.gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------------------------------------
# default model (GGUF -> HF), slow
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_conversion():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = M.build_default_model()  # cached after the first build (~1 min)
    assert M.is_complete(d)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        assert (d / f).is_file(), f
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    size = (d / "model.safetensors").stat().st_size
    assert 260e6 < size < 280e6, size
    marker = json.loads((d / M.MARKER_FILE).read_text())
    assert marker["sha256"]["model.safetensors"] == _sha256(d / "model.safetensors")
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tcfg["chat_template"]

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert text and "4" in text, text
