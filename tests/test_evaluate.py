"""``finetune evaluate`` on a real export: 2 CPU ranks under DeepSpeed's launcher (``--module finetune``).

The session's tiny GPT-2 run (``conftest.tiny_gpt_run``: 16 steps, export; tests/test_train.py reads it too) and one
evaluation of a copy of its run folder with the same config: the evaluation's ``eval/loss`` and ``eval/perplexity``
equal the run's own final evaluation (1e-4 relative; the export is the engine's weights, checked against its logits
at the end of the run), rank 0 writes the JSON beside the export; the evaluation runs at ZeRO-3 (the run at ZeRO-2)
on an engine without optimizer (its log line). Bad input (not a run or export folder, an existing or unwritable
``--out``, the ``dpo`` recipe, an export of another recipe's model class) is one line and exit 2, before any model
is built (``finetune evaluate``'s ``main`` in the test's process). A ``grpo`` export is evaluated in this process on
one rank (a few seconds): greedy completions scored by the config's reward functions, checked against transformers'
own greedy ``generate`` on the export and the reward functions called here.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time

import pytest

from conftest import CONFIGS, REPO, cpu_env, finetune_here, free_port, ok, read_metrics, run_python

pytestmark = pytest.mark.slow

TINY = CONFIGS / "tiny_gpt.yaml"


def evaluate_on_ranks(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus nproc --module finetune evaluate args...`` as DeepSpeed's runner builds it."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nproc))}).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "--module", "finetune", "evaluate", *args]
    return subprocess.run(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)


def test_evaluate_reproduces_the_final_eval_of_the_run(tiny_gpt_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_gpt_run, run)  # the evaluation writes into its export/; tests/test_train.py reads the run
    final = [r for r in read_metrics(run) if "eval/loss" in r][-1]
    proc = ok(evaluate_on_ranks([str(run), "--config", str(TINY), "train.eval_generate.prompts=3",
                                 "train.eval_generate.max_new_tokens=8", "ds.zero_optimization.stage=3",
                                 # the run's 4 batches of 4 rows per rank as 2 batches of 8: the same loss
                                 "train.eval_micro_batch_size=8", "train.eval_max_batches=2"]))
    # no optimizer: DeepSpeed's parameter partitioning alone (ZeRO-3), no optimizer state, no fp32 master weights
    assert proc.stdout.count("engine without optimizer (evaluation): ZeRO stage 3") == 2, proc.stdout[-4000:]
    assert "DeepSpeedZeRoOffload" in proc.stdout
    written = sorted((run / "export").glob("evaluation-*.json"))
    assert len(written) == 1, proc.stdout[-2000:]
    result = json.loads(written[0].read_text())
    assert result["world_size"] == 2 and result["recipe"] == "gpt_clm"
    for key in ("eval/loss", "eval/perplexity"):
        assert abs(result["metrics"][key] - final[key]) <= 1e-4 * abs(final[key]), (key, result, final)
    # train.eval_generate: gpt_clm continues the first half of 3 validation texts; scored against the second half
    assert [g["index"] for g in result["generations"]] == [0, 1, 2] and 0 <= result["metrics"]["eval/rougeL"] <= 1
    assert f"eval/loss        {result['metrics']['eval/loss']:.6g}" in proc.stdout

    # lm-evaluation-harness on the same export, offline, with the shipped local task files (docs/evaluation.md)
    harness = run_python(["-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={run / 'export'},dtype=float32", "--tasks", "gsm8k_local,wikitext2_local",
                          "--include_path", "scripts/lm_eval_tasks", "--limit", "4", "--num_fewshot", "0",
                          "--device", "cpu", "--batch_size", "4", "--gen_kwargs", "max_gen_toks=16",
                          "--output_path", str(tmp_path / "lm_eval")])
    assert harness.returncode == 0, harness.stdout[-3000:]
    scores = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= scores["gsm8k_local"]["exact_match,strict-match"] <= 1.0
    assert 1.0 < scores["wikitext2_local"]["byte_perplexity,none"] < 1e4, scores
    # finetune lm-eval with the same arguments: the harness CLI's scores, in the run folder and the model card
    code, printed = finetune_here(["lm-eval", run, "--tasks", "gsm8k_local,wikitext2_local", "--include-path",
                                   "scripts/lm_eval_tasks", "--limit", "4", "--num-fewshot", "0", "--device", "cpu",
                                   "--batch-size", "4", "--gen-kwargs", "max_gen_toks=16", "--dtype", "float32"], capsys)
    assert code == 0, printed[-3000:]
    (ours,) = sorted((run / "lm_eval").glob("results-*.json"))
    mine = json.loads(ours.read_text())["results"]
    for task in ("gsm8k_local", "wikitext2_local"):
        numbers = {k: v for k, v in scores[task].items() if "," in k}
        assert numbers and {k: mine[task][k] for k in numbers} == numbers, (task, mine[task], scores[task])
    from huggingface_hub import ModelCard

    index = ModelCard.load(run / "export" / "README.md").data.eval_results
    harness = {(r.dataset_name, r.metric_name): r.metric_value for r in index if r.source_name == "lm-evaluation-harness"}
    assert harness[("wikitext2_local", "byte_perplexity")] == scores["wikitext2_local"]["byte_perplexity,none"]
    assert harness[("gsm8k_local", "exact_match (strict-match)")] == scores["gsm8k_local"]["exact_match,strict-match"]
    assert any(r.metric_name == "eval/loss" for r in index)  # the run's own evaluation stays
    code, refused = finetune_here(["lm-eval", run, "--tasks", "gsm8k_nowhere", "--include-path",
                                   "scripts/lm_eval_tasks"], capsys)
    assert code == 2 and "lm-eval: --tasks: gsm8k_nowhere not in the harness's tasks" in refused
    code, refused = finetune_here(["lm-eval", run, "--tasks", "gsm8k_local", "--out", ours], capsys)
    assert code == 2 and "exists; it is never overwritten" in refused

    # bad input: one line each, exit 2, nothing evaluated
    code, again = finetune_here(["evaluate", run, "--config", TINY, "--out", written[0]], capsys)
    assert code == 2 and "exists; it is never overwritten" in again
    code, nowhere = finetune_here(["evaluate", tmp_path, "--config", TINY], capsys)
    assert code == 2 and "neither a run folder with an export/ nor an export folder" in nowhere
    code, dpo = finetune_here(["evaluate", run, "--config", CONFIGS / "parity_dpo.yaml"], capsys)
    assert code == 2 and "recipe dpo measures against its reference model, which an export does not carry" in dpo
    assert "Traceback" not in again + nowhere + dpo


def test_evaluate_refuses_before_building_a_model(tmp_path, capsys):
    """In-process: each refusal returns 2 with one line, before any process group or model exists."""
    from finetune.commands.evaluate import main

    # a seq_cls export (BERT with a classification head) evaluated with a gpt_clm config: not a causal LM
    export = tmp_path / "seq_cls_export"
    export.mkdir()
    config = json.loads((REPO / "data/models/bert-small/config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "architectures": ["BertForSequenceClassification"]}))
    for f in (REPO / "data/models/bert-base-uncased-tokenizer").iterdir():
        shutil.copy(f, export / f.name)
    start = time.perf_counter()
    assert main([str(export), "--config", str(TINY)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BertForSequenceClassification" in err[0] and "AutoModelForCausalLM" in err[0], err
    assert "gpt_clm" in err[0] and "seq_cls" in err[0], err  # names the recipe that trains that class
    assert time.perf_counter() - start < 30

    # --out where no file can be written: under a regular file (as root a chmod'ed folder is still writable)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    shipped = REPO / "data/models/tiny-gpt2"
    assert main([str(shipped), "--config", str(TINY), "--out", str(blocker / "eval.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "is a file, not a folder" in err[0], err


def test_evaluate_grpo_export_scores_greedy_completions(tmp_path, capsys, monkeypatch):
    """Issue 51 item 9: a grpo export is evaluated as the training run evaluates (one greedy completion per validation
    prompt, scored by the run config's reward functions: ``eval/reward`` and ``eval/rewards/<f>/mean``), not refused;
    in this process on one rank, against transformers' greedy ``generate`` on the export and the functions' own
    scores. ``train.grpo.beta`` > 0 (a LoRA run's config) is no refusal: the evaluation has no KL term."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from conftest import free_port

    export = tmp_path / "grpo_export"  # a scratch Llama-architecture export with the GPT-2 tokenizer, as grpo trains
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "data/models/tiny-llama"),
                                             dtype=torch.float32)
    model.save_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2")
    tokenizer.save_pretrained(export)
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def chars(prompts, completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n")
    out = tmp_path / "evaluation.json"
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    code, printed = finetune_here(["evaluate", export, "--config", CONFIGS / "tiny_grpo.yaml", "--out", out,
                                   f"train.grpo.rewards=[length,{scorer}:chars]", "train.grpo.reward_weights=[1.0,0.5]",
                                   "train.eval_max_batches=3", "data.max_seq_len=256", "train.grpo.beta=0.04"], capsys)
    assert code == 0, printed[-3000:]
    result = json.loads(out.read_text())
    assert result["recipe"] == "grpo" and result["world_size"] == 1
    records = result["completions"]
    questions = pq.read_table(REPO / "data/gsm8k/test.parquet", columns=["question"])["question"].to_pylist()
    assert [r["prompt"] for r in records] == questions[:3]  # the first validation rows, in order

    # the reference: transformers' greedy generate on the export, then the reward functions on its completions
    model.eval()
    rows = []
    for q in questions[:3]:
        ids = torch.tensor([tokenizer(q)["input_ids"]])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        new = new.tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode([t for t in new if t != tokenizer.eos_token_id], skip_special_tokens=True)
        length = 0.0 if len(new) <= 12 - 6 else max(-1.0, (12 - 6 - len(new)) / 6)  # length_cache 6 of 12 tokens
        rows.append((text, length, len(text) / 10))
    assert [r["completion"] for r in records] == [t for t, _, _ in rows]
    for r, (_, a, b) in zip(records, rows):  # the scores as the functions gave them (float32 in the table)
        assert r["rewards"] == {"length": pytest.approx(a, abs=1e-6), "chars": pytest.approx(b, abs=1e-6)}, r
    metrics = result["metrics"]
    assert metrics["eval/rewards/length/mean"] == pytest.approx(sum(a for _, a, _ in rows) / 3, abs=1e-6)
    assert metrics["eval/rewards/chars/mean"] == pytest.approx(sum(b for _, _, b in rows) / 3, abs=1e-6)
    assert metrics["eval/reward"] == pytest.approx(sum(a + 0.5 * b for _, a, b in rows) / 3, abs=1e-6)
    assert f"eval/reward               {metrics['eval/reward']:.6g}" in printed  # rank 0's table


def test_lm_eval_refuses_an_export_without_tokenizer_and_limit_zero(tmp_path, capsys):
    """Issue 68, item 15: ``finetune lm-eval`` on an export without tokenizer files ran the harness on the empty
    tokenizer transformers builds from ``config.json`` alone (every text no tokens, scores of nothing), and
    ``--limit 0`` ended in the harness's traceback ("did not find any docs"); each is one line, exit 2, before the
    harness loads a model."""
    bare = tmp_path / "export"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(REPO / "data/models/tiny-gpt2" / name, bare / name)
    tasks = ["--tasks", "wikitext2_local", "--include-path", "scripts/lm_eval_tasks"]
    code, printed = finetune_here(["lm-eval", bare, *tasks, "--limit", "2"], capsys)
    assert code == 2 and f"lm-eval: the export '{bare}' has no tokenizer files (none of tokenizer.json" in printed, \
        printed[-2000:]
    code, printed = finetune_here(["lm-eval", REPO / "data/models/tiny-gpt2", *tasks, "--limit", "0", "--out",
                                   tmp_path / "out.json"], capsys)
    assert code == 2 and "lm-eval: --limit: must be > 0" in printed and "Traceback" not in printed, printed[-2000:]
    assert not (tmp_path / "out.json").exists() and not (bare / "lm_eval").exists()
