"""The training loop on `accelerate`, shared by fine-tuning and distillation.

API (what the stages of `training.stages` build on)::

    check_train_arguments(args)                                 # before anything is loaded
    accelerator = make_accelerator(args)                        # before loading data and model
    rows = build_datasets(data_args, tokenizer, accelerator.main_process_first())  # training.data
    result = train(model, rows["train"], rows["validation"], args, accelerator,
                   loss_fn=causal_lm_loss,                      # or your own LossFn
                   trainable=[r"feature_map", r"window_gate"],  # regexes over parameter names, or None
                   run_name="distill", perplexity=False)
    export_model(accelerator, result.model, args.output_dir, tokenizer)  # training.checkpoints
    accelerator.end_training()  # at the very end: closes the trackers and the process group

- `loss_fn(model, batch) -> (loss_sum, count)`: `batch` holds `[rows, block_size]` tensors
  (`input_ids`, `labels`, `position_ids`, as `training.data.collate_rows` stacks packed rows) already
  on the device; `model` is the prepared (wrapped) model. Return per-row tensors `[rows]`: the summed
  loss and the number of items it sums over (tokens, heads x tokens, ...). Training minimises
  Σ loss_sum / Σ count over each optimizer step's global batch (every micro-batch of every process; under
  DeepSpeed, which owns the gradients, per micro-batch); evaluation reports the item-weighted mean over the
  whole held-out set, exactly, on any number of processes (per-row values let accelerate drop the rows
  it repeats to even out the last batch). The losses (`causal_lm_loss`, logit distillation) and
  `packed_forward`, which runs the model on packed rows with document boundaries respected, are in
  `training.losses`.
- `eval_loss_fn`: what evaluation reports, when it differs from the training objective (e.g. plain
  next-token cross-entropy while training on a distillation loss); default `loss_fn`.
- `trainable`: parameters whose name matches any regex train, all others are frozen (each pattern must
  match something); None leaves `requires_grad` as the caller set it (e.g. PEFT's LoRA). Only trainable
  parameters reach the optimizer and the gradient clipping.
- `perplexity`: also report exp(eval loss) (for cross-entropy objectives).
- A frozen teacher (distillation) is not the loop's business: let `loss_fn` close over it, on
  `accelerator.device`, in eval mode and without gradients.
- `args`: as `check_train_arguments` left them; it turns `resume_from_checkpoint` (a checkpoint folder or
  `latest`) into the verified checkpoint folder that `train` loads, and `mixed_precision` auto into bf16 where the
  device computes it natively (`native_bf16`), no elsewhere. `make_accelerator` resets accelerate's
  process-wide settings, so one process can run several stages one after the other.

The loop: AdamW (no weight decay on biases and norms), a `transformers` LR schedule with warm-up,
gradient accumulation (`accelerator.accumulate`), clipping, mixed precision and every distributed
backend from the accelerate config (DDP, FSDP2, DeepSpeed ZeRO, also on CPU processes; an FSDP config that does
not wrap each decoder layer is refused), the same model for the same seed and global batch on any number of
processes (`GlobalBatchSampler` and the global loss above), periodic evaluation, a tqdm bar with loss and
tokens/s, metrics to accelerate's trackers, among them always `JsonLinesTracker` (`OUTPUT_DIR/log.jsonl`, one
JSON record per line: what the tests and the run summary read), atomic checkpoints every `save_steps` and exact
resumption (`training.checkpoints`): data order, optimizer, scheduler and RNG states are restored, so a
run killed and resumed follows the uninterrupted loss curve (also on another number of processes, where the
engine reshards its checkpoint and the global batch stays the same).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState, GradientState
from accelerate.tracking import GeneralTracker
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    is_tensorboard_available,
    parse_flag_from_env,
    send_to_device,
)
from torch import nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm
from transformers import get_scheduler

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.checkpoints import (
    LOG_FILE,
    PreviousRun,
    check_output_dir,
    load_checkpoint,
    save_checkpoint,
)
from hf_linear_attn.training.data import collate_rows
from hf_linear_attn.training.losses import LossFn, causal_lm_loss, weighted_mean

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
logger = get_logger(__name__)


@dataclass
class TrainArguments:
    """The loop's settings (names follow transformers' `TrainingArguments` / run_clm.py)."""

    output_dir: str = field(default="outputs/finetune", metadata={"help": "Checkpoints and the final model."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Replace the earlier run in output_dir (its checkpoints and log are deleted once this run "
                          "has its first checkpoint)."},
    )
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; > 0 overrides num_train_epochs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the training rows."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Packed rows per process per micro-batch."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Packed rows per process in evaluation."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate (AdamW)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on biases and norms)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": f"One of {SCHEDULERS}."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    seed: int = field(
        default=42, metadata={"help": "Seed of initialisation and data order (the held-out split has its own)."}
    )
    mixed_precision: str | None = field(
        default=None, metadata={"help": "no, fp16, bf16 or auto (bf16 where the device computes it natively: a CUDA "
                                        "GPU with bf16, a CPU with AMX or AVX512-BF16; no elsewhere); default: what "
                                        "`accelerate launch` / its config says."}
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward."})
    logging_steps: int = field(default=10, metadata={"help": "Log the training loss every N steps."})
    eval_steps: int = field(default=0, metadata={"help": "Evaluate every N steps (0: only at the end)."})
    save_steps: int = field(default=0, metadata={"help": "Checkpoint every N steps (0: never)."})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest K checkpoints."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "A checkpoint folder, or `latest` (newest complete one in output_dir)."}
    )
    report_to: str = field(
        default="auto",
        metadata={"help": "Trackers, comma-separated (tensorboard, wandb, ...), `none`, or `auto` (tensorboard "
                          "when installed)."},
    )


def check_train_arguments(args: TrainArguments) -> None:
    """Raise a clear error for values the loop cannot run with, before anything is loaded; also checks the
    output folder (an earlier run there needs --resume_from_checkpoint or --overwrite_output_dir) and
    resolves `resume_from_checkpoint` to the checkpoint folder and `mixed_precision` auto to bf16 or no."""
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise InputError("Set --max_steps > 0 or --num_train_epochs > 0.")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if args.lr_scheduler_type not in SCHEDULERS:
        raise InputError(f"--lr_scheduler_type {args.lr_scheduler_type!r}: use one of {SCHEDULERS}.")
    if args.mixed_precision not in (None, "no", "fp16", "bf16", "auto"):
        raise InputError(f"--mixed_precision {args.mixed_precision!r}: use no, fp16, bf16 or auto.")
    if args.mixed_precision == "auto":
        args.mixed_precision = "bf16" if native_bf16() else "no"
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise InputError(f"--save_total_limit must be >= 1, got {args.save_total_limit}.")
    args.resume_from_checkpoint = check_output_dir(args.output_dir, args.overwrite_output_dir,
                                                   args.resume_from_checkpoint)


def native_bf16() -> bool:
    """Whether this process's device multiplies bf16 natively: a CUDA GPU that supports it, or a CPU with AMX or
    AVX512-BF16 (where bf16 autocast runs the matmuls of a frozen model about twice as fast as fp32). Elsewhere bf16
    is emulated, slower than fp32 on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    # Private probes (torch 2.13 has both; an older torch without them gets fp32, the safe side).
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe() for probe in probes if probe is not None)


