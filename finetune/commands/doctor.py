"""``finetune doctor <run config>``: a pre-flight for the login node, one table, non-zero exit on a blocker.

Rows (status ``ok``, ``warn`` or ``FAIL``; any ``FAIL`` is a blocker and the exit status is 2):

* ``model``: the model folder's files (config, weights, tokenizer) and their sizes; every safetensors header and
  shard index read (:func:`finetune.airgap.manifest.weights_problems`): a truncated or damaged weights file, a missing
  shard, each a blocker naming the file.
* ``data``: every data file's rows and columns (parquet footers only).
* ``config``: every problem the launch's own validation finds (:func:`finetune.preflight.validate.validate_run`: missing
  files, missing or non-text columns, model/tokenizer/data compatibility, DeepSpeed JSON, output folder).
* ``ops``: DeepSpeed op compatibility for what the DeepSpeed config uses, as DeepSpeed's op builders report
  it (``is_compatible()``): ``cpu_adam`` for optimizer offload, ``async_io`` (libaio) for NVMe offload; and the
  folder DeepSpeed builds its ops in (``train.op_build_dir``, ``TORCH_EXTENSIONS_DIR`` or torch's default): a build
  lock that no process on this host holds (:func:`finetune.parallel.op_builds.stale_locks`) makes every launch wait
  without end, a blocker when older than a build takes, a warning when it may be another host's build now.
* ``accelerator``: the visible accelerators (DeepSpeed's ``get_accelerator()``) and the precision the run
  would train in there (:func:`finetune.engine.ds_config.describe_precision`).
* ``disk``: free space in the output folder vs one checkpoint plus the export (parameters from the model
  built on the meta device, :func:`finetune.preflight.plan.model_shape`).
* ``moe`` (mixture-of-experts models only, :mod:`finetune.engine.moe`): experts, top-k, total and active parameters
  per token, the router's load-balancing coefficient (a warning when it is 0: nothing then balances the experts'
  load) and, under ZeRO-3, the size of the sparse block gathered whole.
* ``folders``: output and tokenization cache folders can be written (a file is created and removed).
* ``launcher``: what the launch would see: Slurm variables, a DeepSpeed hostfile, MASTER_ADDR/PORT.
* ``multinode`` (with ``--nodes N`` > 1, or inside a multi-node Slurm job): the output and cache folders on a
  file system every node sees (the mount's type from ``/proc/mounts``: NFS, Lustre, GPFS, BeeGFS, CephFS, ... pass,
  a local disk or tmpfs warns), the rendezvous port free on this host when it is the head node
  (``MASTER_PORT``, else the sbatch scripts' ``20000 + job id % 10000``), and ``NCCL_SOCKET_IFNAME`` /
  ``GLOO_SOCKET_IFNAME`` set when this node has several network interfaces up (NCCL and gloo pick one each,
  not always the one the other nodes reach).
* ``offline``: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set (a warning when not: transformers and datasets
  would try the Hub and wait for network timeouts), and the ``finetune bundle`` folder the model or data come
  from, with the ``finetune verify`` command that checks it.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import torch
from deepspeed.accelerator import get_accelerator

from finetune.data import mixture
from finetune.config import RunConfig, deep_merge, load_run_config
from finetune.data.dataset import default_cache_dir, expand_files
from finetune.parallel import op_builds
from finetune.parallel.distributed import slurm_head_node
from finetune.engine import gguf
from finetune.engine.ds_config import describe_precision, load_ds_json, zero_stage
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.airgap.manifest import weights_problems
from finetune.preflight.plan import active_parameters, model_shape, run_precision
from finetune.recipes import RECIPES, get_recipe
from finetune.preflight.validate import TOKENIZER_FILES, WEIGHT_FILES, resolve_model_files, validate_run

_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_GPUS_ON_NODE", "SLURM_JOB_NODELIST")
_HOSTFILES = ("/job/hostfile",)
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # DeepSpeed's default hostfile (deepspeed.launcher.runner DLTS_HOSTFILE)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _model_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    rows = []
    for key, folder in (("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path)):
        if not folder or gguf.is_gguf(folder):  # a GGUF left as it is could not be converted: its own FAIL row
            continue
        p = Path(folder)
        if not p.is_dir():
            rows.append(("model", "FAIL", f"{key}: folder '{p}' does not exist"))
            continue
        files = sorted(f for f in p.iterdir() if f.is_file())
        listing = ", ".join(f"{f.name} ({_size(f.stat().st_size)})" for f in files) or "no files"
        has_tok = any((p / f).is_file() for f in TOKENIZER_FILES)
        has_w = any((p / f).is_file() for f in WEIGHT_FILES)
        what = []
        if key == "model.path":
            what.append("config.json" + ("" if (p / "config.json").is_file() else " MISSING"))
            what.append("weights" + ("" if has_w else " in the GGUF file (converted at launch)" if gguf.weights_deferred(p)
                                     else (" MISSING" if cfg.model.init == "pretrained" else " none (init: scratch)")))
        if key == "model.tokenizer_path" or not cfg.model.tokenizer_path:
            what.append("tokenizer" + ("" if has_tok else " MISSING"))
        bad = any("MISSING" in w for w in what)
        rows.append(("model", "FAIL" if bad else "ok", f"{key} '{p}': {'; '.join(what)}; files: {listing}"))
        if key == "model.path":  # a truncated or damaged safetensors file or shard index (headers only)
            rows += [("model", "FAIL", f"{key} '{p}': {problem}") for problem in weights_problems(p)]
    return rows


def _data_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    rows = []
    sources = mixture.sources_of(cfg.data, [])
    for where, data in [(f"{s.where}: ", s.data) for s in sources] or [("", cfg.data)]:
        # the columns the recipe reads (sft: prompt/response or messages; seq_cls: text, pair, label)
        needed = get_recipe(cfg.recipe).columns(data) if cfg.recipe in RECIPES else [data.text_column]
        for key, patterns in (("data.train_files", data.train_files), ("data.validation_files", data.validation_files)):
            key = where + key.removeprefix("data.") if where else key  # a source's own key
            for f in expand_files(patterns, key, []):
                try:
                    pf = pq.ParquetFile(f)
                    cols = pf.schema_arrow.names
                    missing = [c for c in needed if c not in cols]
                    rows.append(("data", "FAIL" if missing else "ok",
                                 f"{key} '{f}': {pf.metadata.num_rows:,} rows, {_size(os.path.getsize(f))}, columns "
                                 f"{', '.join(cols)}" + (f" (no column {', '.join(map(repr, missing))}, which recipe "
                                                         f"{cfg.recipe} reads)" if missing else "")))
                except Exception as e:  # noqa: BLE001  (pyarrow raises several types for a bad file)
                    rows.append(("data", "FAIL", f"{key} '{f}': unreadable: {type(e).__name__}: {e}"[:300]))
    return rows


def _config_rows(cfg: RunConfig, world: int, on_cpu: bool) -> tuple[list[tuple[str, str, str]], dict]:
    try:
        resolved = validate_run(cfg, None, world, on_cpu)
    except ConfigError as e:
        return [("config", "FAIL", p) for p in e.problems], {}
    return [("config", "ok", f"every check of a launch passes (world size {world})")], resolved.ds


def _ops_rows(cfg: RunConfig, ds: dict) -> list[tuple[str, str, str]]:
    if not ds:
        try:
            ds = deep_merge(load_ds_json(cfg.deepspeed), copy.deepcopy(cfg.ds))
        except ConfigError:
            return []
    zero = ds.get("zero_optimization", {})
    devices = {zero.get("offload_optimizer", {}).get("device", "none"), zero.get("offload_param", {}).get("device",
                                                                                                         "none")}
    needed = []
    if devices & {"cpu", "nvme"}:
        needed.append(("CPUAdamBuilder", "cpu_adam", "optimizer offload"))
    if "nvme" in devices:
        needed.append(("AsyncIOBuilder", "async_io", "NVMe offload (needs libaio: apt install libaio-dev)"))
    if not needed:
        return [("ops", "ok", f"no offload in {cfg.deepspeed}: no extra DeepSpeed op needed")]
    rows = []
    for builder_name, op, why in needed:
        try:
            builder = get_accelerator().create_op_builder(builder_name)
            compatible = builder is not None and builder.is_compatible(verbose=False)
        except Exception as e:  # noqa: BLE001  (builders import toolchains lazily)
            compatible, builder = False, f"{type(e).__name__}: {e}"
        rows.append(("ops", "ok" if compatible else "FAIL",
                     f"{op} for {why}: {'compatible' if compatible else 'NOT compatible here'} "
                     f"(DeepSpeed {builder_name}.is_compatible())"))
    return rows


def _op_build_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    root = op_builds.build_dir(cfg.train.op_build_dir)
    rows = []
    for lock, age in op_builds.stale_locks(root):
        old = age is None or age >= op_builds.LIKELY_STALE_S
        rows.append(("ops", "FAIL" if old else "warn", op_builds.stale_message(lock, age)))
    return rows or [("ops", "ok", f"op build folder {root}: no build lock left behind")]


def _accelerator_rows(cfg: RunConfig) -> tuple[list[tuple[str, str, str]], bool]:
    acc = get_accelerator()
    name = acc.device_name()
    on_cpu = name == "cpu"
    count = acc.device_count() if not on_cpu else 0
    names = ""
    if not on_cpu:
        try:

            names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
        except Exception:  # noqa: BLE001
            names = ""
    rows = [("accelerator", "ok" if not on_cpu else "warn",
             f"{name}: {count} device(s){f' ({names})' if names else ''}" if not on_cpu else
             "no GPU visible (DeepSpeed's CPU accelerator; fine on a login node, the launch runs elsewhere)")]
    try:

        prec = describe_precision(cfg, on_cpu)
        gpu = f"; on GPUs with bf16: {run_precision(cfg)}" if on_cpu else ""
        rows.append(("accelerator", "ok", f"precision here: {prec['precision']} ({prec['why']}){gpu}"))
    except ConfigError as e:
        rows.append(("accelerator", "FAIL", "; ".join(e.problems)))
    return rows, on_cpu


def _probe_writable(path: Path) -> str | None:
    """None when a file can be created in ``path`` (or its nearest existing ancestor), else why not."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"'{probe}' is a file, not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".finetune-doctor-"):
            pass
    except OSError as e:
        return f"cannot create a file in '{probe}': {e.strerror or e}"
    return None


