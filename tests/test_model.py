"""The tiny Qwen3-VL: deterministic build, real loading path, tokenizer, round trips, LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.envs import MazeConfig, MazeEnv, make_maze, render_image, system_prompt
from workbench.model import (
    LoadedModel,
    LoraSettings,
    TinySpec,
    add_lora,
    build_tiny,
    folder_hash,
    load_adapter,
    load_model,
    resolve_model_path,
    weights_hash,
)
from workbench.model.tiny import tiny_path
from workbench.model.tokenizer import ACTION_WORDS, SPECIAL_TOKENS
from workbench.policy import append_reply, append_user, chat_format, encode_image, start_stream
from workbench.policy.forward import forward_logits, make_batch
from workbench.rl import user_text

CONFIG = MazeConfig(size=9)  # 9x9 at 16 px: a 144x144 image


def _observation(seed: int = 3) -> tuple[dict, dict]:
    env = MazeEnv(CONFIG)
    return env.reset(seed=seed)


def _stream(lm: LoadedModel):
    """System + one user turn with the maze image (the assistant turn opened)."""
    fmt = chat_format(lm.processor)
    obs, info = _observation()
    stream = start_stream(lm.processor, fmt, system_prompt(CONFIG))
    image = encode_image(lm.processor, obs["image"])
    return append_user(stream, lm.processor, fmt, user_text(obs, info, CONFIG), image)


@torch.no_grad()
def _logits(model, lm: LoadedModel) -> torch.Tensor:
    """Logits over the fixed image stream, (1, T, V)."""
    pad_id = lm.processor.tokenizer.pad_token_id
    batch = make_batch(model, [_stream(lm)], pad_id, left=False)
    return forward_logits(model, batch, use_cache=False).logits


# ---------------------------------------------------------------- build and loading path


def test_build_is_deterministic(tiny, tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny(tmp_path / "again")
    assert folder_hash(again) == folder_hash(tiny_dir)
    assert weights_hash(load_model(str(again)).model) == weights_hash(tiny.model)


def test_other_seed_gives_other_weights(tiny, tmp_path: Path) -> None:
    spec = TinySpec(seed=1)
    assert spec.build_hash != TinySpec().build_hash
    other = load_model(str(build_tiny(tmp_path / "seed1", spec)))
    assert weights_hash(other.model) != weights_hash(tiny.model)


def test_weights_hash_sees_one_changed_value(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir)).model
    before = weights_hash(model)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    assert weights_hash(model) != before


def test_loads_through_auto_classes(tiny_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_dir))
    processor = AutoProcessor.from_pretrained(str(tiny_dir))
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    image_processor = processor.image_processor
    assert image_processor.patch_size == 16
    assert image_processor.merge_size == 9
    assert list(image_processor.image_mean) == [0.5, 0.5, 0.5]
    assert list(image_processor.image_std) == [0.5, 0.5, 0.5]


def test_maze_image_is_one_patch_per_square_and_one_token(tiny) -> None:
    obs, _ = _observation()
    assert obs["image"].shape == (144, 144, 3)  # 9 squares of 16 px
    image = encode_image(tiny.processor, obs["image"])
    assert image.grid_thw.tolist() == [1, 9, 9]  # one 16 px patch per square, no resizing
    assert image.n_patches == 81 == CONFIG.size**2
    assert image.pixel_values.shape == (81, 3 * 2 * 16 * 16)
    fmt = chat_format(tiny.processor)
    assert fmt.merge == 9
    stream = _stream(tiny)
    assert stream.tokens_T.count(fmt.image_pad) == 1  # the merger makes the 81 squares one token
    vision = tiny.model.model.visual
    assert vision.merger.linear_fc1.in_features == 81 * vision.config.hidden_size


def test_image_patches_are_the_processors_exact_values(tiny) -> None:
    """encode_image cuts an image the processor keeps at its size itself (a table and a
    reshape): the processor's exact float32 pixels; other sizes go through the processor."""
    from workbench.policy.stream import keeps_size

    ip = tiny.processor.image_processor
    for size, kept in ((9, True), (7, False), (11, False)):
        maze = make_maze(size, 3)
        image_HW3 = render_image(maze, maze.start, 16)
        assert keeps_size(ip, *image_HW3.shape[:2]) == kept
        ours = encode_image(tiny.processor, image_HW3)
        theirs = ip(images=[image_HW3], return_tensors="pt")
        assert torch.equal(ours.pixel_values, theirs["pixel_values"])
        assert ours.grid_thw.tolist() == theirs["image_grid_thw"][0].tolist() == [1, 9, 9]


