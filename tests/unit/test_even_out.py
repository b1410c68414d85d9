"""Every sharded rank runs as many passes: its micro-batches split or padded to the largest count."""

from miles_async.backends.packing import even_out


def test_the_largest_micro_batch_is_halved_until_the_count_is_reached():
    assert even_out([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert even_out([[0, 1, 2, 3], [4]], 4) == [[0], [1], [2, 3], [4]]


def test_ranks_with_too_few_rows_get_throw_away_passes():
    assert even_out([[0], [1]], 4) == [[0], [1], [], []]
    assert even_out([], 2) == [[], []]


def test_a_rank_already_at_the_count_is_unchanged_and_every_row_is_kept_once():
    assert even_out([[0, 1], [2]], 2) == [[0, 1], [2]]
    out = even_out([[5, 6, 7], [8, 9]], 5)
    assert len(out) == 5 and sorted(r for mb in out for r in mb) == [5, 6, 7, 8, 9]
