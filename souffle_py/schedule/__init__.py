"""Scheduling: rule-based default CPU schedules (default.py; the rules in rules/, one per module), MetaSchedule
tuning with a persistent database (tuning.py) and the race check applied to tuned schedules (races.py)."""
