"""Verifiable tasks, reward functions and answer checking. No Ray, no actors."""
