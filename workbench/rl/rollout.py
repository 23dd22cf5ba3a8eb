"""Play episodes of a task: a model policy's live episodes batched, or a scripted policy (random,
oracle).

`play_model` runs G episodes for each of P initial states of a task (any `envs.protocol.Task`:
the maze, or envs/room.py's room). Each live episode samples one reply a turn, batched with the
others by the engine (`Engine.play_rows`: all rows a turn at a time, or with vLLM each row as
soon as it is back); the reply is parsed, the environment steps, and the next observation
(image + feedback + turn budget) is appended to the episode's token stream. Streams only grow by
appending, so the record holds exactly the tokens the sampler saw and produced.

    episodes_P_G = play_model(lm, MazeConfig(), eval_set(9, 8), n=4, params=SamplingParams())

`play_episodes` is the same loop in the shape a session runs beside its sampler
(`session.host.EpisodeLoop`): `sampler.play(play_episodes, task, states_P, n, params, seed)`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workbench.envs import Action
from workbench.envs.protocol import Task, TaskEnv
from workbench.envs.tasks import ScriptedPolicy
from workbench.model.load import LoadedModel
from workbench.policy import (
    Completion,
    SamplingParams,
    Stream,
    VisionInput,
    append_reply,
    append_user,
    chat_format,
    encode_image,
    keep_last_images,
    start_stream,
)
from workbench.policy.engine import Engine
from workbench.sampler.engine import TransformersEngine


@dataclass
class Episode:
    """One played episode: what was seen, said and done, turn by turn."""

    init_state: Any  # the task's initial state (envs.InitState for the maze)
    replies: list[str] = field(default_factory=list)  # raw text per turn
    actions: list[Action] = field(default_factory=list)  # parsed per turn
    feedback: list[str] = field(default_factory=list)  # environment text per turn
    positions: list[tuple[int, int]] = field(default_factory=list)  # start, then after each turn
    reward: float = 0.0  # episode reward (task and format terms)
    success: bool = False  # solved under the config's reward rule
    stream: Stream | None = None  # token stream (model policies only)
    sampled_tokens: list[list[int]] = field(default_factory=list)
    # per turn, the token ids the engine returned for the reply, recorded as it returned them
    # (`phases.token_mismatches` checks every datum against them)
    turn_streams: list[Stream] = field(default_factory=list)
    # with an image window (generator.history_images = k): per turn, the prompt the sampler
    # was given (older images cut out) and the reply it sampled, what the update trains on
    # once images were cut (`phases.windowed`). Empty without a window.

    def __repr__(self) -> str:
        """One line: outcome, turns, the first replies, the path's ends."""
        replies = ", ".join(repr(r) for r in self.replies[:4]) + (", ..." if self.turns > 4 else "")
        path = f"{self.positions[0]} -> {self.positions[-1]}" if self.positions else "-"
        return (f"Episode({'solved' if self.success else 'failed'}, {self.turns} turns, reward "
                f"{self.reward:g}, replies [{replies}], {path})")

    @property
    def turns(self) -> int:
        """Replies taken."""
        return len(self.replies)


def episode_summary(ep: Episode) -> dict[str, Any]:
    """What a viewer or a step record needs of an episode (no tokens)."""
    return {"init_state": ep.init_state.to_dict(), "replies": ep.replies,
            "actions": [a.kind if a.kind != "move" else f"move:{a.direction}" for a in ep.actions],
            "feedback": ep.feedback, "positions": [list(p) for p in ep.positions],
            "reward": ep.reward, "success": ep.success, "turns": ep.turns}


def user_text(obs: dict[str, Any], info: dict[str, Any], config: Task) -> str:
    """The user message after the image: feedback (from turn 2), turn budget, ascii maze."""
    parts = [info["feedback"]] if info.get("feedback") else []
    parts.append(info["budget_text"])
    if config.observation == "ascii":
        parts.append("\n" + obs["text"])
    return " ".join(parts)


@dataclass
class ObserveCache:
    """What `observe` computed once in a rollout and reuses: the processed pixels of each distinct
    image (by its bytes' digest: the G episodes of one maze standing on the same square share
    them) and the tokens of each distinct text (the feedback and turn-budget lines recur)."""

    images: dict[bytes, VisionInput] = field(default_factory=dict)
    texts: dict[str, list[int]] = field(default_factory=dict)


def observe(stream: Stream, processor: Any, fmt: Any, obs: dict, info: dict,
            config: Task, cache: ObserveCache | None = None) -> Stream:
    """Append the user turn for an observation: its image (if shown) and user_text. `cache`
    shares the pixels and tokens of earlier observations of the rollout."""
    image = None
    if config.observation == "image":
        key = hashlib.sha1(np.ascontiguousarray(obs["image"]).data).digest()
        image = cache.images.get(key) if cache is not None else None
        if image is None:
            image = encode_image(processor, obs["image"])
            if cache is not None:
                cache.images[key] = image
    return append_user(stream, processor, fmt, user_text(obs, info, config), image,
                       cache.texts if cache is not None else None)


