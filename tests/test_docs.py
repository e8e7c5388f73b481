"""The documents: every relative link resolves, every results page equals its rendering from the
committed JSON (`benchmarks/render_results.py`), the README stays a short guide, and no document
speaks of sittings or of one machine's paths."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "benchmarks" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _relative_links(text: str):
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the same page
        yield target.split("#", 1)[0]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = [f"{doc.relative_to(ROOT)} -> {target}" for doc in DOCS for target in _relative_links(doc.read_text())
              if not (doc.parent / target).exists()]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [web](https://example.org) [anchor](#x) [gone](missing/file.md#part)\n")
    assert [t for t in _relative_links(page.read_text()) if not (page.parent / t).exists()] == ["missing/file.md"]


def test_every_results_page_equals_its_rendering_from_the_json():
    render = _renderer()
    pages = sorted(render.PAGES.glob("*.md"))
    assert pages, "docs/results/ has no pages"
    blocks = 0
    for page in pages:
        text = page.read_text()
        blocks += len(render.BLOCK.findall(text))
        assert render.render_page(text, page.name) == text, (
            f"{page.relative_to(ROOT)} differs from its JSON: run `python benchmarks/render_results.py`")
    assert blocks >= 10


def test_a_hand_edited_number_in_a_rendered_table_is_caught():
    render = _renderer()
    text = (render.PAGES / "smollm2.md").read_text()
    edited = text.replace("| MT-Bench | 48 | 0 | 2.199 | 2.156 |", "| MT-Bench | 48 | 0 | 2.199 | 2.256 |", 1)
    assert edited != text
    assert render.render_page(edited) == text


def test_an_unknown_table_is_refused_in_one_line_naming_the_page():
    render = _renderer()
    with pytest.raises(ValueError, match=r"^p\.md: unknown table 'nope'"):
        render.render_page("<!-- render: nope file=x.json -->\n<!-- end render -->", "p.md")
    with pytest.raises(ValueError, match=r"^p\.md: table 'served file=missing.json seed=0' cannot be rendered"):
        render.render_page("<!-- render: served file=missing.json seed=0 -->\n<!-- end render -->", "p.md")


def test_a_regime_table_shows_the_pr_drafter_asked_for_over_its_matched_baseline():
    render = _renderer()
    spec = "regime file=regimes.json name=gsm8k-domain seed=0 drafter={}"
    paper = render.render_page(f"<!-- render: {spec.format('pr-paper')} -->\n<!-- end render -->", "p.md")
    assert "`pr-paper` over `eagle3` |" in paper and "`pr-paper-warm`" not in paper
    assert "`pr-warm` over `eagle3-long`" in render.render_page(f"<!-- render: {spec.format('pr-warm')} -->\n<!-- end render -->")
    with pytest.raises(ValueError, match=r"^p\.md: table .* cannot be rendered: ValueError: drafter=eagle3: not a PR drafter"):
        render.render_page(f"<!-- render: {spec.format('eagle3')} -->\n<!-- end render -->", "p.md")


def test_the_readme_is_a_short_guide():
    assert len((ROOT / "README.md").read_text().encode()) <= 12_000


@pytest.mark.parametrize("pattern", [r"\bsessions?\b", r"/work/", r"\brunner [AB]\b"])
def test_no_document_speaks_of_sittings_or_one_machines_paths(pattern):
    hits = [f"{doc.relative_to(ROOT)}:{i}" for doc in DOCS for i, line in enumerate(doc.read_text().splitlines(), 1)
            if re.search(pattern, line, re.I)]
    assert not hits, f"{pattern} in:\n" + "\n".join(hits)


def test_every_pr_recipe_the_readme_lists_shows_its_positive_control_from_the_committed_rows():
    """The README's "Recipes" table prints, beside each PR recipe, the positive control run on that recipe's own
    `pr:` options (benchmarks/control.py's `recipes/NAME.yaml` sets): a recipe whose options change since, or a cell
    that disagrees with the rows, fails here."""
    import itertools
    import json

    from pr_specforge.control.cli import recipe_pr
    from pr_specforge.control.run import ControlSettings, control_pr
    from pr_specforge.training.recipe import read_recipe_mapping

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Recipes"):readme.index("## Layout")]
    report = json.loads((ROOT / "benchmarks" / "results" / "control.json").read_text())
    settings = ControlSettings(**{k: v for k, v in report["settings"].items()})
    checked = 0
    for line in table.splitlines():
        m = re.match(r"\| `(recipes/[^`]+)` \|.*\| ([^|]+) \|$", line)
        if not m:
            continue
        braces = [g.split(",") for g in re.findall(r"\{([^}]+)\}", m.group(1))]
        pattern = re.sub(r"\{[^}]+\}", "{}", m.group(1))
        for parts in itertools.product(*braces):
            name = pattern.format(*parts)
            if (read_recipe_mapping(str(ROOT / name)).get("training") or {}).get("strategy") != "pr":
                continue
            row = report["sets"][name]
            assert row["pr"] == control_pr(recipe_pr(str(ROOT / name)), settings).to_dict(), f"{name}: options changed since its control"
            two = row["result"]["two_hop"]["accuracy"]
            cell = f"{'passes' if row['verdict']['learns_second_pass'] else 'fails'}: {two[0]:.1%} → {max(two[1:]):.1%}"
            assert cell in m.group(2), f"{name}: README shows {m.group(2)!r}, the control's rows {cell!r}"
            checked += 1
    assert checked == 5  # smollm2 offline and online, the three 8B-12B recipes