def make_accelerator(args: TrainArguments) -> Accelerator:
    """The Accelerator for `args`: gradient accumulation over exactly `gradient_accumulation_steps`
    micro-batches (also across epoch ends, so that resumption is exact), trackers per `report_to` plus
    the `JsonLinesTracker` of `OUTPUT_DIR/log.jsonl`, tensorboard logs under `OUTPUT_DIR/runs`.

    accelerate keeps its settings in process-wide singletons; they are reset here (the process group
    stays), so one process can run several stages with different settings, e.g. distillation in fp32
    and then fine-tuning in bf16. On CPU processes, an FSDP or DeepSpeed launch is given its engine
    (`_fit_engine_to_cpu_processes`)."""
    # accelerate (1.x) has no public way to do this: a second Accelerator with other settings (mixed
    # precision, accumulation) raises while the singletons hold the first one's, and `_reset_state` is
    # what accelerate's own test utilities call between runs.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if args.report_to == "auto":
        trackers = ["tensorboard"] if is_tensorboard_available() else []
    elif args.report_to == "none":
        trackers = []
    else:
        trackers = [name.strip() for name in args.report_to.split(",") if name.strip()]
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        log_with=[*trackers, JsonLinesTracker(Path(args.output_dir) / LOG_FILE)],
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=str(Path(args.output_dir) / "runs")),
    )
    _fit_engine_to_cpu_processes(accelerator)
    return accelerator


