"""The benchmark figures the README (and every other page of ``benchmarks.run.FIGURE_PAGES``) shows are
``render(results.json)``: the stored results through each benchmark's ``headline()``, nothing edited by hand
and nothing left from an older run."""

import json

import pytest

from benchmarks.common import ROOT
from benchmarks.run import (
    DEFAULT_OUT,
    FIGURE_PAGES,
    README_END,
    README_START,
    marked_block,
    render_readme_block,
    update_readme,
)


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_the_pages_benchmark_figures_are_rendered_from_the_stored_results(page, tmp_path):
    results = json.loads((DEFAULT_OUT / "results.json").read_text())
    text = page.read_text()
    block = marked_block(text)
    assert block is not None, f"{page} has no {README_START} ... {README_END} block"
    assert block == render_readme_block(results), (
        f"{page}'s benchmark table is not what {DEFAULT_OUT / 'results.json'} renders to: "
        "run `python -m benchmarks.run --readme-only`"
    )
    # Regenerating it changes nothing, on the page or around the table.
    copy = tmp_path / page.name
    copy.write_text(text)
    assert update_readme(results, copy) and copy.read_text() == text
