"""Alerts for the training service: why dflash-train stopped, told to a webhook (standard library only).

The unit's hooks (ExecStartPost=, ExecStopPost=, OnFailure=) only drop an event file into a spool directory
and return, so a restart is never delayed; a path unit starts the drain (`python -m dflash_trainer.alerts
drain`), which reads the journal of the unit's invocation, classifies the cause (classify.py, a pure
function) and posts one message per event (webhook.py), with bounded retries.
"""
