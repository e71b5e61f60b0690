"""A model class for the recipes that train a language model's own completions on text or on images and text
(``grpo``): transformers' ``AutoModelForImageTextToText`` for a checkpoint whose config has a ``vision_config``
(Idefics3/SmolVLM, Qwen2.5-VL, LLaVA, Gemma 3, ...), else ``AutoModelForCausalLM``. It answers what the rest of the
code asks of a recipe's ``model_class``: ``from_config``, ``from_pretrained`` and ``_model_mapping`` (the config
types it builds, and the class for each)."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText


def _image_text(config) -> bool:
    return getattr(config, "vision_config", None) is not None


class _Mapping:
    """``AutoModelForImageTextToText``'s mapping, then ``AutoModelForCausalLM``'s, as one (``in``, ``[]``,
    ``keys``); a config type in both builds the image-text class."""

    def __init__(self, *mappings):
        self.mappings = mappings
        self._model_mapping = {k: v for m in reversed(mappings) for k, v in m._model_mapping.items()}
        self._extra_content = {k: v for m in reversed(mappings) for k, v in m._extra_content.items()}

    def __contains__(self, config_type) -> bool:
        return any(config_type in m for m in self.mappings)

    def __getitem__(self, config_type):
        for m in self.mappings:
            if config_type in m:
                return m[config_type]
        raise KeyError(config_type)

    def keys(self):
        return [k for m in self.mappings for k in m.keys()]


class AutoModelForCausalOrImageTextLM:
    """``AutoModelForImageTextToText`` for a config with a ``vision_config``, else ``AutoModelForCausalLM``
    (module docstring). LoRA wraps either as a causal LM (peft's ``CAUSAL_LM`` task: image inputs pass through its
    ``forward`` and ``generate``)."""

    _model_mapping = _Mapping(AutoModelForImageTextToText._model_mapping, AutoModelForCausalLM._model_mapping)

    @staticmethod
    def for_config(config) -> type:
        """The auto class that builds ``config``."""
        return AutoModelForImageTextToText if _image_text(config) else AutoModelForCausalLM

    @classmethod
    def from_config(cls, config, **kwargs):
        return cls.for_config(config).from_config(config, **kwargs)

    @classmethod
    def from_pretrained(cls, path, *args, config=None, **kwargs):
        if config is None:
            config = AutoConfig.from_pretrained(path, local_files_only=kwargs.get("local_files_only", False))
        return cls.for_config(config).from_pretrained(path, *args, config=config, **kwargs)
