"""A Gymnasium maze environment that takes a model's reply text as the action.

Each ``step(reply)`` parses the reply with ``config.grammar``, moves the agent one cell (or not:
walls and invalid replies leave it in place, with VisGym's feedback text), counts one turn,
and asks the reward rule ``config.reward`` whether the episode is over. The episode is truncated
when ``turn == max_turns``. The step reward is 0.0 until the episode ends; at the end it is
``episode_reward(task, n_valid, turns, config.format_weight)``, with the parts in ``info``.

``reset(seed=s)`` plays maze ``make_maze(config.size, s)`` (VisGym's maze for seed s);
``reset(options={"init_state": state})`` replays a recorded `InitState` exactly.

    env = MazeEnv(MazeConfig(size=9))
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("up")
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.envs.actions import GRAMMARS, Action, parse_action
from workbench.envs.evalsets import oracle_ceiling, train_maze
from workbench.envs.maze import (
    Maze,
    make_maze,
    render_ascii,
    render_image,
    resolve_size,
    step_pos,
)
from workbench.envs.rewards import REWARDS, episode_reward, format_fraction
from workbench.envs.state import FIRST_TRAIN_SEED, InitState, init_maze, init_state_of

__all__ = ["FEEDBACK_OK", "FEEDBACK_WALL", "FIRST_TRAIN_SEED", "InitState", "MazeConfig",
           "MazeEnv", "budget_text", "init_maze", "init_state_of", "rules_text", "system_prompt"]


class _PlainEnv:
    """Stand-in base when gymnasium is not installed (the GPU image lacks it): seeding only."""

    np_random: np.random.Generator

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        if seed is not None or "np_random" not in vars(self):
            self.np_random = np.random.default_rng(seed)


try:
    from gymnasium import Env as _EnvBase
    from gymnasium import spaces
except ImportError:  # MazeEnv still steps and resets; it just has no observation/action spaces
    _EnvBase, spaces = _PlainEnv, None  # type: ignore[assignment,misc]

OBSERVATIONS: tuple[str, ...] = ("image", "ascii")
"""Views a model can be shown; the observation dict always carries both."""

FEEDBACK_OK = "Action executed successfully."
FEEDBACK_WALL = "Cannot move into a wall."


@dataclass(frozen=True)
class MazeConfig:
    """Everything that defines the task a model is asked to solve."""

    size: int = 9
    """Cells per side incl. the outer wall (9 easy, 11 hard, 7, 5); a name in SIZES works too."""
    px_per_cell: int = 16
    """Pixels per cell: 25 = VisGym fidelity, 16 = one vision patch per square (tiny default)."""
    grammar: str = "keyword"
    """Reply grammar, a key of GRAMMARS ("keyword" or VisGym's "tuple")."""
    max_turns: int = 15
    """Replies per episode; the episode is truncated after this many."""
    reward: str = "reach_goal"
    """Reward rule, a key of REWARDS ("reach_goal" or VisGym's "stop_on_goal")."""
    format_weight: float = 0.0
    """Weight w of the format term: reward = (1 - w) * task + w * valid fraction (SkyRL: 0.2)."""
    observation: str = "image"
    """What the model is shown: "image" or "ascii" (the system prompt describes it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", resolve_size(self.size))
        _check_choice("grammar", self.grammar, tuple(GRAMMARS))
        _check_choice("reward", self.reward, tuple(REWARDS))
        _check_choice("observation", self.observation, OBSERVATIONS)
        _check_int("px_per_cell", self.px_per_cell, minimum=4)
        _check_int("max_turns", self.max_turns, minimum=1)
        if not 0.0 <= float(self.format_weight) <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {self.format_weight!r}")

    def make_env(self) -> MazeEnv:
        """A fresh MazeEnv of this config (`envs.protocol.Task`)."""
        return MazeEnv(self)

    def rules(self) -> str:
        """The system prompt (`system_prompt`)."""
        return system_prompt(self)

    def ceiling(self, states: list[InitState]) -> int:
        """Mazes an oracle solves within max_turns under this reward rule (`oracle_ceiling`)."""
        return oracle_ceiling(states, self.max_turns, self.reward)


def _check_int(field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}, got {value!r}")


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


def budget_text(turn: int, max_turns: int) -> str:
    """VisGym's turn counter; turn = replies already taken, so step turn+1 is about to happen.

    Like VisGym, the "more steps" exclude the one about to be taken: at turn 0 of 15 it reads
    "This is step 1. You are allowed to take 14 more steps."
    """
    return f"This is step {turn + 1}. You are allowed to take {max_turns - turn - 1} more steps."


_OBSERVATION_TEXT: dict[str, str] = {
    "image": "The image shows walls (gray) and paths (white). You are the blue circle; "
             "the goal is the red square.",
    "ascii": "The maze is drawn as text: '#' wall, '.' path, 'A' you, 'G' the goal.",
}
_RULE_TEXT: dict[str, str] = {
    "reach_goal": "Reach the goal: the episode ends when you step onto it.",
    "stop_on_goal": "Walk to the goal, then stop: you succeed only if you stop on the goal.",
}
_GRAMMAR_TEXT: dict[str, str] = {
    "keyword": "Reply with exactly one word: up, down, left, right or stop. Example: up",
    "tuple": "Reply with exactly one action: ('move', d) with d 0=right, 1=up, 2=left, 3=down, "
             "or ('stop', 'stop'). Example: ('move', 0)",
}


def rules_text(where: str, observation: str, reward: str, grammar: str, max_turns: int) -> str:
    """A grid task's system prompt: where the agent is, what it sees, the goal rule, the reply
    grammar and the turn limit (the maze's and the room's)."""
    return "\n".join((
        f"{where} " + _OBSERVATION_TEXT[observation],
        _RULE_TEXT[reward],
        _GRAMMAR_TEXT[grammar],
        f"You have at most {max_turns} turns; each reply is one turn.",
    ))


def system_prompt(config: MazeConfig) -> str:
    """The rules shown to the model: goal, what it sees, the reply grammar and the turn limit."""
    return rules_text(f"You are navigating a {config.size}x{config.size} maze.",
                      config.observation, config.reward, config.grammar, config.max_turns)


def _move(maze: Maze, pos: tuple[int, int], action: Action) -> tuple[tuple[int, int], str]:
    after = step_pos(maze, pos, action.direction or 0)
    return after, (FEEDBACK_OK if after != pos else FEEDBACK_WALL)


def _stop(maze: Maze, pos: tuple[int, int], action: Action) -> tuple[tuple[int, int], str]:
    return pos, FEEDBACK_OK


def _invalid(maze: Maze, pos: tuple[int, int], action: Action) -> tuple[tuple[int, int], str]:
    return pos, action.error


TRANSITIONS: dict[str, Callable[[Maze, tuple[int, int], Action], tuple[tuple[int, int], str]]] = {
    "move": _move, "stop": _stop, "invalid": _invalid,
}
"""How each action kind changes the position, and the feedback text it gets."""


def _spaces(config: MazeConfig) -> tuple[Any, Any]:
    """Gymnasium observation space (image, text, pos) and action space (reply text)."""
    side, px = config.size, config.px_per_cell
    text_len = side * side + side - 1
    observation_space = spaces.Dict({
        "image": spaces.Box(0, 255, shape=(side * px, side * px, 3), dtype=np.uint8),
        "text": spaces.Text(min_length=text_len, max_length=text_len, charset="#.GA\n"),
        "pos": spaces.Tuple((spaces.Discrete(side), spaces.Discrete(side))),
    })
    action_space = spaces.Text(min_length=0, max_length=4096, charset=string.printable)
    return observation_space, action_space


class MazeEnv(_EnvBase):
    """One maze episode per reset; actions are reply strings (or parsed Actions)."""

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"]}  # as gymnasium.Env declares it

    def __init__(self, config: MazeConfig = MazeConfig()) -> None:
        self.config = config
        self.render_mode = "rgb_array"
        self._spaces: tuple[Any, Any] | None = None  # built on first use (a Box takes ~5 ms)
        self._maze: Maze | None = None
        self._pos = (0, 0)
        self._turn = 0
        self._n_valid = 0
        self._done = False

    @property
    def observation_space(self) -> Any:
        """Gymnasium's observation space (image, text, pos); none without gymnasium."""
        return self._gym_spaces()[0]

    @observation_space.setter
    def observation_space(self, space: Any) -> None:
        self._spaces = (space, self._gym_spaces()[1])

    @property
    def action_space(self) -> Any:
        """Gymnasium's action space (the reply text); none without gymnasium."""
        return self._gym_spaces()[1]

    @action_space.setter
    def action_space(self, space: Any) -> None:
        self._spaces = (self._gym_spaces()[0], space)

    def _gym_spaces(self) -> tuple[Any, Any]:
        if spaces is None:
            raise AttributeError("gymnasium is not installed: MazeEnv has no spaces")
        if self._spaces is None:
            self._spaces = _spaces(self.config)
        return self._spaces

    @property
    def maze(self) -> Maze:
        """The current episode's maze."""
        if self._maze is None:
            raise RuntimeError("call reset() first")
        return self._maze

    @property
    def pos(self) -> tuple[int, int]:
        """The agent's (row, col)."""
        return self._pos

    @property
    def turn(self) -> int:
        """Replies taken in this episode."""
        return self._turn

    @property
    def done(self) -> bool:
        """True once the episode terminated or was truncated."""
        return self._done

    def init_state(self) -> InitState:
        """The current episode's InitState (replay with reset(options={"init_state": ...}))."""
        return init_state_of(self.maze)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start maze `seed`, or options["init_state"] exactly, or (neither given) a random
        training maze, never one of the eval set's tasks (evalsets.train_maze)."""
        super().reset(seed=seed)
        state = (options or {}).get("init_state")
        if state is not None:
            state = state if isinstance(state, InitState) else InitState.from_dict(state)
            if state.size != self.config.size:
                raise ValueError(f"init_state size {state.size} != config size {self.config.size}")
            self._maze = init_maze(state)
        elif seed is not None:
            self._maze = make_maze(self.config.size, seed)
        else:
            index = int(self.np_random.integers(0, 2**31 - FIRST_TRAIN_SEED))
            self._maze = train_maze(self.config.size, index)
        self._pos, self._turn, self._n_valid, self._done = self._maze.start, 0, 0, False
        info = {"feedback": "", "turn": 0, "success": False, "task_reward": 0.0,
                "budget_text": budget_text(0, self.config.max_turns)}
        return self._observation(), info

    def step(
        self, action: str | Action
    ) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Take one reply: move/stop/invalid, one turn, reward only when the episode ends."""
        maze = self.maze
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        parsed = action if isinstance(action, Action) else parse_action(action, self.config.grammar)
        before = self._pos
        self._pos, feedback = TRANSITIONS[parsed.kind](maze, before, parsed)
        self._turn += 1
        self._n_valid += int(parsed.valid)
        task_reward, terminated = REWARDS[self.config.reward](maze, before, parsed, self._pos)
        truncated = not terminated and self._turn >= self.config.max_turns
        self._done = terminated or truncated
        info: dict[str, Any] = {
            "feedback": feedback, "action": parsed, "turn": self._turn,
            "success": bool(terminated and task_reward >= 1.0), "task_reward": task_reward,
            "budget_text": "" if self._done else budget_text(self._turn, self.config.max_turns),
        }
        reward = 0.0
        if self._done:
            reward = episode_reward(task_reward, self._n_valid, self._turn,
                                    self.config.format_weight)
            info |= {"episode_reward": reward, "n_valid": self._n_valid,
                     "format_reward": format_fraction(self._n_valid, self._turn)}
        return self._observation(), reward, terminated, truncated, info

    def render(self) -> np.ndarray:
        """The current image, uint8 (H, W, 3)."""
        return render_image(self.maze, self._pos, self.config.px_per_cell)

    def _observation(self) -> dict[str, Any]:
        return {"image": self.render(), "text": render_ascii(self.maze, self._pos),
                "pos": self._pos}
