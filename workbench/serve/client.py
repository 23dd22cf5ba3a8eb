"""Play a maze episode through an OpenAI-compatible endpoint, turn by turn.

    from openai import OpenAI
    episode = play_via_endpoint(OpenAI(base_url=..., api_key=...), "tiny:maze-v1", MazeConfig(),
                                eval_set(9, 1)[0])
    trajectory_player(episode)

Each turn sends the whole conversation so far: the system rules, then for every turn the maze
image (a PNG data URL) with the feedback and budget text, and the replies the endpoint gave.
This is the rollout's conversation (`workbench.rl.rollout`), so with temperature 0 the episode
matches a greedy in-process rollout of the same weights.
"""

from __future__ import annotations

from typing import Any

from workbench.envs import InitState, MazeConfig, MazeEnv, system_prompt
from workbench.rl.rollout import Episode, user_text
from workbench.rl.rollout import record_step as record_step
from workbench.serve.chat import image_data_url


def user_message(obs: dict[str, Any], info: dict[str, Any], config: MazeConfig) -> dict[str, Any]:
    """The user turn of an observation: its image (when shown) and the rollout's text."""
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(obs["image"])}}] \
        if config.observation == "image" else []
    return {"role": "user", "content": parts + [{"type": "text",
                                                 "text": user_text(obs, info, config)}]}


def opening_messages(obs: dict[str, Any], info: dict[str, Any],
                     config: MazeConfig) -> list[dict[str, Any]]:
    """A conversation's opening: the system rules, then the first observation's user turn."""
    return [{"role": "system", "content": system_prompt(config)}, user_message(obs, info, config)]


def first_messages(config: MazeConfig, init_state: InitState) -> list[dict[str, Any]]:
    """A maze's opening conversation, from a fresh environment (for one request or a check)."""
    obs, info = MazeEnv(config).reset(options={"init_state": init_state})
    return opening_messages(obs, info, config)


def play_via_endpoint(client: Any, model: str, config: MazeConfig, init_state: InitState,
                      temperature: float = 0.0, max_tokens: int = 4) -> Episode:
    """One episode whose replies come from `client.chat.completions` (an openai.OpenAI)."""
    env = MazeEnv(config)
    obs, info = env.reset(options={"init_state": init_state})
    episode = Episode(init_state=init_state, positions=[env.pos])
    messages = opening_messages(obs, info, config)
    while not env.done:
        reply = client.chat.completions.create(model=model, messages=messages,
                                               temperature=temperature, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        obs, info = record_step(episode, env, text)  # steps the env, as a rollout does
        messages += [{"role": "assistant", "content": text}, user_message(obs, info, config)]
    return episode
