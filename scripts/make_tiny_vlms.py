"""Make two tiny, config-only vision-language models (VLMs) for ``init: scratch``, loadable fully offline.

- ``data/models/tiny-qwen2.5-vl/``: a ``Qwen2_5_VLForConditionalGeneration`` config (text: 2 layers, hidden 64, 4
  heads, 2 key/value heads, intermediate 128, M-RoPE sections [2, 3, 3] of the 8 rotary pairs of a 16-wide head;
  vision tower: 2 blocks, hidden 32, 2 heads, patch 8, spatial merge 2, temporal patch 2, one 32x32 window, the last
  block full attention) and the processor files of ``Qwen2_5_VLProcessor``: ``Qwen2VLImageProcessor`` with
  ``min_pixels = max_pixels = 32*32`` (every image becomes 32x32: 4x4 patches of 8 pixels, merged 2x2 into 4 image
  tokens), the ``Qwen2VLVideoProcessor`` the processor requires, the tokenizer and Qwen2.5-VL's chat template (images
  as ``<|vision_start|><|image_pad|><|vision_end|>``, the default system turn), with the assistant's text and its
  ``<|im_end|>`` marked by ``{% generation %}``.
- ``data/models/tiny-smolvlm/``: an ``Idefics3ForConditionalGeneration`` (SmolVLM's architecture) config (Llama text
  model of the same shape; vision tower: 2 layers, hidden 32, 2 heads, image 32, patch 8; pixel-shuffle
  ``scale_factor`` 2: 16 patches -> 4 image tokens) and an ``Idefics3Processor`` (``image_seq_len`` 4) with
  ``Idefics3ImageProcessor`` (``size`` and ``max_image_size`` 32, no image splitting): an image is
  ``<fake_token_around_image><global-img>`` + 4 x ``<image>`` + ``<fake_token_around_image>``; SmolVLM's chat template
  (``<|im_start|>User:<image>...<end_of_utterance>\\nAssistant: ...``), the assistant's text and its
  ``<end_of_utterance>`` marked by ``{% generation %}``.

Both tokenizers are the project's byte-level BPE ``data/models/gsm8k-bpe-8k`` (8,192 tokens, ``<|endoftext|>`` id 0)
plus each family's special tokens, appended from id 8192; ``vocab_size`` is 8,256 (a multiple of 64) in both
configs, whose token ids (``image_token_id``, ...) are read from the tokenizer. Embeddings are tied. No weights are
written (``init: scratch`` builds the model from ``config.json``).

The Qwen2.5-VL processor cannot be instantiated without torchvision (its video processor is torchvision-only), so
its ``processor_config.json`` is written here as the dictionary ``Qwen2_5_VLProcessor.save_pretrained`` writes
(checked against it with torchvision 0.28 where it imports); loading it with ``AutoProcessor`` needs torchvision. The
Idefics3 processor needs none (``Idefics3ImageProcessorPil``) and is saved by ``save_pretrained``.

    python scripts/make_tiny_vlms.py            # writes data/models/tiny-qwen2.5-vl/ and data/models/tiny-smolvlm/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "data" / "models"
BASE_TOKENIZER = MODELS / "gsm8k-bpe-8k"
VOCAB_SIZE = 8256
"""Embedding rows: the tokenizer's length (8,205 and 8,233) rounded up to a multiple of 64."""
IMAGE = 32
"""Side of the images the processors are set up for (``data/digits``: 32x32)."""
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, vocab_size=VOCAB_SIZE, tie_word_embeddings=True)
"""The language model of both: the shape of ``tiny-llama`` / ``tiny-qwen3``."""
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
               "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