def _fit_engine_to_cpu_processes(accelerator: Accelerator) -> None:
    """`accelerate launch` on CPU processes (ACCELERATE_USE_CPU=1, gloo) with an FSDP or DeepSpeed config: accelerate
    (1.x) makes plain DDP (MULTI_CPU) of it and drops the engine's settings without a word. Both engines run on CPU
    processes all the same (torch's `fully_shard`; DeepSpeed's CPU accelerator over gloo), so the run is switched to
    the engine with the launch's settings (its FSDP_* / DeepSpeed variables) and trains, checkpoints and exports
    as on GPUs. The type is set in the process-wide state too, which every later AcceleratorState copies (a second
    stage in the same process finds the engine's type there, but no plugin)."""
    state = accelerator.state
    if state.device.type != "cpu" or state.num_processes == 1:
        return
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and not getattr(state, "fsdp_plugin", None):
        state.fsdp_plugin = FullyShardedDataParallelPlugin()
        if state.mixed_precision != "no":
            state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
        engine = DistributedType.FSDP
    elif parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") and not getattr(state, "deepspeed_plugins", None):
        import deepspeed  # accelerate's launcher has checked that it is installed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group
        plugin = DeepSpeedPlugin()
        plugin.set_mixed_precision(state.mixed_precision)
        plugin.select(_from_accelerator_state=True)
        state.deepspeed_plugins = {"default": plugin}
        engine = DistributedType.DEEPSPEED
    else:
        return
    state.distributed_type = PartialState().distributed_type = engine


def check_engine(accelerator: Accelerator, model: nn.Module) -> None:
    """Refuse, before training, an FSDP config that would not shard the model per layer: its wrap policy must be
    TRANSFORMER_BASED_WRAP on a layer class of `model` (by default the classes of `model._no_split_modules`, the
    decoder layer), else FSDP would gather the whole model at once, or split a layer."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    plugin = accelerator.state.fsdp_plugin
    present = {type(module).__name__ for module in model.modules()}
    names = plugin.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
    wraps_layers = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is transformer_auto_wrap_policy
    if not wraps_layers or not set(names) & present:
        raise InputError(f"The FSDP config must wrap each decoder layer: set fsdp_auto_wrap_policy: "
                         f"TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap: LinearAttentionDecoderLayer "
                         f"(as configs/accelerate/fsdp2.yaml does); it has policy {plugin.auto_wrap_policy!r} on "
                         f"{names or 'no class'}.")


def select_trainable(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Make exactly the parameters whose name matches one of the regexes `patterns` trainable; returns
    their names. Raises if a pattern matches no parameter."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(re.search(pattern, name) for name in names):
            sample = ", ".join(names[:12])
            raise InputError(f"Trainable-parameter pattern {pattern!r} matches no parameter (names look like: "
                             f"{sample}, ...).")
    return train_only(model, [name for name in names if any(re.search(pattern, name) for pattern in patterns)])


def train_only(model: nn.Module, names: Collection[str]) -> list[str]:
    """Make exactly the parameters of `model` named in `names` trainable, every other one frozen; returns their
    names in the model's order."""
    wanted = set(names)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in wanted)
    return [name for name, parameter in model.named_parameters() if parameter.requires_grad]


