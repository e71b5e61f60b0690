"""GGUF out: a Hugging Face export written as the single ``.gguf`` file llama.cpp and Ollama run.

The conventions are those of llama.cpp's own converter (``convert_hf_to_gguf.py``, ggml-org/llama.cpp), written with
ggml-org's ``gguf`` package (gguf-py: ``GGUFWriter``, ``TensorNameMap``, ``SpecialVocab``, its numpy quantizers):

* **Families** (:data:`FAMILIES`): Llama (Llama 2/3, SmolLM2) and Mistral as llama.cpp's ``llama`` architecture, the
  query and key rows permuted as ``LlamaModel.permute`` does (llama.cpp's rotary embedding pairs neighbouring
  dimensions, transformers' pairs the two halves); Qwen2/2.5 (``qwen2``, the q/k/v biases) and Qwen3 (``qwen3``,
  the q/k norms), not permuted (llama.cpp runs them with the NeoX rotary layout, as transformers does); Gemma-2
  (``gemma2``: the logit soft-caps, the sliding window on alternate layers) and Gemma-3's text model (``gemma3``:
  the local RoPE base, every 6th layer global), their norms written as ``1 + weight`` (``Gemma2Model``,
  ``Gemma3Model``).
* **Metadata**: context length, embedding and feed-forward sizes, blocks, heads and KV heads, key/value length, RoPE
  base and scaling (linear, YaRN; Llama 3's scaling as the ``rope_freqs`` tensor ``LlamaModel`` writes), RMS norm
  epsilon, vocabulary size, file type.
* **Tokenizer**: byte-level BPE (``tokenizer.ggml.model = gpt2``): the token list with llama.cpp's token types
  (``get_vocab_base``), the merges, BOS/EOS/PAD/UNK ids and ``add_bos``/``add_eos`` (``SpecialVocab``), and the
  pre-tokenizer name llama.cpp knows it by (``get_vocab_base_pre``: the SHA-256 of the tokenization of llama.cpp's
  check text, :data:`PRE_TOKENIZERS`; GPT-2's own byte-level regex, as in tokenizers trained with its defaults, is
  ``gpt-2``). A SentencePiece-style ``tokenizer.json`` (BPE with byte fallback, Mistral and Llama 2) is written as
  ``LlamaHfVocab`` reads it (``tokenizer.ggml.model = llama``, scores and types). The chat template
  (``tokenizer.chat_template``) comes with it, so llama.cpp's chat endpoint and Ollama render the model's own.
* **Tensors** under llama.cpp's names (``TensorNameMap``); a tied head is not written (llama.cpp reuses
  ``token_embd``). Norms, biases and ``rope_freqs`` stay float32; matrices take the requested type
  (:data:`TYPES`), and a matrix whose rows are not a whole number of quantization blocks falls back to float16, as
  the converter does. ``q4_0``/``q4_1`` keep the token embedding and the head at ``q8_0`` (llama.cpp's
  ``llama-quantize`` keeps the head at a higher precision too).

:func:`write_adapter_gguf` writes a peft LoRA adapter as llama.cpp's GGUF LoRA adapter (``convert_lora_to_gguf.py``:
``general.type = adapter``, ``adapter.lora.alpha``, ``<tensor>.lora_a``/``.lora_b``), applied by llama.cpp over the
base model's GGUF. :func:`write_modelfile` writes Ollama's ``Modelfile`` beside the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch
from loguru import logger

from finetune.engine import gguf as gguf_in
from finetune.errors import ConfigError

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
"""The tensor types ``--gguf`` writes: gguf-py's writers (float) and numpy quantizers (``Q8_0``, ``Q4_0``, ``Q4_1``)."""

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3_text": "gemma3"}
"""Hugging Face ``model_type`` -> llama.cpp architecture."""

NORM_SHIFTED = {"gemma2", "gemma3"}
"""llama.cpp architectures whose RMS norms multiply by the weight where transformers' multiply by ``1 + weight``
(``Gemma2RMSNorm``, ``Gemma3RMSNorm``): the converter writes ``weight + 1``."""