"""The special tokens of Qwen2.5-VL's tokenizer after ``<|endoftext|>``, in its order."""
SMOLVLM_TOKENS = (["<|im_start|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                  + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
"""SmolVLM's: ``<|im_start|>`` (its BOS), the image markers ``Idefics3Processor`` uses (the ``<row_i_col_j>`` tiles
only with image splitting), ``<end_of_utterance>`` (its EOS)."""

QWEN_TEMPLATE = r"""{#- Qwen2.5-VL's chat template (tiny-qwen2.5-vl, scripts/make_tiny_vlms.py), with the assistant's content and its
    <|im_end|> marked by {% generation %} for apply_chat_template(return_assistant_tokens_mask=True). -#}
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{{- '<|im_start|>' + message['role'] + '\n' -}}
{%- if message['role'] == 'assistant' -%}
{%- generation -%}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for content in message['content'] -%}
{%- if content['type'] == 'text' or ('text' in content and content['text'] is not none) -%}
{{- content['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- endgeneration -%}
{%- elif message['content'] is string -%}
{{- message['content'] + '<|im_end|>' -}}
{%- else -%}
{%- for content in message['content'] -%}
{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
{%- set image_count.value = image_count.value + 1 -%}
{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif content['type'] == 'video' or 'video' in content -%}
{%- set video_count.value = video_count.value + 1 -%}
{%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in content -%}
{{- content['text'] -}}
{%- endif -%}
{%- endfor -%}
{{- '<|im_end|>' -}}
{%- endif -%}
{{- '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

SMOLVLM_TEMPLATE = r"""{#- SmolVLM's chat template (tiny-smolvlm, scripts/make_tiny_vlms.py): "<|im_start|>" then per message
    "Role:" (": " unless the content starts with an image), the content (images as <image>) and "<end_of_utterance>\n";
    the assistant's content and its <end_of_utterance> are marked by {% generation %} for
    apply_chat_template(return_assistant_tokens_mask=True). String contents are accepted too. -#}
{{- '<|im_start|>' -}}
{%- for message in messages -%}
{{- message['role'] | capitalize -}}
{%- if message['content'] is string -%}
{%- set parts = [{'type': 'text', 'text': message['content']}] -%}
{%- else -%}
{%- set parts = message['content'] -%}
{%- endif -%}
{{- ':' -}}
{%- if message['role'] == 'assistant' -%}
{%- generation -%}
{%- if parts[0]['type'] != 'image' -%}{{- ' ' -}}{%- endif -%}
{%- for line in parts -%}
{%- if line['type'] == 'text' -%}{{- line['text'] -}}{%- elif line['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}
{%- endfor -%}
{{- '<end_of_utterance>' -}}
{%- endgeneration -%}
{%- else -%}
{%- if parts[0]['type'] != 'image' -%}{{- ' ' -}}{%- endif -%}
{%- for line in parts -%}
{%- if line['type'] == 'text' -%}{{- line['text'] -}}{%- elif line['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}
{%- endfor -%}
{{- '<end_of_utterance>' -}}
{%- endif -%}
{{- '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- 'Assistant:' -}}
{%- endif -%}
"""


def tokenizer(extra: list[str], bos: str | None, eos: str, pad: str):
    """The base BPE with the special tokens ``extra`` appended (ids 8192...) and the given BOS / EOS / pad."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BASE_TOKENIZER)
    tok.add_special_tokens({"extra_special_tokens": extra})
    tok.bos_token, tok.eos_token, tok.pad_token = bos, eos, pad
    assert tok.convert_tokens_to_ids(extra) == list(range(8192, 8192 + len(extra))), "special tokens are not new"
    assert len(tok) <= VOCAB_SIZE
    return tok


def tidy_tokenizer_config(folder: Path, processor_class: str) -> None:
    """Drop the loading-time keys ``save_pretrained`` copies into ``tokenizer_config.json``; name the processor."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        config.pop(key, None)
    config["processor_class"] = processor_class
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_qwen(folder: Path) -> None:
    """``tiny-qwen2.5-vl``: config, tokenizer, chat template and ``processor_config.json``."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = tokenizer(QWEN_TOKENS, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(QWEN_TOKENS)))
    patch, merge, temporal = 8, 2, 2
    config = Qwen2_5_VLConfig(
        text_config=dict(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                  "mrope_section": [2, 3, 3]},
                         max_window_layers=TEXT["num_hidden_layers"], bos_token_id=0, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                           patch_size=patch, spatial_merge_size=merge, temporal_patch_size=temporal,
                           window_size=IMAGE, fullatt_block_indexes=[1], out_hidden_size=TEXT["hidden_size"],
                           tokens_per_second=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    tidy_tokenizer_config(folder, "Qwen2_5_VLProcessor")
    (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    pixels = IMAGE * IMAGE
    image = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=patch, merge_size=merge,
                                     temporal_patch_size=temporal).to_dict()
    image["image_processor_type"] = "Qwen2VLImageProcessor"  # the auto class picks the backend (torchvision or PIL)
    video = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
             "do_sample_frames": False, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "max_frames": 768,
             "max_video_tokens": 128000, "merge_size": merge, "min_frames": 4, "patch_size": patch, "resample": 3,
             "rescale_factor": 1 / 255, "return_metadata": False,
             "size": {"longest_edge": pixels, "shortest_edge": pixels}, "temporal_patch_size": temporal,
             "video_processor_type": "Qwen2VLVideoProcessor"}
    processor = {"image_processor": image, "processor_class": "Qwen2_5_VLProcessor", "video_processor": video}
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")


def make_smolvlm(folder: Path) -> None:
    """``tiny-smolvlm``: config, and the processor (tokenizer, image processor, chat template) by ``save_pretrained``."""
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = tokenizer(SMOLVLM_TOKENS, bos="<|im_start|>", eos="<end_of_utterance>", pad="<|endoftext|>")
    ids = dict(zip(SMOLVLM_TOKENS, tok.convert_tokens_to_ids(SMOLVLM_TOKENS)))
    patch, scale = 8, 2
    image_seq_len = (IMAGE // patch) ** 2 // scale**2
    config = Idefics3Config(
        text_config=dict(model_type="llama", **TEXT, head_dim=TEXT["hidden_size"] // TEXT["num_attention_heads"],
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"], pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE, patch_size=patch),
        scale_factor=scale, image_token_id=ids["<image>"], pad_token_id=0, tie_word_embeddings=True)
    config.save_pretrained(folder)
    image = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE}, max_image_size={"longest_edge": IMAGE},
                                      do_image_splitting=False, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Idefics3Processor(image_processor=image, tokenizer=tok, image_seq_len=image_seq_len,
                                  chat_template=SMOLVLM_TEMPLATE)
    processor.save_pretrained(folder)
    tidy_tokenizer_config(folder, "Idefics3Processor")
    path = folder / "processor_config.json"
    saved = json.loads(path.read_text())
    saved["image_processor"]["image_processor_type"] = "Idefics3ImageProcessor"  # backend chosen when loading
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def main() -> int:
    """Write both folders; prints their files."""
    for name, make in (("tiny-qwen2.5-vl", make_qwen), ("tiny-smolvlm", make_smolvlm)):
        folder = MODELS / name
        folder.mkdir(parents=True, exist_ok=True)
        make(folder)
        files = ", ".join(f"{p.name} ({p.stat().st_size:,} B)" for p in sorted(folder.iterdir()))
        print(f"{folder}: {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
