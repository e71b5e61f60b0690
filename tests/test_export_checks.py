"""The export refuses missing or empty tensors instead of writing a broken model (no training needed)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import REPO
from finetune.errors import ConfigError
from finetune.export import _check_and_load


@pytest.fixture
def model():
    config = AutoConfig.from_pretrained(REPO / "data/models/tiny-gpt2", local_files_only=True)
    return AutoModelForCausalLM.from_config(config)


def full_state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_complete_state_loads_and_tied_head_is_accepted(model):
    state = full_state(model)
    state.pop("lm_head.weight", None)  # tied to transformer.wte.weight: not needed
    target = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
    _check_and_load(model, target, REPO / "ckpt")
    assert torch.equal(model.transformer.wte.weight, target["transformer.wte.weight"])


def test_empty_zero3_placeholder_is_an_error(model):
    state = full_state(model)
    state["transformer.h.0.attn.c_attn.weight"] = torch.empty(0)
    with pytest.raises(ConfigError, match=r"'transformer.h.0.attn.c_attn.weight' is empty .*not gathered"):
        _check_and_load(model, state, REPO / "ckpt")


def test_missing_tensor_is_an_error(model):
    state = full_state(model)
    del state["transformer.ln_f.weight"]
    with pytest.raises(ConfigError, match=r"'transformer.ln_f.weight' is missing"):
        _check_and_load(model, state, REPO / "ckpt")
