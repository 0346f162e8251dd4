"""The training loop: LoRA SFT / DPO on packed rows with FlashMask attention and context parallelism.

World = data parallel x context parallel. Every rank walks the same deterministic stream of packed
rows; data-parallel rank d takes rows d, d + dp, ... and the context-parallel ranks of one row each
take their shard of it (``ShardPlan``). Losses are normalised by the global token (or sample) count
and LoRA gradients are summed over the whole world, so every layout computes the same update as one
process would.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fm_parallel.distributed import ParallelDims, shard
from fm_parallel.distributed.comm import RankFailure
from fm_parallel.distributed.context import ContextParallel
from fm_parallel.distributed.sharding import length_multiple
from fm_parallel.trainer import runs
from fm_parallel.trainer.config import Config, ConfigError, load_config
from fm_parallel.trainer.data import DataError, Row, dpo_rows, load_tokenizer, sft_rows, validate_jsonl
from fm_parallel.trainer.export import export_adapter, save_base_model
from fm_parallel.trainer.memory import checkpoint_layers
from fm_parallel.trainer.tiling import tile_decoder_layers

__all__ = ["main", "train"]


# --------------------------------------------------------------------- setup
def _init_distributed(timeout_s: float) -> None:
    """Join the job's process group; every collective then fails after ``timeout_s`` instead of
    waiting for ever on a dead or stuck rank."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # Launched by torchrun (or any launcher that sets the env:// rendezvous): join it. A bare WORLD_SIZE=1
    # without MASTER_ADDR is not a launch: accelerate (HF Trainer, TRL) writes it into os.environ once a
    # process group exists, and a later run in that process, or a child of it, would wait for a rendezvous.
    if "MASTER_ADDR" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        dist.init_process_group(backend, timeout=timeout)
        return
    # A plain `python` run is one process: an in-memory store, no TCP port that another job could hold.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _layout(cfg: Config):
    """(cp mode, ParallelDims, mesh, the CP group or sub-mesh, dp rank, cp rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mode = cfg.parallel.cp
    cp = world if cfg.parallel.cp_degree == -1 else cfg.parallel.cp_degree
    if mode == "none":
        cp = 1
    uly = {"ring": 1, "ulysses": cp, "hybrid": cfg.parallel.ulysses_degree, "none": 1}[mode]
    if cp % uly:
        raise ConfigError(f"parallel.ulysses_degree: expected a divisor of the CP degree {cp}, got {uly}")
    if cfg.model.attention != "flashmask" and cp > 1:
        raise ConfigError(f"model.attention: {cfg.model.attention!r} is a single-device baseline; expected parallel.cp none "
                         f"or a CP degree of 1, got {mode} over {cp} ranks")
    if world % cp:
        raise ConfigError(f"parallel.cp_degree: expected a divisor of the {world} ranks, got {cp}")
    divisor = length_multiple(cp, cfg.parallel.balance)  # shard()'s own rule, checked before any rank builds a model
    if cp > 1 and cfg.data.seq_len % divisor:
        raise ConfigError(f"data.seq_len: expected a multiple of {divisor} (CP degree {cp}, balance {cfg.parallel.balance}), "
                          f"got {cfg.data.seq_len}")
    if cfg.parallel.cuda_graphs and not torch.cuda.is_available():
        raise ConfigError("parallel.cuda_graphs: expected a CUDA run (NCCL ring; gloo's host transfers cannot be "
                          "captured), got a CPU run")
    if cfg.parallel.cuda_graphs and cp == 1:
        raise ConfigError("parallel.cuda_graphs: expected a CP degree above 1 (it captures the ring's layers), got 1 "
                          f"(cp {mode} over {world} rank{'s' if world > 1 else ''})")
    dims = ParallelDims(world, ring=cp // uly, ulysses=uly)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = dims.build_mesh(device)
    if mode == "hybrid":
        group = mesh["ring", "ulysses"]
    elif mode == "ulysses":
        group = mesh["ulysses"].get_group()
    else:
        group = mesh["ring"].get_group()
    cp_rank = (rank % cp)  # mesh dims are (dp, ring, ulysses), row-major
    return mode, dims, mesh, group, rank // cp, cp_rank


def _build_model(cfg: Config, vocab_size: int, device, base_dir: Path | None = None):
    """The peft LoRA model. ``base_dir``: where a model built from the config (no ``model.path``)
    saves its base weights once, so its adapters load on a fresh copy (rank 0 of a new run)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from fm_parallel.integrations import transformers as fm_hf

    name = {"flashmask": fm_hf.register(), "sdpa": "sdpa", "flex": "flex_attention"}[cfg.model.attention]
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float64": torch.float64}[cfg.model.dtype]
    torch.manual_seed(cfg.training.seed)
    if cfg.model.path:
        base = AutoModelForCausalLM.from_pretrained(cfg.model.path, attn_implementation=name, torch_dtype=dtype, local_files_only=True)
    else:
        m = cfg.model
        with torch.device(device):  # initialise on the device: an 8B model's CPU init takes minutes
            base = LlamaForCausalLM(LlamaConfig(
                vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                max_position_embeddings=max(cfg.data.seq_len, 2048), attn_implementation=name,
            )).to(dtype)
    base.to(device)
    if base_dir is not None and not cfg.model.path:
        save_base_model(base, base_dir)
    base.config.use_cache = False
    if cfg.model.tile_chunk:
        tile_decoder_layers(base, cfg.model.tile_chunk)  # before checkpointing: the checkpoint wraps the tiled layer
    policy = None
    if cfg.model.activation_checkpointing:  # offload_layers is checked against the model's layer count there
        policy = checkpoint_layers(base, cfg.model.offload_layers)
    elif cfg.model.offload_layers:
        raise ConfigError(f"model.offload_layers: expected 0 without activation checkpointing, got {cfg.model.offload_layers}")
    lora = LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                      target_modules=[t.strip() for t in cfg.model.lora_targets.split(",") if t.strip()])
    model = get_peft_model(base, lora)
    model.train()
    model.checkpoint_policy = policy
    return model