GEMMA3_SWA_PATTERN = 6
"""llama.cpp's Gemma 3 layer pattern: every 6th layer global, the others sliding-window (``set_swa_pattern(6)``)."""

PERMUTED = {"llama"}
"""llama.cpp architectures whose query/key rows the converter permutes (``LlamaModel.permute``)."""

CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 '
              '33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
              '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
              '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
"""llama.cpp's pre-tokenizer check text (``convert_hf_to_gguf.py``, ``get_vocab_base_pre``)."""

PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / 2 / 2.5 / 3
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
}
"""SHA-256 of ``str(tokenizer.encode(CHECK_TEXT))`` -> llama.cpp's ``tokenizer.ggml.pre`` (from the converter's table,
for the families above)."""

GGUF_SUFFIX = ".gguf"
MODELFILE = "Modelfile"


def gguf_type(qtype: str):
    """``qtype`` (one of :data:`TYPES`) as ``(GGMLQuantizationType, LlamaFileType)``."""
    import gguf

    q, f = gguf.GGMLQuantizationType, gguf.LlamaFileType
    return {"f32": (q.F32, f.ALL_F32), "f16": (q.F16, f.MOSTLY_F16), "bf16": (q.BF16, f.MOSTLY_BF16),
            "q8_0": (q.Q8_0, f.MOSTLY_Q8_0), "q4_0": (q.Q4_0, f.MOSTLY_Q4_0), "q4_1": (q.Q4_1, f.MOSTLY_Q4_1)}[qtype]


def check_type(qtype: str, key: str = "--gguf") -> None:
    """Raises ConfigError (one line) unless ``qtype`` is one of :data:`TYPES`."""
    if qtype not in TYPES:
        raise ConfigError(f"{key}: '{qtype}' is not a GGUF type finetune writes; use one of {', '.join(TYPES)} "
                          f"(gguf-py's writers and quantizers; K-quants need llama.cpp's llama-quantize on the f16 file)")


def check_family(model_type: str | None, where: str) -> str:
    """The llama.cpp architecture of ``model_type``; raises ConfigError (one line, naming the supported families)."""
    if model_type not in FAMILIES:
        raise ConfigError(f"{where}: GGUF export supports the model types {', '.join(sorted(FAMILIES))} (Llama 2/3, "
                          f"SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma-2, Gemma-3 text); this model is "
                          f"'{model_type}'. Export the Hugging Face folder and convert it with llama.cpp's "
                          f"convert_hf_to_gguf.py")
    return FAMILIES[model_type]


def file_name(qtype: str) -> str:
    """The file's name in an export folder: ``model-<type>.gguf``."""
    return f"model-{qtype}{GGUF_SUFFIX}"


def rope_parameters(config: dict, layer_type: str = "full_attention") -> dict:
    """The config's RoPE parameters (transformers 5's ``rope_parameters``, per layer type where a model has them (Gemma
    3: ``layer_type``'s), or ``rope_scaling`` + ``rope_theta``)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if layer_type in rope and isinstance(rope[layer_type], dict):
        rope = dict(rope[layer_type])
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """``[head_dim / 2]`` float32: Llama 3's per-frequency RoPE divisors (``LlamaModel.generate_extra_tensors`` in
    ``convert_hf_to_gguf.py``, transformers' ``_compute_llama3_parameters``), llama.cpp's ``rope_freqs`` tensor."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key row order (``LlamaModel.permute``): within each head, the rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
