"""The RL driver: roles (actors), step phases, GRPO and PPO, the training loop. The only part of pipelines that imports actors."""