class GlobalBatchSampler(Sampler[list[int]]):
    """This process's micro-batches, for a run whose optimizer steps each take `global_batch` rows.

    The rows form one endless stream: the permutation of epoch 0, then that of epoch 1, ..., each fixed by
    (seed, epoch) alone (no global RNG: a resumed run sees the same order). Optimizer step s trains on stream rows
    [s·G, (s+1)·G) with G = `per_device` × `accumulation` × `processes`; its micro-batch m on the next
    `per_device` × `processes` of them, of which process p takes slice p (`per_device` rows). So the rows of
    every optimizer step depend on the seed and G only, not on how G is split between processes and micro-batches
    (a step that straddles an epoch end holds the end of one permutation and the start of the next).

    Iterating yields lists of `per_device` row indices, micro-batch after micro-batch, from step `start_step`
    on, without end."""

    def __init__(self, size: int, seed: int, per_device: int, accumulation: int, processes: int,
                 process_index: int, start_step: int = 0) -> None:
        if size < 1:
            raise InputError("The training split holds no rows.")
        self.size, self.seed, self.per_device, self.processes = size, seed, per_device, processes
        self.process_index, self.start_step = process_index, start_step
        self.global_batch = per_device * accumulation * processes

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of the rows in `epoch`."""
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = divmod(self.start_step * self.global_batch, self.size)
        micro_batch = self.per_device * self.processes
        mine = slice(self.process_index * self.per_device, (self.process_index + 1) * self.per_device)
        pending: list[int] = []
        while True:
            pending += self.epoch_order(epoch)[offset:]
            epoch, offset = epoch + 1, 0
            while len(pending) >= micro_batch:
                yield pending[:micro_batch][mine]
                pending = pending[micro_batch:]


@dataclass
class TrainResult:
    """What `train` returns; pass `model` (the prepared model) to `training.checkpoints.export_model`."""

    model: nn.Module
    global_step: int
    tokens_seen: int
    eval_metrics: dict[str, float]
    log_history: list[dict[str, Any]]  # the records of OUTPUT_DIR/log.jsonl (main process; empty on the others)


class JsonLinesTracker(GeneralTracker):
    """An accelerate tracker that writes every `accelerator.log(values, step)` as one JSON line
    `{"step": step, **values}` to `path`, at once (a killed run keeps every line it logged), and keeps
    the records in `history`. Like every tracker it runs on the main process only; `start` reads the
    records already in the file (see `keep_records`)."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.history: list[dict[str, Any]] = []

    @property
    def tracker(self) -> list[dict[str, Any]]:
        return self.history

    @staticmethod
    def keep_records(path: Path, until_step: int | None) -> None:
        """Before a run: keep the records of `path` up to `until_step` (a resumed run drops what the
        interrupted one logged past its checkpoint, so the file is one curve); None empties it."""
        records = []
        if until_step is not None and path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            records = [record for record in records if record["step"] <= until_step]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(record) + "\n" for record in records))

    def start(self) -> None:
        text = self.path.read_text() if self.path.exists() else ""
        self.history = [json.loads(line) for line in text.splitlines() if line.strip()]

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, **values}
        self.history.append(record)
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")


def _logged_history(accelerator: Accelerator) -> list[dict[str, Any]]:
    """The records of the run's `JsonLinesTracker` (main process; empty on the others)."""
    tracker = next((t for t in accelerator.trackers if isinstance(t, JsonLinesTracker)), None)
    return list(tracker.history) if tracker is not None else []


def _optimizer(model: nn.Module, args: TrainArguments) -> torch.optim.Optimizer:
    decayed, plain = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decayed if parameter.dim() >= 2 else plain).append(parameter)
    if not decayed and not plain:
        raise InputError("No parameter is trainable: check the trainable-parameter selection.")
    groups = [{"params": decayed, "weight_decay": args.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                             betas=(args.adam_beta1, args.adam_beta2))


def _tracker_config(config: dict[str, Any]) -> dict[str, Any]:
    # TensorBoard's hparams take only scalars and strings.
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value) for key, value in config.items()}


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, loss_fn: LossFn, accelerator: Accelerator,
             perplexity: bool = True) -> dict[str, float]:
    """Item-weighted mean of `loss_fn` over every held-out row (each counted once on any number of
    processes); with `perplexity`, also exp of it."""
    was_training = model.training
    model.eval()
    loss = weighted_mean(
        accelerator.gather_for_metrics((loss_sum.detach().float(), items.detach().float()))
        for loss_sum, items in (loss_fn(model, batch) for batch in loader)
    )
    model.train(was_training)
    metrics = {"eval_loss": loss}
    if perplexity:
        metrics["perplexity"] = math.exp(min(loss, 700.0))
    return metrics


