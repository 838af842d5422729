"""SFT from a JSONL file: chat conversations (loss on assistant turns only) and prompt/completion
pairs, packed into micro-batches, deterministic batches; the service trains on its own, the
loss goes down, and it stops early once a target loss is reached (sft.stop_at_loss)."""

from __future__ import annotations

import asyncio
import json
import pathlib

import grpc
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from primerl.trainer.v1 import trainer_pb2
from primerl_launcher.tiny_model import EOS_TOKEN_ID
from primerl_trainer.config import TrainerConfig
from primerl_trainer.sft_data import SFTDataset, load_sft_samples, pack_samples, tokenize_example

from .serving import push, serving, trainer_config, watch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def tokenizer(dense_dir: pathlib.Path):
    return AutoTokenizer.from_pretrained(dense_dir)


def _loss_text(tokenizer, example: dict) -> tuple[str, str]:
    sample = tokenize_example(example, tokenizer)
    return (
        tokenizer.decode(sample.input_ids[sample.loss_mask]),
        tokenizer.decode(sample.input_ids),
    )


def test_chat_samples_train_on_assistant_turns_only(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    loss_text, full_text = _loss_text(tokenizer, {"messages": messages})
    assert full_text == tokenizer.apply_chat_template(messages, tokenize=False)
    assert loss_text == "hello<|im_end|>\nciao<|im_end|>\n"


def test_prompt_completion_samples_train_on_the_completion_and_eos(tokenizer) -> None:
    sample = tokenize_example({"prompt": "2+2=", "completion": "4"}, tokenizer)
    assert sample.input_ids.tolist() == [*b"2+2=4", EOS_TOKEN_ID]
    assert sample.loss_mask.tolist() == [False] * 4 + [True, True]


def test_bad_lines_are_named(tokenizer, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "data.jsonl"
    for line, message in [
        ('{"prompt": "a"}', 'needs "messages", or "prompt" and "completion"'),
        ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant message"),
        ('{"messages": [{"role": "user"}]}', '"messages" must be a list'),
        ("[1]", "not a JSON object"),
    ]:
        path.write_text('{"prompt": "a", "completion": "b"}\n\n' + line + "\n")
        with pytest.raises(ValueError, match=f"data.jsonl:3: .*{message}"):
            load_sft_samples(path, tokenizer, seq_len=64)


def test_batches_are_packed_cut_and_deterministic(tokenizer, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "data.jsonl"
    records = [{"prompt": f"q{i}:", "completion": "x" * (i + 1)} for i in range(7)]
    records.append({"prompt": "long:", "completion": "y" * 100})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    samples = load_sft_samples(path, tokenizer, seq_len=16)
    assert len(samples) == 8 and samples[-1].input_ids.numel() == 16
    micro_batches = pack_samples(samples[:4], seq_len=16)
    assert [mb.num_tokens for mb in micro_batches] == [11, 15]  # 5 + 6, then 7 + 8 tokens
    assert micro_batches[0].position_ids.tolist() == [*range(5), *range(6)]

    dataset = SFTDataset(samples, seq_len=16, batch_size=3, epochs=2, max_steps=5, seed=1)
    assert (dataset.batches_per_epoch, dataset.num_steps) == (3, 5)
    assert [dataset.batch(i).num_samples for i in range(5)] == [3, 3, 2, 3, 3]
    again = SFTDataset(samples, seq_len=16, batch_size=3, epochs=2, seed=1)
    for index in range(5):
        for a, b in zip(dataset.batch(index).micro_batches, again.batch(index).micro_batches, strict=True):
            assert torch.equal(a.input_ids, b.input_ids)
    first_epoch = torch.cat([mb.input_ids for i in range(3) for mb in dataset.batch(i).micro_batches])
    assert first_epoch.numel() == sum(s.input_ids.numel() for s in samples)
    with pytest.raises(IndexError):
        dataset.batch(5)


def test_stop_at_loss_needs_a_dataset(dense_dir: pathlib.Path) -> None:
    with pytest.raises(ValidationError, match=r"sft\.stop_at_loss needs sft\.dataset"):
        trainer_config(dense_dir, sft={"stop_at_loss": 1.0})


async def until_checkpointed(stub, step: int) -> trainer_pb2.GetStatusResponse:
    async with asyncio.timeout(30):
        while (status := await stub.GetStatus(trainer_pb2.GetStatusRequest())).last_checkpoint_step != step:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return status


async def test_sft_service_trains_on_its_dataset_and_lowers_the_loss(dense_dir: pathlib.Path, tmp_path) -> None:
    path = tmp_path / "reverse.jsonl"
    words = ["primerl", "trainer", "gradient", "policy", "rollout", "expert", "router", "tensor"]
    lines = [
        {"messages": [{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]}
        for w in words[:4]
    ] + [{"prompt": f"reverse {w}: ", "completion": w[::-1]} for w in words[4:]]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def job(checkpoints: str, **sft: object) -> TrainerConfig:
        return trainer_config(
            dense_dir,
            mode="sft",
            sft={"dataset": str(path), "batch_size": 4, "epochs": 4, **sft},
            optimizer={"lr": 3e-3},
            schedule={"decay": "constant", "warmup_steps": 0},
            checkpoint={"dir": str(tmp_path / checkpoints), "save_on_stop": False},
        )

    config = job("checkpoints")
    async with serving(config) as stub:
        spec = await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
        assert spec.mode == trainer_pb2.TRAINING_MODE_SFT
        steps = await watch(stub, after_step=0, count=8)
        # The end of the dataset is checkpointed.
        status = await until_checkpointed(stub, 8)
        assert (status.step, status.training) == (8, False)
        # The trainer feeds itself: pushed batches are refused.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(stub, 9, [])
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Started again, it resumes at the end: nothing is left to train.
    async with serving(config) as stub:
        status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
        assert (status.step, status.training, status.last_checkpoint_step) == (8, False, 8)
    losses = [s.metrics["loss"] for s in steps]
    assert [s.step for s in steps] == list(range(1, 9))
    assert all(s.metrics["num_samples"] == 4 for s in steps)
    # Each epoch sees the 8 samples once, in two batches.
    first_epoch, last_epoch = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last_epoch < 0.7 * first_epoch, losses

    # The same job told to stop at a loss (the mean of 2 steps) that it reaches before its last
    # step: it stops at the first step whose window gets there, checkpointed, with no step after.
    means = {step: (losses[step - 2] + losses[step - 1]) / 2 for step in range(2, 9)}
    target = means[6] * (1 + 1e-9)
    stop = min(step for step, mean in means.items() if mean <= target)
    assert stop < 8, losses
    async with serving(job("stopped", stop_at_loss=target, stop_loss_window=2)) as stub:
        status = await until_checkpointed(stub, stop)
        assert (status.step, status.training) == (stop, False)
        await asyncio.sleep(0.5)
        assert (await stub.GetStatus(trainer_pb2.GetStatusRequest())).step == stop
