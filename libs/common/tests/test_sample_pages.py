"""samples_page: a step's rows as the HTML page the orchestrator and `primerl samples --html` write."""

import re

from primerl_common.sample_pages import samples_page


def row(**fields):
    return {
        "step": 3,
        "environment": "captions <v2>",
        "group_id": "0123456789abcdef",
        "prompt": "What is <this>?",
        "completion": "A cat & a dog",
        "reward": 1.0,
        "advantage": 0.5,
        "policy_version": 2,
        "images": [],
        **fields,
    }


IMAGES = [
    {"path": "images/aa11.png", "mime_type": "image/png", "digest": "aa11"},
    {"path": "images/bb22.jpeg", "mime_type": "image/jpeg", "digest": "bb22"},
]


def test_a_page_shows_each_rows_numbers_and_escaped_text():
    page = samples_page([row(), row(advantage=-0.25, reward=0.0)], title="run <1>: step 3")

    assert "<title>run &lt;1&gt;: step 3</title>" in page and "2 samples" in page
    assert page.count('<tr class="pos">') == 1 and page.count('<tr class="neg">') == 1
    assert "What is &lt;this&gt;?" in page and "A cat &amp; a dog" in page and "captions &lt;v2&gt;" in page
    assert "<this>" not in page and "<v2>" not in page
    assert '<td class="num">+0.500</td>' in page and '<td class="num">-0.250</td>' in page
    assert "<img" not in page


def test_images_are_shown_inline_from_their_paths_in_order():
    page = samples_page([row(images=IMAGES), row(images=IMAGES[:1])], title="step 3")

    assert re.findall(r'<img src="([^"]+)"', page) == ["images/aa11.png", "images/bb22.jpeg", "images/aa11.png"]
    # Shown in the prompt's cell, before its text.
    assert re.search(r'<td class="text"><div><img src="images/aa11.png"[^>]*><img [^>]*></div>What is', page)


def test_image_links_are_joined_to_the_samples_folders_address_and_quoted():
    page = samples_page([row(images=IMAGES[:1])], title="step 3", samples_href="../my samples")

    assert re.findall(r'<img src="([^"]+)"', page) == ["../my%20samples/images/aa11.png"]


def test_rows_from_before_images_have_none():
    old = row()
    del old["images"]
    assert "<img" not in samples_page([old], title="step 3")
