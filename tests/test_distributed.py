"""Training on several CPU processes (gloo) through `accelerate launch` with the shipped configs, DDP and FSDP2:
the same seed and global batch give the model of one process (losses, saved weights), whatever the number of
processes and micro-batches; FSDP2's sharded checkpoints resume exactly after a kill, also on another number of
processes; every entry point (full fine-tuning, attention transfer, LoRA with a KL teacher) runs under FSDP2."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from helpers import (
    ROOT,
    assert_ordinary_checkpoint,
    free_port,
    read_log,
    save_with_tokenizer,
    script_env,
    stranger_logits,
    teacher,
    tiny_args,
)
from hub_server import HubServer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_linear_attn import convert_to_linear_attention
from hf_linear_attn.training import checkpoints, finetune, loop, stages
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.loop import TrainArguments
from hf_linear_attn.training.recipes import parse_recipe_args

ACCELERATE = Path(sys.executable).parent / "accelerate"
CONFIGS = {"ddp": "cpu_ddp_2proc.yaml", "fsdp2": "fsdp2.yaml", "multi-node-fsdp2": "multi_node_fsdp2.yaml",
           "zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml"}
# Every run: global batch 4 rows of 64 tokens, 8 steps, a checkpoint every 2.
STEPS = ["--max_steps", "8", "--save_steps", "2", "--learning_rate", "3e-3"]
SPLITS = {1: ("4", "1"), 2: ("1", "2"), 4: ("1", "1")}  # processes: (per-device rows, micro-batches per step)


def geometry(processes: int) -> list[str]:
    per_device, accumulation = SPLITS[processes]
    return ["--per_device_train_batch_size", per_device, "--gradient_accumulation_steps", accumulation]


def launch(engine: str, processes: int, script: str, *args: str, machine: tuple[int, int] | None = None
           ) -> subprocess.Popen:
    """`accelerate launch` of `training/SCRIPT ARGS` with the shipped config of `engine` on `processes` CPU
    processes, in a session of its own (so a kill reaches every process); `machine` (rank, port): as that machine
    of two on this one, the main one at 127.0.0.1:port. One machine listens on a free port that accelerate picks
    (port 0): on its default, 29500, two launches of parallel test workers collided, the later one failing to
    listen (EADDRINUSE) or its processes joining the other's rendezvous."""
    nodes = ["--main_process_port", "0"] if machine is None else [
        "--num_machines", "2", "--machine_rank", str(machine[0]), "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(machine[1])]
    command = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "configs" / "accelerate" / CONFIGS[engine]),
               "--num_processes", str(processes), *nodes, "--mixed_precision", "no", str(ROOT / "training" / script),
               *args]
    return subprocess.Popen(command, cwd=ROOT, env=script_env(ACCELERATE_USE_CPU="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(*processes: subprocess.Popen, timeout: float = 300) -> None:
    """Wait for every launch, all within `timeout` seconds, reading the stderr of each as it comes (one thread a
    launch: a launch blocked on writing to a full pipe would stall the others, whose collectives wait for it); fail
    unless each exits 0, with the end of each one's stderr. On a timeout every launch still running is killed (its
    whole session) first, so that no process is left behind."""
    stderr: list[str] = [""] * len(processes)

    def drain(index: int) -> None:
        stderr[index] = processes[index].communicate()[1]

    readers = [threading.Thread(target=drain, args=(index,), daemon=True) for index in range(len(processes))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    if any(reader.is_alive() for reader in readers):
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for reader in readers:
            reader.join()
    codes = [process.wait() for process in processes]
    assert codes == [0] * len(processes), "\n".join(
        f"launch {index}: exit status {code}\n{text[-3000:]}"
        for index, (code, text) in enumerate(zip(codes, stderr, strict=True)))


def named(name: str):
    """An `assert_close` message: the tensor's name before torch's description of the mismatch."""
    return lambda message: f"{name}: {message}"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# How far a run on several processes may be from the one-process run: (loss rtol, weight atol, logit atol). DeepSpeed
# owns the gradients (each micro-batch's loss is its own mean, not a share of the global batch's), and Adam turns the
# slightly other gradients into ~1e-3 steps.
TOLERANCES = {"ddp": (1e-5, 1e-5, 1e-4), "fsdp2": (1e-5, 1e-5, 1e-4), "multi-node-fsdp2": (1e-5, 1e-5, 1e-4),
              "zero2": (1e-3, 5e-3, 5e-2), "zero3": (1e-3, 5e-3, 5e-2)}
IDS = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))  # within every vocabulary here


def assert_same_run(folder: Path, reference: Path, engine: str = "fsdp2") -> None:
    """The run in `folder` logged the losses and token counts of the one in `reference` and saved the same weights
    (within `engine`'s tolerances), as an ordinary checkpoint that loads like a stranger's (`assert_stranger_loads`)."""
    loss_rtol, weight_atol, _ = TOLERANCES[engine]
    log, expected = read_log(folder), read_log(reference)
    assert [(r["step"], r.get("tokens_seen")) for r in log] == [(r["step"], r.get("tokens_seen")) for r in expected]
    for key in ("loss", "eval_loss"):
        torch.testing.assert_close(torch.tensor([r[key] for r in log if key in r]),
                                   torch.tensor([r[key] for r in expected if key in r]), rtol=loss_rtol, atol=1e-6)
    expected_weights = weights(reference)
    for name, tensor in weights(folder).items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=0, atol=weight_atol, msg=named(name))
    assert_stranger_loads(folder, reference, engine)


