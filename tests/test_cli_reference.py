from pathlib import Path

from miles_core.cli_reference import render
from miles_core.config.reference_flags import FLAGS
from miles_core.plugin_manager import PluginHost

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_is_current():
    host = PluginHost(strict=True)
    # docs/cli.md documents this repository's plugins too, so all of them must be loaded.
    assert {r.name for r in host.records if r.status == "ok"} >= {"core", "sd3", "wan22", "ltx", "qwen_image", "cosmos3", "flux", "rewards"}
    assert DOC.read_text(encoding="utf-8") == render(host), (
        "docs/cli.md is stale: run python -m miles_core.cli_reference --write docs/cli.md"
    )


def test_every_flag_and_difference_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for flag in FLAGS:
        assert f"`{flag.name}`" in text, flag.name
    differing = [f for f in FLAGS if f.differs]
    assert len(differing) >= 9
    section = text.split("## Where our defaults differ from the reference", 1)[1]
    for flag in differing:
        assert f"| `{flag.name}` | `{flag.reference_default}` |" in section


def test_render_changes_when_a_flag_changes(monkeypatch):
    # Control: the comparison above can fail.
    host = PluginHost(strict=True)
    before = render(host)
    import dataclasses

    import miles_core.config.parser as parser

    changed = tuple(dataclasses.replace(f, default=2e-6) if f.name == "--lr" else f for f in FLAGS)
    monkeypatch.setattr(parser, "FLAGS", changed)
    assert render(host) != before
