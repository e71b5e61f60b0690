"""GGUF in (issue 69, item 1): a ``.gguf`` ``model.path`` is converted once by transformers' GGUF loader into a cached
Hugging Face folder that every rank and verb reads.

* A tiny Llama written by finetune's own GGUF export (``finetune.lifecycle.gguf_export``: f32 tensors, the byte-level
  BPE tokenizer of ``data/models/gsm8k-bpe-8k`` and a chat template in its metadata) trains its first step to the
  very loss of the folder transformers itself converts the file into (two 1-rank launches, the loss compared with
  ``==``). The refusals' odd files (another architecture, no tokenizer) are written here with ``GGUFWriter``.
* Two processes that start on the same file at once convert it once; the other waits and takes the same folder.
* Refused before any process group, one line each, exit 2: a file that is no GGUF, a truncated one, an architecture
  transformers' loader cannot read, a file without a tokenizer.
* A ``distill`` run's ``train.distill.teacher`` may name a ``.gguf``: checked without its weights, converted once.
* ``doctor``, ``plan`` and ``evaluate`` take the same path, a run's export is made from it; ``bundle --model x.gguf`` carries the file and ``verify`` checks it.
* Extended: the shared real file (SmolLM2-135M-Instruct, Q4_1) converts to the model transformers loads from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CONFIGS, REPO, check_here, cpu_env, finetune_here, launch, ok, refused_here, train_losses

gguf = pytest.importorskip("gguf")

from finetune.lifecycle.gguf_export import permute, write_gguf as export_gguf  # noqa: E402

TOKENIZER = REPO / "data" / "models" / "gsm8k-bpe-8k" / "tokenizer.json"
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
REAL = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_llama():
    """A seeded 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 8,192, tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))
    with torch.no_grad():  # norms away from 1, so a norm written in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_gguf(path: Path, model, arch: str = "llama", tokenizer: bool = True) -> Path:
    """``model`` (a Llama) as a GGUF file with f32 tensors, written by the ``gguf`` package's writer as llama.cpp's
    converter writes it; with ``tokenizer`` the vocabulary, merges, special ids and :data:`TEMPLATE` in its metadata."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        t = json.loads(TOKENIZER.read_text())
        vocab = [k for k, _ in sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(vocab)
        w.add_token_types([3 if k == "<|endoftext|>" else 1 for k in vocab])  # 3: control
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in t["model"]["merges"]])
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, object]:
    """``(the tiny GGUF file, the model written into it)``."""
    from transformers import AutoTokenizer

    model, root = tiny_llama(), tmp_path_factory.mktemp("gguf")
    model.save_pretrained(root / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER.parent)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "tiny-llama")
    return export_gguf(root / "tiny-llama", root / "tiny-llama.f32.gguf", "f32"), model  # finetune's GGUF out


def transformers_folder(path: Path, out: Path) -> Path:
    """What transformers itself makes of the GGUF file ``path`` (its loader, then ``save_pretrained``): the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out