def _optimizer_step(
    model: nn.Module,
    stream: Iterator[dict[str, torch.Tensor]],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    accelerator: Accelerator,
    args: TrainArguments,
) -> tuple[float, int]:
    """One optimizer step over `gradient_accumulation_steps` micro-batches of `stream`, with clipping.

    The gradient is that of the global batch's item-weighted mean loss, Σ loss_sum / Σ count over every micro-batch
    of every process (not a mean of per-process or per-micro-batch means), so it does not depend on how the global
    batch is split. Returns that loss and the tokens fed (all processes)."""
    accumulation = args.gradient_accumulation_steps
    # DeepSpeed keeps the gradients (and steps within the last backward): each micro-batch's mean is its loss.
    owns_gradients = accelerator.distributed_type == DistributedType.DEEPSPEED
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # [loss sum, items, tokens]
    for _ in range(accumulation):
        batch = send_to_device(next(stream), accelerator.device)
        with accelerator.accumulate(model):
            loss_sum, count = loss_fn(model, batch)
            accelerator.backward(loss_sum.sum() / count.sum().clamp(min=1) if owns_gradients else loss_sum.sum())
        totals += torch.stack([loss_sum.detach().sum().double(), count.detach().sum().double(),
                               torch.tensor(batch["input_ids"].numel(), dtype=torch.float64, device=totals.device)])
    totals = accelerator.reduce(totals, reduction="sum")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not owns_gradients:
        # The global items are known only now: the gradients hold Σ loss_sum / accumulation (accelerate divides each
        # backward) averaged over the processes (DDP / FSDP reduce by mean); make them d(Σ loss_sum / Σ count).
        scale = accumulation * accelerator.num_processes / totals[1].clamp(min=1)
        for parameter in trainable:
            if parameter.grad is not None:
                parameter.grad.mul_(scale.to(parameter.grad.dtype))
    if args.max_grad_norm > 0:
        accelerator.clip_grad_norm_(trainable, args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[2])


