"""The report's samples section: for each eval set and prompt, its samples across the
run's evaluations side by side (a row per evaluation, a column per sample), captioned.
Images are embedded as small PNG thumbnails linking to the full files; videos play in
the page from an embedded (or, when large, linked) WebM, with the MP4 offered beside it.
Runs older than the sample manifest show their captioned grids instead."""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

from miles_core.report.run_files import Run

THUMBNAIL = 256
"""Long side, in pixels, of an embedded image (the link opens the full file)."""
GRID_SIDE = 1024
"""Long side, in pixels, of an embedded grid (runs without a sample manifest)."""
VIDEO_EMBED_BYTES = 4 * 2**20
"""Videos (WebM, or the GIF without the video extra) up to this size are embedded; bigger ones are linked."""
EMBED_BUDGET = 32 * 2**20
"""Characters of data URIs one page embeds at most; media beyond it are linked by relative path."""
THUMBS = Path("samples") / "eval" / ".thumbs"
"""Where a run keeps the report's thumbnails (the report is rewritten at every evaluation)."""


def relative_url(target: Path, out_dir: Path) -> str:
    """``target`` as a URL relative to the report's directory (POSIX, percent-encoded)."""
    relative = os.path.relpath(os.path.abspath(target), os.path.abspath(out_dir))
    return quote(Path(relative).as_posix())