# ---------------------------------------------------------------------- loss
def _hidden(model, ids, positions, mask, ctx, impl: str):
    base = model.get_base_model()
    attention = base.config._attn_implementation
    if attention == "sdpa":  # the dense baseline: an N x N boolean mask, as a user without FlashMask would build
        return base.model(input_ids=ids, position_ids=positions, attention_mask=mask.to_dense()).last_hidden_state
    if attention == "flex_attention":  # the FlexAttention baseline: a BlockMask made from the same mask
        from fm_parallel.masks import to_block_mask

        block = to_block_mask(mask, _compile=ids.device.type == "cuda")
        return base.model(input_ids=ids, position_ids=positions, attention_mask=block).last_hidden_state
    kernel = {"fm_context": ctx} if ctx is not None else {"fm_impl": impl}  # under CP the context picks it
    return base.model(input_ids=ids, position_ids=positions, flashmask=mask, **kernel).last_hidden_state


def _chunked(head, hidden, labels, chunk: int, fn):
    """Sum of ``fn(logits_chunk, labels_chunk)`` over token chunks; each chunk's logits are recomputed
    in the backward instead of kept, so ``[N, vocab]`` logits never exist at once."""
    total = 0
    for c0 in range(0, hidden.shape[1], chunk):
        h, y = hidden[:, c0 : c0 + chunk], labels[:, c0 : c0 + chunk]
        total = total + checkpoint(lambda h_, y_: fn(head(h_).float(), y_), h, y, use_reentrant=False)
    return total


