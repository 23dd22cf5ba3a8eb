"""The multi-turn TRL benchmark's claim that both trainers sample from the same token streams:
its chat template draws a tool call and a tool's answer exactly as the workbench's stream
holds a reply and the next user turn, and its response template reads a reply word as that
tool's call (transformers' response parsing, which TRL's tool loop uses). TRL itself is not
installed here (benchmarks/trl_env.sh builds its own venv)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from benchmarks.trl_multiturn import WORDS, tool_processor
from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
from workbench.policy import append_reply, append_user, chat_format, encode_image, start_stream
from workbench.rl.rollout import user_text

TASK = MazeConfig(size=5, max_turns=3)


def test_a_tool_turn_renders_as_the_workbench_stream(tiny_dir: Path) -> None:
    processor = tool_processor(tiny_dir)
    fmt, env = chat_format(processor), MazeEnv(TASK)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    first = (obs["image"], user_text(obs, info, TASK))
    stream = append_user(start_stream(processor, fmt, system_prompt(TASK)), processor, fmt,
                         first[1], encode_image(processor, first[0]))
    reply = processor.tokenizer.encode("right") + [fmt.im_end]
    stream = append_reply(stream, fmt, reply, [0.0] * len(reply))
    obs, _, _, _, info = env.step("right")
    second = (obs["image"], user_text(obs, info, TASK))
    stream = append_user(stream, processor, fmt, second[1], encode_image(processor, second[0]))
    messages = [
        {"role": "system", "content": [{"type": "text", "text": system_prompt(TASK)}]},
        {"role": "user", "content": [{"type": "image", "image": Image.fromarray(first[0])},
                                     {"type": "text", "text": first[1]}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}],
         "tool_calls": [{"type": "function", "function": {"name": "right", "arguments": {}}}]},
        {"role": "tool", "name": "right",
         "content": [{"type": "image", "image": Image.fromarray(second[0])},
                     {"type": "text", "text": second[1]}]},
    ]
    ids = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"][0]
    assert list(ids) == stream.tokens_T
    # TRL's check that a template supports tool calls: name, argument and answer all drawn
    text = processor.apply_chat_template([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "n_1", "arguments": {"k_1": "v_1"}}}]},
        {"role": "tool", "name": "n_1", "content": "c_1"}], tokenize=False)
    assert all(s in text for s in ("n_1 k_1=v_1", "c_1"))


def test_a_reply_word_reads_as_its_tool_call(tiny_dir: Path) -> None:
    tok = tool_processor(tiny_dir).tokenizer
    prefix = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]

    def parsed(text: str) -> dict:
        return tok.parse_response(tok(text)["input_ids"], prefix=prefix)

    for word in WORDS:
        assert parsed(word + "<|im_end|>")["tool_calls"] == [
            {"type": "function", "function": {"name": word, "arguments": {}}}]
    assert parsed("hello<|im_end|>") == {"role": "assistant", "content": "hello"}


def test_the_gpu_run_hands_vllm_one_pad_per_image(tiny_dir: Path) -> None:
    """benchmarks/trl_gpu.py's patch of TRL 1.16 (issue #6294): each image's run of pads cut to
    one, exactly what the workbench's own vLLM engine sends for the same stream."""
    from benchmarks.trl_gpu import one_pad_per_image
    from workbench.vllm.engine import prompt_token_ids

    processor = tool_processor(tiny_dir)
    fmt, env = chat_format(processor), MazeEnv(TASK)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    stream = start_stream(processor, fmt, system_prompt(TASK))
    for move in ("right", "down"):
        stream = append_user(stream, processor, fmt, user_text(obs, info, TASK),
                             encode_image(processor, obs["image"]))
        reply = processor.tokenizer.encode(move) + [fmt.im_end]
        stream = append_reply(stream, fmt, reply, [0.0] * len(reply))
        obs, _, _, _, info = env.step(move)
    cut = one_pad_per_image(stream.tokens_T, fmt.image_pad)
    assert cut == prompt_token_ids(stream) and cut.count(fmt.image_pad) == 2
