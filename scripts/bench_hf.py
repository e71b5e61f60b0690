"""The Hugging Face Trainer + DeepSpeed contender of ``scripts/bench.py`` (launched by it under ``deepspeed``).

Written as a user of transformers writes it: ``datasets`` reads the parquet files; per recipe, the tokenizer
truncates rows and ``DataCollatorForLanguageModeling`` masks and pads (``bert_mlm``), ``group_texts`` packs the texts
into blocks (``gpt_clm``, as ``run_clm.py``), the tokenizer truncates sentences and ``DataCollatorWithPadding`` pads
them, labels being indices of the sorted label set (``seq_cls``, as ``run_glue.py``), words tokenized and their tags
aligned to the first word pieces, truncated and padded by ``DataCollatorForTokenClassification``, the held-out entity
F1 of ``seqeval`` after training (``token_cls``, as ``run_ner.py``), question and context tokenized into
overlapping windows labelled with the answer's tokens, padded by ``DataCollatorWithPadding``, the held-out SQuAD F1
after ``run_qa.py``'s post-processing (``qa``), or each prompt/response pair
becomes ``tokens(prompt) + tokens(response) + [EOS]`` with label -100 on the prompt, truncated, one example per row,
padded by ``DataCollatorForSeq2Seq`` (``sft``; a conversation: rendered by the tokenizer's chat template, the turns
before the last the prompt, the last answer with its end-of-turn marker the response; a pretrained model with
``model.lora``: ``from_pretrained`` and peft's ``get_peft_model``); ``Trainer(args=TrainingArguments(deepspeed=<dict>,
train_sampling_strategy=...))`` trains. Empty texts are dropped first for the LM presets, as the toolkit does, so both
train on the same rows. The model (``config.json`` + the run config's ``config_overrides``, e.g. a Llama
architecture built from config), batch layout, ZeRO stage (the DeepSpeed dict, ZeRO-3 included), gradient
checkpointing (``TrainingArguments(gradient_checkpointing=...)``), precision, optimizer (torch AdamW), schedule, seed and
number of steps come from the same spec as the toolkit's run (``--spec``, written by ``scripts/bench.py``).

Measured, per rank, into ``<out>/rank<r>.json``: the wall time at the end of each optimizer step (Unix seconds),
the non-pad tokens and positions of each collated micro-batch, and (rank 0) the logged loss of each step.
This file is a benchmark contender only: the ``finetune`` package never imports transformers' ``Trainer``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_records import leave, step_meter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="JSON spec written by scripts/bench.py")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args()
    spec = json.loads(Path(args.spec).read_text())

    import datasets
    import torch
    import transformers
    from transformers import (AutoConfig, DataCollatorForLanguageModeling, DataCollatorForSeq2Seq,
                              DataCollatorForTokenClassification, DataCollatorWithPadding, Trainer, TrainingArguments,
                              default_data_collator)

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", 0))
    recipe = spec["recipe"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"], local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    max_len = spec["max_seq_len"]

    half = spec["precision"]
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], max_steps=spec["steps"],
        learning_rate=spec["lr"], weight_decay=spec["weight_decay"], warmup_steps=spec["warmup_steps"],
        lr_scheduler_type=spec["lr_scheduler"], max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        logging_steps=spec.get("log_every", 1), save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, train_sampling_strategy=spec["sampling"], bf16=half == "bf16",
        fp16=half == "fp16", deepspeed=spec["hf_deepspeed"], use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=bool(spec.get("gradient_checkpointing")))
    data_start = time.time()
    # as transformers' examples (run_clm.py, run_mlm.py, run_glue.py): rank 0 maps first, the others read its cache
    with targs.main_process_first(desc="dataset map pre-processing"):
        raw = datasets.load_dataset("parquet", data_files=spec["train_files"], split="train",
                                    cache_dir=spec.get("hf_cache") or str(out.parent / "hf-datasets"))
        if spec.get("max_train_rows"):
            raw = raw.select(range(min(spec["max_train_rows"], len(raw))))
        text = spec["text_column"]
        config = AutoConfig.from_pretrained(spec["model"], local_files_only=True)
        for k, v in spec["config_overrides"].items():
            setattr(config, k, v)
        if recipe == "bert_mlm":
            raw = raw.filter(lambda b: [bool(t and t.strip()) for t in b[text]], batched=True)
            train = raw.map(lambda b: tokenizer(b[text], truncation=True, max_length=max_len,
                                                return_special_tokens_mask=True),
                            batched=True, remove_columns=raw.column_names)
            collate = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=spec["mlm_probability"])
            model_class = transformers.AutoModelForMaskedLM
        elif recipe == "gpt_clm":
            raw = raw.filter(lambda b: [bool(t and t.strip()) for t in b[text]], batched=True)

            def group_texts(batch):  # transformers examples/pytorch/language-modeling/run_clm.py, EOS between texts
                ids = tokenizer(batch[text], add_special_tokens=False)["input_ids"]
                stream = [t for row in ids for t in row + [tokenizer.eos_token_id]]
                n = len(stream) // max_len * max_len
                blocks = [stream[i:i + max_len] for i in range(0, n, max_len)]
                return {"input_ids": blocks, "attention_mask": [[1] * max_len for _ in blocks],
                        "labels": [list(b) for b in blocks]}

            train = raw.map(group_texts, batched=True, remove_columns=raw.column_names)
            collate = default_data_collator
            model_class = transformers.AutoModelForCausalLM
        elif recipe == "seq_cls":  # transformers examples/pytorch/text-classification/run_glue.py, sorted label set
            names = sorted(set(raw[spec["label_column"]]))
            class_id = {n: i for i, n in enumerate(names)}
            config.num_labels = len(names)
            train = raw.map(lambda b: {**tokenizer(b[text], truncation=True, max_length=max_len),
                                       "labels": [class_id[v] for v in b[spec["label_column"]]]},
                            batched=True, remove_columns=raw.column_names)
            collate = DataCollatorWithPadding(tokenizer)
            model_class = transformers.AutoModelForSequenceClassification
        elif recipe == "sft":  # prompt/response: loss on the response + EOS only, one example per row, padded
            def split(batch):
                """(prompt, response) texts: the columns; or a conversation rendered with the tokenizer's chat
                template, the turns before the last as the prompt (with the generation prompt), the rest (the
                last answer and its end-of-turn marker) as the response."""
                if not spec.get("messages_column"):  # the prompt with special tokens, EOS id after the response
                    return [(p, r, True)
                            for p, r in zip(batch[spec["prompt_column"]], batch[spec["response_column"]])]
                pairs = []
                for messages in batch[spec["messages_column"]]:
                    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
                    full = tokenizer.apply_chat_template(messages, tokenize=False)
                    pairs.append((prompt, full[len(prompt):], False))
                return pairs

            def encode(batch):
                ids, labels = [], []
                for prompt, response, special in split(batch):
                    p = tokenizer(prompt, add_special_tokens=special)["input_ids"]
                    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * special
                    ids.append((p + r)[:max_len])
                    labels.append(([-100] * len(p) + r)[:max_len])
                return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids], "labels": labels}

            train = raw.map(encode, batched=True, remove_columns=raw.column_names)
            train = train.filter(lambda b: [any(v != -100 for v in lab) for lab in b["labels"]], batched=True)
            collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
            model_class = transformers.AutoModelForCausalLM
        elif recipe == "token_cls":  # transformers examples/pytorch/token-classification/run_ner.py
            words_col, tags_col = spec["tokens_column"], spec["tags_column"]
            label_list = sorted({t for tags in raw[tags_col] for t in tags})  # run_ner.py's get_label_list
            label_to_id = {label: i for i, label in enumerate(label_list)}
            b_to_i_label = [label_list.index(label.replace("B-", "I-"))
                            if label.startswith("B-") and label.replace("B-", "I-") in label_list else i
                            for i, label in enumerate(label_list)]
            config.num_labels = len(label_list)
            config.id2label = dict(enumerate(label_list))
            config.label2id = label_to_id

            def tokenize_and_align_labels(examples):  # run_ner.py's, padding left to the collator
                tokenized = tokenizer(examples[words_col], truncation=True, max_length=max_len,
                                      is_split_into_words=True)
                labels = []
                for i, label in enumerate(examples[tags_col]):
                    previous, label_ids = None, []
                    for word_idx in tokenized.word_ids(batch_index=i):
                        if word_idx is None:
                            label_ids.append(-100)
                        elif word_idx != previous:
                            label_ids.append(label_to_id[label[word_idx]])
                        else:
                            label_ids.append(b_to_i_label[label_to_id[label[word_idx]]]
                                             if spec["label_all_tokens"] else -100)
                        previous = word_idx
                    labels.append(label_ids)
                tokenized["labels"] = labels
                return tokenized

            train = raw.map(tokenize_and_align_labels, batched=True, remove_columns=raw.column_names)
            if spec.get("validation_files"):
                held = datasets.load_dataset("parquet", data_files=spec["validation_files"], split="train",
                                             cache_dir=spec.get("hf_cache") or str(out.parent / "hf-datasets"))
                held = held.map(tokenize_and_align_labels, batched=True, remove_columns=held.column_names)
            collate = DataCollatorForTokenClassification(tokenizer)
            model_class = transformers.AutoModelForTokenClassification
        elif recipe == "qa":  # transformers examples/pytorch/question-answering/run_qa.py, dynamic padding
            q_col, c_col, a_col = spec["question_column"], spec["context_column"], spec["answers_column"]
            stride = spec["doc_stride"]

            def features(examples, train_split: bool):  # prepare_train_features / prepare_validation_features
                questions = [q.lstrip() for q in examples[q_col]]
                tokenized = tokenizer(questions, examples[c_col], truncation="only_second", max_length=max_len,
                                      stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True)
                sample_mapping = tokenized.pop("overflow_to_sample_mapping")
                offset_mapping = tokenized.pop("offset_mapping")
                if not train_split:
                    tokenized["example"] = list(sample_mapping)
                    tokenized["offsets"] = [[o if s == 1 else (-1, -1) for o, s in zip(offs, tokenized.sequence_ids(i))]
                                            for i, offs in enumerate(offset_mapping)]
                    return tokenized
                tokenized["start_positions"], tokenized["end_positions"] = [], []
                for i, offsets in enumerate(offset_mapping):
                    input_ids = tokenized["input_ids"][i]
                    cls_index = input_ids.index(tokenizer.cls_token_id)
                    sequence_ids = tokenized.sequence_ids(i)
                    answers = examples[a_col][sample_mapping[i]]
                    start = end = cls_index
                    if len(answers["answer_start"]):
                        start_char = answers["answer_start"][0]
                        end_char = start_char + len(answers["text"][0])
                        first = sequence_ids.index(1)
                        last = len(sequence_ids) - 1 - sequence_ids[::-1].index(1)
                        if offsets[first][0] <= start_char and offsets[last][1] >= end_char:
                            while first < len(offsets) and offsets[first][0] <= start_char:
                                first += 1
                            while offsets[last][1] >= end_char:
                                last -= 1
                            start, end = first - 1, last + 1
                    tokenized["start_positions"].append(start)
                    tokenized["end_positions"].append(end)
                return tokenized

            train = raw.map(lambda b: features(b, True), batched=True, remove_columns=raw.column_names)
            if spec.get("validation_files"):
                held_raw = datasets.load_dataset("parquet", data_files=spec["validation_files"], split="train",
                                                 cache_dir=spec.get("hf_cache") or str(out.parent / "hf-datasets"))
                held = held_raw.map(lambda b: features(b, False), batched=True, remove_columns=held_raw.column_names)
            collate = DataCollatorWithPadding(tokenizer)
            model_class = transformers.AutoModelForQuestionAnswering
        else:
            raise SystemExit(f"bench_hf.py: no Hugging Face contender for recipe {recipe!r}")

    data_seconds = time.time() - data_start

    counts: list[tuple[int, int]] = []  # (non-pad tokens, positions) of each collated micro-batch, in order

    def counting_collate(rows):
        batch = collate(rows)
        mask = batch["attention_mask"]
        counts.append((int(mask.sum()), int(mask.numel())))
        return batch

    step_ends: list[float] = []
    step_cpu: list[float] = []
    losses: dict[int, float] = {}

    torch.manual_seed(spec["seed"])
    if (spec["hf_deepspeed"] or {}).get("zero_optimization", {}).get("stage") == 3:
        # from_config builds the model under deepspeed.zero.Init (partitioned as it is built), whose config needs
        # the world size: DeepSpeed's process group up first (it adopts the one Trainer's arguments started)
        import deepspeed

        _ = targs.device
        deepspeed.init_distributed()
    if spec.get("init") == "pretrained":  # a real model: its weights (the converted GGUF folder)
        model = model_class.from_pretrained(spec["model"], config=config, dtype=torch.float32, local_files_only=True)
    else:
        model = model_class.from_config(config, dtype=torch.float32)
    if spec.get("lora"):  # the toolkit's model.lora as peft adapters, as a Trainer user adds them
        from peft import LoraConfig, get_peft_model

        lo = spec["lora"]
        model = get_peft_model(model, LoraConfig(
            r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"], use_dora=lo["use_dora"],
            use_rslora=lo["use_rslora"], task_type="CAUSAL_LM", modules_to_save=lo["modules_to_save"] or None,
            target_modules="all-linear" if lo["target_modules"] == ["all-linear"] else lo["target_modules"]))
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # sequence classification finds the last real token
    trainer = Trainer(model=model, args=targs, train_dataset=train, data_collator=counting_collate,
                      processing_class=tokenizer,
                      callbacks=[step_meter(step_ends, step_cpu, losses)])
    trainer.train()
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    heldout = None
    if recipe == "token_cls" and spec.get("validation_files"):  # run_ner.py's compute_metrics (seqeval), not timed
        from seqeval.metrics import f1_score

        trainer.data_collator = collate
        predictions, labels, _ = trainer.predict(held)
        predictions = predictions.argmax(-1)
        names = model.config.id2label
        y_true = [[names[int(t)] for t in row if t != -100] for row in labels]
        y_pred = [[names[int(p)] for p, t in zip(prow, row) if t != -100] for prow, row in zip(predictions, labels)]
        heldout = {"accuracy": f1_score(y_true, y_pred)}
    if recipe == "qa" and spec.get("validation_files"):  # run_qa.py's post-processing and SQuAD 2.0 F1, not timed
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from finetune.recipes.qa import predict, scores  # tested equal to utils_qa.postprocess_qa_predictions

        trainer.data_collator = collate
        (starts, ends), _, _ = trainer.predict(held.remove_columns(["example", "offsets"]))
        by_example: dict[int, list[int]] = {}
        for i, e in enumerate(held["example"]):
            by_example.setdefault(e, []).append(i)
        f1s = []
        for e, feats in sorted(by_example.items()):
            offs = torch.full((len(feats), starts.shape[1], 2), -1, dtype=torch.long)
            for k, i in enumerate(feats):
                offs[k, :len(held[i]["offsets"])] = torch.tensor(held[i]["offsets"])
            pred = predict(torch.as_tensor(starts[feats]), torch.as_tensor(ends[feats]), offs, held_raw[e][c_col],
                           spec["n_best_size"], spec["max_answer_length"], spec["version_2_with_negative"],
                           spec["null_score_diff_threshold"])
            f1s.append(scores(held_raw[e][a_col]["text"], pred)[1])
        heldout = {"accuracy": sum(f1s) / len(f1s)}
    (out / f"rank{rank}.json").write_text(json.dumps({"step_ends": step_ends, "step_cpu": step_cpu, "counts": counts,
                                                      "losses": losses, "gpu_max_allocated": peak_gpu,
                                                      "heldout": heldout,
                                                      "data_seconds": data_seconds}))
    leave()

if __name__ == "__main__":
    main()
