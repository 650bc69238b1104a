"""The prompts a benchmark sends, as conversations of one or more turns.

Prompts are text, built from a fixed list of common English words drawn by a seeded RNG, so the
same load can go to splitserve's gRPC API and to any OpenAI-compatible server (whose tokenizer
the client does not know). Lengths given in tokens (`--random-input-len`, ...) are therefore
counts of words: most such words are one token in the usual BPE vocabularies, a few are two. The
figures count what the server reports it tokenized (gRPC always; HTTP when it answers
`stream_options.include_usage`), and fall back to the word count only where it reports nothing.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# NOTE: short, frequent words: a single token each in GPT-2-, Llama- and SmolLM-style
# vocabularies (with the leading space), so a prompt of N words is close to N tokens.
_TEXT = """
the of and to in is was for on that with as by at from his it an were are which this be or
has had not first one their its new after who they have her she two been other when there
all during into school time may years more most only over city some world would where
later up such used many can state about national out known university united then made
team american under high also part well life film these both three any than year each
called while between several group game since great still work early same back day found
north south east west house war left long name little old big small home water book light
night road river town open land line hand word point order place power black white red
green blue music party church union local head young five four six seven
"""
WORDS = tuple(dict.fromkeys(_TEXT.split()))


@dataclass(frozen=True)
class Turn:
    """One request's own text and how many tokens it asks for."""

    text: str
    output_tokens: int


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another, each once the previous reply is complete. With `history`,
    turn k's prompt holds every earlier turn and its reply (the prompt grows each turn, as a
    chat's does); without, each turn is a prompt of its own."""

    turns: tuple[Turn, ...]
    history: bool = False

    def prompt(self, index: int, replies: list[str]) -> str:
        if not self.history:
            return self.turns[index].text
        parts = [
            f"User: {turn.text}\nAssistant:{reply}\n"
            for turn, reply in zip(self.turns[:index], replies, strict=True)
        ]
        return "".join(parts) + f"User: {self.turns[index].text}\nAssistant:"


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean·(1−r), mean·(1+r)], as vLLM's random dataset draws lengths."""
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(max(1, low), max(1, high)))


def random_dataset(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)
    return [
        Conversation(
            (
                Turn(
                    words(rng, _length(rng, input_len, range_ratio)),
                    _length(rng, output_len, range_ratio),
                ),
            )
        )
        for _ in range(num)
    ]


def prefix_repetition_dataset(
    num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int
) -> list[Conversation]:
    """`num_prefixes` shared prefixes, each followed by its own random suffix: the requests of
    one group share their first `prefix_len` words (what a prefix cache reuses). Groups are
    interleaved, so a group's requests are spread over the run."""
    rng = random.Random(seed)
    prefixes = [words(rng, prefix_len) for _ in range(max(1, num_prefixes))]
    return [
        Conversation((Turn(f"{prefixes[i % len(prefixes)]} {words(rng, suffix_len)}", output_len),))
        for i in range(num)
    ]


def multi_turn_dataset(
    num: int, turns: int, input_len: int, output_len: int, seed: int
) -> list[Conversation]:
    """Conversations of `turns` turns (the last one shorter if `turns` does not divide `num`),
    `num` requests in all; each turn's prompt is the whole conversation so far."""
    rng = random.Random(seed)
    sizes = [turns] * (num // turns) + ([num % turns] if num % turns else [])
    return [
        Conversation(
            tuple(Turn(words(rng, input_len), output_len) for _ in range(size)), history=True
        )
        for size in sizes
    ]


def custom_dataset(path: str, num: int, default_output: int) -> list[Conversation]:
    """The user's own prompts: a JSONL file, one `{"prompt": text, "output_tokens": N}` a line
    (`output_tokens` may be left out: `default_output`). The first `num` lines are sent, cycled
    when the file holds fewer."""
    rows: list[Turn] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, out = row["prompt"], int(row.get("output_tokens", default_output))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f'{path}:{number}: expected {{"prompt": text, "output_tokens": N}} ({exc!r})'
            ) from None
        if not isinstance(prompt, str) or out < 1:
            raise ValueError(f"{path}:{number}: prompt must be text and output_tokens ≥ 1")
        rows.append(Turn(prompt, out))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [Conversation((rows[i % len(rows)],)) for i in range(num)]


def requests_in(conversations: list[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)