def assert_stranger_loads(folder: Path, reference: Path, engine: str) -> None:
    """`folder` holds an ordinary checkpoint (this package's auto_map and code files, nothing of the engine's) which,
    loaded with trust_remote_code=True where hf-linear-attn is not installed, gives the logits of the one-process
    run's checkpoint `reference` (loaded here) within `engine`'s tolerance."""
    assert_ordinary_checkpoint(folder)
    logits = stranger_logits(folder.parent / f"stranger-{folder.name}", IDS, folder)[str(folder)]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(reference).eval()(IDS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=TOLERANCES[engine][2])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, dataset_cache) -> Path:
    """The reference: the tiny recipe's full fine-tuning on one process, in this one."""
    out = tmp_path_factory.mktemp("one-process")
    stages.finetune(finetune.parse_args(tiny_args(out, dataset_cache, *STEPS, *geometry(1))))
    return out


# Two processes of each engine run in the tests below (FSDP2 killed and resumed, ending as the one-process run) and
# in test_ddp.py; four here (each launch costs 40-50 s of a CI run).
@pytest.mark.parametrize(("engine", "processes"), [("ddp", 4), ("fsdp2", 4)])
def test_the_same_model_on_any_number_of_processes(engine, processes, one_process, tmp_path, dataset_cache):
    """Each optimizer step trains on the same rows and averages the loss over the same tokens as on one process:
    the losses and the final weights agree to fp tolerance (before, each process's mean loss was averaged)."""
    out = tmp_path / "run"
    finish(launch(engine, processes, "finetune.py", *tiny_args(out, dataset_cache, *STEPS, *geometry(processes))))
    assert_same_run(out, one_process, engine)
    last = checkpoints.complete_checkpoints(out)[-1]
    sharded = {path.name for path in last.iterdir() if path.is_dir()}
    assert sharded == ({"pytorch_model_fsdp_0", "optimizer_0"} if engine == "fsdp2" else set())
    assert checkpoints.read_trainer_state(last)["geometry"]["num_processes"] == processes


@pytest.mark.parametrize("resume_processes", [2, 4])
def test_fsdp2_sharded_checkpoints_resume_exactly_after_a_kill(resume_processes, one_process, tmp_path,
                                                               dataset_cache):
    """A 2-process FSDP2 run killed (SIGKILL, every process) after a sharded checkpoint, resumed from `latest` on
    2 or 4 processes (torch.distributed.checkpoint reshards), continues the one-process loss curve and ends with
    its weights."""
    out = tmp_path / "killed"
    process = launch("fsdp2", 2, "finetune.py", *tiny_args(out, dataset_cache, *STEPS, *geometry(2)))
    deadline = time.monotonic() + 240
    while not checkpoints.complete_checkpoints(out):
        assert process.poll() is None, "the run ended before it could be killed: " + process.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()
    resume_from = checkpoints.complete_checkpoints(out)[-1]
    assert checkpoints.read_trainer_state(resume_from)["global_step"] < 8
    finish(launch("fsdp2", resume_processes, "finetune.py", *tiny_args(
        out, dataset_cache, *STEPS, *geometry(resume_processes), "--resume_from_checkpoint", "latest")))
    assert_same_run(out, one_process)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_zero_trains_saves_and_resumes_exactly(stage, one_process, tmp_path, dataset_cache):
    """DeepSpeed ZeRO-2 / ZeRO-3 on 2 CPU processes, fine-tuning a checkpoint: close to the one-process run (DeepSpeed
    owns the gradients, so each micro-batch's loss is its own mean, not a share of the global batch's), the final
    model gathered into an ordinary checkpoint, and a run resumed from its checkpoint-2 equal to the uninterrupted
    one."""
    pytest.importorskip("deepspeed")
    run = ["--config_name", "", "--model_name_or_path", str(one_process), "--max_steps", "4", "--save_steps", "2"]
    one, out, resumed = tmp_path / "one", tmp_path / "run", tmp_path / "resumed"
    stages.finetune(finetune.parse_args(tiny_args(one, dataset_cache, *run, *geometry(1))))
    finish(launch(stage, 2, "finetune.py", *tiny_args(out, dataset_cache, *run, *geometry(2))))
    losses = [[r["loss"] for r in read_log(folder) if "loss" in r] for folder in (out, one)]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-3, atol=0)
    loaded = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for name, tensor in weights(one).items():  # Adam turns the slightly other gradients into ~1e-3 steps
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=TOLERANCES[stage][1], msg=named(name))
    assert_stranger_loads(out, one, stage)

    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    shutil.copy(out / "log.jsonl", resumed / "log.jsonl")
    finish(launch(stage, 2, "finetune.py", *tiny_args(resumed, dataset_cache, *run, *geometry(2),
                                                      "--resume_from_checkpoint", "latest")))
    assert read_log(resumed) == read_log(out)
    for name, tensor in weights(out).items():
        assert torch.equal(weights(resumed)[name], tensor), name


