"""A small byte-level BPE tokenizer for the tiny Qwen3-VL, built locally and deterministically.

Byte-level BPE covers any text; the merges come from a fixed corpus about mazes, so the action
words (`up`, `down`, `left`, `right`, `stop`, `move`) are single tokens and a move is one sampled
token. All Qwen special tokens are present, with the same strings as the real Qwen3-VL.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen2/3-VL special tokens, in Qwen's order; ids 0.. in the tiny vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
)
ACTION_WORDS: tuple[str, ...] = ("up", "down", "left", "right", "stop", "move")
PHRASES: tuple[str, ...] = (
    "system\n", "user\n", "assistant\n",
    "Action executed successfully.", "Cannot move into a wall.",
    "This is step", ". You are allowed to take", " more steps.",
    "You are navigating a", "You have at most", " turns; each reply is one turn.",
    "The image shows walls (gray) and paths (white). You are the blue circle; the goal is the "
    "red square.",
    "The maze is drawn as text: '#' wall, '.' path, 'A' you, 'G' the goal.",
    "Reach the goal: the episode ends when you step onto it.",
    "Walk to the goal, then stop: you succeed only if you stop on the goal.",
    "Reply with exactly one word: up, down, left, right or stop. Example: up",
    "Reply with exactly one action: ('move', d) with d 0=right, 1=up, 2=left, 3=down, or "
    "('stop', 'stop'). Example: ('move', 0)",
)
"""Whole tokens of a `phrase_tokens=True` tokenizer (each also after a space): the chat roles
and the maze's fixed prompt and feedback phrases (envs/env.py; tests/test_model.py checks that
a maze turn is 18 tokens and the system prompt 19, against 41 and 165 in word pieces). The text
a model is shown is the same either way, cut coarser."""


def phrases() -> tuple[str, ...]:
    """PHRASES, each also after a space (the maze joins its parts with spaces)."""
    return tuple(p for text in PHRASES for p in (text, " " + text))


# Jinja chat template in Qwen-VL's format; explicit '\n' strings so no newline is swallowed.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_SENTENCES: tuple[str, ...] = (
    "You are in a maze. Reach the red goal square with the blue circle.",
    "Gray squares are walls and white squares are floor.",
    "Answer with one action word: up, down, left, right or stop.",
    "Action executed successfully.",
    "Cannot move into a wall.",
    "Invalid action. Reply with one of the allowed actions.",
    "This is step 3. You are allowed to take 12 more steps.",
    "The agent moved right, then down, then left, then up, and stopped on the goal.",
    "('move', 0) ('move', 1) ('move', 2) ('move', 3) ('stop', 'stop')",
    "<action>up</action> <action>down</action> <action>left</action> <action>right</action>",
    "#######\n#A....#\n#.###.#\n#...#G#\n#######",
    " ".join(str(n) for n in range(41)),
)


def training_corpus() -> list[str]:
    """The fixed corpus the merges are learned from: sentences plus action words, repeated."""
    words = [f"{w} {w}\n{w}" for w in ACTION_WORDS]
    return list(_SENTENCES) * 20 + words * 200


def build_tokenizer(vocab_size: int = 512, phrase_tokens: bool = False) -> Tokenizer:
    """Train byte-level BPE on `training_corpus()`; deterministic (same bytes every build).
    `phrase_tokens` adds `phrases()` as whole tokens (the tiny default; the 8B shapes keep word
    pieces, so their benchmarks see about as many text tokens a turn as the real tokenizer's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if phrase_tokens:
        tok.add_tokens([AddedToken(p, normalized=False) for p in phrases()])
    for word in ACTION_WORDS:
        ids = tok.encode(word).ids
        if len(ids) != 1:
            raise RuntimeError(f"action word {word!r} is {len(ids)} tokens in the tiny vocabulary")
    return tok
