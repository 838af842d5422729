"""DCP checkpoints: a resumed run continues exactly as the uninterrupted one; the latest marker,
pruning, and saves that crashed half-way."""

import pathlib
import re

import pytest
import torch

from primerl_trainer.batch import BatchSpec, MicroBatch
from primerl_trainer.checkpoint import LATEST_FILE, Checkpointer
from primerl_trainer.models import CausalLMOutput
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

from .tiny_training import batch_spec, load_tiny_model, make_samples, pack_into, parameters, tiny_model_dir

CPU = torch.device("cpu")
# DCP says so when it saves or loads in a process that is not part of a process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory)


def _trainer(model: torch.nn.Module, spec: BatchSpec) -> Trainer:
    # Weight decay, a warmup and a decay: the optimizer's and the schedule's state both matter.
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.01))
    schedule = LRScheduleConfig(decay="cosine", warmup_steps=1, total_steps=4, min_lr_ratio=0.1)
    return Trainer(model, optimizer, build_lr_scheduler(optimizer, schedule), spec=spec, device=CPU)


def test_resumed_run_matches_the_uninterrupted_one(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = load_tiny_model(model_dir)
    batches = [pack_into(make_samples(model, seed=seed, num_samples=3), 2) for seed in range(4)]
    spec = batch_spec(model)

    uninterrupted = _trainer(model, spec)
    expected = [uninterrupted.train_step(batch) for batch in batches]

    first = _trainer(load_tiny_model(model_dir), spec)
    checkpointer = Checkpointer(tmp_path, interval=2)
    for batch in batches[:2]:
        first.train_step(batch)
        checkpointer.maybe_save(first)
    rng_at_save = torch.get_rng_state()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_FILE, "step_00000002"]
    del first

    # "Killed": fresh objects from the model folder, another RNG state, then the checkpoint.
    torch.manual_seed(1234)
    resumed = _trainer(load_tiny_model(model_dir), spec)
    assert Checkpointer(tmp_path, interval=2).load_latest(resumed) == 2
    assert resumed.step == 2
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    for batch, wanted in zip(batches[2:], expected[2:], strict=True):
        got = resumed.train_step(batch)
        for key in ("loss", "grad_norm", "lr", "mismatch_kl", "entropy"):
            assert got[key] == pytest.approx(wanted[key], rel=1e-6, abs=1e-9), key
    final = parameters(uninterrupted.model)
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p.detach(), final[name], rtol=0, atol=1e-6)


class _BigramLM(torch.nn.Module):
    """A two-layer stand-in with the train step's model interface, for the bookkeeping tests."""

    def __init__(self, vocab_size: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 4)
        self.head = torch.nn.Linear(4, vocab_size)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, routed_experts: torch.Tensor | None = None
    ) -> CausalLMOutput:
        return CausalLMOutput(logits=self.head(self.embed(input_ids)))


_SPEC = BatchSpec(seq_len=8, vocab_size=16)
_BATCH = [
    MicroBatch(
        input_ids=torch.tensor([1, 2, 3, 4]),
        position_ids=torch.tensor([0, 1, 2, 3]),
        loss_mask=torch.tensor([False, True, True, True]),
        temperatures=torch.ones(4),
        advantages=torch.tensor([0.0, 1.0, 1.0, 1.0]),
        inference_logprobs=torch.tensor([0.0, -2.0, -3.0, -2.5]),
    )
]


def _bigram_trainer() -> Trainer:
    torch.manual_seed(0)
    return _trainer(_BigramLM(), _SPEC)


def test_keeps_the_newest_checkpoints_and_marks_the_latest(tmp_path: pathlib.Path) -> None:
    trainer = _bigram_trainer()
    checkpointer = Checkpointer(tmp_path, interval=1, keep_last=2)
    for _ in range(3):
        trainer.train_step(_BATCH)
        assert checkpointer.maybe_save(trainer) == tmp_path / f"step_{trainer.step:08d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_FILE, "step_00000002", "step_00000003"]
    assert (tmp_path / LATEST_FILE).read_text() == "step_00000003\n"
    assert checkpointer.latest_path() == tmp_path / "step_00000003"
    # Saving the latest step again is a no-op.
    assert checkpointer.save(trainer) == tmp_path / "step_00000003"


def test_only_every_interval_th_step_is_saved(tmp_path: pathlib.Path) -> None:
    trainer = _bigram_trainer()
    saved = []
    for _ in range(4):
        trainer.train_step(_BATCH)
        saved.append(Checkpointer(tmp_path, interval=3).maybe_save(trainer))
    assert saved == [None, None, tmp_path / "step_00000003", None]
    trainer.train_step(_BATCH)
    assert Checkpointer(tmp_path).maybe_save(trainer) is None  # interval 0: only on request


