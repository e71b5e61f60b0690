"""What several recipes share, each module named for what it owns; no recipe imports another recipe
(the import-linter ``independence`` contract in ``pyproject.toml``), so a change to one recipe cannot break another
through a borrowed helper, and a reader of a recipe opens only the recipe and these modules.

* :mod:`~finetune.recipes.common.targets`: next-token targets, their counts and the causal-LM loss.
* :mod:`~finetune.recipes.common.chat`: prompt/response and chat examples: rendering with a chat template, answer
  masks, packing, and their checks.
* :mod:`~finetune.recipes.common.pairs`: chosen/rejected pair rows, their collation and sequence log-probabilities.
* :mod:`~finetune.recipes.common.reference`: the frozen reference pass (log-probabilities cached by content
  digest and library versions).
* :mod:`~finetune.recipes.common.masks`: block-diagonal (and sliding-window) attention masks for rows that share
  a prefix.
* :mod:`~finetune.recipes.common.rewards`: loading reward functions from ``path/to/file.py:function`` entries and
  the built-in checks (``exact_match``, ...), shared by ``grpo`` and the generating evaluation.
* :mod:`~finetune.recipes.common.labels`: class names in the model config (``seq_cls``, ``token_cls``).
* :mod:`~finetune.recipes.common.fast_tokenizer`: the fast tokenizer the tag and span recipes need (``token_cls``,
  ``qa``).
* :mod:`~finetune.recipes.common.widths`: a micro-batch's short rows run as a second forward at their own width
  (``qa``, ``embed``).

The chunked LM head itself is :mod:`finetune.recipes.lm_loss`, beside this package.
"""
