"""`plan --emit`: the chosen configuration as DeepSpeed JSON that DeepSpeed itself accepts, and as FSDP2 code that runs.

DeepSpeed's `DeepSpeedConfig` (deepspeed/runtime/config.py) checks the batch arithmetic against the data-parallel
world size and builds `DeepSpeedZeroConfig` and the bf16/fp16 sections as pydantic models that forbid unknown
keys. It reads the world size from `deepspeed.comm`, which needs a process group (and, on a CPU, compiles a
shared-memory kernel first, minutes). `deepspeed_accepts` therefore hands it the world size through its own `mpu`
argument and stands in for `deepspeed.comm.get_rank` only, as rank 0; the checks are all DeepSpeed's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_core.cli import main as cli_main
from zero_core.configurations import parse_configurations
from zero_core.planner.batch import plan_batch
from zero_core.planner.emit_deepspeed import deepspeed_config
from zero_core.planner.emit_fsdp2 import fsdp2_code

ROOT = Path(__file__).resolve().parents[1]
PSI = 13_000_000_000


class DataParallelWorld:
    """DeepSpeed's `mpu` argument, reduced to what `DeepSpeedConfig` asks of it: the data-parallel world size."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


@pytest.fixture
def deepspeed_accepts(monkeypatch):
    """`check(config_dict, world_size)` → DeepSpeed's parsed `DeepSpeedConfig`, or DeepSpeed's exception."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    return lambda config, world_size: DeepSpeedConfig(config, mpu=DataParallelWorld(world_size))


def emitted(name: str, world_size: int = 64, gpus_per_node: int = 8, precision: str = "bf16", micro: int = 2):
    (config,) = parse_configurations(name)
    batch = plan_batch(tokens_per_gpu=4 * 4096, sequence=4096, world_size=world_size, micro_batch=micro)
    return deepspeed_config(config, batch, precision, gpus_per_node, PSI)[0]


@pytest.mark.parametrize(
    ("name", "zero_keys"),
    [
        ("zero2", {"stage": 2, "reduce_scatter": True, "overlap_comm": True}),
        ("zero3+offload", {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
        ("zeropp", {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                    "zero_quantized_gradients": True}),
    ],
)
def test_deepspeed_accepts_the_emitted_json_and_reads_back_every_key(deepspeed_accepts, name, zero_keys) -> None:
    config = json.loads(json.dumps(emitted(name)))
    parsed = deepspeed_accepts(config, 64)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        2 * 2 * 64, 2, 2
    )
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    zero = parsed.zero_config.model_dump(by_alias=True)
    for key, value in zero_keys.items():
        read = zero[key] if not isinstance(value, dict) else {k: zero[key][k] for k in value}
        assert read == value, f"DeepSpeed read zero_optimization.{key} as {read!r}, the JSON says {value!r}"
    assert zero["stage3_prefetch_bucket_size" if "zero3" in name or name == "zeropp" else "reduce_bucket_size"]


def test_a_misspelled_zero_key_fails_deepspeeds_validation(deepspeed_accepts) -> None:
    from pydantic import ValidationError

    config = emitted("zero3")
    config["zero_optimization"]["stage3_prefetch_bucket_sise"] = config["zero_optimization"].pop(
        "stage3_prefetch_bucket_size"
    )
    with pytest.raises(ValidationError, match="stage3_prefetch_bucket_sise"):
        deepspeed_accepts(config, 64)


def test_a_misspelled_top_level_key_is_caught_by_reading_it_back(deepspeed_accepts) -> None:
    """DeepSpeed ignores unknown top-level keys: `zero_optimisation` would silently train ZeRO-0. The read-back of
    the stage, as the test above does it, is what catches that."""
    config = emitted("zero3")
    config["zero_optimisation"] = config.pop("zero_optimization")
    assert deepspeed_accepts(config, 64).zero_optimization_stage == 0


def test_deepspeed_refuses_a_batch_that_does_not_multiply_out(deepspeed_accepts) -> None:
    config = emitted("zero2")
    config["train_batch_size"] += 1
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_accepts(config, 64)


def test_the_batch_arithmetic_is_refused_before_deepspeed_sees_it() -> None:
    with pytest.raises(ValueError, match="8,192 tokens per GPU per step, but the plan timed 4,096"):
        plan_batch(tokens_per_gpu=4096, sequence=4096, world_size=8, micro_batch=1, accumulation=2)
    with pytest.raises(ValueError, match="global batch of 100 sequences is not micro-batch 1 x accumulation 1"):
        plan_batch(tokens_per_gpu=4096, sequence=4096, world_size=8, global_batch=100)
    with pytest.raises(ValueError, match="no whole number of micro-batches"):
        plan_batch(tokens_per_gpu=4096, sequence=3000, world_size=8)
    batch = plan_batch(tokens_per_gpu=8 * 4096, sequence=4096, world_size=32, micro_batch=2, global_batch=256)
    assert (batch.gradient_accumulation_steps, batch.train_batch_size, batch.tokens_per_gpu) == (4, 256, 8 * 4096)


def test_fp16_gets_dynamic_loss_scaling_and_fp32_neither_half_precision(deepspeed_accepts) -> None:
    fp16 = deepspeed_accepts(emitted("zero1", precision="fp16"), 64)
    assert fp16.float16_config.enabled and fp16.float16_config.loss_scale == 0
    fp32 = deepspeed_accepts(emitted("zero1", precision="fp32"), 64)
    assert not fp32.float16_config.enabled and not fp32.bfloat16_config.enabled


def test_hsdp_is_refused_for_deepspeed_which_removed_mics() -> None:
    with pytest.raises(ValueError, match="DeepSpeed has no HSDP"):
        emitted("hsdp:16")


def test_plan_emit_deepspeed_writes_only_json_on_stdout_and_the_plan_on_stderr(capsys) -> None:
    args = ["plan", "--model", "llama-2-13b", "--gpu-memory", "40GiB", "--nodes", "4", "--machine", "dgx-a100"]
    assert cli_main(args + ["--emit", "deepspeed"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["zero_optimization"]["stage"] == 3
    assert "Answer: ZeRO++" in err and "- zero_optimization.stage = 3: parameters split too" in err


def test_of_configurations_tied_first_emit_writes_the_one_that_changes_the_least(capsys) -> None:
    """ZeRO++ ranks first, tied within the time model's error with plain ZeRO-3 and others: the config written
    quantises nothing; asked for ZeRO++ alone, it writes ZeRO++'s keys."""
    args = ["plan", "--model", "llama-2-13b", "--gpu-memory", "40GiB", "--nodes", "4", "--machine", "dgx-a100"]
    assert cli_main(args + ["--emit", "deepspeed"]) == 0
    out, err = capsys.readouterr()
    written = json.loads(out)["zero_optimization"]
    assert not {"zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"} & set(written)
    assert "--emit deepspeed writes ZeRO-3: of the configurations ranked first, tied" in " ".join(err.split())
    assert cli_main(args + ["--configs", "zeropp", "--emit", "deepspeed"]) == 0
    written = json.loads(capsys.readouterr()[0])["zero_optimization"]
    assert written["zero_hpz_partition_size"] == 8 and written["zero_quantized_weights"] is True