def test_a_save_that_crashed_half_way_leaves_the_previous_checkpoint_latest(tmp_path: pathlib.Path) -> None:
    trainer = _bigram_trainer()
    checkpointer = Checkpointer(tmp_path, interval=1)
    trainer.train_step(_BATCH)
    checkpointer.save(trainer)
    weights_at_1 = parameters(trainer.model)
    # What a crash during the save of step 2 leaves: a folder without DCP metadata.
    partial = tmp_path / "step_00000002"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"torn")

    resumed = _bigram_trainer()
    assert checkpointer.load_latest(resumed) == 1
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, weights_at_1[name]), name
    resumed.train_step(_BATCH)
    assert checkpointer.save(resumed) == partial
    assert (partial / ".metadata").is_file() and (partial / "__0_0.distcp").read_bytes() != b"torn"
    assert checkpointer.load_latest(_bigram_trainer()) == 2


def test_no_checkpoint_yet(tmp_path: pathlib.Path) -> None:
    trainer = _bigram_trainer()
    before = parameters(trainer.model)
    assert Checkpointer(tmp_path / "missing").load_latest(trainer) is None
    assert trainer.step == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name])


def test_errors(tmp_path: pathlib.Path) -> None:
    trainer = _bigram_trainer()
    with pytest.raises(ValueError, match="before the optimizer's first update"):
        Checkpointer(tmp_path).save(trainer)
    (tmp_path / LATEST_FILE).write_text("step_00000007\n")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        Checkpointer(tmp_path).load_latest(trainer)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="interval"):
        Checkpointer(tmp_path, interval=-1)


def _cut_shard(step: pathlib.Path) -> None:
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _lose_shard(step: pathlib.Path) -> None:
    next(step.glob("*.distcp")).unlink()


def _lose_metadata(step: pathlib.Path) -> None:
    (step / ".metadata").unlink()


def _cut_metadata(step: pathlib.Path) -> None:
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:10])


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_cut_shard, r"step_00000002 has __0_0\.distcp cut short \(\d+ of \d+ bytes\)"),
        (_lose_shard, r"step_00000002 lacks __0_0\.distcp"),
        (_lose_metadata, r"step_00000002 has no \.metadata \(its save did not finish\)"),
        (_cut_metadata, r"step_00000002 has a \.metadata that does not load"),
    ],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_complete_one(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, damage, why: str
) -> None:
    trainer = _bigram_trainer()
    checkpointer = Checkpointer(tmp_path, interval=1)
    trainer.train_step(_BATCH)
    checkpointer.save(trainer)
    weights_at_1 = parameters(trainer.model)
    trainer.train_step(_BATCH)
    checkpointer.save(trainer)
    damage(tmp_path / "step_00000002")
    assert (tmp_path / LATEST_FILE).read_text() == "step_00000002\n"  # still names the damaged one

    resumed = _bigram_trainer()
    with caplog.at_level("WARNING", logger="primerl_trainer.checkpoint"):
        assert checkpointer.load_latest(resumed) == 1
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, weights_at_1[name]), name
    [warning] = [r.getMessage() for r in caplog.records if "newest complete checkpoint" in r.getMessage()]
    assert warning.startswith("resuming from step_00000001, the newest complete checkpoint: ")
    assert re.search(why, warning), warning
    # The next save of step 2 replaces the damaged folder and becomes the latest again.
    resumed.train_step(_BATCH)
    assert checkpointer.save(resumed) == tmp_path / "step_00000002"
    assert checkpointer.load_latest(_bigram_trainer()) == 2


def test_a_lost_or_garbled_latest_marker_falls_back_to_the_newest_complete_checkpoint(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _bigram_trainer()
    checkpointer = Checkpointer(tmp_path, interval=1)
    for _ in range(2):
        trainer.train_step(_BATCH)
        checkpointer.save(trainer)
    (tmp_path / LATEST_FILE).write_bytes(b"\xff\x00garbage")
    with caplog.at_level("WARNING", logger="primerl_trainer.checkpoint"):
        assert checkpointer.load_latest(_bigram_trainer()) == 2
    assert f'{tmp_path / LATEST_FILE} names "<unreadable: ' in caplog.text, caplog.text
    assert "not a step folder" in caplog.text
    (tmp_path / LATEST_FILE).unlink()
    _lose_shard(tmp_path / "step_00000002")
    caplog.clear()
    with caplog.at_level("WARNING", logger="primerl_trainer.checkpoint"):
        assert checkpointer.load_latest(_bigram_trainer()) == 1
    assert f"{tmp_path / LATEST_FILE} is missing; step_00000002 lacks __0_0.distcp" in caplog.text, caplog.text


def test_no_complete_checkpoint_left_is_an_error_when_latest_names_one(tmp_path: pathlib.Path) -> None:
    trainer = _bigram_trainer()
    checkpointer = Checkpointer(tmp_path, interval=1)
    trainer.train_step(_BATCH)
    checkpointer.save(trainer)
    _cut_shard(tmp_path / "step_00000001")
    with pytest.raises(ValueError, match=r"names 'step_00000001', which is not a complete checkpoint, .*cut short"):
        checkpointer.load_latest(_bigram_trainer())
    # Without the marker no save ever finished (the first one crashed): a fresh start.
    (tmp_path / LATEST_FILE).unlink()
    assert checkpointer.load_latest(_bigram_trainer()) is None