def test_turns_are_few_tokens_with_phrase_tokens(tiny) -> None:
    """The tiny tokenizer makes the chat roles and the maze's fixed phrases one token each: the
    system prompt is 19 tokens and a turn (observation, budget, reply) 18, against 165 and 41
    in word pieces; the text decodes back the same."""
    from workbench.model.tokenizer import build_tokenizer

    fmt = chat_format(tiny.processor)
    head = start_stream(tiny.processor, fmt, system_prompt(CONFIG))
    assert len(head) == 19
    obs, info = _observation()
    turn = append_user(head, tiny.processor, fmt, "Action executed successfully. "
                       + info["budget_text"], encode_image(tiny.processor, obs["image"]))
    turn = append_reply(turn, fmt, tiny.processor.tokenizer.encode("up"), [0.0])
    assert len(turn) - len(head) == 18
    pieces = build_tokenizer(512, phrase_tokens=False)
    text = tiny.processor.tokenizer.decode(turn.tokens_T)
    assert pieces.decode(pieces.encode(text).ids, skip_special_tokens=False) == text
    assert len(pieces.encode(text).ids) == 165 + 41


def test_load_tiny_by_name_uses_cache(tiny_dir: Path, workbench_cache: Path) -> None:
    assert resolve_model_path("tiny") == str(tiny_dir)
    assert Path(resolve_model_path("tiny")).is_relative_to(workbench_cache)
    assert resolve_model_path("/some/folder") == "/some/folder"
    assert resolve_model_path("Qwen/Qwen3-VL-8B-Instruct") == "Qwen/Qwen3-VL-8B-Instruct"
    lm = load_model("tiny")
    assert (lm.source, lm.path) == ("tiny", str(tiny_dir))
    assert tiny_path() == tiny_dir  # second call reuses the built folder


def test_a_build_holds_its_lock_and_is_never_repeated(tmp_path: Path) -> None:
    """build_atomically builds a folder once: during the build the lock beside it is held (a
    second process would wait there), after it a second call finds the folder and builds
    nothing; a failed build leaves neither the folder nor its temp copy."""
    import fcntl

    from workbench.model.tiny import build_atomically

    final, calls = tmp_path / "models" / "thing", []

    def build(tmp: Path) -> None:
        with open(final.parent / ".thing.lock") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (tmp / "made").write_text(str(len(calls)))
        calls.append(tmp)

    build_atomically(final, build)
    build_atomically(final, build)
    assert len(calls) == 1 and (final / "made").read_text() == "0"

    def fail(tmp: Path) -> None:
        (tmp / "half").write_text("")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_atomically(tmp_path / "models" / "broken", fail)
    assert sorted(p.name for p in final.parent.iterdir()) == [".broken.lock", ".thing.lock",
                                                              "thing"]


# ---------------------------------------------------------------- tokenizer


def test_vision_attention_is_one_call_for_same_size_images(tiny, tiny_dir: Path) -> None:
    """batch_vision_attention (a CUDA host's fast path, model/vision.py) gives the vision tower
    one attention call a layer for images of one size; its features equal transformers'
    image-by-image loop, mixed sizes take transformers' own path, and on=False restores it."""
    from workbench.model.vision import batch_vision_attention

    hf = load_model(str(tiny_dir)).model  # as loaded: transformers' loop
    batched = load_model(str(tiny_dir))
    blocks = batched.model.model.visual.blocks
    assert not any(getattr(b.attn, "batched_images", False) for b in hf.model.visual.blocks)
    assert batch_vision_attention(batched.model) == len(blocks)
    assert all(b.attn.batched_images for b in blocks)

    def images(*configs: MazeConfig) -> list:
        return [encode_image(tiny.processor, MazeEnv(c).reset(seed=s)[0]["image"])
                for s, c in enumerate(configs)]

    calls = []
    hook = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return hook(*args, **kwargs)

    for batch in (images(CONFIG, CONFIG, CONFIG), images(CONFIG, MazeConfig(size=5))):
        pixels = torch.cat([im.pixel_values for im in batch])
        grid = torch.stack([im.grid_thw for im in batch])
        with torch.no_grad():
            want = hf.model.get_image_features(pixels, grid, return_dict=True).pooler_output
            calls.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
                got = batched.model.model.get_image_features(pixels, grid,
                                                             return_dict=True).pooler_output
        same_size = len({tuple(im.grid_thw.tolist()) for im in batch}) == 1
        assert len(calls) == len(blocks) * (1 if same_size else len(batch))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    batch_vision_attention(batched.model, on=False)
    assert not any(b.attn.batched_images for b in blocks)
    assert all(b.attn.forward == b.attn.hf_forward for b in blocks)


