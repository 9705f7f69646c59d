"""Workload families for ``tiering sweep``: one policy is judged on several regimes, not one.

A family is a named, seeded generator of requests in the Mooncake trace shape
(:class:`~tiering.replay.trace.Request`, block ids assigned like prefix hashes):

* ``builtin``: the built-in multi-turn chat workload (:class:`SyntheticWorkload` defaults);
* ``chat-long``: long multi-turn sessions with long think times and many conversations open
  at once, so a conversation's next turn comes back after more distinct blocks than a small
  cache holds (reuse distances exceed small caches; recency alone keeps nothing);
* ``scan-heavy``: one-off long documents (a scan) behind a few hot system prompts, with some
  follow-up questions on recent documents and short chats: frequency must keep the hot
  prompts, recency the follow-ups.

``trace`` is not generated: it is the shared Mooncake-format trace
(``tests/data/mooncake_synthetic_trace.jsonl.gz``) when the checkout has it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from tiering.core.errors import ConfigError
from tiering.replay.synthetic import SyntheticWorkload, _BlockNamer, _Conversation, _Segment
from tiering.replay.trace import DEFAULT_BLOCK_TOKENS, Request

#: The shared synthetic trace, in the checkout this package runs from (absent from a wheel).
SHARED_TRACE = (
    Path(__file__).resolve().parents[2] / "tests" / "data" / "mooncake_synthetic_trace.jsonl.gz"
)


def chat_long_workload(num_requests: int, seed: int, block_tokens: int) -> SyntheticWorkload:
    """Long sessions (16 turns on average), 5-minute think times, many system prompts."""
    return SyntheticWorkload(
        num_requests=num_requests,
        seed=seed,
        num_system_prompts=24,
        system_prompt_tokens_min=512,
        system_prompt_tokens_max=4096,
        mean_turns=16.0,
        user_tokens_median=400,
        output_tokens_median=300,
        max_context_tokens=65536,
        conversations_per_s=0.5,
        think_time_s_mean=300.0,
        block_tokens=block_tokens,
    )


@dataclass(frozen=True, slots=True)
class ScanWorkload:
    """One-off long documents behind hot system prompts (the ``scan-heavy`` family).

    Each request starts with one of ``num_system_prompts`` prompts (Zipf, so one is hot).
    With probability ``document_share`` it carries a new document (log-normal around
    ``document_tokens_median`` tokens, never seen again unless followed up); with
    probability ``follow_up_share`` it asks again about one of the last ``recent_documents``
    documents (the prefix system prompt + document is reused); otherwise it is a short chat
    message.
    """

    num_requests: int = 2000
    seed: int = 0
    num_system_prompts: int = 32
    system_prompt_tokens: int = 4096
    system_prompt_zipf_s: float = 1.0
    document_share: float = 0.6
    follow_up_share: float = 0.2
    recent_documents: int = 64
    document_tokens_median: int = 12000
    max_document_tokens: int = 30000
    question_tokens_median: int = 200
    requests_per_s: float = 4.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        for name in (
            "num_requests",
            "num_system_prompts",
            "system_prompt_tokens",
            "recent_documents",
            "document_tokens_median",
            "max_document_tokens",
            "question_tokens_median",
            "block_tokens",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"scan workload: {name} must be positive, got {value}")
        shares = (self.document_share, self.follow_up_share)
        if any(not 0 <= s <= 1 for s in shares) or sum(shares) > 1:
            raise ConfigError("scan workload: document and follow-up shares must sum to <= 1")
        if not self.requests_per_s > 0 or not self.system_prompt_zipf_s > 0:
            raise ConfigError("scan workload: rates must be positive")

    def generate(self) -> list[Request]:
        """The requests in arrival order (deterministic for a given seed)."""
        rng = random.Random(self.seed)
        namer = _BlockNamer()
        weights = [
            1.0 / (r + 1) ** self.system_prompt_zipf_s for r in range(self.num_system_prompts)
        ]
        prompts: list[_Segment] = [
            (("system", i), self.system_prompt_tokens) for i in range(self.num_system_prompts)
        ]
        recent: list[tuple[_Segment, _Segment]] = []  # (system prompt, document)
        requests: list[Request] = []
        now = 0.0
        segment_ids = 0

        def tokens(median: int, cap: int) -> int:
            return min(cap, max(1, round(rng.lognormvariate(math.log(median), 0.7))))

        while len(requests) < self.num_requests:
            now += rng.expovariate(self.requests_per_s)
            draw = rng.random()
            segment_ids += 1
            question: _Segment = (
                ("user", segment_ids),
                tokens(self.question_tokens_median, 4 * self.question_tokens_median),
            )
            if draw < self.follow_up_share and recent:
                prompt, document = rng.choice(recent)
                segments = [prompt, document, question]
            else:
                prompt = prompts[rng.choices(range(len(prompts)), weights)[0]]
                if draw < self.follow_up_share + self.document_share:
                    length = tokens(self.document_tokens_median, self.max_document_tokens)
                    document = (("document", segment_ids), length)
                    recent.append((prompt, document))
                    del recent[: -self.recent_documents]
                    segments = [prompt, document, question]
                else:
                    segments = [prompt, question]
            conversation = _Conversation(0, 1, segments)
            hash_ids = namer.name(conversation, self.block_tokens)
            input_length = sum(length for _, length in segments)
            output = tokens(self.question_tokens_median, 4 * self.question_tokens_median)
            requests.append(Request(round(now * 1000.0), input_length, output, tuple(hash_ids)))
        return requests


Generator = Callable[[int, int, int], list[Request]]


def _builtin(num_requests: int, seed: int, block_tokens: int) -> list[Request]:
    return SyntheticWorkload(
        num_requests=num_requests, seed=seed, block_tokens=block_tokens
    ).generate()


def _chat_long(num_requests: int, seed: int, block_tokens: int) -> list[Request]:
    return chat_long_workload(num_requests, seed, block_tokens).generate()


def _scan_heavy(num_requests: int, seed: int, block_tokens: int) -> list[Request]:
    return ScanWorkload(num_requests=num_requests, seed=seed, block_tokens=block_tokens).generate()


#: Generated families by name: ``generator(num_requests, seed, block_tokens)``.
GENERATED_FAMILIES: Mapping[str, Generator] = MappingProxyType(
    {"builtin": _builtin, "chat-long": _chat_long, "scan-heavy": _scan_heavy}
)

#: Every family name ``family:`` accepts (``trace`` is the shared trace file).
FAMILY_NAMES = (*GENERATED_FAMILIES, "trace")

#: What ``family:all`` runs: the built-in workload at seeds 0-2, the shared trace and the
#: two generated families that stress opposite regimes.
ALL_FAMILIES = ("builtin@0", "builtin@1", "builtin@2", "trace", "chat-long", "scan-heavy")

#: Capacities a family sweep uses by default, as fractions of each family's footprint.
FAMILY_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)


def parse_families(text: str) -> list[tuple[str, int | None]]:
    """``"all"`` or a comma list of ``NAME`` / ``NAME@SEED`` as (name, seed or None)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if items == ["all"]:
        items = list(ALL_FAMILIES)
    if not items:
        raise ConfigError("family: give 'all' or names from " + ", ".join(FAMILY_NAMES))
    parsed: list[tuple[str, int | None]] = []
    for item in items:
        name, sep, seed_text = item.partition("@")
        if name not in FAMILY_NAMES:
            raise ConfigError(
                f"family: unknown family {name!r}; choose from {', '.join(FAMILY_NAMES)} or all"
            )
        try:
            seed = int(seed_text) if sep else None
        except ValueError:
            raise ConfigError(f"family: {item!r}: the seed after @ must be an integer") from None
        parsed.append((name, seed))
    return parsed


def family_requests(
    name: str, num_requests: int, seed: int, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> list[Request]:
    """A generated family's requests (``ConfigError`` for ``trace`` or an unknown name)."""
    generator = GENERATED_FAMILIES.get(name)
    if generator is None:
        raise ConfigError(
            f"family {name!r} is not generated; choose from {', '.join(GENERATED_FAMILIES)}"
        )
    return generator(num_requests, seed, block_tokens)
