"""Class names of classification heads (``seq_cls``'s labels, ``token_cls``'s tags): what the model config says
about them, so that the export returns names in ``transformers.pipeline``."""

from __future__ import annotations


def name_classes(model_config, names: list):
    """Set ``num_labels``, ``id2label`` (class id -> name as str) and ``label2id`` from the sorted class names
    ``names`` (class id ``i`` is ``names[i]``); returns the config."""
    model_config.num_labels = len(names)
    model_config.id2label = {i: str(name) for i, name in enumerate(names)}
    model_config.label2id = {str(name): i for i, name in enumerate(names)}
    return model_config