"""Qwen2's pre-tokenizer regular expression (transformers' ``Qwen2Tokenizer``, llama.cpp's ``qwen2``)."""


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the pre-tokenizer of ``tokenizer`` as transformers loads it (``get_vocab_base_pre``: the
    hash of the check text's tokenization, :data:`PRE_TOKENIZERS`); for a vocabulary of one's own, its form: GPT-2's
    byte-level regex with no normalizer is ``gpt-2``, Qwen2's split (``Qwen2Tokenizer``, which transformers builds
    for the qwen2 model type) is ``qwen2``. Raises ConfigError (one line, with the hash) for another one, which
    llama.cpp would tokenize differently."""
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    pre, norm = backend.get("pre_tokenizer") or {}, backend.get("normalizer")
    if (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
            and norm is None):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True)
            and (norm is None or norm.get("type") == "NFC")):
        return "qwen2"
    raise ConfigError(f"GGUF export: this tokenizer's pre-tokenizer is not one llama.cpp knows (check hash {digest}, "
                      f"llama.cpp's convert_hf_to_gguf.py get_vocab_base_pre); the file would tokenize differently "
                      f"in llama.cpp. Export the Hugging Face folder and convert it with a llama.cpp that knows it")


def _looks_special(token: str) -> bool:
    """``does_token_look_special`` of ``convert_hf_to_gguf.py``."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def prepends_space(tokenizer_json: dict) -> bool:
    """Whether a SentencePiece-style tokenizer puts ``▁`` before the text (Llama 2, Mistral: a ``Prepend`` normalizer
    or a ``Metaspace`` that prepends; Gemma: neither), llama.cpp's ``tokenizer.ggml.add_space_prefix``."""
    def steps(node: dict | None, kind: str) -> list[dict]:
        node = node or {}
        return node.get(kind, []) if node.get("type") == "Sequence" else [node]

    norm = steps(tokenizer_json.get("normalizer"), "normalizers")
    pre = steps(tokenizer_json.get("pre_tokenizer"), "pretokenizers")
    return (any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in norm)
            or any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pre))


def add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The tokenizer's metadata (module docstring); raises ConfigError for a tokenizer llama.cpp cannot read."""
    import gguf
    from transformers import AutoTokenizer

    tj_path = folder / "tokenizer.json"
    if not tj_path.is_file():
        raise ConfigError(f"GGUF export: '{folder}' has no tokenizer.json (a fast tokenizer); llama.cpp needs the "
                          f"vocabulary in the file")
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):  # SentencePiece-style BPE (Mistral, Llama 2)
        vocab = gguf.LlamaHfVocab(folder)
        tokens, scores, types = zip(*vocab.all_tokens())
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(list(tokens))
        writer.add_token_scores(list(scores))
        writer.add_token_types(list(types))
        writer.add_add_space_prefix(prepends_space(tj))
        gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
        return
    if model.get("type") != "BPE":
        raise ConfigError(f"GGUF export: '{tj_path}' holds a {model.get('type')} tokenizer; GGUF export writes "
                          f"byte-level BPE and SentencePiece-style BPE tokenizers")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):  # get_vocab_base
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def add_hyperparameters(writer, config: dict, arch: str, name: str, file_type) -> np.ndarray | None:
    """The architecture's metadata; returns Llama 3's ``rope_freqs`` (or None). Raises ConfigError for a RoPE scaling
    llama.cpp's architecture does not take."""
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch in NORM_SHIFTED:
        add_gemma(writer, config, arch, head_dim)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings",
                                                          config["max_position_embeddings"])))
    elif kind == "llama3":
        return llama3_rope_factors(rope, head_dim)
    elif kind != "default":
        raise ConfigError(f"GGUF export: RoPE scaling '{kind}' is not written for llama.cpp's '{arch}' (default, "
                          f"linear, yarn and llama3 are)")
    return None


