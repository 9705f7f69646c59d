"""A seeded synthetic workload: multi-turn conversations over shared system prompts.

This is the replay's embedded default, so it needs no file and no server. It models
the two sources of prefix reuse that dominate chat serving:

* a handful of system prompts shared by many conversations (Zipf popularity);
* multi-turn conversations, where each turn resends the whole history plus a new
  user message, so every turn extends the previous turn's prefix.

Requests come out in arrival order in the Mooncake trace shape (:class:`Request`),
with block ids assigned like prefix hashes: two blocks get the same id exactly when
their whole token prefix is the same.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from tiering.core.errors import ConfigError
from tiering.replay.trace import DEFAULT_BLOCK_TOKENS, Request

# A context segment: (unique id of its tokens, number of tokens).
_Segment = tuple[tuple[str, int], int]
# The tokens a block covers: (segment id, first token, end token) per segment piece.
_Signature = tuple[tuple[tuple[str, int], int, int], ...]


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Parameters of the generator. The defaults make the replay demo's workload.

    Token lengths are drawn log-normally around the given medians; turns per
    conversation are geometric with mean ``mean_turns``; new conversations arrive
    as a Poisson process and later turns follow after a think time.
    """

    num_requests: int = 2000
    seed: int = 0
    num_system_prompts: int = 8
    system_prompt_tokens_min: int = 1024
    system_prompt_tokens_max: int = 8192
    system_prompt_zipf_s: float = 1.1
    mean_turns: float = 5.0
    user_tokens_median: int = 600
    output_tokens_median: int = 300
    max_context_tokens: int = 32768
    conversations_per_s: float = 1.0
    think_time_s_mean: float = 60.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        positive = {
            "num_requests": self.num_requests,
            "num_system_prompts": self.num_system_prompts,
            "system_prompt_tokens_min": self.system_prompt_tokens_min,
            "user_tokens_median": self.user_tokens_median,
            "output_tokens_median": self.output_tokens_median,
            "max_context_tokens": self.max_context_tokens,
            "block_tokens": self.block_tokens,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"synthetic workload: {name} must be positive, got {value}")
        if self.system_prompt_tokens_max < self.system_prompt_tokens_min:
            raise ConfigError(
                "synthetic workload: system_prompt_tokens_max must be >= system_prompt_tokens_min"
            )
        if self.mean_turns < 1:
            raise ConfigError(f"synthetic workload: mean_turns must be >= 1, got {self.mean_turns}")
        for name, rate in (
            ("conversations_per_s", self.conversations_per_s),
            ("think_time_s_mean", self.think_time_s_mean),
            ("system_prompt_zipf_s", self.system_prompt_zipf_s),
        ):
            if not rate > 0:
                raise ConfigError(f"synthetic workload: {name} must be positive, got {rate}")

    def generate(self) -> list[Request]:
        """The workload's requests in arrival order (deterministic for a given seed)."""
        return _Generator(self).run()


class _BlockNamer:
    """Assigns prefix-hash-like block ids: one id per distinct (parent id, tokens)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, _Signature], int] = {}

    def name(self, conversation: _Conversation, block_tokens: int) -> list[int]:
        """Block ids of the conversation's context, naming only what the last call did not.

        A context only grows at its end, so the full blocks named before stay; the
        walk resumes where the first unfinished block starts.
        """
        full = conversation.full_block_ids
        parent = full[-1] if full else -1
        index, offset = conversation.next_block_at
        segments = conversation.segments
        pieces: list[tuple[tuple[str, int], int, int]] = []
        room = block_tokens
        while index < len(segments):
            segment_id, length = segments[index]
            take = min(room, length - offset)
            pieces.append((segment_id, offset, offset + take))
            offset += take
            room -= take
            if offset == length:
                index, offset = index + 1, 0
            if room == 0:
                parent = self._intern(parent, tuple(pieces))
                full.append(parent)
                conversation.next_block_at = (index, offset)
                pieces, room = [], block_tokens
        if pieces:
            return [*full, self._intern(parent, tuple(pieces))]
        return list(full)

    def _intern(self, parent: int, signature: _Signature) -> int:
        key = (parent, signature)
        block_id = self._ids.get(key)
        if block_id is None:
            block_id = self._ids[key] = len(self._ids)
        return block_id


@dataclass(slots=True)
class _Conversation:
    system_prompt: int
    turns_left: int
    segments: list[_Segment]
    # Ids of the context's full blocks, and (segment, offset) where the next one starts.
    full_block_ids: list[int] = field(default_factory=list)
    next_block_at: tuple[int, int] = (0, 0)


class _Generator:
    def __init__(self, workload: SyntheticWorkload) -> None:
        self.w = workload
        self.rng = random.Random(workload.seed)
        self.namer = _BlockNamer()
        lo, hi = workload.system_prompt_tokens_min, workload.system_prompt_tokens_max
        self.system_prompt_lengths = [
            self.rng.randint(lo, hi) for _ in range(workload.num_system_prompts)
        ]
        weights = [
            1.0 / (rank + 1) ** workload.system_prompt_zipf_s
            for rank in range(len(self.system_prompt_lengths))
        ]
        self.system_prompt_weights = weights
        self.next_segment = 0

    def _lognormal_tokens(self, median: int) -> int:
        return max(1, round(self.rng.lognormvariate(math.log(median), 0.8)))

    def _segment(self, kind: str, length: int) -> _Segment:
        self.next_segment += 1
        return ((kind, self.next_segment), length)

    def _new_conversation(self) -> _Conversation:
        prompt = self.rng.choices(
            range(len(self.system_prompt_lengths)), self.system_prompt_weights
        )[0]
        # Geometric number of turns with the requested mean (at least one).
        p = 1.0 / self.w.mean_turns
        turns = 1
        while self.rng.random() > p:
            turns += 1
        return _Conversation(
            prompt, turns, [(("system", prompt), self.system_prompt_lengths[prompt])]
        )

    def run(self) -> list[Request]:
        w = self.w
        requests: list[Request] = []
        # (time in seconds, tie-breaker, conversation or None for "a new one arrives")
        events: list[tuple[float, int, _Conversation | None]] = [(0.0, 0, None)]
        order = 1
        while len(requests) < w.num_requests and events:
            now, _, conversation = heapq.heappop(events)
            if conversation is None:
                conversation = self._new_conversation()
                heapq.heappush(
                    events, (now + self.rng.expovariate(w.conversations_per_s), order, None)
                )
                order += 1
            user = self._segment("user", self._lognormal_tokens(w.user_tokens_median))
            conversation.segments.append(user)
            input_length = sum(length for _, length in conversation.segments)
            if input_length > w.max_context_tokens:
                continue  # the conversation outgrew the context window: it ends here
            output_length = self._lognormal_tokens(w.output_tokens_median)
            hash_ids = self.namer.name(conversation, w.block_tokens)
            requests.append(
                Request(round(now * 1000.0), input_length, output_length, tuple(hash_ids))
            )
            conversation.turns_left -= 1
            if conversation.turns_left > 0:
                conversation.segments.append(self._segment("assistant", output_length))
                think = self.rng.expovariate(1.0 / w.think_time_s_mean)
                heapq.heappush(events, (now + think, order, conversation))
                order += 1
        return requests