def test_plan_emit_refuses_a_batch_the_plan_did_not_time(capsys) -> None:
    args = ["plan", "--params", "13B", "--gpu-memory", "40GiB", "--nodes", "4", "--machine", "dgx-a100"]
    assert cli_main(args + ["--emit", "deepspeed", "--grad-accum", "2"]) == 2
    assert "but the plan timed 4,096" in capsys.readouterr().err


RANK = """
import json, os, sys, warnings
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from zero_core.model import build_model, loss_fn, micro_batch, preset
rank, world_size, rendezvous, *plans = sys.argv[1:]
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module")
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=int(rank), world_size=int(world_size),
                        timeout=timedelta(seconds=60))
reports = []
for path in plans:
    namespace = {}
    exec(compile(open(path).read(), path, "exec"), namespace)
    model = build_model(preset("tiny"))
    namespace["shard_model"](model, list(model.blocks), "cpu")
    before = [p.to_local().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters())
    loss = loss_fn(model(micro_batch(preset("tiny"), int(rank), 0)[0]), micro_batch(preset("tiny"), int(rank), 0)[1])
    loss.backward()
    optimizer.step()
    reports.append({
        "loss": loss.item(),
        "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}),
        "changed": all(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())),
    })
print(json.dumps(reports), flush=True)
os._exit(0)
"""


def test_the_emitted_fsdp2_code_trains_the_tiny_gpt_on_two_gloo_processes(tmp_path: Path) -> None:
    """ZeRO-3 on a flat mesh and HSDP on a (2, 1) mesh, one step each, in the same two processes."""
    plans = []
    for name in ("zero3", "hsdp:1"):
        (config,) = parse_configurations(name)
        batch = plan_batch(tokens_per_gpu=16, sequence=16, world_size=2)
        path = tmp_path / f"{name.replace(':', '_')}.py"
        path.write_text(fsdp2_code(config, batch, "bf16", gpus_per_node=1, label=config.label))
        plans.append(str(path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), "2", str(tmp_path / "rendezvous"), *plans],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in range(2)
    ]
    try:
        outputs = [r.communicate(timeout=120) for r in ranks]
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()
    seconds = time.perf_counter() - start
    for rank, (process, (_, errors)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} of the emitted FSDP2 code failed:\n{errors[-3000:]}"
    zero3, hsdp = zip(*(json.loads(out) for out, _ in outputs), strict=True)
    assert [r["placements"] for r in zero3[0:1] + hsdp[0:1]] == [["(Shard(dim=0),)"], ["(Replicate(), Shard(dim=0))"]]
    assert all(r["changed"] and 0 < r["loss"] < 10 for r in zero3 + hsdp)
    print(f"two gloo ranks ran the emitted ZeRO-3 and HSDP code in {seconds:.1f} s")