def add_gemma(writer, config: dict, arch: str, head_dim: int) -> None:
    """Gemma-2/3's metadata (``Gemma2Model`` / ``Gemma3Model`` in ``convert_hf_to_gguf.py``): the logit soft-caps and
    the sliding window; Gemma 3's local RoPE base. Raises ConfigError for a layout llama.cpp's graph would not run
    as transformers does: a query scale other than ``head_dim ** -0.5`` (llama.cpp takes it from the head size) or,
    for Gemma 3, sliding and global layers in another pattern than every 6th layer global."""
    scalar = config.get("query_pre_attn_scalar", head_dim)
    if scalar != head_dim:
        raise ConfigError(f"GGUF export: {arch} with query_pre_attn_scalar {scalar} != head_dim {head_dim} is not "
                          f"written (llama.cpp scales queries by the head size)")
    if arch == "gemma2":  # llama.cpp's Gemma 2 graph always soft-caps the attention logits
        if config.get("attn_logit_softcapping") is None:
            raise ConfigError("GGUF export: gemma2 without attn_logit_softcapping is not written (llama.cpp's Gemma 2 "
                              "always soft-caps attention logits, at 50 unless told)")
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(int(config["sliding_window"]))
    types = config.get("layer_types") or []
    if arch == "gemma2":
        want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]
    else:
        want = ["full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding_attention"
                for i in range(len(types))]
        writer.add_rope_freq_base_swa(float(rope_parameters(config, "sliding_attention")["rope_theta"]))
    if types and types != want:
        raise ConfigError(f"GGUF export: {arch}'s layer_types {types} differ from llama.cpp's fixed pattern "
                          f"({'alternating, sliding first' if arch == 'gemma2' else 'every 6th layer global'})")


def tensor_type(name: str, shape: tuple, qtype: str):
    """The GGML type ``name`` is written as under ``qtype`` (module docstring)."""
    import gguf

    t = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return t.F32
    wanted = gguf_type(qtype)[0]
    if qtype in ("q4_0", "q4_1") and name in ("token_embd.weight", "output.weight"):
        wanted = t.Q8_0
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else t.F16


def as_written(model, qtype: str) -> None:
    """Round ``model``'s weights in place to what :func:`write_gguf` writes for them under ``qtype`` (each matrix
    quantized with gguf-py's quantizer and dequantized; float32 tensors unchanged): transformers' reference for
    llama.cpp on the file (:func:`finetune.lifecycle.gguf_check.compare`)."""
    import gguf

    arch = check_family(model.config.model_type, "GGUF check")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], model.config.num_hidden_layers)
    with torch.no_grad():
        for key, p in model.named_parameters():
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            kind = tensor_type(name or key, tuple(p.shape), qtype)
            if kind != gguf.GGMLQuantizationType.F32:
                data = gguf.quants.quantize(p.detach().float().numpy(), kind)
                p.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
                        .reshape(p.shape))


def safetensors_items(folder: Path):
    """``(name, float32 numpy array)`` for each tensor of the folder's ``*.safetensors`` files, one at a time (a large
    export is never held whole in float32)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"GGUF export: '{folder}' has no *.safetensors weights")
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k).float().numpy()


def llama_cpp_rows(arch: str, key: str, data: np.ndarray, config: dict) -> np.ndarray:
    """A Hugging Face tensor (or a LoRA ``B`` of it, named by its base weight) in llama.cpp's layout: the Llama
    family's query/key rows permuted (:func:`permute`), Gemma's norms as ``1 + weight``."""
    heads = config["num_attention_heads"]
    if arch in PERMUTED and key.endswith(("q_proj.weight", "q_proj.bias")):
        return permute(data, heads)
    if arch in PERMUTED and key.endswith(("k_proj.weight", "k_proj.bias")):
        return permute(data, config.get("num_key_value_heads") or heads)
    if arch in NORM_SHIFTED and key.endswith("norm.weight"):
        return data + 1.0
    return data


def _add_tensor(writer, name: str, data: np.ndarray, kind) -> None:
    import gguf

    writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


@contextlib.contextmanager
def _writing(out: Path, arch: str):
    """A ``GGUFWriter`` for ``out``: written as ``<out>.partial`` when the block ends, then renamed; nothing is left
    when the block or the write fails. Raises ConfigError when ``out`` exists."""
    import gguf

    if out.exists():
        raise ConfigError(f"GGUF export: '{out}' exists; finetune never overwrites a file, choose a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(str(out) + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)


def model_type_of(folder: Path) -> str | None:
    """The ``model_type`` of ``folder``'s ``config.json`` (None without one)."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()).get("model_type") if path.is_file() else None


