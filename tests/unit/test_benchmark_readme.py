"""The README's performance table is generated from results.json by each benchmark's headline()."""

from benchmarks.run import README_END, README_START, render_readme_block, update_readme

RESULTS = {
    "benchmarks": {
        "orchestration": {
            "quick": False,
            "machine": {"date": "2026-11-30T06:00:00", "cpu_model": "CPU", "cores": 2},
            "results": {"bare_ray_round_trip_us": 500.0, "paths": {"8x4": {"us_per_sample_without_engine": 250.0}}},
        },
        "long_tail": {"error": "Traceback ..."},
    }
}


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nbefore\n{README_START}\nold table\n{README_END}\nafter\n")
    assert update_readme(RESULTS, readme)
    text = readme.read_text()
    assert text.startswith("# title\nbefore\n") and text.endswith("\nafter\n")
    assert "old table" not in text
    assert (
        "| orchestration overhead per sample (8x4, zero-cost generation and training) | 250 us = 0.50x a bare "
        "Ray round trip (500 us) | full, 2026-11-30 |" in text
    )
    assert "long_tail" not in render_readme_block(RESULTS)  # a failed benchmark has no headline


def test_update_readme_without_markers_changes_nothing(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert not update_readme(RESULTS, readme)
    assert readme.read_text() == "# no markers\n"
