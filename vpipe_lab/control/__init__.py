"""Processes and messages: the launcher, the authenticated channel and the Session (no torch here)."""