def write_gguf(folder: str | Path, out: str | Path, qtype: str) -> Path:
    """Write the Hugging Face folder ``folder`` (config, tokenizer, safetensors) as one GGUF file.

    Args:
        folder: a plain (merged) Hugging Face causal-LM folder of a family in :data:`FAMILIES`.
        out: the new ``.gguf`` file (written as ``<out>.partial``, renamed when complete).
        qtype: one of :data:`TYPES`.

    Returns:
        ``out``.

    Raises:
        ConfigError: an unknown type, an unsupported family or RoPE scaling, a tokenizer llama.cpp would not read as
            transformers does, or ``out`` exists; one line each, nothing written.
    """
    import gguf

    folder, out = Path(folder), Path(out)
    check_type(qtype)
    config = json.loads((folder / "config.json").read_text())
    arch = check_family(config.get("model_type"), f"GGUF export of '{folder}'")
    file_type = gguf_type(qtype)[1]
    tied = config.get("tie_word_embeddings", arch in NORM_SHIFTED)
    with _writing(out, arch) as writer:
        rope_freqs = add_hyperparameters(writer, config, arch, folder.resolve().name, file_type)
        add_tokenizer(writer, folder, config["vocab_size"])
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
        if rope_freqs is not None:
            _add_tensor(writer, "rope_freqs.weight", rope_freqs, gguf.GGMLQuantizationType.F32)
        for key, data in safetensors_items(folder):
            if tied and key == "lm_head.weight":
                continue
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ConfigError(f"GGUF export: tensor '{key}' of '{folder}' has no llama.cpp name for '{arch}'")
            data = llama_cpp_rows(arch, key, data, config)
            _add_tensor(writer, name, data, tensor_type(name, data.shape, qtype))
    logger.info(f"GGUF: {folder} -> {out} ({qtype}, llama.cpp architecture {arch}, "
                f"{out.stat().st_size / 2**20:.1f} MiB)")
    return out


def write_adapter_gguf(adapter: str | Path, base_config: dict, out: str | Path, qtype: str = "f16") -> Path:
    """Write a peft LoRA adapter folder as llama.cpp's GGUF LoRA adapter (``convert_lora_to_gguf.py``).

    llama.cpp adds ``scale x (alpha / r) x B A`` (``scale`` given at load, 1 by default) to each base matrix; peft's
    rsLoRA scales by ``alpha / sqrt(r)``, so its alpha is written as ``alpha x sqrt(r)``. The query/key ``B`` rows
    take the base's permutation.

    Args:
        adapter: peft's folder (``adapter_config.json``, ``adapter_model.safetensors``).
        base_config: the base model's ``config.json`` as a dict.
        out: the new ``.gguf`` file.
        qtype: ``f32`` or ``f16``/``bf16``/``q8_0`` (the adapter's matrices; a ``q4`` request writes f16).

    Raises:
        ConfigError: DoRA or per-module ranks/alphas (llama.cpp's adapter has one alpha and plain LoRA), a target that
            is not a linear layer of the base, an unsupported family, or ``out`` exists.
    """
    import gguf
    from safetensors.torch import load_file

    adapter, out = Path(adapter), Path(out)
    check_type(qtype)
    lcfg = json.loads((adapter / "adapter_config.json").read_text())
    arch = check_family(base_config.get("model_type"), f"GGUF adapter of '{adapter}'")
    if lcfg.get("use_dora") or lcfg.get("rank_pattern") or lcfg.get("alpha_pattern"):
        raise ConfigError(f"GGUF adapter: '{adapter}' uses DoRA or per-module ranks; llama.cpp's LoRA adapter has one "
                          f"alpha and plain LoRA. Export with --gguf (the merged model) instead")
    r, alpha = lcfg["r"], float(lcfg["lora_alpha"])
    if lcfg.get("use_rslora"):
        alpha *= math.sqrt(r)
    kind = gguf.GGMLQuantizationType.F32 if qtype == "f32" else gguf.GGMLQuantizationType.F16
    with _writing(out, arch) as writer:
        writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], base_config["num_hidden_layers"])
        state = load_file(str(adapter / "adapter_model.safetensors"))
        for key in sorted(k for k in state if ".lora_A." in k):
            base_key = key.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
            name = names.get_name(base_key, try_suffixes=(".weight",))
            if name is None:
                raise ConfigError(f"GGUF adapter: '{key}' targets '{base_key}', which llama.cpp's '{arch}' has no name "
                                  f"for")
            a = state[key].float().numpy()
            b = state[key.replace(".lora_A.", ".lora_B.")].float().numpy()
            b = llama_cpp_rows(arch, base_key, b, base_config)  # B's rows are the base matrix's rows
            _add_tensor(writer, name + ".lora_a", a, kind)
            _add_tensor(writer, name + ".lora_b", b, kind)
    logger.info(f"GGUF adapter: {adapter} -> {out} (r {r}, alpha {alpha:g}, llama.cpp architecture {arch})")
    return out


