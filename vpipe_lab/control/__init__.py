"""The controller (no torch): launch and attach, the Session and its collaborators, worker processes, live changes."""
