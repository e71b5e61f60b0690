"""``finetune plan``, ``finetune doctor`` and ``finetune report`` (in-process: no training launch).

The plan's figures are compared with the measured peak memory of real runs in
``tests/test_train.py::test_plan_matches_measured_rss`` (it reads the runs that module launches anyway).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import CONFIGS, EXPORT_STAND_INS, REPO, cpu_env, run_python

from finetune.preflight import plan

from finetune.lifecycle import report
from finetune.commands import doctor
from finetune.commands import plan as plan_cmd
from finetune.commands import report as report_cmd

SHIPPED = sorted((REPO / "finetune" / "recipes" / "configs").glob("*.yaml"))
BIG = {  # name -> (run config, overrides, parameters: transformers' own count of the full model)
    "bert-large": (REPO / "finetune/recipes/configs/bert_large_mlm_wikitext2_zero3.yaml",
                   ["model.path=data/models/bert-large-config"], 335_174_458),
    "gpt2-medium": (REPO / "finetune/recipes/configs/gpt_clm_wikitext2.yaml",
                    ["model.path=data/models/gpt2-medium-config", "model.config_overrides={}",
                     "data.max_seq_len=1024", "train.micro_batch_size=8"], 354_823_168),
}


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # run configs name repo-relative paths


def _plan(capsys, argv):
    code = plan_cmd.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("config", SHIPPED + [CONFIGS / "tiny_gpt.yaml", CONFIGS / "tiny_bert.yaml"],
                         ids=lambda p: p.stem)
def test_plan_prints_table_for_shipped_configs(capsys, config):
    overrides = ["model.path=data/models/bert-large-config"] if "bert_large" in config.name else []
    overrides = EXPORT_STAND_INS.get(config.name, overrides)  # an SFT run's export: the model it is built from
    code, out, err = _plan(capsys, [config, *overrides, "--gpus-per-node", "2"])
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("ZeRO ")]
    assert len(rows) == 14, out  # 4 stages + 3 offloaded, each with and without gradient checkpointing
    assert "recommendation: ZeRO 0 " in out, out  # small models fit an 80 GiB GPU without sharding


@pytest.mark.parametrize("name", sorted(BIG))
def test_plan_big_configs(capsys, name):
    config, overrides, params = BIG[name]
    code, out, err = _plan(capsys, [config, *overrides, "--gpus-per-node", "8", "--gpu-memory", "80GiB"])
    assert code == 0, err
    assert f"{params:,} parameters" in out, out
    from finetune.config import load_run_config

    cfg = load_run_config(config, overrides)
    text, options, best = plan.make_plan(cfg, 8, 1, 80 * 2**30, None)
    by = {(e.stage, e.offload, e.checkpointing): e for e in options}
    n = params
    # bf16 model states per GPU, DeepSpeed's byte counts: ZeRO 0 = 2+2+16 bytes/param, ZeRO 2 = 2 + 18/8
    states = lambda e: sum(v for k, v in e.gpu.items() if k not in ("activations", "logits", "DeepSpeed buffers"))
    assert states(by[0, False, False]) == pytest.approx(20 * n)
    assert states(by[2, False, False]) == pytest.approx(2 * n + 18 * n / 8)
    assert states(by[3, False, False]) < states(by[2, False, False]) < states(by[1, False, False]) \
        < states(by[0, False, False])
    assert by[2, True, False].gpu_total < by[2, False, False].gpu_total  # offload moves states to CPU RAM
    assert by[2, True, False].cpu["Adam moments (fp32)" + " (offloaded)"] == pytest.approx(8 * n / 8 * 8)
    assert by[0, False, True].gpu["activations"] < by[0, False, False].gpu["activations"] / 5  # recomputation
    assert best is not None and best[0] is options[0] and best[1] >= cfg.train.micro_batch_size
    # Korthikanti et al. per layer: sbh(34 + 5as/h) bytes in 16-bit with eager attention (I = 4h, dropout on)
    eager = plan.model_shape(cfg)
    eager.eager_attention = True
    s, b, h, a = cfg.data.max_seq_len, 1, eager.hidden, eager.heads
    per_layer = (plan.activation_bytes(eager, b, s, 2, False)["activations"] - 3 * s * b * h * 2) / eager.layers
    assert per_layer == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    # A small GPU: the fastest option no longer fits, the recommendation moves on and says so.
    _, _, small_best = plan.make_plan(cfg, 8, 1, 6 * 2**30, None)
    assert small_best is not None and small_best[0].cost > options[0].cost
    e, mb = small_best
    shape = plan.model_shape(cfg)
    fits = plan.estimate(shape, plan.cfg_ds(cfg, 8, "bf16"), e.stage, e.offload, e.checkpointing, mb,
                         cfg.data.max_seq_len, 8, 1, "bf16")
    too_big = plan.estimate(shape, plan.cfg_ds(cfg, 8, "bf16"), e.stage, e.offload, e.checkpointing, mb + 1,
                            cfg.data.max_seq_len, 8, 1, "bf16")
    assert fits.gpu_total <= 0.9 * 6 * 2**30 < too_big.gpu_total


def test_plan_counts_dpo_under_sequence_parallelism_and_lora():
    """``dpo`` (2 sequences per row) at SP 2: the activations are those of half the tokens per rank, and the table's
    'max micro' is the recommendation's (both at the SP length); LoRA: gradients and optimizer states of the
    adapters only, the frozen base counted as parameters."""
    from finetune.config import load_run_config

    config = REPO / "finetune" / "recipes" / "configs" / "dpo_gsm8k.yaml"
    cfg = load_run_config(config, ["parallel.sequence_parallel_size=2"])
    text, options, best = plan.make_plan(cfg, 8, 1, 2 * 2**30, None)
    assert "sequence parallelism 2: activations of 128 tokens per row and rank" in text
    shape = plan.model_shape(cfg)
    assert shape.sequences_per_row == 2 and shape.trainable == 0
    whole = plan.activation_bytes(shape, 2 * cfg.train.micro_batch_size, cfg.data.max_seq_len, 2, False)
    half = plan.activation_bytes(shape, 2 * cfg.train.micro_batch_size, cfg.data.max_seq_len // 2, 2, False)
    assert options[0].gpu["activations"] == half["activations"] < whole["activations"]
    e, mb = best
    row = next(line for line in text.splitlines() if line.startswith(e.name + " "))
    assert row.split()[-1] == str(mb) and f"train.micro_batch_size up to {mb} " in text
    lora_cfg = load_run_config(config, ["parallel.sequence_parallel_size=2", "model.lora.r=8"])
    adapted = plan.model_shape(lora_cfg)
    assert 0 < adapted.trainable < adapted.params / 100 and adapted.params > shape.params
    _, lora_options, _ = plan.make_plan(lora_cfg, 8, 1, 2 * 2**30, None)
    z0 = next(o for o in lora_options if (o.stage, o.offload, o.checkpointing) == (0, False, False))
    assert z0.gpu["gradients"] == adapted.trainable * 2 and z0.gpu["Adam moments (fp32)"] == adapted.trainable * 8
    assert z0.gpu["parameters"] == adapted.params * 2


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_plan_and_doctor_count_active_experts(capsys, model, tmp_path):
    """A mixture of experts: total and active parameters (non-expert + top_k / experts of the expert ones, counted here
    from transformers' own modules), activations of the top-k experts, the whole sparse block as ZeRO-3's largest
    gather, and doctor's ``moe`` row (a warning without a load-balancing loss)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.config import load_run_config

    config = REPO / "finetune" / "recipes" / "configs" / "gpt_clm_moe.yaml"
    over = [f"model.path=data/models/{model}", f"output_dir={tmp_path / 'run'}"]
    hf = AutoConfig.from_pretrained(REPO / "data" / "models" / model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(hf)
    total = sum(p.numel() for p in built.parameters())
    experts = sum(p.numel() for n, p in built.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * hf.num_experts_per_tok // 4
    block = sum(p.numel() for p in built.model.layers[0].mlp.parameters())
    shape = plan.model_shape(load_run_config(config, over))
    assert (shape.params, shape.expert_params, plan.active_parameters(shape)) == (total, experts, active)
    assert shape.largest_layer == block and shape.intermediate == 2 * 64 and shape.gated_mlp
    code, out, err = _plan(capsys, [config, *over, "--gpus-per-node", "2"])
    assert code == 0, err
    assert (f"{total:,} parameters" in out and f"mixture of experts: 4 experts, top-2, {active:,} active per token"
            in out), out
    # expert parallelism: a rank holds half the experts; ZeRO 0 keeps them whole, ZeRO-3 partitions them anyway
    ep = plan.model_shape(load_run_config(config, [*over, "parallel.expert_parallel_size=2"]))
    gpu = {z: [plan.estimate(s, {}, z, False, False, 1, 64, 2, 1, "fp32").gpu for s in (shape, ep)] for z in (0, 3)}
    assert gpu[0][0]["parameters"] - gpu[0][1]["parameters"] == experts // 2 * 4
    assert gpu[0][0]["Adam moments (fp32)"] - gpu[0][1]["Adam moments (fp32)"] == experts // 2 * 8
    assert gpu[3][0]["parameters"] == gpu[3][1]["parameters"]
    code, out, _ = _plan(capsys, [config, *over, "parallel.expert_parallel_size=2", "--gpus-per-node", "2"])
    assert code == 0 and f"expert-parallel size 2: {experts // 2:,} expert parameters per rank" in out, out
    assert doctor.main([str(config), *over]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("moe"))
    assert row.split()[1] == "ok" and f"{active:,} active per token" in row and f"up to {block:,} parameters" in row
    doctor.main([str(config), *over, "model.config_overrides={router_aux_loss_coef: 0.0}"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("moe"))
    assert row.split()[1] == "warn" and "router_aux_loss_coef is 0" in row
    assert plan.active_parameters(plan.model_shape(load_run_config(CONFIGS / "tiny_gpt.yaml"))) == 102_714  # dense


def test_plan_bad_arguments(capsys):
    code, _, err = _plan(capsys, [CONFIGS / "tiny_gpt.yaml", "--gpu-memory", "lots"])
    assert code == 2 and "finetune: error: --gpu-memory/--cpu-memory: 'lots' is not a memory size" in err
    code, _, err = _plan(capsys, [CONFIGS / "tiny_gpt.yaml", "model.path=/nonexistent/model"])
    assert code == 2 and "finetune: error: model.path: '/nonexistent/model/config.json' does not exist" in err
    assert plan.parse_size("80GiB") == 80 * 2**30 and plan.parse_size("512GB") == 512e9


def test_doctor_good_config(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = doctor.main([str(CONFIGS / "tiny_gpt.yaml"), f"output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no blockers" in out and "FAIL" not in out
    assert ["offline", "warn", "HF_DATASETS_OFFLINE not set: export HF_DATASETS_OFFLINE=1 before Python starts"] in [
        [*line.split(None, 2)[:2], line.split(None, 2)[2].split(" (in the job")[0]] for line in out.splitlines()
        if line.startswith("offline")]
    for area in ("model", "data", "config", "ops", "accelerator", "disk", "folders", "launcher", "offline"):
        assert any(line.startswith(area) for line in out.splitlines()), (area, out)
    assert "model.safetensors (403.6 KiB)" in out and "2,891 rows" in out


def test_doctor_names_every_blocker(capsys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(REPO / "data/models/tiny-gpt2", model)
    (model / "model.safetensors").unlink()
    code = doctor.main([str(CONFIGS / "tiny_gpt.yaml"), f"model.path={model}", "data.text_column=body",
                        "output_dir=/proc/finetune-doctor-test", "ds.wandb.enabled=true"])
    out = capsys.readouterr().out
    assert code == 2, out
    fails = [line for line in out.splitlines() if "  FAIL  " in line]
    assert any("weights MISSING" in line for line in fails), out
    assert any("no column 'body'" in line for line in fails), out
    assert any("output_dir '/proc/finetune-doctor-test': not writable" in line for line in fails), out
    import importlib.util

    if importlib.util.find_spec("wandb") is None:  # a tracker without its package: refused before any model
        assert any("wandb.enabled is true but the 'wandb' package is not installed" in line for line in fails), out
    assert out.rstrip().endswith("blocker(s)")


def _metrics(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_panels_and_png(tmp_path, capsys):
    a = _metrics(tmp_path / "run_a", [
        *({"step": s, "launch": 1, "train/loss": 10.0 / s, "train/lr": 1e-3, "train/grad_norm": 2.0,
           "train/tokens_per_s": 1000.0} for s in range(1, 5)),
        {"step": 4, "launch": 1, "eval/loss": 3.0, "eval/perplexity": 20.09, "eval/masked_accuracy": 0.1},
        # a resume re-ran step 4: launch 2's row counts
        {"step": 4, "launch": 2, "train/loss": 2.0, "train/lr": 1e-3, "train/grad_norm": None,
         "train/tokens_per_s": 900.0},
        {"step": 5, "launch": 2, "train/loss": 0.05, "train/lr": 5e-4, "train/grad_norm": 1.0,
         "train/tokens_per_s": 950.0}])
    b = _metrics(tmp_path / "run_b", [{"step": s, "launch": 1, "train/loss": 5.0, "train/lr": 2e-3,
                                       "train/grad_norm": 1.5, "train/tokens_per_s": 500.0, "train/reward": 0.25 * s}
                                       for s in (1, 2)])
    fig = report.build_figure({"run_a": report.read_run(a), "run_b": report.read_run(b)})
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == list(report.PANELS)
    lines = {ax_name: {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
             for ax_name, ax in axes.items()}
    assert lines["loss"]["run_a (train)"] == ([1, 2, 3, 4, 5], [10.0, 5.0, 10.0 / 3, 2.0, 0.05])
    assert lines["loss"]["run_a (eval)"] == ([4], [3.0]) and lines["loss"]["run_b (train)"] == ([1, 2], [5.0, 5.0])
    assert axes["loss"].get_yscale() == "log"  # spans 200x
    assert lines["perplexity"] == {"run_a (eval)": ([4], [20.09])}
    assert lines["accuracy"] == {"run_a (eval, masked tokens)": ([4], [0.1])}
    assert lines["grad norm"]["run_a"] == ([1, 2, 3, 5], [2.0, 2.0, 2.0, 1.0])  # null (non-finite) left out
    assert lines["throughput"]["run_b"] == ([1, 2], [500.0, 500.0])
    assert set(lines["learning rate"]) == {"run_a", "run_b"}
    assert lines["reward"] == {"run_b (train, mean over completions)": ([1, 2], [0.25, 0.5])}  # grpo
    assert all(ax.get_xlabel() == "optimizer step" and ax.get_ylabel() for ax in fig.axes)

    assert report_cmd.main([str(a)]) == 0
    png = a / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (850, 1900)
    out = tmp_path / "both.png"
    assert report_cmd.main([str(a), str(b), "--out", str(out)]) == 0 and out.is_file()
    assert report_cmd.main([str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_csv_tracker_through_deepspeed_monitor(tmp_path):
    """``ds.csv_monitor.enabled=true`` goes through DeepSpeed's own monitor into the run folder."""
    script = tmp_path / "csv_probe.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="{_port()}")
import deepspeed
from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster
from pathlib import Path
from finetune.logs import monitor_sections
deepspeed.init_distributed("gloo")
ds = monitor_sections({{"csv_monitor": {{"enabled": True}}, "wandb": {{"enabled": False}}}}, Path({str(tmp_path)!r}))
monitor = MonitorMaster(get_monitor_config(ds))
monitor.write_events([("train/loss", 2.5, 1), ("train/loss", 2.0, 2)])
""")
    proc = run_python([str(script)], env=cpu_env())
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = (tmp_path / "csv" / "train_loss.csv").read_text().splitlines()
    assert rows[1:] == ["1,2.5", "2,2.0"], rows
    assert (tmp_path / "tensorboard").is_dir()


def _port() -> int:
    from conftest import free_port

    return free_port()


def test_doctor_multinode_rows(capsys, tmp_path, monkeypatch):
    """--nodes 2: the run folder on a local disk warns, a busy rendezvous port on the head node blocks; several
    interfaces without NCCL/GLOO_SOCKET_IFNAME warn (a network namespace with a veth pair: two interfaces up)."""
    import socket
    import subprocess
    import sys
    import uuid

    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
    code = doctor.main([str(CONFIGS / "tiny_gpt.yaml"), f"output_dir={tmp_path / 'run'}", "--nodes", "2"])
    port = busy.getsockname()[1]
    busy.close()
    rows = [line.split(None, 2) for line in capsys.readouterr().out.splitlines() if line.startswith("multinode")]
    assert code == 2
    assert rows[0][:2] == ["multinode", "warn"] and "a local file system, but all 2 nodes" in rows[0][2]
    assert rows[1][:2] == ["multinode", "ok"] and "node-local, each node tokenizes" in rows[1][2]
    assert rows[2] == ["multinode", "FAIL", f"rendezvous port {port} on the head node 127.0.0.1: in use: set "
                                            "MASTER_PORT to a free port"]
    assert doctor.mount_of(Path("/proc/self")) == ("/proc", "proc")

    if shutil.which("ip") is None:
        pytest.skip("iproute2 missing")
    ns = f"ftdoc{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=True)
        for dev in ("d0", "d1"):
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "finetune", "doctor", str(CONFIGS / "tiny_gpt.yaml"),
               f"output_dir={tmp_path / 'run'}", "--nodes", "2"]
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME") and k != "MASTER_ADDR"}
        env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO).stdout
        assert "2 network interfaces up (d0, d1) and NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME not set" in out, out
        env.update(NCCL_SOCKET_IFNAME="d0", GLOO_SOCKET_IFNAME="d0")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO).stdout
        assert "network interfaces up: d0, d1; NCCL_SOCKET_IFNAME=d0; GLOO_SOCKET_IFNAME=d0" in out, out
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_run_summary_prints_held_out_answers_before_and_after(tmp_path):
    """The end of a grpo run: the held-out answers of the first and last evaluation (``eval/step<N>_completions.jsonl``,
    ordered by step number, not by name), the prompt's last user message, and grpo's always-zero eval loss left out of
    the evaluation line; one evaluation only: no answer lines."""
    from finetune.lifecycle.report import eval_answers, eval_summary

    (tmp_path / "eval").mkdir()
    for step, answers in ((0, ["To add", "71 + 55 = 226"]), (2, ["12", "13"]), (10, ["122", "126"])):
        rows = [{"step": step, "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": f"What is {q}?"}],
                 "completion": a, "rewards": {"exact_match": float(a in ("122", "126"))}}
                for q, a in zip(("59 + 63", "71 + 55"), answers)]
        (tmp_path / "eval" / f"step{step}_completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = eval_answers(tmp_path, n=3)
    assert lines == ["held-out answer to 'What is 59 + 63?': step 0 'To add' (exact_match 0) -> step 10 '122' (exact_match 1)",
                     "held-out answer to 'What is 71 + 55?': step 0 '71 + 55 = 226' (exact_match 0) -> step 10 '126' "
                     "(exact_match 1)"], lines
    for step in (2, 10):
        (tmp_path / "eval" / f"step{step}_completions.jsonl").unlink()
    assert eval_answers(tmp_path) == []
    assert eval_summary({"eval/loss": [(0, 0.0), (10, 0.0)], "eval/reward": [(0, 0.14), (10, 0.625)]}) == \
        "eval/reward 0.14 (step 0) -> 0.625 (step 10)"
