"""Rewards for the RL trainers: reward functions (TRL's convention), reward models, and the one
component a trainer scores with (``scoring.Rewards``)."""
