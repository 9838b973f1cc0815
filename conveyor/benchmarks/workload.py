"""Seeded synthetic workloads: long-tailed lengths as in real chat traffic, shared prefixes, multi-turn chats,
and the fixed workloads engines are compared on."""

from __future__ import annotations

import random
from dataclasses import dataclass

from conveyor.sim.workload import LengthDistribution, multi_turn_shapes, shared_prefix_requests

WORKLOADS = ("longtail", "shared-prefix", "multi-turn")  # what ``bench throughput --workload`` offers


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_token_ids: list[int]
    output_len: int


def long_tail_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (8, 512),
    prompt_median: int = 128,
    output_median: int = 64,
) -> list[SyntheticRequest]:
    """Random-token prompts (ids from the upper part of the vocabulary, away from special tokens), lengths from
    the simulator's ``clipped`` long tail (:class:`conveyor.sim.workload.LengthDistribution`)."""
    rng = random.Random(seed)
    prompt_lengths = LengthDistribution.clipped(*prompt_range, prompt_median)
    output_lengths = LengthDistribution.clipped(*output_range, output_median)
    requests = []
    for _ in range(num_requests):
        prompt_len = prompt_lengths.sample(rng)
        output_len = output_lengths.sample(rng)
        prompt = [rng.randrange(vocab_size // 8, vocab_size) for _ in range(prompt_len)]
        requests.append(SyntheticRequest(prompt, output_len))
    return requests


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size // 8, vocab_size) for _ in range(n)]


def shared_prefix_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    num_prefixes: int = 8,
    prefix_range: tuple[int, int] = (400, 800),
    output_len: int = 64,
) -> list[SyntheticRequest]:
    """Requests over a few long shared prefixes (system prompts, few-shot preambles), each with its own short
    question: the traffic prefix caching is for. Lengths are the simulator's (``shared_prefix_requests``)."""
    shapes = shared_prefix_requests(num_requests, seed, num_prefixes, prefix_range, output_len=output_len)
    rng = random.Random(f"{seed}:shared-prefix-tokens")
    prefixes: dict[int, list[int]] = {}
    requests = []
    for shape in shapes:
        if shape.shared_prefix_id not in prefixes:
            prefixes[shape.shared_prefix_id] = _random_tokens(rng, shape.shared_prefix_len, vocab_size)
        question = _random_tokens(rng, shape.prompt_len - shape.shared_prefix_len, vocab_size)
        requests.append(SyntheticRequest(prefixes[shape.shared_prefix_id] + question, shape.output_len))
    return requests


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat of several turns: each turn resends the whole history (system prompt, every earlier question and
    answer) followed by its new question, as chat clients do."""

    system_prompt: list[int]
    questions: list[list[int]]
    output_len: int

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        """The token ids sent at ``turn`` (0-based), given the answers of the turns before it."""
        history = list(self.system_prompt)
        for question, answer in zip(self.questions[:turn], answers):
            history += question + answer
        return history + self.questions[turn]


def multi_turn_workload(num_conversations: int, seed: int, vocab_size: int, num_turns: int = 6,
                        output_len: int = 64, num_system_prompts: int = 0) -> list[Conversation]:
    """Conversations with their own questions, and their own system prompts or ``num_system_prompts`` shared
    ones (random token ids, seeded); lengths are the simulator's (``multi_turn_shapes``), so it can predict the
    same workload."""
    rng = random.Random(f"{seed}:multi-turn-tokens")
    shared: dict[int, list[int]] = {}
    conversations = []
    for shape in multi_turn_shapes(num_conversations, seed, num_turns, output_len=output_len,
                                   num_system_prompts=num_system_prompts):
        system = _random_tokens(rng, shape.system_len, vocab_size)
        if shape.system_id is not None:
            system = shared.setdefault(shape.system_id, system)
        conversations.append(Conversation(system, [_random_tokens(rng, n, vocab_size) for n in shape.question_lens],
                                          shape.output_len))
    return conversations


# ----- the fixed workloads that engines are compared on (``conveyor bench compare``) -----------------

W1_NUM_PROMPTS = 64
W1_PROMPT_LEN = 41
W1_OUTPUT_LEN = 128
W2_NUM_REQUESTS = 256
W2_SEED = 0
SP_NUM_REQUESTS = 128  # SP: bench throughput's shared-prefix workload, every engine's prefix caching on

AT_ONCE = "at-once"
ONE_AT_A_TIME = "one-at-a-time"

W1_QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do bees make honey?",
    "What causes the seasons on Earth?",
    "Name three rivers in Africa.",
    "What does a compiler do?",
    "How does a rainbow form?",
    "Why do cats purr?",
    "What is photosynthesis?",
    "How far away is the Moon?",
    "Write a haiku about the sea.",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "How do airplanes stay in the air?",
    "What is a prime number?",
    "Why do leaves change color in autumn?",
    "Give me three tips for sleeping well.",
    "What is the largest ocean?",
    "How does a vaccine work?",
    "What is the speed of light?",
    "Explain gravity to a child.",
    "What are the planets of the solar system?",
    "How do I boil an egg?",
    "What is the tallest mountain?",
    "Why is the ocean salty?",
    "What is an atom made of?",
    "How do volcanoes erupt?",
    "Suggest a name for a pet turtle.",
    "What is the difference between weather and climate?",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "Why do we have day and night?",
    "What is a black hole?",
    "How does the heart pump blood?",
    "Write a short poem about snow.",
    "What is the main ingredient of bread?",
    "How do magnets work?",
    "What is the capital of Japan?",
    "Why do birds migrate?",
    "What is a noun?",
    "How do fish breathe underwater?",
    "Who painted the Mona Lisa?",
    "What is the freezing point of water?",
    "How does a battery store energy?",
    "List three kinds of clouds.",
    "What is the longest river in the world?",
    "How do plants drink water?",
    "What does DNA stand for?",
    "Why does the Moon change shape?",
    "What is an earthquake?",
    "Give me a fun fact about octopuses.",
    "How do I make a paper airplane?",
    "What is the smallest country?",
    "Why do we yawn?",
    "What is the Internet?",
    "How do clocks keep time?",
    "Describe a sunset in one sentence.",
    "What is the hottest planet?",
    "How does soap clean hands?",
    "What is a desert?",
    "Why do onions make people cry?",
    "What do pandas eat?",
    "How is glass made?",
    "Tell me a riddle about time.",
)
# Appended to every question, then cut to length: prompts reach exactly W1_PROMPT_LEN tokens with the
# question intact and the chat template's structure kept.
_W1_FILLER = " Please answer in a few clear sentences, and give one simple example that a child would understand."


@dataclass(frozen=True, slots=True)
class Workload:
    """A named list of requests and how they arrive: all at once, or each after the previous one ended."""

    name: str
    mode: str  # AT_ONCE or ONE_AT_A_TIME
    requests: list[SyntheticRequest]
    prefix_caching: bool = False  # every engine runs it with its prefix caching on (else off)

    def to_json(self) -> dict:
        """What the peer runners read (bench/peers/*)."""
        return {"name": self.name, "mode": self.mode, "prefix_caching": self.prefix_caching, "requests": [
            {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in self.requests]}


def chat_prompt_ids(tokenizer, question: str, length: int) -> list[int]:
    """``question`` (plus filler) in the chat template, its content cut so the whole is ``length`` token ids. A
    tokenizer with fewer tokens to the filler or a shorter template (Gemma's) gets the filler again, as many
    times as it takes; the default model's prompts need it once."""
    for times in range(1, 9):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question + _W1_FILLER * times}])
        if len(ids) >= length:
            break
    excess = len(ids) - length
    if excess < 0:
        raise ValueError(f"W1: {question!r} with filler is {len(ids)} tokens, fewer than {length}")
    tail = _template_tail_len(tokenizer)
    return ids[: len(ids) - tail - excess] + ids[len(ids) - tail :]


def _template_tail_len(tokenizer) -> int:
    """Token ids the chat template puts after the user's content (end of turn, assistant header)."""
    a = tokenizer.apply_chat_template([{"role": "user", "content": "1"}])
    b = tokenizer.apply_chat_template([{"role": "user", "content": "2"}])
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def w1_requests(tokenizer) -> list[SyntheticRequest]:
    """W1: 64 chat prompts of exactly 41 tokens, 128 output tokens each."""
    return [SyntheticRequest(chat_prompt_ids(tokenizer, q, W1_PROMPT_LEN), W1_OUTPUT_LEN) for q in W1_QUESTIONS]


def comparison_workloads(tokenizer, vocab_size: int, w1_single: int = 8,
                         names: tuple[str, ...] = ("W1@1", "W1@64", "W2")) -> list[Workload]:
    """W1@1 (the first ``w1_single`` W1 prompts, one at a time), W1@64 (all 64 at once), W2 (256 long-tailed
    requests at once, seed fixed), SP (128 requests over 8 shared prefixes, at once, prefix caching on): the
    same token ids for every engine."""
    w1 = w1_requests(tokenizer) if {"W1@1", "W1@64"} & set(names) else []
    build = {
        "W1@1": lambda: Workload("W1@1", ONE_AT_A_TIME, w1[:w1_single]),
        "W1@64": lambda: Workload("W1@64", AT_ONCE, w1),
        "W2": lambda: Workload("W2", AT_ONCE, long_tail_workload(W2_NUM_REQUESTS, W2_SEED, vocab_size)),
        "SP": lambda: Workload("SP", AT_ONCE, shared_prefix_workload(SP_NUM_REQUESTS, W2_SEED, vocab_size),
                               prefix_caching=True),
    }
    unknown = [n for n in names if n not in build]
    if unknown:
        raise ValueError(f"workloads: unknown {unknown}; choose from {', '.join(build)}")
    return [build[name]() for name in names]
