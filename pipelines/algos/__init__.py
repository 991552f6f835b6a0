"""Algorithms as pure torch functions: advantage estimators, losses, schedules. No Ray, no actors."""