def _token_logps(logits, labels):
    """Per-token log-probability of the label, 0 where the label is -100: ``[B, n]``."""
    safe = labels.clamp(min=0)
    logp = torch.log_softmax(logits, -1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(labels >= 0, logp, torch.zeros_like(logp))


def _response_logps(model, ids, positions, mask, ctx, impl, labels, segment, sample, n_samples, chunk):
    """``[n_samples, 2]``: summed log-probs of each sample's chosen and rejected tokens (this rank's part)."""
    hidden = _hidden(model, ids, positions, mask, ctx, impl)
    head = model.get_base_model().lm_head
    slot = torch.where(labels[0] >= 0, sample[0] * 2 + (segment[0] - 1), torch.full_like(sample[0], 2 * n_samples))

    parts = []
    for c0 in range(0, hidden.shape[1], chunk):
        h, y = hidden[:, c0 : c0 + chunk], labels[:, c0 : c0 + chunk]
        parts.append(checkpoint(lambda h_, y_: _token_logps(head(h_).float(), y_)[0], h, y, use_reentrant=False))
    per_token = torch.cat(parts)
    sums = torch.zeros(2 * n_samples + 1, dtype=per_token.dtype, device=per_token.device).index_add(0, slot, per_token)
    return sums[: 2 * n_samples].view(n_samples, 2)


# ---------------------------------------------------------------------- loop
def _rows(cfg: Config, tokenizer):
    if cfg.data.objective == "sft":
        return sft_rows(cfg.data.seq_len, tokenizer, cfg.data.path)
    return dpo_rows(cfg.data.seq_len, tokenizer, cfg.data.path, cfg.data.dpo_layout)


def _lr(cfg: Config, step: int) -> float:
    t = cfg.training
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(t.steps - t.warmup, 1)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _checkpoint_dir(cfg: Config, step: int) -> Path:
    return Path(cfg.output.dir) / "checkpoints" / f"step_{step:06d}"


def _save(cfg: Config, model, optim, step: int, rows_done: int, rows_per_step: int, tokenizer) -> Path:
    """A distributed checkpoint (adapter + optimizer + progress + each rank's RNG) and the adapter in
    peft format; complete once every file's checksum is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    path = _checkpoint_dir(cfg, step)
    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(ignore_frozen_params=True))
    progress = {"step": torch.tensor(step), "rows": torch.tensor(rows_done), "rows_per_step": torch.tensor(rows_per_step)}
    dcp.save({"model": model_sd, "optim": optim_sd, "progress": progress}, checkpoint_id=str(path))
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save(rng, path / f"rng_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:  # LoRA weights are the same on every rank (gradients are all-reduced)
        export_adapter(model, path / "adapter", cfg, tokenizer, step)
    dist.barrier()
    if dist.get_rank() == 0:
        runs.write_checksums(path)
        (path / "complete").write_text("ok")  # a checkpoint cut short by a kill is never resumed from
    return path


def _load(path: Path, model, optim, stop) -> tuple[int, int, int]:
    """Restore a verified checkpoint; returns (step, rows done, rows per step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    runs.verify_checkpoint(path, stop)
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    progress = {"step": torch.tensor(-1), "rows": torch.tensor(-1), "rows_per_step": torch.tensor(0)}
    state = {"model": model_sd, "optim": optim_sd, "progress": progress}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001 - another adapter shape or format: say which checkpoint, not a stack
        raise runs.CheckpointError(f"--resume: {path} cannot be loaded into this model ({type(e).__name__}: {str(e)[:300]})") from None
    # Only the adapter was saved: the frozen base weights come from the model build, not the checkpoint.
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rng_path = path / f"rng_rank{dist.get_rank()}.pt"
    if not rng_path.exists():
        raise runs.CheckpointError(f"--resume: {path} was written by fewer ranks (no {rng_path.name}); resume with the same "
                                   "number of ranks")
    rng = torch.load(rng_path, weights_only=False)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    step, rows = int(state["progress"]["step"]), int(state["progress"]["rows"])
    per_step = int(state["progress"]["rows_per_step"])
    # Bound the counters by what the run can have done: a damaged counter must not spin the data stream.
    if step < 0 or rows < 0 or (per_step and rows != (step + 1) * per_step) or rows > (step + 1) * 2**20:
        raise runs.CheckpointError(f"--resume: {path} holds inconsistent progress (step {step}, rows {rows}, "
                                   f"rows per step {per_step}); delete it to resume from an earlier checkpoint")
    return step, rows, per_step


def _preflight(cfg: Config, tokenizer, stop) -> None:
    """Checks that need no model: folders exist, the data file is valid (one pass, ``file:line`` named)."""
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path: expected a local Hugging Face model folder with a config.json, got {cfg.model.path!r}")
    if cfg.data.path:
        validate_jsonl(cfg.data.path, cfg.data.objective, cfg.data.seq_len, tokenizer, stop, cfg.data.dpo_layout)


def _tokenizer(cfg: Config):
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer: expected a local Hugging Face tokenizer folder, got {cfg.data.tokenizer!r}")
    try:
        return load_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer!r} could not be loaded ({e})") from None


def train(cfg: Config) -> dict:
    """Run training as configured; returns the summary (also printed and written by rank 0)."""
    # transformers 5 renamed gradient to activation checkpointing and warns from its own internals each step.
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*is deprecated")
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True  # finish the step (or the loop in progress), write a checkpoint, exit

    previous = {s_: signal.signal(s_, on_signal) for s_ in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _train(cfg, stop)
    finally:
        for s_, handler in previous.items():
            signal.signal(s_, handler)


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _train(cfg: Config, stop: dict) -> dict:
    stopped = lambda: stop["flag"]  # noqa: E731
    tokenizer = _tokenizer(cfg)
    _preflight(cfg, tokenizer, stopped)
    _init_distributed(cfg.parallel.timeout_s)
    rank = dist.get_rank()
    out_dir = Path(cfg.output.dir)
    runs.check_run_dir(cfg)  # every rank, before anything is written
    mode, dims, mesh, group, dp_rank, cp_rank = _layout(cfg)
    dist.barrier()  # no rank writes until every rank has checked the directory
    if rank == 0:
        if cfg.output.overwrite:
            runs.clear_run_dir(cfg)
        out_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.output.resume:
            (out_dir / runs.RUN_FILE).write_text(json.dumps(cfg.to_dict(), indent=1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    fresh = rank == 0 and not cfg.output.resume
    model = _build_model(cfg, tokenizer.vocab_size, device, base_dir=out_dir / "base_model" if fresh else None)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.training.lr, weight_decay=0.0)
    dp, accum, cp = dims.dp, cfg.training.grad_accum, dims.cp
    rows_per_step = dp * accum
    start, rows_done = 0, 0
    if cfg.output.resume:
        latest = runs.latest_checkpoint(out_dir)
        if latest is None:
            raise ConfigError(f"--resume: expected a complete checkpoint under {out_dir / 'checkpoints'}, found none")
        try:
            step, rows_done, saved_per_step = _load(latest, model, optim, stopped)
        except runs.StopRequested:
            _say(rank, f"stopped while verifying {latest}; nothing was changed")
            return {}
        start = step + 1
        _say(rank, f"resumed from {latest} (step {step}, {rows_done} rows done)")
        if saved_per_step and saved_per_step != rows_per_step:
            _say(rank, f"note: rows per step changed from {saved_per_step} to {rows_per_step} (data-parallel degree)")

    stream = _rows(cfg, tokenizer)
    skipping = range(rows_done)
    if rank == 0 and rows_done > 64:
        from tqdm import tqdm

        skipping = tqdm(skipping, desc="resume: skipping rows already trained on", unit="row", leave=False)
    for _ in skipping:
        if stop["flag"]:  # a stop while skipping: nothing new was trained, the checkpoint stands
            _say(rank, f"stopped while resuming; the last checkpoint is still {runs.latest_checkpoint(out_dir)}")
            return {}
        next(stream)
    metrics_path = out_dir / "metrics.jsonl"
    if rank == 0 and metrics_path.exists():
        # A resumed run drops what was logged after its checkpoint (a fresh one starts in an empty directory).
        kept = [line for line in metrics_path.read_text().splitlines() if line.strip() and _logged_step(line) < start]
        metrics_path.write_text("".join(line + "\n" for line in kept))
    if start >= cfg.training.steps:
        _say(rank, f"nothing to train: the run already reached training.steps = {cfg.training.steps}")
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.training.steps, initial=min(start, cfg.training.steps),
                   desc=f"{cfg.data.objective} {mode} x{cp} dp{dp}", unit="step")
    policy = model.checkpoint_policy
    saved = None
    for step in range(start, cfg.training.steps):
        t0 = time.perf_counter()
        if policy is not None:
            policy.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rows: list[Row] = [next(stream) for _ in range(rows_per_step)]
        rows_done += len(rows)
        mine = rows[dp_rank::dp]
        if cfg.data.objective == "sft":
            denom = sum(int((r.labels != -100).sum()) for r in rows)
        else:
            denom = sum(int(r.sample.max()) + 1 for r in rows)
        denom = max(denom, 1)  # rows with nothing to predict contribute zero, not NaN
        for group_ in optim.param_groups:
            group_["lr"] = _lr(cfg, step)
        local_loss = torch.zeros((), device=device, dtype=torch.float64)
        for row in mine:
            loss = _row_loss(cfg, model, row, mode, group, mesh, cp, cp_rank, device) / denom
            loss.backward()
            local_loss += loss.detach().double()
        for p in params:  # the whole world's contributions; losses were normalised globally
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        dist.all_reduce(local_loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        tokens = len(rows) * cfg.data.seq_len
        record = {"step": step, "loss": local_loss.item(), "tokens_per_s": tokens / elapsed, "lr": _lr(cfg, step), "step_s": elapsed}
        if device.type == "cuda":  # the largest over the ranks: the one that decides whether a length fits
            peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            record["peak_gib"] = peak.item()
        if policy is not None and policy.host_bytes:
            record["host_gib"] = policy.host_bytes / 2**30
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if (step + 1) % cfg.output.log_every == 0 or step + 1 == cfg.training.steps:
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
        last = step == cfg.training.steps - 1
        flag = torch.tensor(1 if stop["flag"] else 0, device=device)  # NCCL reduces device tensors only
        dist.all_reduce(flag)  # every rank stops at the same step
        stopping = bool(flag.item()) or step + 1 == cfg.output.stop_after
        if (cfg.output.checkpoint_every and (step + 1) % cfg.output.checkpoint_every == 0) or last or stopping:
            saved = _save(cfg, model, optim, step, rows_done, rows_per_step, tokenizer)
        if stopping and not last:
            if bar is not None:
                bar.close()
                bar = None
            _say(rank, f"stopped after step {step}; checkpoint {saved}; continue with --resume")
            break
    if bar is not None:
        bar.close()
    if rank == 0 and saved is not None and not stop["flag"] and saved.name == f"step_{cfg.training.steps - 1:06d}":
        import shutil

        final = out_dir / "adapter"
        if final.exists():
            shutil.rmtree(final)
        shutil.copytree(saved / "adapter", final)
        _say(rank, f"adapter: {final} (PeftModel.from_pretrained)")
    summary = _finish(cfg, out_dir, rank, metrics_path)
    dist.barrier()
    return summary


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable line was written after any checkpoint: dropped


def _row_loss(cfg: Config, model, row: Row, mode, group, mesh, cp: int, cp_rank: int, device):
    n = cfg.data.seq_len
    ids, labels = row.input_ids.view(1, n).to(device), row.labels.view(1, n).to(device)
    positions = row.positions.view(1, n).to(device)
    segment, sample = row.segment.view(1, n).to(device), row.sample.view(1, n).to(device)
    ctx = None
    if cp > 1:
        plan = shard(row.mask, cp, cfg.parallel.balance)
        ctx = ContextParallel(mode, plan, group=None if mode == "hybrid" else group,
                              mesh=group if mode == "hybrid" else None, impl=cfg.parallel.impl or None,
                              cuda_graphs=cfg.parallel.cuda_graphs)
        # The step's mask prepared once, from the loader's host mask (its digest hashed there, the ranks'
        # agreement, the pair table, column masks; launch plans on the first layer); every layer of the
        # policy and reference passes, forward and backward, reuses it.
        mask = ctx.prepare(row.mask, device=device).mask
        ids, labels, positions, segment, sample = (plan.shard(t, cp_rank, dim=1) for t in (ids, labels, positions, segment, sample))
    else:
        mask = row.mask.to(device)
    impl = cfg.parallel.impl or "auto"
    if cfg.data.objective == "sft":
        hidden = _hidden(model, ids, positions, mask, ctx, impl)
        head = model.get_base_model().lm_head
        return _chunked(head, hidden, labels, cfg.training.loss_chunk,
                        lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))
    n_samples = int(row.sample.max()) + 1
    args = (ids, positions, mask, ctx, impl, labels, segment, sample, n_samples, cfg.training.loss_chunk)
    policy = _response_logps(model, *args)
    with torch.no_grad(), model.disable_adapter():
        reference = _response_logps(model, *args)
    if cp > 1:
        import torch.distributed.nn.functional as dfn

        cp_group = ctx.mesh.get_group("ring") if mode == "hybrid" else group
        policy = dfn.all_reduce(policy, group=cp_group) if mode != "hybrid" else _hybrid_sum(policy, ctx.mesh)
        reference = reference.clone()
        if mode == "hybrid":
            reference = _hybrid_sum(reference, ctx.mesh)
        else:
            dist.all_reduce(reference, group=cp_group)
    margin = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    # Each CP rank holds the same per-sample sums; 1/cp makes the world-summed gradient exact.
    return -F.logsigmoid(cfg.training.dpo_beta * margin).sum() / cp


def _hybrid_sum(x, mesh):
    import torch.distributed.nn.functional as dfn

    x = dfn.all_reduce(x, group=mesh.get_group("ulysses"))
    return dfn.all_reduce(x, group=mesh.get_group("ring"))


def _finish(cfg: Config, out_dir: Path, rank: int, metrics_path: Path) -> dict:
    if rank != 0:
        return {}
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] if metrics_path.exists() else []
    if not records:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in records]
    a.plot(steps, [r["loss"] for r in records], "o-", ms=3)
    a.set_xlabel("step")
    a.set_ylabel(f"{cfg.data.objective} loss")
    a.grid(alpha=0.3)
    b.plot(steps, [r["tokens_per_s"] for r in records], "s-", ms=3, color="C1")
    b.set_xlabel("step")
    b.set_ylabel("tokens / s")
    b.grid(alpha=0.3)
    fig.suptitle(f"{cfg.data.objective}, seq_len {cfg.data.seq_len}, cp {cfg.parallel.cp}")
    fig.tight_layout()
    plot = out_dir / "training.png"
    fig.savefig(plot, dpi=110)
    tail = records[len(records) // 2 :] or records
    summary = {
        "plot": str(plot), "metrics": str(metrics_path), "steps": len(records),
        "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
        "tokens_per_s": sum(r["tokens_per_s"] for r in tail) / len(tail),
    }
    if "peak_gib" in records[-1]:
        summary["peak_gib"] = max(r.get("peak_gib", 0.0) for r in records)
    print(f"plot: {plot}")
    print(f"summary: {summary['tokens_per_s']:.0f} tokens/s, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} "
          f"over {summary['steps']} steps ({cfg.data.objective}, cp={cfg.parallel.cp})")
    return summary


USER_ERRORS = (ConfigError, DataError, ValueError, FileNotFoundError, PermissionError, RankFailure)


def main(argv: list[str] | None = None) -> None:
    """The command line. A user error (configuration, data, folders, a checkpoint that cannot be
    resumed, ranks that disagree) prints one line from rank 0 and exits with status 2, no traceback;
    ``FM_TRACEBACK=1`` shows it."""
    try:
        cfg = load_config(argv)
        train(cfg)
    except USER_ERRORS as e:
        if os.environ.get("FM_TRACEBACK"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
