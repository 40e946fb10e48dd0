"""Rewards for the RL trainers: reward functions (TRL's convention), reward models, and the sources a run scores with."""