def test_multi_node_fsdp2_as_two_machines_on_this_one(one_process, tmp_path, dataset_cache):
    """The multi-node config, run as two "machines" of one process each (two launches, --machine_rank 0 and 1,
    sharing the output folder as the config asks), trains the one-process model and writes one checkpoint per
    save, holding the RNG state and the weight shard of either machine."""
    out, port = tmp_path / "run", free_port()
    machines = [launch("multi-node-fsdp2", 2, "finetune.py", *tiny_args(out, dataset_cache, *STEPS, *geometry(2)),
                       machine=(rank, port)) for rank in (0, 1)]
    finish(*machines)
    assert_same_run(out, one_process, "multi-node-fsdp2")
    # the recipe keeps the newest 2
    assert [p.name for p in checkpoints.complete_checkpoints(out)] == ["checkpoint-6", "checkpoint-8"]
    last = checkpoints.complete_checkpoints(out)[-1]
    assert {"rng_state_0.json", "rng_state_1.json"} <= {p.name for p in last.iterdir()}
    assert len(list((last / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2


def tiny_teacher_checkpoint(folder: Path) -> Path:
    """A softmax Llama over the byte-level vocabulary (259 ids), the KL teacher of the LoRA run."""
    torch.manual_seed(7)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=259)).save_pretrained(folder)
    return folder


def distill_args(folder: Path, out: Path, processes: int) -> list[str]:
    """Attention transfer of a converted tiny Llama (written into `folder` once) on word-level text."""
    if not (folder / "converted").exists():
        student = convert_to_linear_attention(teacher("llama"), feature_map="hedgehog", feature_dim=8, window_size=4,
                                              num_sink_tokens=1)
        save_with_tokenizer(student, folder / "converted")
        generator = torch.Generator().manual_seed(0)
        lines = [" ".join(f"w{j}" for j in torch.randint(0, 90, (60,), generator=generator).tolist())
                 for _ in range(20)]
        (folder / "train.txt").write_text("\n".join(lines[:16]) + "\n")
        (folder / "valid.txt").write_text("\n".join(lines[16:]) + "\n")
    return ["--model_name_or_path", str(folder / "converted"), "--output_dir", str(out), "--train_file",
            str(folder / "train.txt"), "--validation_file", str(folder / "valid.txt"), "--block_size", "48",
            "--max_eval_samples", "4", "--max_steps", "4", "--learning_rate", "3e-2", "--lr_scheduler_type",
            "constant", "--logging_steps", "1", "--report_to", "none", *geometry(processes)]


def lora_kl_args(folder: Path, out: Path, cache: Path, processes: int, base: Path) -> list[str]:
    """LoRA (unmerged: the adapter is saved) of the checkpoint `base` with a KL to a softmax teacher."""
    if not (folder / "teacher").exists():
        tiny_teacher_checkpoint(folder / "teacher")
    return tiny_args(out, cache, "--config_name", "", "--model_name_or_path", str(base), "--max_steps", "4",
                     "--learning_rate", "1e-2", "--use_lora", "--merge_lora", "false", "--teacher_name_or_path",
                     str(folder / "teacher"), "--kl_weight", "0.5", *geometry(processes))


ENGINES = ["fsdp2", "ddp", "zero2", "zero3"]


def needs_engine(engine: str) -> None:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")


@pytest.mark.parametrize("engine", ENGINES)
def test_attention_transfer_matches_one_process(engine, tmp_path):
    needs_engine(engine)
    one, sharded = tmp_path / "one", tmp_path / engine
    stages.distill(*parse_recipe_args((stages.DistillArguments, DataArguments, TrainArguments),
                                      distill_args(tmp_path, one, 1)))
    finish(launch(engine, 2, "distill.py", *distill_args(tmp_path, sharded, 2)))
    assert_same_run(sharded, one, engine)
    converted = weights(tmp_path / "converted")
    changed = {name for name, tensor in weights(sharded).items() if not torch.equal(tensor, converted[name])}
    assert changed and all("feature_map" in name or "window_gate" in name for name in changed), changed


@pytest.mark.parametrize("engine", ENGINES)
def test_lora_with_a_kl_teacher_ends_in_a_merged_checkpoint_that_pushes_and_generates(
        engine, one_process, tmp_path, dataset_cache, monkeypatch):
    """LoRA with a KL teacher on 2 processes saves the one-process run's adapter (only adapter files, no code);
    `hf-linear-attn-export` merges it into its base (the only LoRA route under FSDP2 and ZeRO-3) with the logits of
    the adapter on its base (1e-5), as an ordinary checkpoint that pushes to a Hub, from which a process without
    hf-linear-attn loads it and generates."""
    from peft import PeftModel

    from hf_linear_attn.training import export
    from hf_linear_attn.training.hub import push_to_hub

    needs_engine(engine)
    loss_rtol, weight_atol, logit_atol = TOLERANCES[engine]
    if engine.startswith("zero"):
        # At LoRA's learning rate (1e-2), an adapter weight whose gradient is near zero may step the other way under
        # DeepSpeed's per-micro-batch means; Adam bounds each step by about the learning rate (4 steps here).
        weight_atol = 4 * 1e-2
    one, sharded, merged = tmp_path / "one", tmp_path / engine, tmp_path / "merged"
    stages.finetune(finetune.parse_args(lora_kl_args(tmp_path, one, dataset_cache, 1, one_process)))
    finish(launch(engine, 2, "finetune.py", *lora_kl_args(tmp_path, sharded, dataset_cache, 2, one_process)))
    log, expected = read_log(sharded), read_log(one)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in log if "loss" in r]),
                               torch.tensor([r["loss"] for r in expected if "loss" in r]), rtol=loss_rtol, atol=1e-6)
    adapter, expected_adapter = (load_file(str(folder / "adapter_model.safetensors")) for folder in (sharded, one))
    assert adapter.keys() == expected_adapter.keys() and any("lora_B" in name for name in adapter)
    for name, tensor in adapter.items():
        torch.testing.assert_close(tensor, expected_adapter[name], rtol=0, atol=weight_atol, msg=named(name))
    assert not list(sharded.glob("*.py")) and not (sharded / "config.json").exists()

    assert export.main(["--model_name_or_path", str(sharded), "--output_dir", str(merged)]) == 0
    assert_ordinary_checkpoint(merged)
    with torch.no_grad():
        on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(one_process), sharded).eval()
        merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(IDS).logits
        torch.testing.assert_close(merged_logits, on_base(IDS).logits, rtol=0, atol=1e-5)
        one_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(one_process), one).eval()(IDS)
    torch.testing.assert_close(merged_logits, one_logits.logits, rtol=0, atol=logit_atol)

    with HubServer() as hub:
        hub.use_in_this_process(monkeypatch, tmp_path / "home")
        push_to_hub(merged, "someone/merged")
        downloaded = stranger_logits(tmp_path / "stranger", IDS, "someone/merged", **hub.env(tmp_path / "home"))
    torch.testing.assert_close(downloaded["someone/merged"], merged_logits, rtol=0, atol=0)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_sharding_engines_refuse_to_merge_lora_before_training(engine, tmp_path, dataset_cache):
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    process = launch(engine, 2, "finetune.py", *tiny_args(tmp_path / "out", dataset_cache, "--max_steps", "1",
                                                          "--use_lora"))
    _, stderr = process.communicate(timeout=300)
    assert process.returncode != 0 and "Merging LoRA needs the full weights on one process" in stderr
    assert not (tmp_path / "out" / "log.jsonl").exists()



