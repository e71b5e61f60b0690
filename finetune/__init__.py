"""finetune: fine-tune Hugging Face models with DeepSpeed from local files (see README.md)."""

__version__ = "0.1.0"