def record_step(ep: Episode, env: TaskEnv, reply: str) -> tuple[dict, dict]:
    """Step the env with a reply and record it; returns (observation, info)."""
    obs, reward, _, _, info = env.step(reply)
    ep.replies.append(reply)
    ep.actions.append(info["action"])
    ep.feedback.append(info["feedback"])
    ep.positions.append(env.pos)
    if env.done:
        ep.reward, ep.success = reward, info["success"]
    return obs, info


@torch.no_grad()
def play_model(
    lm: LoadedModel,
    config: Task,
    init_states_P: list[Any],
    n: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    engine: Engine | None = None,
    history_images: int = 0,
) -> list[list[Episode]]:
    """G = n episodes per maze, the live ones sampled together by the engine: episodes_P_G.

    `engine` draws the replies (default: the transformers engine over lm.model) and decides
    when each row samples (`Engine.play_rows`): the transformers engine a turn at a time for
    all live rows, vLLM each row as soon as its last reply is back. Each maze's first prompt is
    prefilled once and shared by its G rows; after that a turn prefills only the new
    observation (KV cache kept across turns). With `history_images` = k > 0 only the last k
    turns keep their image (older turns keep their text: `policy.keep_last_images`): once a row
    holds more than k images its prompt is no longer an extension of the last, so it is
    prefilled anew each turn, and each turn's prompt and sampled reply are kept in
    `Episode.turn_streams`.
    """
    engine = engine or TransformersEngine(lm)
    fmt = chat_format(lm.processor)
    system = start_stream(lm.processor, fmt, config.rules())
    envs: list[TaskEnv] = []
    episodes: list[Episode] = []
    first_streams: list[Stream] = []
    cache = ObserveCache()
    for state in init_states_P:
        env = config.make_env()
        obs, info = env.reset(options={"init_state": state})
        first_streams.append(observe(system, lm.processor, fmt, obs, info, config, cache))
        for _ in range(n):
            env = config.make_env()
            env.reset(options={"init_state": state})
            envs.append(env)
            episodes.append(Episode(init_state=state, positions=[env.pos]))
    streams = [s for s in first_streams for _ in range(n)]
    prompts = list(streams)  # prompts[i]: what episode i is sampling from now

    def step_row(i: int, done: Completion) -> Stream | None:
        """Episode i's reply: record it, step its environment, append the next observation;
        its next prompt (the image window applied), or None once the episode is over."""
        reply = lm.processor.tokenizer.decode(done.tokens, skip_special_tokens=True)
        episodes[i].sampled_tokens.append(list(done.tokens))
        if history_images:
            episodes[i].turn_streams.append(
                append_reply(prompts[i], fmt, done.tokens, done.logprobs))
        streams[i] = append_reply(streams[i], fmt, done.tokens, done.logprobs)
        obs, info = record_step(episodes[i], envs[i], reply)
        if not envs[i].done:
            streams[i] = observe(streams[i], lm.processor, fmt, obs, info, config, cache)
        episodes[i].stream = streams[i]
        if envs[i].done:
            return None
        prompts[i] = keep_last_images(streams[i], fmt, history_images) if history_images \
            else streams[i]
        return prompts[i]

    engine.play_rows(first_streams, n, params, generator, step_row)
    return [episodes[p * n:(p + 1) * n] for p in range(len(init_states_P))]


def play_episodes(lm: LoadedModel, engine: Engine, task: Task, init_states_P: list[Any], n: int,
                  params: SamplingParams, seed: int, history_images: int = 0
                  ) -> list[list[Episode]]:
    """The episode loop a session runs beside its sampler (`session.host.EpisodeLoop`):
    play_model with the engine of the sampler's weights version, sampling seeded by `seed`."""
    return play_model(lm, task, init_states_P, n, params, torch.Generator().manual_seed(seed),
                      engine, history_images)


def play_scripted(policy: ScriptedPolicy, config: Task, init_states_P: list[Any], n: int = 1,
                  seed: int = 0) -> list[list[Episode]]:
    """n episodes per initial state of a task (the maze, the room) of a scripted policy
    (`envs.tasks.SCRIPTED`): episodes_P_G."""
    rng = np.random.default_rng(seed)
    episodes_P_G = []
    for state in init_states_P:
        group = []
        for _ in range(n):
            env = config.make_env()
            env.reset(options={"init_state": state})
            ep = Episode(init_state=state, positions=[env.pos])
            while not env.done:
                record_step(ep, env, policy(env.maze, env.pos, config, rng))
            group.append(ep)
        episodes_P_G.append(group)
    return episodes_P_G
