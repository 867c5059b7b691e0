"""Scheduling: rule-based default CPU schedules (default.py; convolutions in conv.py), MetaSchedule tuning with a persistent database
(tuning.py) and the race check applied to tuned schedules (races.py)."""