# Engine configs that do not fit the run: refused before training -------------------------------------------------


def engine(distributed_type, **fsdp_options) -> SimpleNamespace:
    """The parts of an Accelerator that the engine checks read."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **fsdp_options) if fsdp_options else None
    return SimpleNamespace(distributed_type=distributed_type,
                           state=SimpleNamespace(distributed_type=distributed_type, fsdp_plugin=plugin))


def test_fsdp_that_does_not_wrap_each_decoder_layer_is_refused():
    from helpers import tiny_model

    model = tiny_model()
    other_layer = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}
    for options in ({"auto_wrap_policy": "no_wrap"}, {"auto_wrap_policy": "size_based_wrap"}, other_layer):
        with pytest.raises(ValueError, match="The FSDP config must wrap each decoder layer"):
            loop.check_engine(engine(DistributedType.FSDP, **options), model)
    for names in (["LinearAttentionDecoderLayer"], None):  # None: the model's _no_split_modules
        loop.check_engine(engine(DistributedType.FSDP, auto_wrap_policy="transformer_based_wrap",
                                 transformer_cls_names_to_wrap=names), model)


# What the engines need from the model ----------------------------------------------------------------------------

ONE_B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True)
PARTS = {  # between them, every module kind `_init_weights` sets up
    "hedgehog-window-decay": dict(feature_map="hedgehog", feature_dim=64, window_size=64, num_sink_tokens=4,
                                  decay="vector", softmax_layers=[0]),
    "t2r-delta-conv-gate": dict(feature_map="t2r", normalize=False, update_rule="delta", decay="scalar", conv_size=4,
                                output_norm=True, output_gate=True, window_size=64),
}


@pytest.mark.parametrize("parts", PARTS.values(), ids=PARTS.keys())
@pytest.mark.parametrize("empty", ["meta-device", "init_empty_weights"])
def test_a_1b_shaped_model_is_built_empty_in_seconds(parts, empty):
    """FSDP's and ZeRO-3's memory-efficient loading build the model without weights, then load them: a 1B-shaped
    model builds on the meta device in under 5 s, every parameter and buffer without storage; the decoder layer is
    the unit `_no_split_modules` names (the one FSDP wraps)."""
    from accelerate import init_empty_weights

    from hf_linear_attn import LinearAttentionConfig, LinearAttentionForCausalLM
    from hf_linear_attn.modeling_linear_attention import LinearAttentionDecoderLayer

    config = LinearAttentionConfig(**ONE_B, **parts)
    started = time.perf_counter()
    with torch.device("meta") if empty == "meta-device" else init_empty_weights():
        model = LinearAttentionForCausalLM(config)
    elapsed = time.perf_counter() - started
    assert elapsed < 5, f"{elapsed:.1f} s"
    assert sum(p.numel() for p in model.parameters()) > 1e9
    assert all(p.is_meta for p in model.parameters())
    if empty == "meta-device":
        assert all(b.is_meta for b in model.buffers())
    assert set(model._no_split_modules) == {LinearAttentionDecoderLayer.__name__}
    assert sum(isinstance(m, LinearAttentionDecoderLayer) for m in model.modules()) == config.num_hidden_layers


@pytest.mark.parametrize("parts", PARTS.values(), ids=PARTS.keys())
def test_parameters_and_buffers_are_all_made_in_init(parts):
    """A forward and backward create no parameter or buffer (FSDP shards what exists when it wraps); the only
    buffers are the rotary frequencies, not saved, the same on every process, and recomputed by `_init_weights`
    in a model built on the meta device and then given storage (what loading an empty model does)."""
    from hf_linear_attn import LinearAttentionConfig, LinearAttentionForCausalLM

    config = LinearAttentionConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   **{**parts, "feature_dim": 16 if "feature_dim" in parts else None,
                                      "window_size": 8, "softmax_layers": []})
    model = LinearAttentionForCausalLM(config)
    before = ({n: p.shape for n, p in model.named_parameters()}, {n: b.shape for n, b in model.named_buffers()})
    model(torch.randint(3, 96, (2, 24)), labels=torch.randint(3, 96, (2, 24))).loss.backward()
    assert ({n: p.shape for n, p in model.named_parameters()}, {n: b.shape for n, b in model.named_buffers()}) == before
    assert {name.rsplit(".", 1)[-1] for name in before[1]} <= {"inv_freq", "original_inv_freq"}
    assert not set(before[1]) & model.state_dict().keys()
    with torch.device("meta"):
        empty = LinearAttentionForCausalLM(config)
    empty.to_empty(device="cpu").apply(empty._init_weights)
    for (name, buffer), (_, expected) in zip(empty.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(buffer, expected), name
