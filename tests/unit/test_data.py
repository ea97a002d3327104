"""Byte-level data: corpus loading, the held-out tail, shards, deterministic and resumable sampling."""

from __future__ import annotations

import pytest
import torch

from parallax.node.train.data import (
    DEFAULT_CORPUS,
    BatchSampler,
    load_corpus,
    shard,
    split_corpus,
    val_batches,
)


def test_builtin_corpus_is_tinyshakespeare():
    data = load_corpus()
    assert DEFAULT_CORPUS.is_file()
    assert len(data) == 1_115_394
    assert data.startswith(b"First Citizen:")


def test_file_folder_and_glob(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_bytes(b"alpha")
    (tmp_path / "b" / "c.md").write_bytes(b"gamma")
    (tmp_path / "b" / "skip.bin").write_bytes(b"binary")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_bytes(b"hidden")
    (tmp_path / "empty.txt").write_bytes(b"")

    assert load_corpus(tmp_path / "a.txt") == b"alpha"
    assert load_corpus(str(tmp_path)) == b"alpha\ngamma"  # sorted by path, empty file skipped
    assert load_corpus(str(tmp_path / "**" / "*.md")) == b"gamma"
    assert load_corpus(str(tmp_path / "*.txt")) == b"alpha"


@pytest.mark.parametrize("what", ["missing", "empty_file", "empty_dir", "no_match"])
def test_nothing_to_read_says_what_to_do(tmp_path, what):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "d").mkdir()
    path = {"missing": tmp_path / "nope.txt", "empty_file": tmp_path / "empty.txt",
            "empty_dir": tmp_path / "d", "no_match": str(tmp_path / "*.nothing")}[what]
    with pytest.raises(ValueError, match="--data"):
        load_corpus(path)


def test_split_is_the_tail_and_bytes_are_tokens():
    data = bytes(range(256)) * 4
    train, val = split_corpus(data, 0.25)
    assert train.dtype == torch.uint8 and val.dtype == torch.uint8
    assert len(train) == 768 and len(val) == 256
    assert bytes(train.tolist()) + bytes(val.tolist()) == data
    with pytest.raises(ValueError, match="too small"):
        split_corpus(b"abc", 0.05)
    with pytest.raises(ValueError, match="too small"):
        split_corpus(bytes(100), 0.05, seq_len=10)
    with pytest.raises(ValueError):
        split_corpus(data, 1.0)


def test_shards_are_disjoint_and_cover():
    train = torch.arange(103)
    parts = [shard(train, i, 4) for i in range(4)]
    assert torch.equal(torch.cat(parts), train)
    assert {len(p) for p in parts} <= {25, 26}
    assert torch.equal(shard(train, 2, 4), parts[2])  # deterministic
    with pytest.raises(ValueError):
        shard(train, 4, 4)


def test_sampler_windows_are_shifted_and_deterministic():
    tokens = torch.arange(200) % 256
    s1, s2 = BatchSampler(tokens, 4, 16, seed=7), BatchSampler(tokens, 4, 16, seed=7)
    x, y = s1.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)  # arange stream
    assert torch.equal(s2.next_batch()[0], x)
    assert not torch.equal(BatchSampler(tokens, 4, 16, seed=8).next_batch()[0], x)
    assert s1.tokens_seen == 64
    # Every window fits: the last start is N - T - 1.
    for _ in range(50):
        x, y = s1.next_batch()
        assert int(y.max()) <= 199


def test_sampler_resumes_exact_stream():
    tokens = torch.randint(0, 256, (500,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a = BatchSampler(tokens, 3, 8, seed=1)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(3)]
    b = BatchSampler(tokens, 3, 8, seed=99)
    b.load_state_dict(state)
    assert b.tokens_seen == 5 * 3 * 8
    for (ex, ey), (gx, gy) in zip(expected, [b.next_batch() for _ in range(3)], strict=True):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(tokens, 4, 8, seed=1).load_state_dict(state)


def test_a_sampler_replays_any_of_its_draws_from_its_seed_and_stays_where_it_is():
    tokens = torch.randint(0, 256, (500,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a = BatchSampler(tokens, 3, 8, seed=7)
    drawn = [a.next_batch() for _ in range(9)]
    for (ex, ey), (gx, gy) in zip(drawn[4:7], a.replay(4, 3), strict=True):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)
    assert a.step == 9 and a.replay(2, 0) == []
    following = BatchSampler(tokens, 3, 8, seed=7).replay(9, 1)[0]
    assert torch.equal(a.next_batch()[0], following[0])
    with pytest.raises(ValueError, match="non-negative"):
        a.replay(-1, 2)
    # A draw is a function of the seed and its number alone: one far along the stream costs one draw (a peer's claim
    # names the count; a stream replayed from its start would cost a liar's count of draws).
    far = a.replay(10**15, 2)
    assert len(far) == 2 and not torch.equal(far[0][0], far[1][0])
    with pytest.raises(ValueError, match="seed"):
        BatchSampler(tokens, 3, 8, seed=-1)


def test_sampler_rejects_short_stream():
    with pytest.raises(ValueError):
        BatchSampler(torch.arange(8), 2, 8, seed=0)


def test_val_batches_fixed_and_evenly_spaced():
    val = torch.arange(1000)
    batches = val_batches(val, 2, 10, 3)
    assert len(batches) == 3 and all(x.shape == (2, 10) for x, _ in batches)
    starts = [int(x[i, 0]) for x, _ in batches for i in range(2)]
    assert starts == [0, 197, 395, 593, 791, 989]  # (1000 - 11) spread over 5 gaps
    assert all(torch.equal(y, x + 1) for x, y in batches)
    again = val_batches(val, 2, 10, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    single = val_batches(val, 1, 10, 1)
    assert int(single[0][0][0, 0]) == 0
    with pytest.raises(ValueError):
        val_batches(torch.arange(5), 1, 10, 1)