def test_linear_patch_embedding_equals_the_convolution(tiny_dir: Path) -> None:
    """linear_patch_embed (every host's path, model/vision.py) gives the patch embedding the
    Conv3d's own values as one matrix product, its gradient too."""
    from workbench.model.vision import linear_patch_embed

    conv, linear = load_model(str(tiny_dir)).model, load_model(str(tiny_dir)).model
    assert linear_patch_embed(linear) == 1
    pixels = encode_image(load_model(str(tiny_dir)).processor,
                          MazeEnv(CONFIG).reset(seed=1)[0]["image"]).pixel_values
    outs = []
    for model in (conv, linear):
        embed = model.model.visual.patch_embed
        out = embed(pixels)
        out.pow(2).sum().backward()
        outs.append((out.detach(), embed.proj.weight.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)


def test_action_words_are_single_tokens(tiny) -> None:
    tok = tiny.processor.tokenizer
    ids = {w: tok.encode(w, add_special_tokens=False) for w in ("up", "down", "left", "right",
                                                                  "stop", "move")}
    assert set(ids) == set(ACTION_WORDS)
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == 6
    assert all(tok.decode(v) == w for w, v in ids.items())


def test_special_tokens_are_ids_0_to_17(tiny) -> None:
    tok = tiny.processor.tokenizer
    assert len(SPECIAL_TOKENS) == 18
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.encode(name, add_special_tokens=False) == [i], name
        assert tok.convert_ids_to_tokens(i) == name
    assert tok.pad_token_id == 0
    assert tok.eos_token_id == SPECIAL_TOKENS.index("<|im_end|>") == 2


@pytest.mark.parametrize("text", [
    "héllo wörld ✓ 🙂",
    "日本語のテキスト、混在 mixed",
    "  tabs\tand\nnewlines \r\n  ",
    "Ω≈ç√∫ \x00\x7f zero-width\u200bjoiner",
    "('move', 0) <action>up</action>",
])
def test_byte_level_round_trip(tiny, text: str) -> None:
    tok = tiny.processor.tokenizer
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


# ---------------------------------------------------------------- chat format agreement


def test_stream_matches_processor_chat_template(tiny) -> None:
    """The stream is token for token what the processor renders (true for a real checkpoint)."""
    processor = tiny.processor
    obs, info = _observation()
    text = user_text(obs, info, CONFIG)
    messages = [
        {"role": "system", "content": system_prompt(CONFIG)},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    out = processor(text=[rendered], images=[obs["image"]], return_tensors="pt")
    stream = _stream(tiny)
    assert out["input_ids"][0].tolist() == stream.tokens_T
    assert out["mm_token_type_ids"][0].tolist() == stream.mm_types_T
    assert torch.equal(out["image_grid_thw"][0], stream.images[0].grid_thw)
    assert torch.equal(out["pixel_values"], stream.images[0].pixel_values)


# ---------------------------------------------------------------- save / load round trip


def test_save_load_gives_identical_logits(tiny, tmp_path: Path) -> None:
    tiny.model.save_pretrained(tmp_path)
    tiny.processor.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert weights_hash(again.model) == weights_hash(tiny.model)
    assert torch.equal(_logits(again.model, again), _logits(tiny.model, tiny))


# ---------------------------------------------------------------- LoRA

# rank 8 on q,k,v,o (128 -> 128) and gate, up (128 -> 384), down (384 -> 128) in 4 layers
LORA_PARAMS = 2 * 8 * (4 * (128 + 128) + 3 * (128 + 384))


def _perturb_lora_B(model, scale: float = 0.05) -> None:
    torch.manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(scale * torch.randn_like(param))


def test_lora_trains_only_language_adapters(tiny_dir: Path) -> None:
    model = add_lora(load_model(str(tiny_dir)).model, LoraSettings(rank=8, alpha=16))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("visual" in n for n in trainable)
    assert all("language_model" in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # layers x projections x (A, B)
    assert sum(p.numel() for p in trainable.values()) == LORA_PARAMS
    lora_B = [p for n, p in trainable.items() if "lora_B" in n]
    assert len(lora_B) == 14 and all(bool((p == 0).all()) for p in lora_B)
    assert not any("lora_" in n for n, _ in model.named_parameters() if "visual" in n)


def test_lora_settings_regex_targets_language_model_only() -> None:
    regex = LoraSettings(target_modules=("q_proj", "down_proj")).target_regex
    assert regex == r".*language_model.*\.(q_proj|down_proj)"


def test_lora_round_trip(tiny, tiny_dir: Path, tmp_path: Path) -> None:
    base_logits = _logits(tiny.model, tiny)
    lm = load_model(str(tiny_dir))
    model = add_lora(lm.model, LoraSettings(rank=8, alpha=16))
    assert torch.equal(_logits(model, lm), base_logits)  # B = 0: the adapter adds exactly 0

    _perturb_lora_B(model)
    perturbed = _logits(model, lm)
    assert (perturbed - base_logits).abs().max().item() > 1e-3

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    fresh = load_model(str(tiny_dir))
    reloaded = load_adapter(fresh.model, tmp_path / "adapter")
    assert not any(p.requires_grad for p in reloaded.parameters())  # trainable=False
    assert torch.allclose(_logits(reloaded, fresh), perturbed, rtol=0, atol=1e-6)