def write_modelfile(folder: str | Path, gguf_file: str | Path, out_dir: str | Path | None = None) -> Path:
    """Ollama's ``Modelfile`` beside ``gguf_file``: ``FROM ./<file>``, a ``PARAMETER stop`` per end-of-turn token
    (the generation config's ``eos_token_id``\\s and the tokenizer's EOS) and the generation config's sampling
    defaults (temperature, top_p, top_k, repetition_penalty as ``repeat_penalty``). Ollama takes the chat template
    from the file's ``tokenizer.chat_template``. Raises ConfigError when the ``Modelfile`` exists."""
    from transformers import AutoTokenizer

    folder, gguf_file = Path(folder), Path(gguf_file)
    out = Path(out_dir or gguf_file.parent) / MODELFILE
    if out.exists():
        raise ConfigError(f"GGUF export: '{out}' exists; finetune never overwrites a file, choose a new folder")
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    eos = gen.get("eos_token_id", tokenizer.eos_token_id)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    lines = [f"FROM ./{gguf_file.name}"]
    for i in ids:
        lines.append(f"PARAMETER stop {json.dumps(tokenizer.convert_ids_to_tokens(int(i)))}")
    for key, ollama in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                        ("repetition_penalty", "repeat_penalty")):
        if gen.get(key) is not None and (key != "temperature" or gen.get("do_sample", False)):
            lines.append(f"PARAMETER {ollama} {gen[key]}")
    out.write_text("\n".join(lines) + "\n")
    return out


BOUNDS = {"f32": 2e-2, "f16": 2e-2, "bf16": 2e-2, "q8_0": 7e-2, "q4_0": 0.1, "q4_1": 0.1}
"""The largest mean absolute log-probability difference (nats) between llama.cpp on the file and transformers on the
export's weights as the file holds them that the check accepts, per type (docs/checkpoints.md gives the measured
differences)."""

AGREE = ("f32", "f16")
"""Types whose greedy continuations must equal transformers' for 9 prompts in 10. llama.cpp multiplies bfloat16 and
quantized matrices with activations rounded to the same precision (its ``vec_dot`` kernels), which parts greedy paths
at near-ties; those files are held to their log-probability bound alone."""


def file_type_of(path: Path) -> str | None:
    """The :data:`TYPES` name of a GGUF file's ``general.file_type`` (None for another type, or none recorded)."""
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return None
    value = int(field.parts[-1][0])
    return next((t for t in TYPES if gguf_type(t)[1] == value), None)


