"""The step's sample log: rows, content-addressed image files and the page beside the JSONL."""

import hashlib
import io
import json
import re

import torch
from PIL import Image

from primerl_orchestrator.episodes import Rollout
from primerl_orchestrator.samples import PromptImage, Sample
from primerl_orchestrator.step_samples import sample_images, sample_rows, write_samples


class Words:
    """A renderer stand-in: token i decodes to WORDS[i]."""

    WORDS = ["Describe", "<b>", "&", "it", "red", "blue"]

    def decode(self, token_ids):
        return " ".join(self.WORDS[i] for i in token_ids)


def png(color: str) -> PromptImage:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), color).save(out, format="PNG")
    data = out.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    return PromptImage(data, "image/png", digest, torch.zeros(1, 8), (1, 2, 2), 1)


RED, BLUE = png("red"), png("blue")


def rollout(name: str, images: list[PromptImage], advantage: float = 0.5) -> Rollout:
    sample = Sample(
        token_ids=[0, 1, 2, 3, 4],
        loss_mask=[False, False, False, True, True],
        policy_versions=[7, 7, 7, 7, 8],
        images=images,
    )
    return Rollout(f"episode-{name}", "captions", f"group-{name}", 1.0, advantage, [sample])


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_images_are_written_once_and_rows_name_their_files(tmp_path):
    rollouts = [rollout("a", [RED, BLUE]), rollout("b", [RED], advantage=-0.5)]
    path = write_samples(tmp_path, 3, sample_rows(3, rollouts, Words()), sample_images(rollouts))

    assert path == tmp_path / "step_000003.jsonl"
    first, second = read_rows(path)
    assert first["images"] == [
        {"path": f"images/{RED.digest}.png", "mime_type": "image/png", "digest": RED.digest},
        {"path": f"images/{BLUE.digest}.png", "mime_type": "image/png", "digest": BLUE.digest},
    ]
    assert second["images"] == first["images"][:1]
    assert (first["prompt"], first["completion"], first["policy_version"]) == ("Describe <b> &", "it red", 7)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(f"{i.digest}.png" for i in (RED, BLUE))
    assert (tmp_path / first["images"][0]["path"]).read_bytes() == RED.data
    assert (tmp_path / first["images"][1]["path"]).read_bytes() == BLUE.data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "step_000003.html", "step_000003.jsonl"]

    # A later step with the same image leaves its file as it was.
    red_file = tmp_path / first["images"][0]["path"]
    before = red_file.stat()
    later = [rollout("c", [RED])]
    write_samples(tmp_path, 4, sample_rows(4, later, Words()), sample_images(later))
    after = red_file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert read_rows(tmp_path / "step_000004.jsonl")[0]["images"] == first["images"][:1]


def test_the_step_page_shows_the_images_from_their_files_and_escapes_the_text(tmp_path):
    rollouts = [rollout("a", [RED, BLUE]), rollout("b", [RED])]
    write_samples(tmp_path, 3, sample_rows(3, rollouts, Words()), sample_images(rollouts))
    page = (tmp_path / "step_000003.html").read_text()

    sources = re.findall(r'<img src="([^"]+)"', page)
    assert sources == [f"images/{RED.digest}.png", f"images/{BLUE.digest}.png", f"images/{RED.digest}.png"]
    assert all((tmp_path / source).is_file() for source in sources)
    assert "Describe &lt;b&gt; &amp;" in page and "<b>" not in page
    assert "<title>step 3</title>" in page and "2 samples" in page


def test_a_text_step_has_rows_as_before_and_no_images(tmp_path):
    rows = sample_rows(5, [rollout("a", [])], Words())
    path = write_samples(tmp_path, 5, rows)

    assert read_rows(path) == [
        {
            "step": 5,
            "environment": "captions",
            "group_id": "group-a",
            "episode_id": "episode-a",
            "sample_index": 0,
            "prompt": "Describe <b> &",
            "completion": "it red",
            "reward": 1.0,
            "advantage": 0.5,
            "policy_version": 7,
            "num_tokens": 5,
            "num_loss_tokens": 2,
            "images": [],
        }
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005.html", "step_000005.jsonl"]
    assert "<img" not in (tmp_path / "step_000005.html").read_text()
