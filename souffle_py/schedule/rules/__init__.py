"""The default CPU schedule rules, one class per module, tried in the order of cpu.py's lists (dispatch.py);
a rule is a ScheduleRule (base.py), as TVM dlight's are (dlight/base/schedule_rule.py)."""
