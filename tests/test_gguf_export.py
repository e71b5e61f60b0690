"""GGUF out (issue 73): ``finetune export --gguf`` writes what llama.cpp runs, checked by llama.cpp itself.

llama.cpp runs in process (``xllamacpp``). Each family is a seeded tiny model of the conformance matrix's kinds
(Llama, Llama 3's rope scaling, Qwen2.5's tied head and q/k/v biases, Qwen3's q/k norms, Mistral with a
SentencePiece-style tokenizer too, Gemma-2's soft-caps and alternating 16-token windows, Gemma-3's 6-layer pattern and
local RoPE base), 2 layers (Gemma-3: 6), hidden
64, with the byte-level BPE tokenizer of ``data/models/gsm8k-bpe-8k`` and a chat template; its weights are scaled so
that greedy choices are not near-ties of a random model (an untied head at standard deviation 1; a tied one behind a
final norm of about 20, so it does not predict its input token) and attention is sharp (queries and keys at 0.3), so
a rotary layout written wrongly shows.

* **Every family, f16**: llama.cpp's greedy continuations of 10 prompts (32 tokens, token-id prompts) equal
  transformers' on the export for at least 9 and its log-probabilities of its tokens are within 2e-2 nats (mean
  absolute difference) of transformers' on the weights as written (rounded to float16); the chat endpoint replies
  what transformers replies through ``apply_chat_template``; llama.cpp tokenizes the text prompts as transformers.
* **Each type** (Llama): f32, bf16, q8_0, q4_0, q4_1 within :data:`finetune.lifecycle.gguf_export.BOUNDS` of
  transformers on the dequantized weights.
* **GGUF in, both ways**: a file written here loads back through transformers' GGUF loader into the same logits
  (and, for Llama and Mistral, the same tokenization; for Qwen the loader builds Qwen's own pre-tokenizer, which a
  real Qwen tokenizer has). The Qwen3 model has ``head_dim`` 128: the loader does not read ``key_length``.
* **LoRA**: the adapter as llama.cpp's GGUF LoRA adapter over the base's f16 file equals the merged export within the
  f16 bound (plain LoRA and rsLoRA's scale).
* **Refusals**, one line each, nothing written: an unsupported family, a type gguf-py cannot write, an output that
  exists, an export named without ``--gguf``, ``--gguf-adapter`` without an adapter, a DoRA adapter, and a run config's
  ``export_gguf`` with either mistake, before any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, REPO, finetune_here, refusals

gguf = pytest.importorskip("gguf")

from finetune.lifecycle import gguf_check, gguf_export  # noqa: E402

needs_llama_cpp = pytest.mark.skipif(not gguf_check.available(), reason="xllamacpp (llama.cpp) is not installed")

TOKENIZER = REPO / "data" / "models" / "gsm8k-bpe-8k"
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
COMMON = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0,
              eos_token_id=0, pad_token_id=0)
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama3": ("llama", dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2.5": ("qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1000000.0})),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=128)),  # transformers' GGUF loader assumes 128
    "mistral": ("mistral", dict(sliding_window=None)),
    "gemma2": ("gemma2", dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16,
                              head_dim=256, query_pre_attn_scalar=256,  # Gemma's: the GGUF loader assumes 256
                              layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("gemma3_text", dict(sliding_window=16, head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6)),
    "mistral-spm": ("mistral", dict(sliding_window=None, vocab_size=1000, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=2)),  # a SentencePiece-style tokenizer.json (spm_tokenizer)
}


def spm_tokenizer(root: Path):
    """A SentencePiece-style ``tokenizer.json`` as Mistral and Llama 2 ship it (BPE with byte fallback, ``▁`` for
    spaces, a BOS added), trained here on GSM8K questions (1,000 tokens: 3 special, 256 bytes, merges)."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")  # SentencePiece's pieces: "▁word"
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    texts = pq.read_table(REPO / "data" / "gsm8k" / "train.parquet", columns=["question"])["question"].to_pylist()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=special, initial_alphabet=[]))
    tok.pre_tokenizer = None  # then the form transformers' converter gives a SentencePiece model (Llama 2, Mistral)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    (root / "spm").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "spm" / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(root / "spm" / "tokenizer.json"), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def tiny_folder(root: Path, family: str, lora: dict | None = None) -> Path:
    """A seeded tiny model of ``family`` saved with the tokenizer and :data:`TEMPLATE` (the norms away from 1, so a
    norm in the wrong place shows); with ``lora`` (peft ``LoraConfig`` keywords) a LoRA export's layout instead: the
    merged model, ``adapter/`` and ``base/`` (the model before the adapters)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = root / f"tiny-{family}"
    if (out / "config.json").is_file():
        return out
    model_type, own = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(COMMON | own)), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name != "model.norm.weight":
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.3)  # sharp attention: the rotary embedding's layout shows
            elif model.config.tie_word_embeddings:  # a tied head predicts its input token unless the layers and
                if "embed_tokens" in name:  # the final norm outweigh the embedding
                    p.normal_(0, 0.05)
                elif "o_proj" in name or "down_proj" in name:
                    p.normal_(0, 0.2)
                elif name == "model.norm.weight":
                    p.normal_(20.0, 2.0)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0, 1.0)  # peaked logits: greedy choices that are not near-ties
    tokenizer = spm_tokenizer(root) if family == "mistral-spm" else AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = TEMPLATE.replace("<|endoftext|>", tokenizer.eos_token if family == "mistral-spm"
                                               else "<|endoftext|>")
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model.save_pretrained(out / "base")
        tokenizer.save_pretrained(out / "base")
        peft_model = get_peft_model(model, LoraConfig(**lora))
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        peft_model.save_pretrained(out / "adapter")
        model = peft_model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_models")


@needs_llama_cpp
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_runs_each_family_as_transformers(family, models, tmp_path):
    folder = tiny_folder(models, family)
    path = gguf_export.write_gguf(folder, tmp_path / "model-f16.gguf", "f16")
    result = gguf_export.verify_gguf(path, folder, "f16")  # raises past the bounds
    assert result["agree"] >= 9 and result["mean_abs_logprob_diff"] <= 2e-2, result
    if family == "mistral-spm":  # llama.cpp's SentencePiece merges follow the scores, which a tokenizer trained
        return  # here as BPE does not order as its merges (2 of 12 texts split otherwise); a converted SPM model does
    assert result["chat"]["equal"], result["chat"]
    assert result["mean_abs_logprob_diff_unrounded"] <= 2e-2, result
    assert json.loads(Path(str(path) + ".check.json").read_text())["passed"]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    with gguf_check.server(path) as srv:  # llama.cpp's own tokenization of the text gives the same continuation
        for text in [*gguf_check.PROMPTS[:4], "Il coûte 12 € : naïve café"]:  # bytes and accents too
            ids = tokenizer(text)["input_ids"]
            r = srv.handle_completions({"prompt": text, "n_predict": 4, "temperature": 0.0, "top_k": 1,
                                        "samplers": ["top_k"], "cache_prompt": False})
            assert r["usage"]["prompt_tokens"] == len(ids), (text, r["usage"], ids)
            assert r["choices"][0]["text"] == gguf_check.llama_greedy(srv, ids, 4)[0]


@needs_llama_cpp
@pytest.mark.parametrize("qtype", ["f32", "bf16", "q8_0", "q4_0", "q4_1"])
def test_each_type_within_its_bound(qtype, models, tmp_path):
    folder = tiny_folder(models, "llama")
    path = gguf_export.write_gguf(folder, tmp_path / gguf_export.file_name(qtype), qtype)
    result = gguf_export.verify_gguf(path, folder, qtype)
    assert result["passed"] and result["mean_abs_logprob_diff"] <= gguf_export.BOUNDS[qtype], result
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    want = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}[qtype]
    assert types["blk.0.attn_q.weight"] == want and types["blk.0.attn_norm.weight"] == "F32", types
    assert types["output.weight"] == ("Q8_0" if qtype.startswith("q4") else want), types


@pytest.mark.parametrize("family", ["llama", "qwen2.5", "qwen3", "mistral", "gemma2", "gemma3"])
def test_round_trip_through_transformers_gguf_loader(family, models, tmp_path):
    """f32 out, transformers' ``gguf_file=`` in: the same logits as the export (1e-5), the same tokenization."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_folder(models, family)
    path = gguf_export.write_gguf(folder, tmp_path / "model-f32.gguf", "f32")
    ids = torch.randint(1, 8192, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (ref(input_ids=ids).logits - back(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    if family in ("llama", "mistral"):  # for qwen2/qwen3 the loader builds Qwen's own pre-tokenizer, whatever the
        text = "Natalia sold clips to 48 of her friends in April."  # file's tokenizer.ggml.pre says
        assert (AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)(text)["input_ids"]
                == AutoTokenizer.from_pretrained(folder)(text)["input_ids"])


@needs_llama_cpp
@pytest.mark.parametrize("rslora", [False, True])
def test_lora_adapter_applied_by_llama_cpp_equals_the_merged_export(rslora, tmp_path):
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"], use_rslora=rslora)
    folder = tiny_folder(tmp_path, "llama", lora=lora)
    written = gguf_export.export_gguf(folder, tmp_path / "out", "f16", adapter=True, base=folder / "base")
    assert [p.name for p in written] == ["adapter-f16.gguf", "base-f16.gguf"]
    result = json.loads((tmp_path / "out" / "adapter-f16.gguf.check.json").read_text())
    assert result["passed"] and result["agree"] >= 9 and result["mean_abs_logprob_diff"] <= 2e-2, result
    reader = gguf.GGUFReader(written[0])
    alpha = reader.fields["adapter.lora.alpha"].parts[-1][0]
    assert abs(alpha - (8 * 2 if rslora else 8)) < 1e-6, alpha
    assert {"blk.1.attn_k.weight.lora_a", "blk.1.ffn_down.weight.lora_b"} <= {t.name for t in reader.tensors}


def test_modelfile_names_the_file_and_the_stop_tokens(models, tmp_path):
    folder = tiny_folder(models, "qwen3")
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [0], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    path = gguf_export.write_gguf(folder, tmp_path / "model-q8_0.gguf", "q8_0")
    text = gguf_export.write_modelfile(folder, path).read_text().splitlines()
    assert text == ["FROM ./model-q8_0.gguf", 'PARAMETER stop "<|endoftext|>"', "PARAMETER temperature 0.7",
                    "PARAMETER top_p 0.8", "PARAMETER top_k 20"], text
    meta = gguf.GGUFReader(path).fields
    assert bytes(meta["tokenizer.chat_template"].parts[-1]).decode() == TEMPLATE
    assert bytes(meta["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"


def _one_line(args, capsys) -> str:
    code, printed = finetune_here(args, capsys)
    lines = [line for line in printed.splitlines() if line.startswith("finetune: error:")]
    assert code == 2 and len(lines) == 1, printed
    return lines[0]


def test_refusals(models, tmp_path, capsys):
    llama = tiny_folder(models, "llama")
    gpt2 = REPO / "data" / "models" / "tiny-gpt2"
    assert "supports the model types gemma2, gemma3_text, llama, mistral, qwen2, qwen3" in _one_line(
        ["export", gpt2, tmp_path / "a", "--gguf", "f16"], capsys)
    assert "'q5_k' is not a GGUF type" in _one_line(["export", llama, tmp_path / "b", "--gguf", "q5_k"], capsys)
    assert "add --gguf TYPE" in _one_line(["export", llama, tmp_path / "c"], capsys)
    assert "has no adapter/ folder" in _one_line(
        ["export", llama, tmp_path / "d", "--gguf", "f16", "--gguf-adapter", "--no-check"], capsys)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("mine")
    assert "exists and is not empty" in _one_line(["export", llama, tmp_path / "e", "--gguf", "f16"], capsys)
    assert (tmp_path / "e" / "x").read_text() == "mine"
    (tmp_path / "f.gguf").write_text("mine")
    with pytest.raises(gguf_export.ConfigError, match="exists; finetune never overwrites"):
        gguf_export.write_gguf(llama, tmp_path / "f.gguf", "f16")
    assert (tmp_path / "f.gguf").read_text() == "mine"
    dora = tmp_path / "dora"
    shutil.copytree(tiny_folder(tmp_path, "qwen3", lora=dict(r=2, target_modules=["q_proj"])), dora)
    cfg = json.loads((dora / "adapter" / "adapter_config.json").read_text())
    (dora / "adapter" / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    assert "uses DoRA" in _one_line(["export", dora, tmp_path / "g", "--gguf", "f16", "--gguf-adapter"], capsys)
    from transformers import AutoConfig

    for name, config, words in [  # layouts llama.cpp's Gemma graphs fix otherwise: refused before any weight is read
            ("g2", dict(model_type="gemma2", attn_logit_softcapping=None, query_pre_attn_scalar=16),
             "without attn_logit_softcapping"),
            ("g3", dict(model_type="gemma3_text", query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"]),
             "differ from llama.cpp's fixed pattern"),
            ("g3q", dict(model_type="gemma3_text", query_pre_attn_scalar=256), "query_pre_attn_scalar 256")]:
        kind = config.pop("model_type")
        AutoConfig.for_model(kind, **(COMMON | config)).save_pretrained(tmp_path / name)
        with pytest.raises(gguf_export.ConfigError, match=words):
            gguf_export.write_gguf(tmp_path / name, tmp_path / name / "model-f16.gguf", "f16")
    assert not list(tmp_path.glob("*/*.gguf*")), list(tmp_path.glob("*/*.gguf*"))


def test_run_config_export_gguf_refused_before_any_model():
    assert any("export_gguf: 'q3' is not a GGUF type" in p for p in refusals(CONFIGS / "tiny_sft.yaml",
                                                                              "export_gguf=q3"))
    assert any("export_gguf: GGUF export supports the model types" in p
               for p in refusals(CONFIGS / "tiny_gpt.yaml", "export_gguf=f16"))


@needs_llama_cpp
@pytest.mark.extended
def test_real_smollm2_in_llama_cpp(tmp_path):
    """The shared SmolLM2-135M-Instruct (its Q4_1 file dequantized by transformers into a folder): f16 continues the
    10 prompts as transformers does on at least 9 (log-probabilities within 2e-2 nats, the ChatML reply equal);
    q8_0 within 5e-2 nats of the export; q4_1 of the dequantized Q4_1 weights within the 4-bit bound."""
    from conftest import smollm2_gguf

    from finetune.engine import gguf as gguf_in

    folder = tmp_path / "smollm2"
    gguf_in.convert(smollm2_gguf(), folder)
    results = {}
    for qtype in ("f16", "q8_0", "q4_1"):
        path = gguf_export.write_gguf(folder, tmp_path / gguf_export.file_name(qtype), qtype)
        results[qtype] = gguf_export.verify_gguf(path, folder, qtype)
        path.unlink()
    f16, q8, q4 = results["f16"], results["q8_0"], results["q4_1"]
    assert f16["agree"] >= 9 and f16["mean_abs_logprob_diff_unrounded"] <= 2e-2 and f16["chat"]["equal"], f16
    assert q8["mean_abs_logprob_diff_unrounded"] <= 5e-2 and q8["chat"]["equal"], q8
    assert q4["mean_abs_logprob_diff"] <= gguf_export.BOUNDS["q4_1"], q4
    meta = gguf.GGUFReader(smollm2_gguf()).fields  # the file llama.cpp users keep names the same pre-tokenizer
    assert bytes(meta["tokenizer.ggml.pre"].parts[-1]).decode() == "smollm"


@needs_llama_cpp
def test_the_check_fails_a_file_written_wrongly(models, tmp_path, monkeypatch):
    """The check can fail: llama.cpp on a Llama 3 file without its ``rope_freqs`` (written from the config with the
    scaling removed: 2 of 10 continuations alike, 5.4e-2 nats, where the right file has 10 and 4.9e-4), or on a Llama
    file without the Q/K permutation (3 of 10, 8.9e-2 nats), fails the f16 check and is renamed."""
    folder = tiny_folder(models, "llama3")
    unscaled = tmp_path / "unscaled"
    shutil.copytree(folder, unscaled)
    config = json.loads((unscaled / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (unscaled / "config.json").write_text(json.dumps(config))
    path = gguf_export.write_gguf(unscaled, tmp_path / "unscaled.gguf", "f16")
    with pytest.raises(gguf_export.ConfigError, match="GGUF check: llama.cpp on 'unscaled.failed.gguf' differs"):
        gguf_export.verify_gguf(path, folder, "f16")

    monkeypatch.setattr(gguf_export, "PERMUTED", set())
    path = gguf_export.write_gguf(tiny_folder(models, "llama"), tmp_path / "unpermuted.gguf", "f16")
    with pytest.raises(gguf_export.ConfigError, match="GGUF check: llama.cpp on 'unpermuted.failed.gguf' differs"):
        gguf_export.verify_gguf(path, tiny_folder(models, "llama"), "f16")
    assert (tmp_path / "unpermuted.failed.gguf").is_file() and not path.exists()