def _folder_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    rows = []
    for key, path in (("output_dir", cfg.output_dir), ("output_root", cfg.output_root),
                      ("data.cache_dir", str(default_cache_dir(cfg.data)))):
        if not path:
            continue
        why = _probe_writable(Path(path))
        rows.append(("folders", "FAIL" if why else "ok",
                     f"{key} '{path}': " + (f"not writable: {why}" if why else "writable")))
    return rows


def _disk_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    folder = Path(cfg.output_dir or cfg.output_root or ".").absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return []
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return [("disk", "warn", f"'{folder}': {_size(shutil.disk_usage(folder).free)} free; checkpoint size "
                 f"unknown (no model config.json)")]
    try:
        n = model_shape(cfg).params
        w = 4 if run_precision(cfg) == "fp32" else 2
    except ConfigError as e:
        return [("disk", "warn", f"checkpoint size unknown: {e.problems[0]}")]
    need = n * (w + (4 if w == 2 else 0) + 8) + n * 4  # checkpoint (weights, fp32 master, Adam m+v) + fp32 export
    free = shutil.disk_usage(folder).free
    return [("disk", "ok" if free >= need else "FAIL",
             f"'{folder}': {_size(free)} free; one checkpoint + export needs about {_size(need)} "
             f"({n:,} parameters)" + ("" if free >= need else "; free space or move output_dir"))]


