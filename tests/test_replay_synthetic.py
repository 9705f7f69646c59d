"""The built-in synthetic workload: seeded, prefix-consistent, multi-turn, shared prompts."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tiering.core.errors import ConfigError
from tiering.replay.offline import unlimited_hit_rate
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import read_trace, write_trace


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    first = SyntheticWorkload(num_requests=200, seed=3).generate()
    assert first == SyntheticWorkload(num_requests=200, seed=3).generate()
    assert first != SyntheticWorkload(num_requests=200, seed=4).generate()
    assert len(first) == 200


def test_requests_look_like_a_mooncake_trace() -> None:
    requests = SyntheticWorkload(num_requests=300).generate()
    timestamps = [r.timestamp_ms for r in requests]
    assert timestamps == sorted(timestamps)
    for request in requests:
        assert len(request.hash_ids) == -(-request.input_length // 512)
        assert request.output_length > 0
        assert request.input_length <= SyntheticWorkload().max_context_tokens


def test_block_ids_are_prefix_hashes() -> None:
    # An id always follows the same parent id: equal ids mean equal prefixes.
    parent_of: dict[int, int] = {}
    for request in SyntheticWorkload(num_requests=400).generate():
        parent = -1
        for block in request.hash_ids:
            assert parent_of.setdefault(block, parent) == parent
            parent = block


def test_conversations_extend_earlier_turns_and_prompts_are_shared() -> None:
    workload = SyntheticWorkload(num_requests=400, num_system_prompts=3)
    requests = workload.generate()
    first_blocks = {r.hash_ids[0] for r in requests}
    assert len(first_blocks) <= 3  # every system prompt is longer than one block
    extended = 0
    earlier: set[tuple[int, ...]] = set()
    for request in requests:
        ids = request.hash_ids
        # A later turn resends the earlier turn's full blocks: a long shared prefix.
        if any(ids[:k] in earlier for k in range(len(ids) - 1, 4, -1)):
            extended += 1
        earlier.update(ids[:k] for k in range(1, len(ids) + 1))
    assert extended > len(requests) // 3
    assert 0.5 < unlimited_hit_rate(requests).token_hit_rate < 1.0


def test_round_trips_through_the_trace_format(tmp_path: Path) -> None:
    requests = SyntheticWorkload(num_requests=50).generate()
    buffer = io.StringIO()
    write_trace(requests, buffer)
    path = tmp_path / "synthetic.jsonl"
    path.write_text(buffer.getvalue(), encoding="utf-8")
    assert read_trace(path) == requests


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_requests", 0),
        ("mean_turns", 0.5),
        ("conversations_per_s", 0.0),
        ("system_prompt_tokens_max", 10),
        ("block_tokens", -1),
    ],
)
def test_bad_parameters_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SyntheticWorkload(**{field: value})  # type: ignore[arg-type]
