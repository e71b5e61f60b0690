"""Shared helpers: launch the real toolkit on CPU ranks as DeepSpeed's launcher starts them and read what it wrote.

Every launch gets its own free master port (tests may run beside each other) and a shared
tokenization cache for the session (``FINETUNE_CACHE``), so only the first run of a recipe tokenizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "tests" / "configs"
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A master port for one launch: a free one below the ephemeral range (``distributed.free_port``), from this
    pytest-xdist worker's share of it, so the launches of two workers never pick the same port."""
    from finetune.parallel.distributed import FREE_PORTS, free_port as pick

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    share = (FREE_PORTS[1] - FREE_PORTS[0]) // max(count, 1)
    return pick(FREE_PORTS[0] + index * share, FREE_PORTS[0] + (index + 1) * share)


def distill_teacher_stand_in() -> Path:
    """The shipped distillation chain's teacher (``sft_gsm8k.yaml`` grown to 4 layers, hidden 128: what its export
    holds) with seeded random weights and the GPT-2 tokenizer, written once per machine to the temp folder (atomically:
    pytest-xdist workers may race) for the shipped-config checks on a clean clone."""
    import shutil
    import tempfile

    folder = Path(tempfile.gettempdir()) / "finetune-tests" / "distill-teacher-v1"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(dir=folder.parent.mkdir(parents=True, exist_ok=True) or folder.parent))
    config = AutoConfig.from_pretrained(REPO / "data" / "models" / "tiny-llama")
    config.update(dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256, head_dim=32))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
    for f in (REPO / "data" / "models" / "tiny-gpt2").iterdir():
        shutil.copy(f, tmp / f.name)
    try:
        tmp.rename(folder)
    except OSError:  # another worker's is there
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF file: where ``scripts/get_smollm2.sh`` puts it when it has run, else the
    shared copy beside the repository (``../shared/models/``, which CI has)."""
    fetched = REPO / "models" / "smollm2-135m-instruct" / SMOLLM2_NAME
    return fetched if fetched.is_file() else REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / SMOLLM2_NAME


EXPORT_STAND_INS = {
    "grpo_smollm2_arithmetic.yaml": [f"model.path={smollm2_gguf()}"],  # a clean clone has not fetched it
    "sft_smollm2_gsm8k.yaml": [f"model.path={smollm2_gguf()}"],
    "dpo_smollm2_arithmetic.yaml": [f"model.path={smollm2_gguf()}"],
    "distill_smollm2_gsm8k.yaml": [f"model.path={smollm2_gguf()}", f"train.distill.teacher={smollm2_gguf()}"],
    "sft_smollm2_calculator.yaml": [f"model.path={smollm2_gguf()}"],
    "grpo_smollm2_calculator.yaml": [f"model.path={smollm2_gguf()}", "model.tokenizer_path="],  # the SFT's export
    "distill_gsm8k.yaml": [f"train.distill.teacher={distill_teacher_stand_in()}"],
    "grpo_gsm8k.yaml": ["model.path=data/models/tiny-llama", "model.init=scratch",
                        "model.tokenizer_path=data/models/tiny-gpt2"],
    "grpo_guess_number.yaml": [
        "model.path=data/models/tiny-llama", "model.init=scratch", "model.tokenizer_path=data/models/gsm8k-bpe-8k",
        "model.config_overrides={vocab_size: 8192, pad_token_id: 0, bos_token_id: 0, eos_token_id: 0, "
        "max_position_embeddings: 1536}"],
    "grpo_digits.yaml": ["model.path=data/models/tiny-smolvlm", "model.init=scratch"],
}
"""Overrides for the shipped configs that name a model a clean clone does not have: an SFT run's export (the
two-command chains), replaced by the model it is built from, from scratch (a distillation's teacher: a stand-in with
weights); the real SmolLM2 GGUF, by its shared copy."""


def shm_buffers() -> set[str]:
    """The CPU backend's all-reduce buffers now in ``/dev/shm`` (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<n>``)."""
    return {str(p) for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


def leftover_shm(before: set[str], wait_s: float = 30.0) -> set[str]:
    """Buffers made since ``before`` that are still there after up to ``wait_s`` seconds. A launch unlinks its buffer
    once its ranks have mapped it, so a buffer of a test running beside this one (pytest-xdist) lives only while its
    ranks start; one that stays was left behind."""
    import time

    deadline = time.monotonic() + wait_s
    while (new := shm_buffers() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return new


def cpu_env(**extra: str) -> dict:
    """Environment for CPU DeepSpeed runs: CPU accelerator, one OpenMP thread per rank, shared caches."""
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.setdefault("FINETUNE_CACHE", str(REPO / ".pytest_cache" / "finetune-cache"))
    env.update(extra)
    return env


def _zero3(config: str | Path, overrides: list[str]) -> bool:
    """The launch runs ZeRO-3: a ``stage=3`` override, a ``deepspeed=`` override naming a ZeRO-3 file, or a run
    config that names one (or sets stage 3) without an override of the stage."""
    stage = [o for o in overrides if "zero_optimization.stage=" in o]
    if stage:
        return stage[-1].endswith("=3")
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("deepspeed=")]
    if named:
        return "zero3" in named[-1]
    text = Path(config).read_text() if Path(config).is_file() else ""
    return "zero3" in text or "stage: 3" in text


def launch(config: str | Path, overrides: list[str] = (), nproc: int = 2, resume: str | None = None,
           timeout: int = 600, extra_args: list[str] = (), env: dict | None = None,
           script: str = "finetune/run.py") -> subprocess.CompletedProcess:
    """Launch ``finetune/run.py --config config overrides...`` on ``nproc`` CPU ranks of this host as DeepSpeed's
    per-node launcher starts them, from the repo root.

    ``deepspeed --num_gpus nproc --master_port P finetune/run.py ...`` on one node runs ``python -u -m
    deepspeed.launcher.launch --world_info=...``, which starts each rank as ``python -u finetune/run.py
    --local_rank=<r> ...`` with ``CUDA_VISIBLE_DEVICES=0,..,nproc-1``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``WORLD_SIZE``, ``CROSS_RANK=0``, ``CROSS_SIZE=1``, ``LOCAL_SIZE``, ``RANK`` and ``LOCAL_RANK`` added to its own
    environment, and, when a rank exits non-zero, terminates the others' process trees and exits with that code
    (``deepspeed/launcher/launch.py``, DeepSpeed 0.19.8). This function does exactly that itself: the ranks see
    what they see under ``deepspeed``, without the two launcher processes in front, which import torch and
    DeepSpeed only to build and watch those commands (about 5 s of a core per launch on 2 cores). The
    ``deepspeed`` command itself is run by the README test, tests/test_launchers.py (SIGTERM and SIGINT through the
    launcher, ``--hostfile``), tests/test_run_folder.py's busy-folder test and the benchmark's test.

    ``script``: the entry point (a test's wrapper around ``finetune/run.py``, e.g. ``tests/grpo_teacher_forced.py``).

    A ZeRO-3 launch runs with ``stage3_param_persistence_threshold: 0`` unless an override sets it: tiny models then
    gather and release every parameter as real models' layers are (a test that passes under DeepSpeed's default
    threshold may keep all of a tiny model resident).

    Returns the completed process (every rank's stdout and stderr, merged in one file as the launcher's children
    share its stdout, in ``.stdout``); does not raise on failure. Raises ``subprocess.TimeoutExpired`` (the ranks
    killed) past ``timeout`` seconds.
    """
    import psutil
    import tempfile
    import time

    overrides = list(overrides)
    if _zero3(config, overrides) and not any("stage3_param_persistence_threshold" in o for o in overrides):
        # every parameter partitioned, gathered and released as a real model's layers are (the tiny tensors would
        # stay resident under DeepSpeed's default threshold of 1e5 elements)
        overrides.append("ds.zero_optimization.stage3_param_persistence_threshold=0")
    args = ["--config", str(config), *overrides, *extra_args]
    if resume is not None:
        args += ["--resume"] + ([resume] if resume != "latest" else [])
    base = dict(env or cpu_env())
    base.update({"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(nproc))), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc), "CROSS_RANK": "0", "CROSS_SIZE": "1",
                 "LOCAL_SIZE": str(nproc)})
    cmd = [sys.executable, "-u", script]

    def stop(procs):  # as launch.py does: its terminate_process_tree on each rank (SIGTERM, SIGKILL after 30 s)
        from deepspeed.launcher.launch import terminate_process_tree

        for proc in procs:
            try:
                terminate_process_tree(proc.pid)
            except (OSError, psutil.Error):
                pass
            proc.wait()

    with tempfile.TemporaryFile("w+") as out:
        procs = [subprocess.Popen([*cmd, f"--local_rank={rank}", *args], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(nproc)]
        deadline = time.monotonic() + timeout
        code = 0
        try:
            while True:
                codes = [proc.poll() for proc in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    code = failed[0] % 256  # sys.exit(returncode) in the launcher: -9 exits as 247
                    stop([proc for proc in procs if proc.poll() is None])
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    stop(procs)
                    out.seek(0)
                    raise subprocess.TimeoutExpired([*cmd, *args], timeout, output=out.read())
                time.sleep(0.2)
        except BaseException:
            stop([proc for proc in procs if proc.poll() is None])
            raise
        out.seek(0)
        text = out.read()
    return subprocess.CompletedProcess([*cmd, *args], code, stdout=text)


def run_python(args: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python <args>`` (single process, no launcher) from the repo root."""
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env or cpu_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def check_here(args: list[str], capsys, **env: str) -> tuple[int, str]:
    """``finetune/run.py <args> --check`` in this process (no interpreter start, no imports: about 5 s less than
    :func:`run_python` per call), with ``env`` set (``RANK``, ``WORLD_SIZE``, ...) for the call only; the variables
    the check sets are removed again, so later tests' child processes do not look like ranks.

    Returns:
        ``(exit code, everything printed)``.
    """
    from finetune.commands.train import main as train_main

    saved = dict(os.environ)
    try:
        os.environ.update(cpu_env(**env))
        capsys.readouterr()
        code = train_main([*map(str, args), "--check"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr()
    return code, out.out + out.err


def refused_here(args: list[str], capsys, **env: str) -> tuple[int, str]:
    """``finetune/run.py <args>`` (a launch, not ``--check``) in this process from the repo root, for launches that
    the checks refuse (exit 2 with ``finetune: error:`` lines before any process group, run folder or model): the
    same path as :func:`run_python` without the interpreter start and imports (about 5 s per call). A launch that
    passes its checks fails the test instead of training here. ``env`` and the working directory as in
    :func:`check_here`.

    Returns:
        ``(exit code, everything printed)``.
    """
    from finetune.commands import train as train_command

    def no_training(*_a, **_k):
        raise AssertionError(f"the checks passed: this launch would train ({' '.join(map(str, args))})")

    saved, cwd, real_train = dict(os.environ), os.getcwd(), train_command.train
    try:
        os.environ.update(cpu_env(**env))
        os.chdir(REPO)
        train_command.train = no_training
        capsys.readouterr()
        code = train_command.main([*map(str, args)])
    finally:
        train_command.train = real_train
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr()
    return code, out.out + out.err


def finetune_here(args: list[str], capsys) -> tuple[int, str]:
    """``python -m finetune <args>`` (``export``, ``evaluate``, ...) in this process from the repo root, for commands
    that start no process group (an export, a refusal): no interpreter start, about 5 s less than :func:`run_python`.

    Returns:
        ``(exit code, everything printed)``.
    """
    from finetune.cli import main as cli_main

    saved, cwd = dict(os.environ), os.getcwd()
    try:
        os.environ.update(cpu_env())
        os.chdir(REPO)
        capsys.readouterr()
        code = cli_main([*map(str, args)])
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr()
    return code, out.out + out.err


def scratch_model(cfg):
    """The run's model as the engine builds it from its config (``model.init: scratch``; what
    :func:`finetune.engine.model.scratch_model` does), fp32, on one device: the same weights from ``train.seed``."""
    import torch
    from transformers.initialization import no_init_weights

    from finetune.engine.model import load_model_config
    from finetune.recipes import get_recipe

    recipe = get_recipe(cfg.recipe)
    torch.manual_seed(cfg.train.seed)
    with no_init_weights():
        model = recipe.model_class.from_config(load_model_config(cfg, recipe), dtype=torch.float32,
                                               attn_implementation=cfg.model.attn_implementation)
    model.init_weights()
    return model


def reference_optimizer(model, t, steps: int):
    """The engine's optimizer in one process, for the one-process references: AdamW (fused) on
    :func:`finetune.engine.model.param_groups`, the ``train.lr_scheduler`` schedule over ``steps``, and clipping at
    ``train.max_grad_norm`` of the global gradient norm summed in fp64 (as ZeRO computes it).

    Args:
        model: the trainable model.
        t: the run config's ``train`` section.
        steps: optimizer steps of the schedule.

    Returns:
        ``step() -> float``: clips, steps the optimizer and the schedule, zeroes the gradients, and returns the
        gradient norm before clipping.
    """
    import torch
    from transformers import get_scheduler

    from finetune.engine.model import param_groups

    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                            eps=t.adam_eps, fused=True)
    sched = get_scheduler(t.lr_scheduler, opt, num_warmup_steps=t.warmup_steps, num_training_steps=steps)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        norm = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params
                            if p.grad is not None]).norm()
        torch.nn.utils.clip_grads_with_norm_(params, t.max_grad_norm, norm.float())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    return step


def simulated_ranks(cfg, world: int, configured: bool = False) -> tuple:
    """The toolkit's training batches of ``world`` data-parallel ranks, in one process, for the one-process
    references: the recipe's tokenizer and tokenized splits, its collator, each rank's sampler (:func:`finetune.data.dataset.
    train_sampler`, global batch ``micro x accumulation x world``) and loader (row-seeded collation, as a launch).
    ``configured``: the recipe as the run configures it (``grpo`` with tools: prompts that offer them).

    Returns:
        ``(tokenizer, splits, collator, samplers, loaders)``.
    """
    from torch.utils.data import DataLoader

    from finetune.data.dataset import IndexedRows, RowSeededCollate, load_splits, train_sampler
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    t, recipe = cfg.train, get_recipe(cfg.recipe)
    if configured:
        recipe = recipe.configure(recipe, cfg)
    tokenizer = load_tokenizer(cfg, recipe)
    splits = load_splits(recipe, tokenizer, cfg.data, t.seed)
    collator = recipe.make_collator(tokenizer, cfg.data)
    rows = IndexedRows(splits.train)
    mb, gas = t.micro_batch_size, t.gradient_accumulation_steps
    samplers = [train_sampler(rows, cfg.data, mb * gas * world, world, r, t.seed) for r in range(world)]
    loaders = [DataLoader(rows, batch_size=mb, sampler=smp, collate_fn=RowSeededCollate(collator, t.seed),
                          drop_last=True) for smp in samplers]
    return tokenizer, splits, collator, samplers, loaders


def write_parquet(path: Path, rows: dict) -> Path:
    """``rows`` (column name -> values) written as a parquet file at ``path``; returns ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(rows), path)
    return path


def check_files(config: str | Path, tmp_path: Path, files: list[Path], extra: list[str] = ()) -> int:
    """``finetune/run.py --config config --check`` in this process on ``files`` as the training files (the first also
    as the validation file), caches under ``tmp_path``; the rank variables the check sets (``RANK``,
    ``MASTER_PORT``, ...) are removed again, so that later tests' child processes do not look like ranks. The lines
    it prints are the caller's ``capsys``'s."""
    from finetune.commands.train import main as train_main

    saved = dict(os.environ)
    try:
        return train_main(["--config", str(config), "--check", f"output_dir={tmp_path / 'out'}",
                           f"data.train_files=[{','.join(map(str, files))}]",
                           f"data.validation_files=[{files[0]}]", f"data.cache_dir={tmp_path / 'cache'}", *extra])
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch_problems(config: str | Path, overrides: list[str]) -> list[str]:
    """In process, the launch's own validation (``validate_run``, 1 rank, CPU) of ``config`` with ``overrides``: the
    problem lines it refuses with, [] when it passes."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    try:
        validate_run(load_run_config(config, list(overrides)), None, 1, True)
    except ConfigError as e:
        return e.problems
    return []


def refusals(config: str | Path, *overrides: str) -> list[str]:
    """In process, the problem lines a 2-rank CPU launch of ``config`` with ``overrides`` is refused with
    (``validate_run``; ``output_dir`` a folder that does not exist); fails the test when it is not refused."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    cfg = load_run_config(config, ["output_dir=/nonexistent/run", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, world_size=2, on_cpu=True)
    return err.value.problems


def one_refusal(config: str | Path, *overrides: str) -> str:
    """The one problem line of :func:`refusals` (fails the test when there are more)."""
    problems = refusals(config, *overrides)
    assert len(problems) == 1, problems
    return problems[0]


def logged(run: Path, key: str) -> list[float]:
    """The values of ``key`` in a run's ``metrics.jsonl`` at steps 1, 2, ..., in step order."""
    values = {r["step"]: r[key] for r in read_metrics(run) if key in r and r["step"] > 0}
    return [values[s] for s in sorted(values)]


def max_rel(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two equally long series."""
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def lazy_runs(root: Path, config: str | Path, variants: dict[str, list[str]], common: list[str] = ()):
    """``get(name) -> run folder``: the 2-rank launch of ``config`` with ``common`` and ``variants[name]`` into
    ``root/name``, made on the first call for that name (for module-scoped fixtures whose tests share runs), in the
    session's tokenized-data cache."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = Path(root) / name
            ok(launch(config, [*common, *variants[name], f"output_dir={out}",
                               f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"]))
            done[name] = out
        return done[name]

    return get


def assert_one_device(run: Path, reference, zero3: bool, head: str, skip: tuple[str, ...] = ()) -> None:
    """A 2-rank x accumulation run equals :func:`parity_reference.reference_run`'s one device on the whole global
    batch: the micro-batches' own means differ from the global weighting (so the weighting is tested), the logged
    losses agree to 1e-5, the grad norms to 1e-4 (ZeRO 0) or 1e-5 (ZeRO 3), and at ZeRO 3 every exported weight
    (``head`` among them) but those in ``skip`` to 1e-5."""
    import torch
    from safetensors.torch import load_file

    assert max(abs(a - b) / b for a, b in zip(reference.micro_batch_losses, reference.token_losses)) > 1e-4
    assert max_rel(logged(run, "train/loss"), reference.losses) <= 1e-5
    assert max_rel(logged(run, "train/grad_norm"), reference.grad_norms) <= (1e-5 if zero3 else 1e-4)
    if zero3:
        got = load_file(run / "export" / "model.safetensors")
        assert head in got
        for name, tensor in got.items():
            want = reference.state_dict[name]
            assert name in skip or torch.allclose(tensor.float(), want, rtol=1e-5, atol=1e-5), \
                (name, (tensor.float() - want).abs().max())


def assert_resume_repeats(config: str | Path, overrides: list[str], run: Path, out: Path, step: int = 3) -> None:
    """A 2-rank launch of ``config`` with ``overrides`` into ``out``, resumed from ``run``'s checkpoint ``step<step>``,
    trains the steps after it with ``run``'s losses (relative 1e-6)."""
    ok(launch(config, [*overrides, "export=false", f"output_dir={out}"], resume=str(run / "checkpoints" / f"step{step}")))
    resumed, full = train_losses(out), train_losses(run)
    assert sorted(resumed) == list(range(step + 1, max(full) + 1))
    for s, loss in resumed.items():
        assert loss == pytest.approx(full[s], rel=1e-6), s


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert a launch succeeded, showing its output tail when not."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc


def finished_run(tmp_path_factory, config: str | Path, overrides: list[str]) -> Path:
    """A successful 2-rank launch of ``config`` with ``overrides`` into a fresh folder (for module-scoped fixtures
    that several tests resume from or compare with); returns its run folder."""
    run = tmp_path_factory.mktemp(Path(config).stem) / "run"
    ok(launch(config, [f"output_dir={run}", *overrides]))
    return run


def read_metrics(run_dir: Path) -> list[dict]:
    """Rows of ``run_dir/metrics.jsonl``."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Optimizer step -> logged train loss (needs ``train.log_every=1`` for every step)."""
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.fixture(scope="session")
def tiny_gpt_run(tmp_path_factory) -> Path:
    """The run folder of one finished launch of ``tests/configs/tiny_gpt.yaml`` as it is (GPT-2, ZeRO-2, 2 ranks, 16
    steps, evaluations at 8 and 16, checkpoints, export), launched once per session: tests/test_train.py's GPT run
    (which also resumes it in place) and the run tests/test_evaluate.py evaluates (a copy of it)."""
    run = tmp_path_factory.mktemp("tiny_gpt_run") / "run"
    ok(launch(CONFIGS / "tiny_gpt.yaml", [f"output_dir={run}", "deepspeed=ds_configs/zero2.json"]))
    return run


@pytest.fixture(scope="session")
def tiny_gpt() -> Path:
    return CONFIGS / "tiny_gpt.yaml"


@pytest.fixture(scope="session")
def tiny_bert() -> Path:
    return CONFIGS / "tiny_bert.yaml"
