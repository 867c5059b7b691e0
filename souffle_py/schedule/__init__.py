"""Scheduling: rule-based default CPU schedules (default.py); MetaSchedule integration comes later."""
