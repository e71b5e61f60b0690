"""Reward functions of the ``grpo`` recipe: the built-ins, user functions named by path, their checks and scoring.

``train.grpo.rewards`` lists them; ``train.grpo.reward_weights`` weights their sum (TRL's ``reward_funcs`` and
``reward_weights``). Every function is called as TRL 1.16 calls a reward function::

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

with one entry per completion (a prompt is repeated for each of its ``num_generations`` completions; prompts and
completions are text, the prompt as the data holds it) and ``columns`` the ``data.reward_columns`` values of each
completion's row. ``None`` means "does not apply to this completion" (TRL's meaning): a completion every function
returns ``None`` for gets advantage 0. A function that raises, returns another number of values, a value that is no
number or ``None``, or NaN is a failure named after the function (:class:`RewardError`).

Built-ins:

* ``exact_match``: 1.0 when the answer ``train.grpo.answer_pattern`` finds in the completion equals the one it finds
  in the first reward column (:func:`answer_of`, as ``train.eval_generate``), else 0.0; ``None``
  when the reference has none.
* ``format``: 1.0 when ``train.grpo.format_pattern`` matches the completion (``re.search``, ``re.DOTALL``), else 0.0.
* ``length``: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13; TRL's
  ``get_soft_overlong_punishment``): 0 up to ``max_completion_length - length_cache`` tokens, then linear down to
  -1 at ``max_completion_length``.

A **reward model**: an entry that is a folder with a ``config.json`` (a ``reward`` recipe export, or any
``AutoModelForSequenceClassification`` with one label and its tokenizer) is loaded frozen, in fp32, on every rank
(:class:`RewardModel`), and scores each prompt + completion as TRL 1.16 does: the texts joined (a conversational
prompt: the messages plus the completion as the assistant's turn, rendered with the reward tokenizer's chat
template), tokenized without special tokens, right-padded, ``logits[:, 0]``.

A user function ``path/to/file.py:function`` is loaded from that file (relative to the working directory) when the
run starts and by ``--check``: the run config names the file, so running it is what the user asked for. Nothing
else is imported by name.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from finetune.errors import ConfigError

BUILTINS = ("exact_match", "format", "length")


class RewardError(RuntimeError):
    """A reward function failed on a batch: raised, returned the wrong number of values, a non-number, or NaN.
    ``str(err)`` names the function and what it did."""


@dataclass(frozen=True)
class RewardFunction:
    """One entry of ``train.grpo.rewards``, loaded.

    Attributes:
        spec: the entry as written (``exact_match``, ``rewards.py:brevity``).
        name: the metric name (``rewards/<name>/mean``): the built-in's name or the function's ``__name__``.
        fn: the callable, TRL's signature.
        weight: its weight in the sum.
    """

    spec: str
    name: str
    fn: Callable
    weight: float


def answer_of(text: str, pattern: str) -> str | None:
    """The answer ``pattern`` finds in ``text`` (its first group when it has groups, else the whole match),
    normalised for comparison: thousands separators, ``$`` and a trailing period removed, whitespace stripped;
    None when the pattern does not match."""
    m = re.search(pattern, text)
    if m is None:
        return None
    found = m.group(1) if m.re.groups else m.group(0)
    return (found or "").replace(",", "").replace("$", "").strip().rstrip(".").strip()


def exact_match(prompts, completions, completion_ids, *, pattern: str, reference_column: str, **columns):
    """``exact_match`` (module docstring): ``[N]`` of 1.0 / 0.0 / None."""
    out = []
    for completion, reference in zip(completions, columns[reference_column]):
        want = answer_of(str(reference), pattern) if reference is not None else None
        out.append(None if want is None else float(answer_of(completion, pattern) == want))
    return out


def format_reward(prompts, completions, completion_ids, *, pattern: str, **columns):
    """``format`` (module docstring): ``[N]`` of 1.0 / 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.search(c) is not None) for c in completions]


def length_penalty(prompts, completions, completion_ids, *, max_length: int, cache: int, **columns):
    """``length`` (module docstring): ``[N]`` in [-1, 0] from each completion's token count."""
    start = max_length - cache
    return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / cache) for ids in completion_ids]


def _builtin(spec: str, cfg) -> Callable:
    g, d = cfg.train.grpo, cfg.data
    if spec == "exact_match":
        return lambda **kw: exact_match(pattern=g.answer_pattern, reference_column=d.reward_columns[0], **kw)
    if spec == "format":
        return lambda **kw: format_reward(pattern=g.format_pattern, **kw)
    return lambda **kw: length_penalty(max_length=g.max_completion_length, cache=length_cache(g), **kw)