def encode_thumbnail(path: Path, side: int) -> bytes | None:
    """``path`` shrunk to at most ``side`` pixels on its long side, as PNG bytes; None when
    the file cannot be read as an image."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            picture = image.convert("RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB")
    except (OSError, ValueError):
        return None
    picture.thumbnail((side, side))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", optimize=False)  # optimize=True costs several times the encode for ~10% bytes
    return buffer.getvalue()


def thumbnail(run_dir: Path, path: Path, side: int) -> bytes | None:
    """:func:`encode_thumbnail`, cached in ``run_dir/samples/eval/.thumbs`` under the file's
    path, modification time, size and ``side`` (a changed file gets a new thumbnail). A cache
    that cannot be written (a read-only copy of a run) only costs the encode."""
    try:
        stat = path.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_mtime_ns}|{stat.st_size}|{side}".encode()).hexdigest()[:32]
    cached = run_dir / THUMBS / f"{key}.png"
    try:
        return cached.read_bytes()
    except OSError:
        pass
    data = encode_thumbnail(path, side)
    if data is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            temp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
            temp.write_bytes(data)
            os.replace(temp, cached)  # never a half thumbnail for the next report
        except OSError:
            pass
    return data


class Embedder:
    """The page's media: embedded as data URIs while the page's budget lasts, then linked by
    a path relative to the report (counted, so the page can say so)."""

    def __init__(self, out_dir: Path, budget: int | None = None) -> None:
        self.out_dir = out_dir
        self.budget = EMBED_BUDGET if budget is None else budget
        self.left = self.budget
        self.linked = 0

    def data_uri(self, data: bytes, mime: str) -> str | None:
        """``data`` as a data URI, or None (counted as linked) when the budget has no room for it."""
        size = len(mime) + 13 + 4 * ((len(data) + 2) // 3)  # "data:" + mime + ";base64," + the base64
        if size > self.left:
            self.linked += 1
            return None
        self.left -= size
        return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")

    def image(self, run_dir: Path, path: Path, side: int) -> str | None:
        """The src of ``path``'s thumbnail: embedded, else the full file's relative URL; None
        when the file cannot be read as an image."""
        data = thumbnail(run_dir, path, side)
        if data is None:
            return None
        return self.data_uri(data, "image/png") or relative_url(path, self.out_dir)

    def file(self, path: Path, mime: str, limit: int = VIDEO_EMBED_BYTES) -> str:
        """The src of ``path`` (a video): embedded when at most ``limit`` bytes and in budget, else linked."""
        if path.stat().st_size <= limit and (uri := self.data_uri(path.read_bytes(), mime)):
            return uri
        if path.stat().st_size > limit:
            self.linked += 1
        return relative_url(path, self.out_dir)

    def note(self) -> str:
        if not self.linked:
            return ""
        return (
            f'<p class="note">{self.linked} media file{"s are" if self.linked != 1 else " is"} linked by relative path, '
            f"not embedded (the page embeds at most {self.budget / 2**20:g} MiB, videos up to {VIDEO_EMBED_BYTES // 2**20} MiB "
            "each): keep this report next to its run directory to see them.</p>"
        )


def evaluation_label(entry: dict[str, Any]) -> str:
    trained = entry.get("trained_rollouts")
    if str(entry.get("tag", "")).endswith("_before"):
        return f"before training (resumed at {trained} rollouts)" if trained else "before training"
    return f"after {trained} rollout{'s' if trained != 1 else ''}"


def format_reward(value: Any) -> str:
    return "failed" if value is None else f"{float(value):.4f}"


def existing(run: Run, value: Any) -> Path | None:
    """The file a manifest path names, when it is there."""
    if isinstance(value, str) and (run.path / value).is_file():
        return run.path / value
    return None


def sample_cell(run: Run, entry: dict[str, Any], media: Embedder) -> str:
    prompt = str(entry.get("prompt", ""))
    caption = f"seed {entry.get('seed')} · reward {format_reward(entry.get('reward'))}"
    components = entry.get("reward_components") or {}
    if isinstance(components, dict) and components:
        caption += " (" + ", ".join(f"{k} {float(v):.3f}" for k, v in sorted(components.items()) if isinstance(v, (int, float))) + ")"
    hover = escape(f"{prompt} | {evaluation_label(entry)} | {caption}")
    out_dir = media.out_dir
    html = '<span class="missing">no file</span>'
    image = existing(run, entry.get("image"))
    video = entry.get("video") if isinstance(entry.get("video"), dict) else {}
    webm, mp4, gif = (existing(run, video.get(kind)) for kind in ("webm", "mp4", "gif"))
    poster = media.image(run.path, image, THUMBNAIL) if image and not (gif and not webm) else None  # a GIF needs none
    if webm:
        poster_attr = f' poster="{poster}"' if poster else ""
        html = (
            f'<video controls muted loop playsinline preload="auto" width="{THUMBNAIL}"{poster_attr} title="{hover}">'
            f'<source src="{media.file(webm, "video/webm")}" type="video/webm"></video>'
        )
        links = [f'<a href="{relative_url(webm, out_dir)}">WebM</a>']
        links += [f'<a href="{relative_url(p, out_dir)}" download>{kind}</a>' for kind, p in (("MP4", mp4), ("GIF", gif)) if p]
        html += f'<div class="links">{" · ".join(links)}</div>'
    elif gif:  # no video extra: the GIF animates in an <img>
        html = f'<a href="{relative_url(gif, out_dir)}"><img class="gif" src="{media.file(gif, "image/gif")}" alt="{hover}" title="{hover}"></a>'
        links = [f'<a href="{relative_url(gif, out_dir)}" download>GIF</a>']
        links += [f'<a href="{relative_url(mp4, out_dir)}" download>MP4</a>'] if mp4 else []
        html += f'<div class="links">{" · ".join(links)}</div>'
    elif poster and image:
        html = f'<a href="{relative_url(image, out_dir)}"><img src="{poster}" alt="{hover}" title="{hover}"></a>'
    return f'<td>{html}<div class="cap">{escape(caption)}</div></td>'


def manifest_html(run: Run, media: Embedder) -> str:
    sets: dict[str, dict[int, dict[int, list[dict[str, Any]]]]] = {}
    for entry in run.manifest:
        try:
            by_prompt = sets.setdefault(str(entry["eval_set"]), {}).setdefault(int(entry["prompt_index"]), {})
            by_prompt.setdefault(int(entry["evaluation"]), []).append(entry)
        except (KeyError, TypeError, ValueError):
            continue  # a line of another shape: nothing to place it by
    parts = []
    for eval_set, prompts in sorted(sets.items()):
        parts.append(f"<h3>Eval set {escape(eval_set)}</h3>")
        for prompt_index, evaluations in sorted(prompts.items()):
            first = next(iter(evaluations.values()))[0]
            parts.append(
                f'<div class="prompt"><h4>Prompt {prompt_index}: <q>{escape(str(first.get("prompt", "")))}</q></h4><table class="samples">'
            )
            for _, entries in sorted(evaluations.items()):
                entries.sort(key=lambda e: int(e.get("sample_index", 0)))
                cells = "".join(sample_cell(run, e, media) for e in entries)
                parts.append(f'<tr><th scope="row">{escape(evaluation_label(entries[0]))}</th>{cells}</tr>')
            parts.append("</table></div>")
    return "".join(parts)


def grids_html(run: Run, media: Embedder) -> str:
    parts = []
    for grid in run.grids:
        src = media.image(run.path, grid, GRID_SIDE)
        if src is None:
            continue
        parts.append(
            f'<figure class="grid"><a href="{relative_url(grid, media.out_dir)}"><img src="{src}" alt="{escape(grid.name)}"></a>'
            f"<figcaption>{escape(grid.name)}</figcaption></figure>"
        )
    return f'<div class="charts">{"".join(parts)}</div>' if parts else ""


def samples_section(runs: Sequence[Run], out_dir: Path) -> str:
    """The samples section's HTML, or "" when no run saved evaluation samples."""
    parts = []
    media = Embedder(out_dir)
    for run in runs:
        body = manifest_html(run, media) if run.manifest else grids_html(run, media)
        if not body:
            continue
        if len(runs) > 1:
            parts.append(f"<h3>Run {escape(run.name)}</h3>")
        if not run.manifest:
            parts.append('<p class="note">This run has no sample manifest: its evaluation grids are shown.</p>')
        parts.append(body)
    return media.note() + "".join(parts) if parts else ""