def test_gguf_trains_as_its_folder(tiny, tmp_path):
    """The first-step loss of a launch on the ``.gguf`` equals that of a launch on transformers' own conversion of it
    (``==``); the conversion holds the written weights exactly, the tokenizer and its chat template, and the launch
    says what it converted and where."""
    path, model = tiny
    reference = transformers_folder(path, tmp_path / "reference")
    common = ["train.max_steps=1", "train.eval_every=0", "train.save_every=0", "data.max_train_rows=64",
              f"data.cache_dir={tmp_path / 'cache'}"]
    run_gguf = ok(launch(CONFIGS / "tiny_gpt.yaml", [f"output_dir={tmp_path / 'a'}", f"model.path={path}", *common],
                         nproc=1))  # with its export, checked against the engine as every run's
    ok(launch(CONFIGS / "tiny_gpt.yaml", [f"output_dir={tmp_path / 'b'}", f"model.path={reference}", "export=false",
                                          *common], nproc=1))
    folders = list((tmp_path / "cache" / "gguf").glob("[0-9a-f]" * 64))
    assert len(folders) == 1, folders
    assert f"converted by transformers into '{folders[0]}'" in run_gguf.stdout
    assert f"model from GGUF '{path}'" in (tmp_path / "a" / "logs" / "rank0.log").read_text()
    loss_gguf, loss_ref = train_losses(tmp_path / "a")[1], train_losses(tmp_path / "b")[1]
    assert loss_gguf == loss_ref, (loss_gguf, loss_ref)
    assert (tmp_path / "a" / "export" / "model.safetensors").is_file()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    weights = load_file(folders[0] / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in weights:  # lm_head.weight is tied: saved once
            assert torch.equal(weights[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(folders[0])
    assert tokenizer.chat_template == TEMPLATE
    text = "Natalia sold clips to 48 of her friends in April."
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(TOKENIZER.parent)(text)["input_ids"]


_RESOLVE = """
import sys
from pathlib import Path
from finetune.config import load_run_config
from finetune.preflight.validate import resolve_model_files
cfg = load_run_config(sys.argv[1], [f"model.path={sys.argv[2]}", f"data.cache_dir={sys.argv[3]}"])
found = []
notes = resolve_model_files(cfg, found, announce=False)
print("RESULT", cfg.model.path, len(notes), found)
"""


def test_two_processes_convert_once(tiny, tmp_path):
    """Two processes resolving the same ``.gguf`` at the same moment (the ranks of a launch before their process
    group): one converts under the file's lock, the other waits and takes the same folder; no partial folder is left."""
    path, _ = tiny
    cmd = [sys.executable, "-c", _RESOLVE, str(CONFIGS / "tiny_gpt.yaml"), str(path), str(tmp_path / "cache")]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    results = [next(line for line in p.communicate(timeout=300)[0].splitlines() if line.startswith("RESULT")).split()
               for p in procs]
    assert results[0][1] == results[1][1], results
    assert sorted(int(r[2]) for r in results) == [0, 1], results  # exactly one converted
    assert not list((tmp_path / "cache" / "gguf").glob(".partial-*"))


def _refused(args, capsys) -> list[str]:
    code, printed = refused_here(args, capsys)
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any process group
    assert code == 2, printed
    return [line for line in printed.splitlines() if line.startswith("finetune: error:")]


@pytest.mark.parametrize("case", ["not_gguf", "truncated", "architecture", "no_tokenizer"])
def test_refusals(case, tiny, tmp_path, capsys):
    """A file that is no GGUF, a truncated one, an architecture transformers cannot read, a file without a tokenizer:
    one line each naming the file and what to do, exit 2, before any process group or model."""
    path, model = tiny
    bad = tmp_path / "bad.gguf"
    if case == "not_gguf":
        bad.write_text("this is a text file, not a model\n" * 10)
    elif case == "truncated":
        bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif case == "architecture":
        write_gguf(bad, model, arch="rwkv6")
    else:
        write_gguf(bad, model, tokenizer=False)
    lines = _refused(["--config", CONFIGS / "tiny_gpt.yaml", f"output_dir={tmp_path / 'run'}", f"model.path={bad}",
                      f"data.cache_dir={tmp_path / 'cache'}"], capsys)
    assert len(lines) == 1, lines
    want = {"not_gguf": "cannot be read as a GGUF file", "truncated": "is truncated",
            "architecture": "'rwkv6' model, an architecture transformers' GGUF loader cannot read (it reads: ",
            "no_tokenizer": "holds no tokenizer"}[case]
    assert lines[0].startswith("finetune: error: model.path: ") and want in lines[0], lines
    assert not (tmp_path / "cache" / "gguf").is_dir() or not list((tmp_path / "cache" / "gguf").glob("[0-9a-f]*"))


def test_plan_doctor_and_evaluate_take_a_gguf(tiny, tmp_path, capsys):
    """``finetune doctor``, ``finetune plan`` and ``--check`` read the GGUF's config and tokenizer without converting
    its weights (a config-only folder, made once); ``finetune evaluate x.gguf`` converts it whole and evaluates it, and
    the config-only folder holds the same config, generation config and tokenizer as that full conversion."""
    path, _ = tiny
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    code, printed = finetune_here(["doctor", CONFIGS / "tiny_gpt.yaml", f"model.path={path}", cache,
                                   f"output_dir={tmp_path / 'run'}"], capsys)
    light = next((tmp_path / "cache" / "gguf").glob("[0-9a-f]" * 64 + "-config"))
    assert f"config and tokenizer read by transformers into '{light}'" in printed, printed
    assert f"model.path '{light}': config.json; weights in the GGUF file (converted at launch); tokenizer" in printed
    assert not any(f.suffix in (".safetensors", ".bin") for f in light.iterdir()), list(light.iterdir())
    code, printed = finetune_here(["plan", CONFIGS / "tiny_gpt.yaml", f"model.path={path}", cache,
                                   "--gpus-per-node", "1"], capsys)
    assert code == 0, printed
    assert "598,336" in printed or "0.6M" in printed or "ZeRO" in printed, printed
    code, printed = finetune_here(["train", "--config", CONFIGS / "tiny_gpt.yaml", f"model.path={path}", cache,
                                   f"output_dir={tmp_path / 'run'}", "--check"], capsys)
    assert code == 0, printed
    assert not list((tmp_path / "cache" / "gguf").glob("[0-9a-f]" * 64)), "a check converted the weights"
    out = tmp_path / "eval.json"
    code, printed = finetune_here(["evaluate", path, "--config", CONFIGS / "tiny_gpt.yaml", cache,
                                   "train.eval_max_batches=1", "--out", out], capsys)
    assert code == 0, printed
    assert json.loads(out.read_text())["metrics"]["eval/loss"] > 0
    full = next((tmp_path / "cache" / "gguf").glob("[0-9a-f]" * 64))

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    def config(folder):
        return {k: v for k, v in AutoConfig.from_pretrained(folder).to_dict().items() if k not in ("dtype", "_name_or_path")}

    assert config(light) == config(full)
    assert GenerationConfig.from_pretrained(light).to_dict() == GenerationConfig.from_pretrained(full).to_dict()
    a, b = AutoTokenizer.from_pretrained(light), AutoTokenizer.from_pretrained(full)
    text = "Natalia sold clips to 48 of her friends in April."
    assert a(text)["input_ids"] == b(text)["input_ids"] and a.chat_template == b.chat_template == TEMPLATE


def test_a_distill_teacher_may_be_a_gguf(tiny, tmp_path, capsys):
    """``train.distill.teacher`` may name a ``.gguf`` (a real model as the teacher): ``--check`` reads its config and
    tokenizer without its weights and compares its vocabulary with the student's; a launch's resolution converts it
    whole, once, into the folder the teacher is then built from; a student of another vocabulary is refused, naming
    the key."""
    from finetune.config import load_run_config
    from finetune.preflight.validate import resolve_model_files
    from finetune.recipes import distill

    path, _ = tiny
    cache = tmp_path / "cache"
    common = [f"train.distill.teacher={path}", f"data.cache_dir={cache}", f"output_dir={tmp_path / 'run'}"]
    code, printed = check_here(["--config", CONFIGS / "parity_distill.yaml", *common], capsys)
    assert code == 0, printed
    assert not list((cache / "gguf").glob("[0-9a-f]" * 64)), "a check converted the weights"
    cfg = load_run_config(CONFIGS / "parity_distill.yaml", common)
    found: list[str] = []
    notes = resolve_model_files(cfg, found, announce=False)
    folder = next((cache / "gguf").glob("[0-9a-f]" * 64))
    assert not found and cfg.train.distill.teacher == str(folder) and len(notes) == 1, (found, notes)
    assert (folder / "model.safetensors").is_file()
    distill.check_teacher(cfg, found)
    assert not found, found
    code, printed = check_here(["--config", CONFIGS / "parity_distill.yaml", *common,
                                "model.tokenizer_path=data/models/tiny-gpt2", "model.config_overrides={}"], capsys)
    assert code == 2 and "train.distill.teacher: the teacher's tokenizer" in printed, printed


@pytest.mark.extended
@pytest.mark.skipif(not REAL.is_file(), reason="the shared real GGUF file is not here")
def test_real_gguf_converts(tmp_path):
    """The shared SmolLM2-135M-Instruct Q4_1 file converts to the 134.5M-parameter ``LlamaForCausalLM`` transformers
    loads from it (the same logits), with its ChatML template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from finetune.engine.gguf import ensure_converted, problems

    assert problems(str(REAL), "model.path", True) == []
    folder, note = ensure_converted(str(REAL), tmp_path)
    assert note and "LlamaForCausalLM, 134,515,008 parameters" in note
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(REAL.parent, gguf_file=REAL.name, dtype=torch.float32,
                                                  quantization_config=GgufConfig(dequantize=True)).eval()
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(folder).chat_template


def test_bundle_carries_a_gguf_and_verify_checks_it(tiny, tmp_path, capsys):
    """``finetune bundle OUT --model x.gguf`` carries the file (its run config's ``model.path`` names it) and
    ``finetune verify OUT`` checks it: whole as hashed, and readable by transformers' GGUF loader."""
    path, model = tiny
    out = tmp_path / "bundle"
    code, printed = finetune_here(["bundle", out, "--model", path], capsys)
    assert code == 0, printed
    carried = out / "models" / "tiny-llama.f32" / path.name
    assert carried.read_bytes() == path.read_bytes()
    assert f"path: models/tiny-llama.f32/{path.name}" in (out / "run_config.yaml").read_text()
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert [s.get("gguf") for s in manifest["sources"]] == [path.name]
    code, printed = finetune_here(["verify", out], capsys)
    assert code == 0, printed

    from finetune.airgap.bundle import verify_bundle
    from finetune.airgap.manifest import file_entries, write_manifest

    carried.chmod(0o644)
    write_gguf(carried, model, arch="rwkv6")  # rehashed: only the GGUF check can find it
    write_manifest(out, {**manifest, "files": file_entries(out)})
    problems = verify_bundle(out)
    assert len(problems) == 1 and "'rwkv6' model, an architecture transformers' GGUF loader cannot read" in problems[0]
