"""workbench: a Jupyter-first workbench for multi-turn, multimodal GRPO on 2D visual mazes.

Layers (data flows top to bottom): `envs` (the maze), `model` (Qwen3-VL + LoRA, the tiny
default), `policy` (conversation streams and a batched sampler with log-probabilities).
Optional layers import their extras lazily; `workbench.deps.require` names the extra to install.
"""

__version__ = "0.1.0"
