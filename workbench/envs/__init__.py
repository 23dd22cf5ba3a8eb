"""VisGym-faithful 2D maze: seeded Wilson mazes, reply parsing, reward rules, a Gymnasium env.

Same seed, same maze as VisGym's ``maze_2d`` (walls, start and goal). Everything a notebook needs
is exported here:

    from workbench.envs import MazeConfig, MazeEnv, eval_set, oracle_ceiling
"""

from workbench.envs.actions import (
    DIRECTIONS,
    GRAMMARS,
    Action,
    format_action,
    parse_action,
)
from workbench.envs.env import (
    InitState,
    MazeConfig,
    MazeEnv,
    budget_text,
    init_maze,
    system_prompt,
)
from workbench.envs.evalsets import (
    EVAL_SEEDS,
    check_trainable,
    distinct_tasks,
    eval_set,
    eval_task_keys,
    oracle_ceiling,
    shortest_path_lengths,
    task_key,
    train_maze,
    train_states,
)
from workbench.envs.maze import (
    SIZES,
    Maze,
    make_maze,
    oracle_actions,
    render_ascii,
    render_image,
    shortest_path,
)
from workbench.envs.rewards import REWARDS, RewardFn, episode_reward

__all__ = [
    "DIRECTIONS",
    "EVAL_SEEDS",
    "GRAMMARS",
    "REWARDS",
    "SIZES",
    "Action",
    "InitState",
    "Maze",
    "MazeConfig",
    "MazeEnv",
    "RewardFn",
    "budget_text",
    "check_trainable",
    "distinct_tasks",
    "episode_reward",
    "eval_set",
    "eval_task_keys",
    "format_action",
    "init_maze",
    "make_maze",
    "oracle_actions",
    "oracle_ceiling",
    "parse_action",
    "render_ascii",
    "render_image",
    "shortest_path",
    "shortest_path_lengths",
    "system_prompt",
    "task_key",
    "train_maze",
    "train_states",
]