def verify_gguf(path: Path, folder: Path, qtype: str, base: Path | None = None, adapter: Path | None = None,
                prompts: int = 10) -> dict:
    """llama.cpp (``xllamacpp``) on ``path`` (or on ``base`` with the GGUF LoRA ``adapter``) against transformers on
    ``folder`` (:func:`finetune.lifecycle.gguf_check.compare`); the result is written to ``<path>.check.json``. An
    adapter is held to the larger of its type's bound and its base file's (a user's 4-bit base computes at 4 bits,
    and the run trained on that base dequantized: the merged export's weights), against the unrounded export.

    Raises:
        ConfigError: the difference exceeds :data:`BOUNDS` or, for a float type, fewer than 9 in 10 prompts continue
            alike; the file is renamed ``*.failed.gguf`` first (it is not one to serve).
    """
    from finetune.lifecycle import gguf_check

    model = base if adapter is not None else path
    if adapter is not None:  # the base's own type bounds the check (a user's Q4_1 file computes at 4 bits)
        base_type = file_type_of(base) or "q4_0"
        qtype = max((qtype, base_type), key=lambda t: BOUNDS[t])
    result = gguf_check.compare(model, folder, gguf_check.PROMPTS[:prompts], lora=adapter,
                                as_written=None if adapter is not None else lambda m: as_written(m, qtype))
    result |= {"file": path.name, "type": qtype, "bound": BOUNDS[qtype], "checked_by": "llama.cpp (xllamacpp)"}
    ok = result["mean_abs_logprob_diff"] <= BOUNDS[qtype] and (
        qtype not in AGREE or result["agree"] >= math.ceil(0.9 * result["prompts"]))
    result["passed"] = ok
    Path(str(path) + ".check.json").write_text(json.dumps(result, indent=1) + "\n")
    logger.info(f"GGUF check (llama.cpp): {result['agree']}/{result['prompts']} greedy continuations as transformers', "
                f"log-probabilities {result['mean_abs_logprob_diff']:.2e} nats apart on average (bound "
                f"{BOUNDS[qtype]:g})" + (f"; chat reply equal: {result['chat']['equal']}" if result["chat"] else ""))
    if not ok:
        failed = path.with_suffix(".failed" + GGUF_SUFFIX)
        path.rename(failed)
        raise ConfigError(f"GGUF check: llama.cpp on '{failed.name}' differs from transformers on '{folder}' "
                          f"({result['agree']}/{result['prompts']} continuations alike, {result['mean_abs_logprob_diff']:.3g} "
                          f"nats mean, bound {BOUNDS[qtype]:g}); the file was renamed, see its .check.json")
    return result


def export_gguf(folder: str | Path, out_dir: str | Path, qtype: str, adapter: bool = False, check: bool = True,
                base: str | Path | None = None) -> list[Path]:
    """The GGUF files of the Hugging Face export ``folder`` in ``out_dir``: ``model-<type>.gguf`` (merged) and Ollama's
    ``Modelfile``; with ``adapter``, the folder's LoRA adapter (``adapter/``) as ``adapter-<type>.gguf`` instead.
    With ``check`` and ``xllamacpp`` importable, llama.cpp checks each file (:func:`verify_gguf`; an adapter over
    ``base``: the base model's ``.gguf`` (also the file a converted folder came from: the one the user serves), or
    its folder, written to ``base-<type>.gguf``).

    Raises:
        ConfigError: the checks of :func:`write_gguf` / :func:`write_adapter_gguf` / :func:`verify_gguf`.
    """
    from finetune.lifecycle import gguf_check

    folder, out_dir = Path(folder), Path(out_dir)
    check_type(qtype)
    config = json.loads((folder / "config.json").read_text())
    check_family(config.get("model_type"), f"GGUF export of '{folder}'")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not adapter:
        path = write_gguf(folder, out_dir / file_name(qtype), qtype)
        written = [path, write_modelfile(folder, path, out_dir)]
        if check and gguf_check.available():
            verify_gguf(path, folder, qtype)
        elif check:
            logger.warning("GGUF: not checked by llama.cpp (pip install xllamacpp to check the file where it runs)")
        return written
    if not (folder / "adapter" / "adapter_config.json").is_file():
        raise ConfigError(f"--gguf-adapter: '{folder}' has no adapter/ folder (a LoRA run's export has one)")
    path = write_adapter_gguf(folder / "adapter", config, out_dir / f"adapter-{qtype}{GGUF_SUFFIX}", qtype)
    written = [path]
    if check and gguf_check.available() and base is not None:
        base = Path(base)
        source = gguf_in.source_of(base)  # a run from a .gguf trained on its converted folder: the file itself
        if source and Path(source.get("source", "")).is_file():
            base = Path(source["source"])
        if base.suffix.lower() != GGUF_SUFFIX:
            base = write_gguf(base, out_dir / f"base-{qtype}{GGUF_SUFFIX}", qtype)
            written.append(base)
        verify_gguf(path, folder, qtype, base=base, adapter=path)
    return written
