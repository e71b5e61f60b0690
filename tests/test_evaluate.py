"""``finetune evaluate`` on a real export: 2 CPU ranks under DeepSpeed's launcher (``--module finetune``).

The session's tiny GPT-2 run (``conftest.tiny_gpt_run``: 16 steps, export; tests/test_train.py reads it too) and one
evaluation of a copy of its run folder with the same config: the evaluation's ``eval/loss`` and ``eval/perplexity``
equal the run's own final evaluation (1e-4 relative; the export is the engine's weights, checked against its logits
at the end of the run), rank 0 writes the JSON beside the export; the evaluation runs at ZeRO-3 (the run at ZeRO-2)
on an engine without optimizer (its log line). Bad input (not a run or export folder, an existing or unwritable
``--out``, the ``dpo`` recipe, an export of another recipe's model class) is one line and exit 2, before any model
is built (``finetune evaluate``'s ``main`` in the test's process).
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
                                 "train.eval_generate.max_new_tokens=8", "ds.zero_optimization.stage=3"]))
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
