"""Episodes and evaluation (the GRPO phases build on these)."""

from workbench.rl.evaluate import (
    FAILURE_REASONS,
    EvalResult,
    failure_reason,
    format_table,
    summarize,
    wasted_turns,
)
from workbench.rl.rollout import (
    SCRIPTED,
    Episode,
    oracle_policy,
    play_model,
    play_scripted,
    random_open_policy,
    random_policy,
    user_text,
)

__all__ = [
    "FAILURE_REASONS", "SCRIPTED", "EvalResult", "Episode", "failure_reason", "format_table",
    "oracle_policy", "play_model", "play_scripted", "random_open_policy", "random_policy",
    "summarize", "user_text", "wasted_turns",
]
