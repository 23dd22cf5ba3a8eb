"""Evaluate a policy on a fixed set of a task, with the oracle ceiling beside the success rate.

The ceiling is how many of the set can be solved at all within the turn budget (for the maze,
under its reward rule: `workbench.envs.oracle_ceiling`; `Task.ceiling`); a success rate means
little without it. `failure_reason`
names why a failed episode failed (parse error, wall bump, loop, stopped, turn budget).

    python -m workbench demo   # random, oracle and the untrained tiny model on 64 mazes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.envs import Action
from workbench.envs.protocol import Task
from workbench.rl.rollout import Episode


@dataclass(frozen=True)
class EvalResult:
    """Outcome of one policy on one maze set (per maze: successes over its episodes)."""

    policy: str  # name shown in tables
    mode: str  # "greedy", "sampled" or "scripted"
    n_mazes: int
    episodes_per_maze: int
    successes_P: tuple[int, ...]  # successful episodes per maze
    mean_turns: float
    mean_reward: float
    ceiling: int  # mazes solvable at all within max_turns

    @property
    def success_rate(self) -> float:
        """Fraction of all episodes that succeeded."""
        return sum(self.successes_P) / (self.n_mazes * self.episodes_per_maze)

    @property
    def solved(self) -> float:
        """Mean solved mazes per pass (out of n_mazes): the seed's "X/64"."""
        return sum(self.successes_P) / self.episodes_per_maze

    def row(self) -> str:
        """One table row: policy, mode, solved/N, rate, ceiling, mean turns."""
        return (f"{self.policy:<16} {self.mode:<9} {self.solved:6.1f}/{self.n_mazes:<3} "
                f"{100 * self.success_rate:6.1f}%  {self.ceiling:>3}/{self.n_mazes:<3} "
                f"{self.mean_turns:6.2f}")


TABLE_HEADER = f"{'policy':<16} {'mode':<9} {'solved':>10} {'rate':>7}  {'ceiling':>7} {'turns':>6}"


def summarize(name: str, mode: str, episodes_P_G: list[list[Episode]], states: list[Any],
              config: Task) -> EvalResult:
    """Reduce episodes_P_G to an EvalResult with the task's oracle ceiling on `states`."""
    flat = [ep for group in episodes_P_G for ep in group]
    return EvalResult(
        policy=name,
        mode=mode,
        n_mazes=len(episodes_P_G),
        episodes_per_maze=len(episodes_P_G[0]),
        successes_P=tuple(sum(ep.success for ep in group) for group in episodes_P_G),
        mean_turns=float(np.mean([ep.turns for ep in flat])),
        mean_reward=float(np.mean([ep.reward for ep in flat])),
        ceiling=config.ceiling(states),
    )


def format_table(results: list[EvalResult]) -> str:
    """A plain-text table of results."""
    return "\n".join([TABLE_HEADER, *(r.row() for r in results)])


FAILURE_REASONS: tuple[str, ...] = ("parse error", "wall bump", "loop", "stopped", "turn budget")
"""Why a failed episode failed, in the order that breaks ties (see failure_reason)."""


def wasted_turns(episode: Episode | dict) -> dict[str, int]:
    """Turns that brought the agent no closer to anything new, by kind: "parse error" (reply
    not an action), "wall bump" (a move into a wall), "loop" (a move onto a square already
    visited in this episode)."""
    actions = [a.kind if isinstance(a, Action) else a.split(":")[0] for a in _field(
        episode, "actions")]
    positions = [tuple(p) for p in _field(episode, "positions")]
    counts = dict.fromkeys(FAILURE_REASONS[:3], 0)
    for t, kind in enumerate(actions):
        before, after = positions[t], positions[t + 1]
        if kind == "invalid":
            counts["parse error"] += 1
        elif kind == "move" and after == before:
            counts["wall bump"] += 1
        elif kind == "move" and after in positions[:t + 1]:
            counts["loop"] += 1
    return counts


def turn_rates(episodes: list[Episode]) -> dict[str, float]:
    """Of all turns the episodes took, the fraction that bumped a wall, that were invalid
    replies and that stepped back onto a visited square (see wasted_turns)."""
    counts = dict.fromkeys(FAILURE_REASONS[:3], 0)
    for ep in episodes:
        for kind, n in wasted_turns(ep).items():
            counts[kind] += n
    turns = max(sum(ep.turns for ep in episodes), 1)
    return {"wall_bump_rate": counts["wall bump"] / turns,
            "invalid_rate": counts["parse error"] / turns, "loop_rate": counts["loop"] / turns}


def failure_reason(episode: Episode | dict) -> str:
    """"solved", or why an episode failed: "stopped" when it ended on a stop off the goal;
    otherwise the budget ran out, and the reason is the kind of wasted turn it spent most on
    ("parse error", "wall bump", "loop"; ties in that order), or "turn budget" when every turn
    was a new, valid move and the maze was just too far. Takes an Episode or its summary dict
    (as a step record's episodes.json holds it)."""
    if _field(episode, "success"):
        return "solved"
    actions = _field(episode, "actions")
    last = actions[-1].kind if isinstance(actions[-1], Action) else actions[-1]
    if last == "stop":
        return "stopped"
    counts = wasted_turns(episode)
    worst = max(counts, key=lambda k: (counts[k], -FAILURE_REASONS.index(k)))
    return worst if counts[worst] > 0 else "turn budget"


def _field(episode: Episode | dict, name: str) -> Any:
    return episode[name] if isinstance(episode, dict) else getattr(episode, name)