def _launcher_rows() -> list[tuple[str, str, str]]:
    slurm = {k: os.environ[k] for k in _SLURM_VARS if k in os.environ}
    rows = [("launcher", "ok", "Slurm: " + (", ".join(f"{k}={v}" for k, v in slurm.items()) if slurm
                                            else "not in a Slurm job (no SLURM_JOB_ID)"))]
    hostfiles = [h for h in _HOSTFILES if Path(h).is_file()]
    rows.append(("launcher", "ok", "DeepSpeed hostfile: " + (", ".join(hostfiles) if hostfiles else
                                                             "none at /job/hostfile (single node, or pass "
                                                             "--hostfile to deepspeed)")))
    dist = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if k in os.environ}
    if dist:
        rows.append(("launcher", "ok", ", ".join(f"{k}={v}" for k, v in dist.items())))
    return rows


_LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "vfat", "ramfs"}


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, file system type) of the mount holding ``path`` (the longest mount point of ``/proc/mounts``
    that is a prefix of the absolute path); ``("", "unknown")`` where ``/proc/mounts`` cannot be read."""
    target = str(path.expanduser().absolute())
    best = ("", "unknown")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, parts[2])
    return best


def interfaces_up() -> list[str]:
    """Network interfaces of this host that are up, loopback excluded (from ``/sys/class/net``)."""
    up = []
    for d in sorted(Path("/sys/class/net").glob("*")):
        try:
            state = (d / "operstate").read_text().strip()
            flags = int((d / "flags").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        if d.name != "lo" and (state == "up" or (state == "unknown" and flags & 0x1 and d.name != "lo")):
            up.append(d.name)
    return up


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _multinode_rows(cfg: RunConfig, nodes: int) -> list[tuple[str, str, str]]:
    if nodes <= 1:
        return []
    out = cfg.output_dir or cfg.output_root or "."
    point, fs = mount_of(Path(out))
    shared = fs not in _LOCAL_FS and fs != "unknown"
    rows = [("multinode", "ok" if shared else "warn", f"output '{out}' is on {fs} ({point or '?'})" + (
        "" if shared else f": a local file system, but all {nodes} nodes must write to the same run folder "
        "(every rank writes its checkpoint shards): use shared storage (NFS, Lustre, GPFS, ...)"))]
    cache = str(default_cache_dir(cfg.data))
    point, fs = mount_of(Path(cache))
    rows.append(("multinode", "ok", f"data.cache_dir '{cache}' is on {fs} ({point or '?'}): " + (
        "shared, each node tokenizes a share of the data" if fs not in _LOCAL_FS else "node-local, each node tokenizes the data itself")))
    head = os.environ.get("MASTER_ADDR") or (slurm_head_node() if "SLURM_JOB_NODELIST" in os.environ else "")
    job = os.environ.get("SLURM_JOB_ID")
    port = int(os.environ.get("MASTER_PORT") or (20000 + int(job) % 10000 if job and job.isdigit() else 29500))
    import socket

    if head and head in (socket.gethostname(), socket.getfqdn(), "127.0.0.1", "localhost"):
        free = _port_free(port)
        rows.append(("multinode", "ok" if free else "FAIL", f"rendezvous port {port} on the head node {head}: " +
                     ("free" if free else "in use: set MASTER_PORT to a free port")))
    else:
        rows.append(("multinode", "ok", f"rendezvous port {port}: checked on the head node only (this is "
                     f"{socket.gethostname()}{', the head node is ' + head if head else ''}); run doctor in the job"))
    ifaces = interfaces_up()
    named = {v: os.environ[v] for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if os.environ.get(v)}
    if len(ifaces) > 1 and len(named) < 2:
        unset = [v for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if v not in named]
        rows.append(("multinode", "warn", f"{len(ifaces)} network interfaces up ({', '.join(ifaces)}) and "
                     f"{' and '.join(unset)} not set: NCCL and gloo may pick one the other nodes cannot reach; "
                     f"export {'='.join([unset[0], ifaces[0]])} (the interface of the nodes' network)"))
    else:
        rows.append(("multinode", "ok", f"network interfaces up: {', '.join(ifaces) or 'none'}" +
                     "".join(f"; {k}={v}" for k, v in named.items())))
    return rows


def _offline_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    unset = [v for v in _OFFLINE_VARS if os.environ.get(v, "").upper() not in ("1", "ON", "YES", "TRUE")]
    rows = [("offline", "warn", f"{' and '.join(unset)} not set: export {'=1 '.join(unset)}=1 before Python starts "
             "(in the job script); without them transformers and datasets try the Hub and wait for network "
             "timeouts on a cluster without internet")] if unset else \
        [("offline", "ok", " and ".join(f"{v}=1" for v in _OFFLINE_VARS))]
    bundles = []
    source_files = [f for s in mixture.sources_of(cfg.data, []) for f in [*s.data.train_files, *s.data.validation_files]]
    for p in [cfg.model.path, cfg.model.tokenizer_path, *cfg.data.train_files, *cfg.data.validation_files,
              *source_files]:
        here = Path(p).expanduser().absolute() if p else None
        b = next((d for d in ([here, *here.parents] if here else []) if (d / "MANIFEST.json").is_file()), None)
        if b is not None and b not in bundles:
            bundles.append(b)
            rows.append(("offline", "ok", f"from the bundle {b}: check it with  finetune verify {b}"))
    return rows


def _moe_rows(cfg: RunConfig, ds: dict) -> list[tuple[str, str, str]]:
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return []
    try:
        shape = model_shape(cfg)
    except ConfigError:
        return []  # the config rows report it
    if not shape.experts:
        return []
    gather = (f"; ZeRO-3 gathers each sparse block whole (a leaf module): up to {shape.largest_layer:,} parameters at "
              f"once" if zero_stage(ds) == 3 else "")
    what = (f"{shape.experts} experts, top-{shape.top_k}: {shape.params:,} parameters, {active_parameters(shape):,} "
            f"active per token (non-expert + {shape.top_k}/{shape.experts} of the {shape.expert_params:,} expert "
            f"parameters){gather}")
    if shape.aux_loss_coef <= 0:
        return [("moe", "warn", f"{what}; router_aux_loss_coef is 0: nothing balances the experts' load (set "
                                f"model.config_overrides={{router_aux_loss_coef: 0.001}})")]
    return [("moe", "ok", f"{what}; load-balancing loss x {shape.aux_loss_coef:g} trained and logged (train/aux_loss, "
                          f"train/router/*)")]


def diagnose(cfg: RunConfig, world: int = 1, nodes: int = 1) -> list[tuple[str, str, str]]:
    """Every doctor row ``(area, status, detail)`` for ``cfg`` on ``nodes`` nodes (status ``ok``, ``warn`` or
    ``FAIL``)."""
    rows = _model_rows(cfg) + _data_rows(cfg) + (get_recipe(cfg.recipe).doctor_rows(cfg) if cfg.recipe in RECIPES
                                                 else [])
    acc_rows, on_cpu = _accelerator_rows(cfg)
    config_rows, ds = _config_rows(cfg, world, on_cpu)
    rows += config_rows + _ops_rows(cfg, ds) + _op_build_rows(cfg) + acc_rows + _disk_rows(cfg) + _moe_rows(cfg, ds)
    rows += _folder_rows(cfg)
    rows += _launcher_rows()
    rows += _multinode_rows(cfg, nodes) + _offline_rows(cfg)
    return rows


def render(rows: list[tuple[str, str, str]]) -> str:
    """The rows as one aligned text table."""
    w0 = max(len(r[0]) for r in rows + [("area", "", "")])
    lines = [f"{'area':<{w0}}  status  detail", f"{'-' * w0}  ------  ------"]
    lines += [f"{a:<{w0}}  {s:<6}  {d}" for a, s, d in rows]
    blockers = sum(s == "FAIL" for _, s, _ in rows)
    lines.append(f"{blockers} blocker(s)" if blockers else "no blockers")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``finetune doctor <run config> [key=value ...] [--world-size N]``: print the table; exit 2 on a blocker."""
    p = argparse.ArgumentParser(prog="finetune doctor", description="Pre-flight checks of a run config on the "
                                "login node: model and data files, DeepSpeed ops, accelerators, disk, folders, "
                                "launcher, offline settings. Exit status 2 when something blocks the launch.")
    p.add_argument("config", help="run config (YAML or JSON)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for finetune train")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks of the planned launch, for the batch-size and layout checks (default: WORLD_SIZE, "
                        "else the fewest ranks the config's layout needs: sequence x tensor-parallel size)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes of the planned launch, for the multi-node checks (default: SLURM_JOB_NUM_NODES or 1)")
    args = p.parse_intermixed_args(argv)

    try:
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world-size: must be >= 1 (the ranks of the planned launch), got {args.world_size}")
        if args.nodes is not None and args.nodes < 1:
            raise ConfigError(f"--nodes: must be >= 1 (the nodes of the planned launch), got {args.nodes}")
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as e:
        return report_error(e)
    # on a login node no launcher says the world size: check the fewest ranks the layout can run on (an SP = 2
    # config is not "blocked" by a world of 1 it will never be launched with)
    world = (args.world_size or int(os.environ.get("WORLD_SIZE", "0") or 0)
             or max(1, cfg.parallel.sequence_parallel_size) * max(1, cfg.parallel.tensor_parallel_size))
    nodes = args.nodes or int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
    found: list[str] = []  # a .gguf model.path: checked, converted once, then the folder is what is diagnosed
    notes = resolve_model_files(cfg, found, announce=False, weights=False)
    rows = [("model", "FAIL", line) for line in found] + [("model", "ok", line) for line in notes]
    rows += diagnose(cfg, world, nodes)
    print(render(rows))
    return 2 if any(s == "FAIL" for _, s, _ in rows) else 0