def train(
    model: nn.Module,
    train_dataset: Dataset,
    eval_dataset: Dataset | None,
    args: TrainArguments,
    accelerator: Accelerator,
    *,
    loss_fn: LossFn = causal_lm_loss,
    eval_loss_fn: LossFn | None = None,
    trainable: Sequence[str] | None = None,
    collate_fn: Callable[[list[Any]], dict[str, torch.Tensor]] = collate_rows,
    run_name: str = "finetune",
    perplexity: bool = True,
    tracker_config: dict[str, Any] | None = None,
) -> TrainResult:
    """Train `model` in place (see the module docstring), `args` checked by `check_train_arguments`. Call on
    every process."""
    if trainable is not None:
        select_trainable(model, trainable)
    check_engine(accelerator, model)
    output_dir = Path(args.output_dir)
    optimizer = _optimizer(model, args)
    eval_loader = None
    if eval_dataset is not None:
        eval_loader = DataLoader(eval_dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collate_fn,
                                 generator=torch.Generator().manual_seed(args.seed))
        eval_loader = accelerator.prepare(eval_loader)
    # The training rows are not given to accelerate: `GlobalBatchSampler` already hands each process its slice. So
    # DeepSpeed, which reads its micro-batch size from a prepared training loader, is told it.
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    model, optimizer = accelerator.prepare(model, optimizer)
    accumulation = args.gradient_accumulation_steps
    if accelerator.gradient_accumulation_steps != accumulation:  # a DeepSpeed config can impose its own
        raise InputError(f"The accelerate config sets gradient_accumulation_steps="
                         f"{accelerator.gradient_accumulation_steps} but --gradient_accumulation_steps is "
                         f"{accumulation}; leave it unset (auto) in the DeepSpeed config.")
    global_batch = args.per_device_train_batch_size * accumulation * accelerator.num_processes
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(
        args.num_train_epochs * len(train_dataset) / global_batch)
    # The schedule counts optimizer steps; stepped by hand (a prepared scheduler steps once per process).
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=total_steps)
    geometry = {"num_processes": accelerator.num_processes, "per_device_train_batch_size":
                args.per_device_train_batch_size, "gradient_accumulation_steps": accumulation,
                "global_batch": global_batch}

    global_step, tokens_seen = 0, 0
    if args.resume_from_checkpoint:
        state = load_checkpoint(accelerator, args.resume_from_checkpoint, scheduler)  # verified by the check
        global_step, tokens_seen = state["global_step"], state["tokens_seen"]
        if state["geometry"].get("global_batch") != global_batch:
            logger.warning(f"Resuming a run made with {state['geometry']} as {geometry}: another global batch, so "
                           "the data order and the steps differ from the interrupted run.", main_process_only=True)
    sampler = GlobalBatchSampler(len(train_dataset), args.seed, args.per_device_train_batch_size, accumulation,
                                 accelerator.num_processes, accelerator.process_index, start_step=global_step)
    # A loader with its own generator: starting to iterate one draws a seed from it, and from the global torch RNG
    # otherwise, which would shift dropout masks between a resumed run and the uninterrupted one.
    train_loader = DataLoader(train_dataset, batch_sampler=sampler, collate_fn=collate_fn,
                              generator=torch.Generator().manual_seed(args.seed))
    # An earlier run that this one replaces (--overwrite_output_dir) is moved aside only now, with every input
    # checked and loaded, and deleted once this run has a checkpoint of its own or has finished.
    replaces = args.overwrite_output_dir and not args.resume_from_checkpoint
    previous = PreviousRun(accelerator, output_dir, move=replaces)
    try:
        if accelerator.is_main_process:
            JsonLinesTracker.keep_records(output_dir / LOG_FILE, global_step if args.resume_from_checkpoint else None)
        accelerator.init_trackers(run_name, config=_tracker_config(tracker_config or asdict(args)))

        stream = iter(train_loader)
        progress = tqdm(total=total_steps, initial=global_step, desc=run_name, disable=not accelerator.is_main_process,
                        dynamic_ncols=True)
        eval_metrics: dict[str, float] = {}
        window_loss, window_steps, window_tokens, window_seconds = 0.0, 0, 0, 0.0  # since the last log line
        model.train()
        while global_step < total_steps:
            started = time.perf_counter()
            step_loss, step_tokens = _optimizer_step(model, stream, loss_fn, optimizer, accelerator, args)
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            global_step += 1
            tokens_seen += step_tokens
            window_loss, window_steps = window_loss + step_loss, window_steps + 1
            window_tokens, window_seconds = window_tokens + step_tokens, window_seconds + time.perf_counter() - started
            tokens_per_second = window_tokens / max(window_seconds, 1e-9)  # training time only (no eval, no saving)
            progress.update(1)
            progress.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens_per_second:,.0f}",
                                 lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if global_step % args.logging_steps == 0 or global_step == total_steps:
                record = {"loss": window_loss / window_steps,
                          "learning_rate": scheduler.get_last_lr()[0], "tokens_seen": tokens_seen,
                          "tokens_per_second": tokens_per_second}
                accelerator.log(record, step=global_step)
                window_loss, window_steps, window_tokens, window_seconds = 0.0, 0, 0, 0.0
            if eval_loader is not None and (
                global_step == total_steps or (args.eval_steps > 0 and global_step % args.eval_steps == 0)
            ):
                eval_metrics = evaluate(model, eval_loader, eval_loss_fn or loss_fn, accelerator, perplexity)
                accelerator.log(eval_metrics, step=global_step)
                if accelerator.is_main_process:
                    progress.write(f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
            if args.save_steps > 0 and global_step % args.save_steps == 0:
                trainer_state = {"global_step": global_step, "tokens_seen": tokens_seen, "geometry": geometry}
                save_checkpoint(accelerator, output_dir, trainer_state, scheduler, keep_last=args.save_total_limit)
                previous.discard()
    except BaseException:
        previous.restore()
        raise
    previous.discard()
    progress.close()
    return TrainResult(model, global_step, tokens_seen, eval_metrics, _logged_history(accelerator))
