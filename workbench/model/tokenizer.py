"""A small byte-level BPE tokenizer for the tiny Qwen3-VL, built locally and deterministically.

Byte-level BPE covers any text; the merges come from a fixed corpus about mazes, so the action
words (`up`, `down`, `left`, `right`, `stop`, `move`) are single tokens and a move is one sampled
token. All Qwen special tokens are present, with the same strings as the real Qwen3-VL.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
VISION_TOKENS: tuple[str, ...] = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ACTION_WORDS: tuple[str, ...] = ("up", "down", "left", "right", "stop", "move")

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
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
)


def training_corpus() -> list[str]:
    """The fixed corpus the merges are learned from: sentences plus action words, repeated."""
    words = [f"{w} {w}\n{w}" for w in ACTION_WORDS]
    return list(_SENTENCES) * 20 + words * 200


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train byte-level BPE on `training_corpus()`; deterministic (same bytes every build)."""
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
    for word in ACTION_WORDS:
        ids = tok.encode(word).ids
        if len(ids) != 1:
            raise RuntimeError(f"action word {word!r} is {len(ids)} tokens in the tiny vocabulary")
    return tok