def length_cache(g) -> int:
    """``train.grpo.length_cache``, or a quarter of ``max_completion_length`` when 0 (at least 1)."""
    return g.length_cache or max(1, g.max_completion_length // 4)


class RewardModel:
    """A frozen sequence classifier with one label as a reward function (module docstring; TRL 1.16's
    ``_calculate_rewards`` for an ``nn.Module`` reward). Loaded with ``from_pretrained`` from local files only
    (``trust_remote_code`` off), fp32, eval mode, no gradients. As TRL 1.16's ``GRPOTrainer`` does for a reward model,
    the tokenizer pads with EOS when it has no pad token and the model's ``config.pad_token_id`` is set to the
    tokenizer's pad token: transformers' sequence classifiers score the last position that is not
    ``config.pad_token_id``, so a text scores the same alone and right-padded in a batch (a config whose pad id is
    another token would score a padding position; one without raises for batches of more than one).

    Args:
        folder: the export folder (``config.json``, weights, tokenizer files).
        key: the config key, for errors.

    Raises:
        ConfigError: the folder has no loadable model or tokenizer, or the model has another number of labels than 1.
    """

    def __init__(self, folder: Path, key: str, batch_size: int = 16):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{key}: '{folder}' has no readable config.json ({type(e).__name__}: {e})") from e
        if getattr(config, "num_labels", None) != 1:
            raise ConfigError(f"{key}: '{folder}' is a model with {getattr(config, 'num_labels', None)} labels; a "
                              f"reward model has one (recipe reward's export)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                folder, local_files_only=True, dtype=torch.float32).eval().requires_grad_(False)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{key}: loading the reward model '{folder}' failed ({type(e).__name__}: {e})") from e
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the classifier reads the score at the last position that is not the config's pad token: it must be the
        # token the batch is padded with (TRL 1.16's GRPOTrainer sets it so), else a padded row is scored at a pad
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.__name__ = "reward_model"

    def __call__(self, prompts, completions, **columns) -> list[float]:
        import torch

        if prompts and not isinstance(prompts[0], str):
            texts = [self.tokenizer.apply_chat_template(list(p) + [{"role": "assistant", "content": c}], tokenize=False)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        out: list[float] = []
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model.to(device)  # the rank's own device (a no-op after the first call)
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                     padding_side="right", add_special_tokens=False)
                out += self.model(**enc.to(device)).logits[:, 0].float().tolist()
        return out


def import_function(spec: str, key: str, what: str) -> Callable:
    """The function ``path/to/file.py:name`` names, its file imported once per process (also used for
    ``train.grpo.tools``). ``what`` ends the error for a ``spec`` that is no ``file:name`` ("'x' is <what>").

    Raises:
        ConfigError: one line naming ``key``: ``spec`` is no ``file:name``, the file is missing or fails to import
            (raises, ``sys.exit`` included), or it has no callable ``name``.
    """
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ConfigError(f"{key}: '{spec}' is {what}")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}: '{path}' is no file (relative paths are from the working directory {Path.cwd()})")
    module_name = f"finetune_reward_{abs(hash(str(file.resolve())))}"
    try:
        if module_name not in sys.modules:
            spec_obj = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec_obj)
            spec_obj.loader.exec_module(module)
            sys.modules[module_name] = module
        module = sys.modules[module_name]
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001  (the user's file: one line; sys.exit
        # or a KeyboardInterrupt raised at import included, which would end --check silently or with a traceback)
        raise ConfigError(f"{key}: importing '{path}' failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key}: '{path}' has no function '{name}'")
    return fn


def _load_user(spec: str, key: str) -> Callable:
    """The reward function ``file.py:name`` names. Raises ConfigError (one line, naming ``key``)."""
    fn = import_function(spec, key, f"neither a built-in ({', '.join(BUILTINS)}), a reward model folder (with a "
                                    f"config.json) nor path/to/file.py:function")
    name = spec.rpartition(":")[2]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: the signature of '{spec}' cannot be read ({e})") from e
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_KEYWORD not in kinds or not all(
            n in params or inspect.Parameter.VAR_POSITIONAL in kinds for n in ("prompts", "completions")):
        raise ConfigError(f"{key}: '{spec}' has the signature {name}{inspect.signature(fn)}; a reward function "
                          f"takes (prompts, completions, **kwargs) and returns one float (or None) per completion "
                          f"(TRL's signature)")
    return fn


def load(cfg) -> list[RewardFunction]:
    """The run's reward functions with their weights.

    Raises:
        ConfigError: an entry is unknown, a file is missing or fails to import, a function is missing or has
            another signature, ``reward_weights`` has another length, ``exact_match`` without a reward column or
            ``format`` without ``format_pattern``.
    """
    g = cfg.train.grpo
    problems: list[str] = []
    if not g.rewards and not g.environment:
        problems.append("train.grpo.rewards: empty; name at least one reward function (built-ins: "
                        f"{', '.join(BUILTINS)}; or path/to/file.py:function)")
    if g.reward_weights and len(g.reward_weights) != len(g.rewards):
        problems.append(f"train.grpo.reward_weights: {len(g.reward_weights)} weights for {len(g.rewards)} reward "
                        f"functions; give one per function or none (all 1)")
    bad = [(i, w) for i, w in enumerate(g.reward_weights) if not _finite_number(w)]
    if bad:
        problems.append(f"train.grpo.reward_weights[{bad[0][0]}]: {bad[0][1]!r} is not a finite number; every weight "
                        f"must be one (0 turns a function's reward off but keeps logging it)")
    if g.length_cache > g.max_completion_length:
        problems.append(f"train.grpo.length_cache: {g.length_cache} is longer than train.grpo.max_completion_length "
                        f"{g.max_completion_length}; the length penalty's ramp must fit in the completion (0: a "
                        f"quarter of it)")
    out = []
    for i, spec in enumerate(g.rewards):
        key = f"train.grpo.rewards[{i}]"
        spec = str(spec)
        try:
            if (Path(spec) / "config.json").is_file():
                fn = RewardModel(Path(spec), key)
                name = fn.__name__
            elif spec in BUILTINS:
                if spec == "exact_match" and not cfg.data.reward_columns:
                    raise ConfigError(f"{key}: exact_match compares with the first of data.reward_columns, which "
                                      f"is empty; name the reference column (e.g. data.reward_columns=[answer])")
                if spec == "format" and not g.format_pattern:
                    raise ConfigError(f"{key}: format needs train.grpo.format_pattern (a regular expression)")
                fn, name = _builtin(spec, cfg), spec
            else:
                fn = _load_user(spec, key)
                name = getattr(fn, "__name__", spec.rpartition(":")[2])
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        weight = float(g.reward_weights[i]) if len(g.reward_weights) == len(g.rewards) else 1.0
        if name in {f.name for f in out}:  # two reward models, or two functions of one name: rewards/<name>_<i>
            name = f"{name}_{i}"
        out.append(RewardFunction(spec, name, fn, weight))
    for pattern_key in ("answer_pattern", "format_pattern"):
        try:
            re.compile(getattr(g, pattern_key))
        except re.error as e:
            problems.append(f"train.grpo.{pattern_key}: '{getattr(g, pattern_key)}' is no regular expression ({e})")
    if problems:
        raise ConfigError(problems)
    return out


def _finite_number(v) -> bool:
    try:
        return not isinstance(v, (str, bool)) and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def score(functions: list[RewardFunction], prompts: list, completions: list[str], completion_ids: list[list[int]],
          columns: dict[str, list]) -> list[list[float]]:
    """Every function's rewards of every completion.

    Args:
        functions: from :func:`load`.
        prompts: ``N`` prompts (text, or lists of messages), one per completion.
        completions: ``N`` completion texts (special tokens skipped).
        completion_ids: ``N`` lists of the completion's token ids, up to and including its EOS (TRL's).
        columns: ``data.reward_columns`` -> ``N`` values.

    Returns:
        ``[N][F]`` floats, NaN where a function returned ``None``.

    Raises:
        RewardError: a function raised (``SystemExit`` included: a function calling ``sys.exit`` or ``exit()``),
            returned a non-list or another length, a non-number, NaN or an infinity.
    """
    n = len(completions)
    table = [[math.nan] * len(functions) for _ in range(n)]
    for j, f in enumerate(functions):
        try:
            got = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (named and re-raised as one line)
            raise RewardError(f"reward function {f.spec} raised {type(e).__name__}: {e}") from e
        if not isinstance(got, (list, tuple)) or len(got) != n:
            what = f"{len(got)} values" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
            raise RewardError(f"reward function {f.spec} returned {what} for {n} completions; it must return a list "
                              f"of one float (or None) per completion")
        for i, v in enumerate(got):
            if v is None:
                continue
            if isinstance(v, str) or not hasattr(v, "__float__"):
                raise RewardError(f"reward function {f.spec} returned {v!r} (a {type(v).__name__}) for completion "
                                  f"{i}; return a float or None")
            v = float(v)
            if not math.isfinite(v):
                raise RewardError(f"reward function {f.spec} returned {'NaN' if math.isnan(v) else v} for "
                                  f"completion {i} ({completions[i][:60]!r}); return a finite float, or None for a "
                                  f"completion it does not apply to")
            table[i][j] = v
    return table
