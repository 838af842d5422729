"""A step's samples as an HTML page, from the rows of output.samples_dir/step_<n>.jsonl: what
the orchestrator writes beside each step's JSONL, and `primerl samples --html` where asked.

A row's images (its "images": {"path", "mime_type", "digest"}, the path relative to the samples
folder) are shown inline from their files, linked relatively: the folder can be copied
elsewhere whole. Rows written before images had no "images".
"""

from __future__ import annotations

import html
import posixpath
import urllib.parse
from collections.abc import Sequence
from typing import Any

__all__ = ["samples_page"]

_STYLE = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: monospace; }
td.num { text-align: right; }
img { max-width: 320px; max-height: 320px; margin: 0 4px 4px 0; border: 1px solid #ccc; }
.pos { background: #e6f4e6; } .neg { background: #f8e6e6; }
"""

_COLUMNS = ("environment", "group", "reward", "advantage", "policy version", "prompt", "completion")


def samples_page(rows: Sequence[dict[str, Any]], *, title: str, samples_href: str = "") -> str:
    """The page of `rows`. `samples_href`: the samples folder's address as seen from the page
    ("" when the page lies in it), which the images' paths are joined to."""
    body = []
    for row in rows:
        sign = "pos" if row["advantage"] > 0 else "neg" if row["advantage"] < 0 else ""
        images = "".join(_image_tag(image, samples_href) for image in row.get("images", ()))
        body.append(
            f'<tr class="{sign}"><td>{html.escape(row["environment"])}</td>'
            f"<td>{html.escape(row['group_id'][:8])}</td>"
            f'<td class="num">{row["reward"]:.3f}</td><td class="num">{row["advantage"]:+.3f}</td>'
            f'<td class="num">{row["policy_version"]}</td>'
            f'<td class="text">{f"<div>{images}</div>" if images else ""}{html.escape(row["prompt"])}</td>'
            f'<td class="text">{html.escape(row["completion"])}</td></tr>'
        )
    head = "".join(f"<th>{name}</th>" for name in _COLUMNS)
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{len(rows)} samples</p><table><thead><tr>{head}</tr></thead><tbody>\n"
        + "\n".join(body)
        + "\n</tbody></table></body></html>\n"
    )


def _image_tag(image: dict[str, Any], samples_href: str) -> str:
    src = urllib.parse.quote(posixpath.join(samples_href, image["path"]))
    alt = f"{image['mime_type']} {image['digest'][:12]}"
    return f'<img src="{html.escape(src)}" alt="{html.escape(alt)}">'
